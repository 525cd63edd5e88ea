/**
 * The network port: one `fetch` per request, answered in the model's vocabulary (the mapping of
 * `HttpTransport` in `impl/documents/session.py`). A request that gets no answer — the browser is
 * offline, the connection was refused or cut, the server failed (5xx) — is `noAnswer`: it may or
 * may not have been applied, and the session retries it unchanged.
 */
import type { Answer, Request } from "./protocol.js";
import type { Transport } from "./session.js";

export class FetchTransport implements Transport {
  /** `apiBase`: where `/api/desk/files` lives ("" for the page's own origin). */
  constructor(readonly apiBase = "") {}

  async send(request: Request): Promise<Answer> {
    const headers: Record<string, string> = { "X-User": request.user };
    let url: string, method: string, body: string | undefined;
    if (request.type === "save") {
      method = "PUT";
      url = `${this.apiBase}/api/desk/files/${encodeURIComponent(request.docId)}`;
      body = JSON.stringify({
        expectedVersion: request.baseVersion,
        content: request.content,
        writerId: request.writerId,
        saveSeq: request.seq,
      });
    } else if (request.type === "read") {
      method = "GET";
      url = `${this.apiBase}/api/desk/files/${encodeURIComponent(request.docId)}`;
    } else {
      method = "POST";
      url = `${this.apiBase}/api/desk/files`;
      body = JSON.stringify({
        copyOf: request.copyOf,
        content: request.content,
        writerId: request.writerId,
        saveSeq: request.seq,
      });
    }
    if (body !== undefined) headers["Content-Type"] = "application/json";
    let r: Response;
    try {
      r = await fetch(url, { method, headers, body, cache: "no-store" });
    } catch (e) {
      return { type: "noAnswer", reason: `unreachable: ${String(e)}` };
    }
    let text: string;
    try {
      text = await r.text();
    } catch (e) {
      return { type: "noAnswer", reason: `lost: ${String(e)}` };
    }
    return FetchTransport.answer(request, r.status, text);
  }

  static answer(request: Request, status: number, text: string): Answer {
    if (status >= 500) return { type: "noAnswer", reason: `server_error: ${status}` };
    let body: any;
    try {
      body = JSON.parse(text);
    } catch {
      return { type: "noAnswer", reason: `garbled: ${status} answer is not JSON` };
    }
    if (status === 200 || status === 201) {
      if (request.type === "read") {
        const { id, kind, schema, version, content } = body;
        return { type: "snapshot", snapshot: { id, kind, schema, version, content } };
      }
      if (request.type === "save") return { type: "saved", version: body.version, replayed: !!body.replayed };
      return { type: "created", id: body.id, version: body.version, replayed: !!body.replayed };
    }
    body = body !== null && typeof body === "object" && !Array.isArray(body) ? body : {};
    const error: string = body.error || `http_${status}`;
    const message: string = body.message ?? "";
    if (status === 409 && error === "version_conflict") {
      return { type: "conflict", version: body.version, content: body.content };
    }
    if (status === 409 && error === "save_seq_taken") {
      const receipt = body.receipt;
      return {
        type: "seqTaken",
        writerId: receipt.writerId,
        seq: receipt.saveSeq,
        version: receipt.version,
        lastSeq: body.lastSeq,
      };
    }
    if (["not_found", "forbidden", "precondition_required", "create_conflict"].includes(error)) {
      return { type: "rejected", reason: error };
    }
    if (error === "invalid_content") return { type: "rejected", reason: `invalid: ${message}` };
    return { type: "rejected", reason: `${error}: ${message}` };
  }
}
