/**
 * The page: a record editor and a sheet editor a person can use, each a document session of the
 * reference client (autosave on a real clock, a failed save retried after 2 s or at once when
 * the browser is back online, flushed when the page is hidden, parked in the draft when it goes
 * away). Served by `knownstate serve` at `/app/`.
 */
import { LocalStorageDrafts } from "./drafts.js";
import { FetchTransport } from "./http.js";
import { type Content, type Value, preferLocal } from "./kinds.js";
import { PAGE_AUTOSAVE, attachLifecycle } from "./lifecycle.js";
import { Session } from "./session.js";

const $ = <T extends HTMLElement>(id: string) => document.getElementById(id) as T;
const params = new URLSearchParams(location.search);
const drafts = new LocalStorageDrafts();
const transport = new FetchTransport(params.get("api") ?? "");

function user(): string {
  return $<HTMLInputElement>("user").value.trim() || "alice";
}

/** One writer id per tab and document: a reload keeps it (sessionStorage), a new tab does not. */
function writerFor(docId: string): string {
  const key = `knownstate:writer:${docId}`;
  let w = sessionStorage.getItem(key);
  if (w === null) {
    w = `w${Math.random().toString(36).slice(2, 10)}`;
    sessionStorage.setItem(key, w);
  }
  return w;
}

function el(tag: string, attrs: Record<string, string> = {}, ...children: (Node | string)[]): HTMLElement {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  e.append(...children);
  return e;
}

function button(label: string, onClick: () => unknown, id?: string): HTMLButtonElement {
  const b = el("button", id ? { id } : {}, label) as HTMLButtonElement;
  b.addEventListener("click", () => {
    void Promise.resolve()
      .then(onClick)
      .catch((e) => alert(String(e)));
  });
  return b;
}

const sessions: Record<string, Session> = {};

async function openDocument(docId: string): Promise<void> {
  const probe = await transport.send({ type: "read", docId, user: user(), readSeq: 0, generation: 0, baseVersion: null, purpose: "load" });
  if (probe.type !== "snapshot") {
    alert(`cannot open ${docId}: ${JSON.stringify(probe)}`);
    return;
  }
  const kind = probe.snapshot.kind;
  sessions[kind]?.close().catch(() => undefined);
  const panel = $(kind === "sheet" ? "sheet-panel" : "record-panel");
  const s = new Session({
    docId,
    user: user(),
    kind,
    writerId: writerFor(docId),
    drafts,
    transport,
    ...PAGE_AUTOSAVE,
  });
  s.onChange = () => render(s, panel);
  sessions[kind] = s;
  attachLifecycle(s);
  history.replaceState(null, "", `?user=${encodeURIComponent(user())}&doc=${encodeURIComponent(docId)}`);
  await s.open();
  render(s, panel);
}

async function create(kind: "record" | "sheet"): Promise<void> {
  const seq = Number(localStorage.getItem("knownstate:page:seq") ?? "0") + 1;
  localStorage.setItem("knownstate:page:seq", String(seq));
  const schema =
    kind === "record"
      ? { attributes: { title: "text", owner: "text", qty: "number", done: "bool" } }
      : { rows: 6, cols: 5 };
  const content: Content = kind === "record" ? { title: "New record", qty: 1 } : { A1: "item", B1: "qty" };
  const r = await fetch(`${params.get("api") ?? ""}/api/desk/files`, {
    method: "POST",
    headers: { "X-User": user(), "Content-Type": "application/json" },
    body: JSON.stringify({ kind, schema, content, writerId: `page-${writerFor("new")}`, saveSeq: seq }),
  });
  const body = await r.json();
  if (!r.ok) {
    alert(`cannot create: ${body.message ?? r.status}`);
    return;
  }
  await openDocument(body.id);
}

function parse(kind: string, type: string, raw: string): Value | null {
  if (raw === "") return null;
  if (type === "number" || (kind === "sheet" && raw.trim() !== "" && !Number.isNaN(Number(raw)))) return Number(raw);
  return raw;
}

function edit(s: Session, id: string, value: Value | null): void {
  if (value === null && !(id in s.local)) return;
  try {
    s.edit({ [id]: value });
  } catch (e) {
    alert(String(e));
  }
}

function render(s: Session, panel: HTMLElement): void {
  // what the user is typing survives a re-render (a save that lands while they type)
  const focused = document.activeElement as HTMLInputElement | null;
  const focusKey = panel.contains(focused) ? focused?.dataset?.id : undefined;
  const typing = focusKey !== undefined && focused?.type !== "checkbox" ? focused?.value : undefined;
  const v = s.view();
  panel.replaceChildren();
  panel.append(
    el("div", { class: "bar" },
      el("strong", {}, `${s.kind} ${s.docId}`),
      el("span", { class: `state ${v.state}`, id: `${s.kind}-state` }, v.state),
      el("span", { class: "muted" }, `v${v.baseVersion} · writer ${v.writerId} · drafts ${v.draftStatus}`),
    ),
  );
  if (v.siblings.length) {
    const b = el("div", { class: "banner siblings" }, "Another tab left unsaved work here: ");
    for (const w of v.siblings) {
      b.append(
        el("span", {}, ` ${w} `),
        button("Adopt", () => s.adopt(w)),
        button("Discard", () => s.discardSibling(w)),
      );
    }
    panel.append(b);
  }
  if (v.state === "conflict") {
    const b = el("div", { class: "banner conflict" }, `The document changed on the server (now v${v.conflictVersion}); your copy was not saved. `);
    if (s.k.canMerge) b.append(button("Merge, mine wins clashes", () => s.rebase(preferLocal)));
    b.append(
      button("Keep mine as a new document", () => s.keepLocalAsCopy()),
      button("Discard mine", () => s.discard()),
    );
    panel.append(b);
  }
  const editable = !["loading", "closed", "copying"].includes(v.state);
  if (s.kind === "record") {
    const form = el("form", { class: "record" });
    const attrs = (s.schema.attributes ?? {}) as Record<string, string>;
    for (const [id, type] of Object.entries(attrs)) {
      const input = el("input", { "data-id": id }) as HTMLInputElement;
      const value = v.local[id];
      if (type === "bool") {
        input.type = "checkbox";
        input.checked = value === true;
        input.addEventListener("change", () => edit(s, id, input.checked));
      } else {
        input.type = type === "number" ? "number" : "text";
        input.value = value === undefined ? "" : String(value);
        input.addEventListener("change", () => edit(s, id, parse("record", type, input.value)));
      }
      input.disabled = !editable;
      form.append(el("label", {}, id, input));
    }
    panel.append(form);
  } else if (s.kind === "sheet") {
    const rows = Math.min(Number(s.schema.rows ?? 0), 12);
    const cols = Math.min(Number(s.schema.cols ?? 0), 8);
    const table = el("table", { class: "sheet" });
    const head = el("tr", {}, el("th"));
    for (let c = 0; c < cols; c++) head.append(el("th", {}, String.fromCharCode(65 + c)));
    table.append(head);
    for (let r = 1; r <= rows; r++) {
      const tr = el("tr", {}, el("th", {}, String(r)));
      for (let c = 0; c < cols; c++) {
        const id = `${String.fromCharCode(65 + c)}${r}`;
        const input = el("input", { "data-id": id }) as HTMLInputElement;
        input.value = v.local[id] === undefined ? "" : String(v.local[id]);
        input.disabled = !editable;
        input.addEventListener("change", () => edit(s, id, parse("sheet", "", input.value)));
        tr.append(el("td", {}, input));
      }
      table.append(tr);
    }
    panel.append(table);
  }
  panel.append(
    el("div", { class: "bar" },
      button("Save now", () => s.flush()),
      button("Reload", () => s.reload()),
      button("Discard and reload", () => s.discardAndReload()),
    ),
  );
  const again = focusKey ? (panel.querySelector(`[data-id="${focusKey}"]`) as HTMLInputElement | null) : null;
  if (again) {
    if (typing !== undefined) again.value = typing;
    again.focus();
  }
}

$("new-record").addEventListener("click", () => void create("record"));
$("new-sheet").addEventListener("click", () => void create("sheet"));
$("open").addEventListener("click", () => void openDocument($<HTMLInputElement>("doc").value.trim()));
if (params.get("user")) $<HTMLInputElement>("user").value = params.get("user") as string;
for (const id of (params.get("doc") ?? "").split(",").filter(Boolean)) void openDocument(id);
