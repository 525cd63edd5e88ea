/**
 * The client session of one document: the seed's state machine, in TypeScript.
 *
 * Theory of operation
 * -------------------
 *
 * One `Session` per (tab, document), owned by the document rather than by a view. It implements
 * exactly the machine of `model/document_session.py` (`SessionCore`): the same states, the same
 * one table (`TABLE`, data, not `if` chains), the same events. The knownstate browser check
 * drives it in Chromium and compares everything it shows with that model, step by step.
 *
 * It is driven through three ports: the network (`Transport.send(request) -> Promise<Answer>`),
 * time (`clock()`, seconds; or `now` passed to an operation), and the draft store
 * (`DraftPort`: the browser's localStorage, one slot per writer). Network operations are async
 * and may interleave with edits: an edit made while a save is in flight stays pending.
 *
 * - Save queue: edits debounce into one latest snapshot; saves are serialised; a success confirms
 *   the snapshot it carried (its generation), never a later edit.
 * - Compare-and-swap: every save carries its base version. `409 version_conflict` is the state
 *   `conflict`, left only by user events: `rebase(resolve)` (kinds that merge), keep a copy,
 *   discard, discard and reload, close. A lost answer leaves the request *unconfirmed*; it is
 *   retried unchanged so the server answers it from its receipt.
 * - Per-writer drafts: every unsaved snapshot is in the writer's own slot before the save goes
 *   out; a slot is deleted only after a save of that exact snapshot succeeded, it was copied, or
 *   the user discarded it. Other writers' drafts are offered (`siblings`), never applied.
 * - Stale reads carry a read sequence, the edit generation and the base version they started
 *   from; `readGuards` drop those that arrive stale.
 * - `discardAndReload()` fetches first; `close()` flushes, parks what the server did not take in
 *   the draft, and refuses (`UnsavedWork`) rather than drop an edit.
 */
import {
  type Content,
  type Kind,
  type Patch,
  type Resolve,
  type Schema,
  MergeUnsupported,
  kindOf,
  sameContent,
} from "./kinds.js";
import {
  type Answer,
  type CopyRequest,
  type DraftRecord,
  type ReadRequest,
  type Request,
  type SaveRequest,
  type Snapshot,
  draftKey,
  saveFromJson,
  saveToJson,
} from "./protocol.js";

export type State =
  | "loading"
  | "clean"
  | "dirty"
  | "saving"
  | "offline"
  | "conflict"
  | "copying"
  | "closed";

export const CREATED = "(new)";

/** The one table: (source, event, target), as in the model. */
export const TABLE: ReadonlyArray<readonly [string, string, State]> = [
  [CREATED, "open", "loading"],
  ["loading", "loaded", "clean"],
  ["loading", "restored", "dirty"],
  ["loading", "load_failed", "loading"],
  ["loading", "close", "closed"],
  ["clean", "edit", "dirty"],
  ["clean", "adopt", "dirty"],
  ["clean", "reloaded", "clean"],
  ["clean", "discard_reloaded", "clean"],
  ["clean", "close", "closed"],
  ["dirty", "edit", "dirty"],
  ["dirty", "save", "saving"],
  ["dirty", "discard", "clean"],
  ["dirty", "discard_reloaded", "clean"],
  ["saving", "edit", "saving"],
  ["saving", "saved", "clean"],
  ["saving", "saved_pending", "dirty"],
  ["saving", "save_failed", "offline"],
  ["saving", "seq_taken", "dirty"],
  ["saving", "version_conflict", "conflict"],
  ["offline", "edit", "offline"],
  ["offline", "save", "saving"],
  ["offline", "discard", "clean"],
  ["offline", "discard_reloaded", "clean"],
  ["offline", "close", "closed"],
  ["conflict", "edit", "conflict"],
  ["conflict", "rebase", "dirty"],
  ["conflict", "copy", "copying"],
  ["conflict", "discard", "clean"],
  ["conflict", "discard_reloaded", "clean"],
  ["conflict", "close", "closed"],
  ["copying", "copied", "clean"],
  ["copying", "copy_failed", "conflict"],
];

const NEXT = new Map(TABLE.map(([s, e, t]) => [`${s} ${e}`, t]));

/** States in which the session holds work the server has not confirmed. */
export const PENDING: ReadonlyArray<State> = ["dirty", "saving", "offline", "conflict", "copying"];

/** An event the table does not have from the current state; nothing changed. */
export class IllegalTransition extends Error {
  constructor(
    readonly table: string,
    readonly state: string,
    readonly event: string,
  ) {
    super(`${table}: no transition from '${state}' on '${event}'`);
    this.name = "IllegalTransition";
  }
}

/** Closing now would drop an edit: the save did not go through and the draft store is failing. */
export class UnsavedWork extends Error {
  constructor() {
    super("closing now would drop an edit: the save did not go through and the draft store is failing");
    this.name = "UnsavedWork";
  }
}

/** No sibling draft of that writer is offered. */
export class KeyError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "KeyError";
  }
}

/** The draft store refused to write: the draft is not durable. */
export class DraftStoreError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "DraftStoreError";
  }
}

export interface DraftPort {
  key(kind: string, user: string, fileId: string, writerId: string): string;
  write(key: string, record: DraftRecord): void; // throws DraftStoreError
  delete(key: string): void; // throws DraftStoreError
  read(key: string): DraftRecord | null;
  siblings(kind: string, user: string, fileId: string, writerId: string): DraftRecord[];
}

export interface Transport {
  send(request: Request): Promise<Answer>;
}

/** What the user sees of a session (the model's `TabView`). */
export interface TabView {
  user: string;
  docId: string;
  writerId: string;
  kind: string;
  state: State;
  local: Content;
  baseVersion: number;
  generation: number;
  draftStatus: "ok" | "failing";
  transitions: [string, string, string][];
  siblings: string[];
  conflictVersion: number | null;
}

/** What an operation ended with, in the model's vocabulary. */
export type Outcome =
  | Answer
  | { type: "won"; value: string | number }
  | { type: "dropped"; reason: string }
  | { type: "closed"; flushed: boolean; parkedInDraft: boolean }
  | null;

export interface SessionOptions {
  docId: string;
  user: string;
  kind: string;
  writerId: string;
  drafts: DraftPort;
  transport: Transport;
  /** seconds; default `performance.now() / 1000` */
  clock?: () => number;
  /** seconds an edit waits before it is saved (default 1) */
  debounce?: number;
  /** seconds before a failed save is retried (default 0: on the next tick; the page waits 2 s,
   * `PAGE_AUTOSAVE` in lifecycle.ts) */
  retryDelay?: number;
  /** start timers for the debounce and retries (a page); off when a driver ticks (a check) */
  autosave?: boolean;
  /** told after every change, for a view to render */
  onChange?: (s: Session) => void;
}

export class Session {
  readonly docId: string;
  readonly user: string;
  readonly kind: string;
  readonly writerId: string;
  readonly k: Kind;
  drafts: DraftPort;
  transport: Transport;
  clock: () => number;
  debounce: number;
  retryDelay: number;
  autosave: boolean;
  onChange?: (s: Session) => void;

  /** The stale-read guard, one method per reason a read that arrives is dropped (in order). */
  readGuards: string[] = [
    "readOutOfOrder",
    "readRacedLocalEdit",
    "readDuringSave",
    "readAfterSave",
    "readOlderThanBase",
  ];

  schema: Schema = {};
  state: State | null = null;
  local: Content = {};
  baseVersion = 0;
  baseContent: Content = {};
  generation = 0;
  savedGeneration = 0;
  dueAt: number | null = null;
  inflight: SaveRequest | null = null;
  unconfirmed: SaveRequest | null = null;
  copyInflight: CopyRequest | null = null;
  unconfirmedCopy: CopyRequest | null = null;
  conflict: Snapshot | null = null;
  nextSeq = 1;
  readSeq = 0;
  appliedReadSeq = 0;
  draftStatus: "ok" | "failing" = "ok";
  draftError: string | null = null;
  draftGeneration: number | null = null; // the generation the durable slot holds
  pendingDeletes = new Set<string>();
  siblings: DraftRecord[] = [];
  lastError: string | null = null;
  now: number;
  counters: Record<string, number> = {};
  transitions: [string, string, string][] = [];
  private timer: ReturnType<typeof setTimeout> | null = null;

  constructor(o: SessionOptions) {
    this.docId = o.docId;
    this.user = o.user;
    this.kind = o.kind;
    this.writerId = o.writerId;
    this.k = kindOf(o.kind);
    this.drafts = o.drafts;
    this.transport = o.transport;
    this.clock = o.clock ?? (() => performance.now() / 1000);
    this.debounce = o.debounce ?? 1;
    this.retryDelay = o.retryDelay ?? 0;
    this.autosave = o.autosave ?? false;
    this.onChange = o.onChange;
    this.now = this.clock();
    this.go("open");
  }

  // -- observation -------------------------------------------------------------------------
  get key(): string {
    return this.drafts.key(this.kind, this.user, this.docId, this.writerId);
  }

  get pending(): boolean {
    return this.state !== null && PENDING.includes(this.state);
  }

  view(): TabView {
    return {
      user: this.user,
      docId: this.docId,
      writerId: this.writerId,
      kind: this.kind,
      state: this.state as State,
      local: { ...this.local },
      baseVersion: this.baseVersion,
      generation: this.generation,
      draftStatus: this.draftStatus,
      transitions: this.transitions.map((t) => [...t] as [string, string, string]),
      siblings: this.siblings.map((d) => d.writerId),
      conflictVersion: this.conflict !== null ? this.conflict.version : null,
    };
  }

  // -- the table, time, counts -------------------------------------------------------------
  protected check(event: string): State {
    const src = this.state ?? CREATED;
    const target = NEXT.get(`${src} ${event}`);
    if (target === undefined) throw new IllegalTransition("document-session", src, event);
    return target;
  }

  protected go(event: string): void {
    const src = this.state ?? CREATED;
    const target = this.check(event);
    this.transitions.push([src, event, target]);
    this.state = target;
    this.changed();
  }

  protected at(now?: number): void {
    this.now = now ?? this.clock();
  }

  protected count(what: string): void {
    this.counters[what] = (this.counters[what] ?? 0) + 1;
  }

  protected changed(): void {
    this.onChange?.(this);
  }

  /** With `autosave`, a timer ticks when the debounce (or a retry) is due. */
  protected schedule(): void {
    if (!this.autosave) return;
    if (this.timer !== null) clearTimeout(this.timer);
    this.timer = null;
    if (this.dueAt === null || this.state === "closed") return;
    const wait = Math.max(0, this.dueAt - this.clock()) * 1000;
    this.timer = setTimeout(() => {
      this.timer = null;
      void this.tick().catch(() => undefined);
    }, wait);
  }

  // -- drafts --------------------------------------------------------------------------------
  protected record(): DraftRecord {
    const inflight = this.inflight ?? this.unconfirmed;
    return {
      kind: this.kind,
      user: this.user,
      fileId: this.docId,
      writerId: this.writerId,
      content: { ...this.local },
      baseVersion: this.baseVersion,
      baseContent: { ...this.baseContent },
      generation: this.generation,
      nextSeq: this.nextSeq,
      inflight: inflight !== null ? saveToJson(inflight) : null,
    };
  }

  protected storeOk(): void {
    if (this.draftStatus !== "ok") {
      this.draftStatus = "ok";
      this.draftError = null;
      this.count("draft_recoveries");
    }
  }

  protected storeFailed(e: unknown): void {
    if (this.draftStatus === "ok") this.count("draft_failures");
    this.draftStatus = "failing";
    this.draftError = String(e);
  }

  /** A store operation other than writing our own slot went through. The status says "ok" only
   * once our own slot holds our work: if it is behind, this is the retry. */
  protected storeSucceeded(): void {
    const behind = this.draftGeneration !== this.generation && this.pending;
    if (this.draftStatus !== "ok" && behind) this.writeDraft();
    else this.storeOk();
  }

  protected flushDeletes(): void {
    for (const key of [...this.pendingDeletes].sort()) {
      try {
        this.drafts.delete(key);
      } catch (e) {
        if (e instanceof DraftStoreError) continue;
        throw e;
      }
      this.pendingDeletes.delete(key);
    }
  }

  protected writeDraft(): boolean {
    this.pendingDeletes.delete(this.key); // a pending delete must never remove newer work
    try {
      this.drafts.write(this.key, this.record());
    } catch (e) {
      if (!(e instanceof DraftStoreError)) throw e;
      this.storeFailed(e);
      return false;
    }
    this.draftGeneration = this.generation;
    this.storeOk();
    this.flushDeletes();
    return true;
  }

  protected deleteDraft(key?: string): void {
    const k = key ?? this.key;
    if (k === this.key) this.draftGeneration = null;
    try {
      this.drafts.delete(k);
    } catch (e) {
      if (!(e instanceof DraftStoreError)) throw e;
      this.pendingDeletes.add(k);
      this.storeFailed(e);
      return;
    }
    this.pendingDeletes.delete(k);
    if (k === this.key) this.storeOk();
    else this.storeSucceeded();
    this.flushDeletes();
  }

  // -- reads ---------------------------------------------------------------------------------
  /** A read: `load` (the first), `refresh` (clean only) or `replace` (discard and reload). */
  beginRead(purpose: ReadRequest["purpose"] = "refresh"): ReadRequest {
    if (purpose === "load") {
      if (this.state !== "loading") throw new IllegalTransition("document-session", this.state ?? CREATED, "loaded");
    } else {
      this.check(purpose === "refresh" ? "reloaded" : "discard_reloaded");
    }
    this.readSeq += 1;
    const base = this.state !== "loading" ? this.baseVersion : null;
    return {
      type: "read",
      docId: this.docId,
      user: this.user,
      readSeq: this.readSeq,
      generation: this.generation,
      baseVersion: base,
      purpose,
    };
  }

  finishRead(req: ReadRequest, answer: Answer): Outcome {
    if (answer.type !== "snapshot") {
      if (req.purpose === "load" && this.state === "loading") this.go("load_failed");
      this.lastError = JSON.stringify(answer);
      this.count("read_failures");
      return answer.type === "rejected" || answer.type === "noAnswer"
        ? answer
        : { type: "noAnswer", reason: JSON.stringify(answer) };
    }
    const snap = answer.snapshot;
    if (req.purpose === "load") {
      if (this.state !== "loading" || req.readSeq <= this.appliedReadSeq) {
        this.count("stale_reads_dropped");
        return { type: "dropped", reason: "out_of_order" };
      }
      if (snap.kind !== this.kind) {
        this.go("load_failed");
        return { type: "rejected", reason: `wrong_kind: ${this.docId} is a ${snap.kind}, not a ${this.kind}` };
      }
      this.appliedReadSeq = req.readSeq;
      this.load(snap);
      return { type: "won", value: this.state as State };
    }
    const reason = this.staleReason(req, snap);
    if (reason !== null) {
      this.count("stale_reads_dropped");
      return { type: "dropped", reason };
    }
    this.appliedReadSeq = Math.max(this.appliedReadSeq, req.readSeq);
    this.local = { ...snap.content };
    this.baseContent = { ...snap.content };
    this.baseVersion = snap.version;
    if (req.purpose === "replace") {
      this.unconfirmed = null;
      this.conflict = null;
      this.dueAt = null;
      this.deleteDraft();
      this.count("discarded");
      this.go("discard_reloaded");
    } else {
      this.go("reloaded");
    }
    this.schedule();
    return { type: "won", value: this.state as State };
  }

  /** Why a read that arrived must be dropped, or null to apply it. */
  staleReason(req: ReadRequest, snap: Snapshot): string | null {
    const guards = this as unknown as Record<string, (r: ReadRequest, s: Snapshot) => string | null>;
    for (const guard of this.readGuards) {
      const reason = guards[guard].call(this, req, snap);
      if (reason !== null) return reason;
    }
    const event = req.purpose === "refresh" ? "reloaded" : "discard_reloaded";
    if (!NEXT.has(`${this.state} ${event}`)) return `state_changed_to_${this.state}`;
    return null;
  }

  readOutOfOrder(req: ReadRequest, _snap: Snapshot): string | null {
    return req.readSeq <= this.appliedReadSeq ? "out_of_order" : null;
  }

  readRacedLocalEdit(req: ReadRequest, _snap: Snapshot): string | null {
    return req.generation !== this.generation ? "raced_local_edit" : null;
  }

  readDuringSave(_req: ReadRequest, _snap: Snapshot): string | null {
    return this.inflight !== null ? "raced_save" : null;
  }

  readAfterSave(req: ReadRequest, _snap: Snapshot): string | null {
    return req.baseVersion !== this.baseVersion ? "raced_save" : null;
  }

  readOlderThanBase(_req: ReadRequest, snap: Snapshot): string | null {
    return snap.version < this.baseVersion ? "older_than_base" : null;
  }

  protected load(snap: Snapshot): void {
    this.schema = { ...snap.schema };
    let own = this.drafts.read(this.key);
    this.siblings = this.drafts.siblings(this.kind, this.user, this.docId, this.writerId);
    this.baseVersion = snap.version;
    this.baseContent = { ...snap.content };
    this.local = { ...snap.content };
    if (own !== null && own.inflight === null && sameContent(own.content, snap.content)) {
      this.deleteDraft(); // its work is already the stored content
      own = null;
    }
    if (own === null) {
      this.go("loaded");
      return;
    }
    // The writer's own draft (a reopened tab): its work, its base, its unanswered save.
    this.local = { ...own.content };
    this.baseContent = { ...own.baseContent };
    this.baseVersion = Number(own.baseVersion);
    this.generation = Number(own.generation);
    this.nextSeq = Number(own.nextSeq);
    if (own.inflight) this.unconfirmed = saveFromJson(this.docId, this.user, own.inflight);
    this.draftGeneration = this.generation;
    this.dueAt = this.now;
    this.count("drafts_restored");
    this.go("restored");
    this.schedule();
  }

  private async exchange(req: Request): Promise<Answer> {
    try {
      return await this.transport.send(req);
    } catch (e) {
      return { type: "noAnswer", reason: `transport: ${String(e)}` };
    }
  }

  /** Load the document (one read): restores this writer's own draft, offers siblings. */
  async open(): Promise<Outcome> {
    return this.read("load");
  }

  /** Refresh a clean session from the server (one read). Stale answers are dropped. */
  async reload(): Promise<Outcome> {
    return this.read("refresh");
  }

  /** Fetch first; replace local state only once the fetch succeeded. Offline, nothing changes. */
  async discardAndReload(): Promise<Outcome> {
    return this.read("replace");
  }

  async read(purpose: ReadRequest["purpose"]): Promise<Outcome> {
    const req = this.beginRead(purpose);
    return this.finishRead(req, await this.exchange(req));
  }

  // -- edits ---------------------------------------------------------------------------------
  /** Apply a patch (id -> value; null clears) to the local copy and write the draft. */
  edit(patch: Patch, now?: number): Outcome {
    this.check("edit");
    this.k.validatePatch(this.schema, patch);
    this.at(now);
    this.local = this.k.apply(this.local, patch);
    this.generation += 1;
    this.dueAt = this.now + this.debounce;
    this.go("edit");
    this.writeDraft();
    this.schedule();
    return { type: "won", value: this.generation };
  }

  // -- saves ---------------------------------------------------------------------------------
  due(now: number): boolean {
    return (
      (this.state === "dirty" || this.state === "offline") &&
      this.inflight === null &&
      this.dueAt !== null &&
      now >= this.dueAt
    );
  }

  /** Start a save now (ignoring the debounce). A save whose answer was lost is retried unchanged. */
  beginSave(now?: number): SaveRequest {
    this.check("save");
    this.at(now); // a save the user asks for (no time given) is sent now: its retry counts from it
    let req: SaveRequest;
    if (this.unconfirmed !== null) {
      req = this.unconfirmed;
    } else {
      req = {
        type: "save",
        docId: this.docId,
        user: this.user,
        writerId: this.writerId,
        seq: this.nextSeq,
        baseVersion: this.baseVersion,
        content: { ...this.local },
        generation: this.generation,
      };
      this.nextSeq += 1;
    }
    this.inflight = req;
    this.writeDraft(); // the snapshot is durable before the request goes out
    this.count("saves");
    this.go("save");
    return req;
  }

  finishSave(req: SaveRequest, answer: Answer): Outcome {
    if (req !== this.inflight) throw new Error("finishSave: not the save in flight");
    this.inflight = null;
    if (answer.type === "saved") {
      this.unconfirmed = null;
      this.baseVersion = answer.version;
      this.baseContent = { ...req.content };
      this.savedGeneration = Math.max(this.savedGeneration, req.generation);
      if (answer.replayed) this.count("idempotent_replays");
      if (this.generation === req.generation) {
        this.dueAt = null;
        this.deleteDraft(); // a save of exactly this snapshot succeeded
        this.go("saved");
      } else {
        this.go("saved_pending"); // edits made during the save stay pending
        this.writeDraft();
      }
    } else if (answer.type === "seqTaken") {
      // an earlier life of this writer used the seq for other content: sent again at once
      this.unconfirmed = null;
      this.nextSeq = Math.max(this.nextSeq, answer.lastSeq + 1);
      this.dueAt = this.now;
      this.count("seqs_taken");
      this.go("seq_taken");
      this.writeDraft();
    } else if (answer.type === "conflict") {
      this.unconfirmed = null;
      this.conflict = {
        id: this.docId,
        kind: this.kind,
        schema: this.schema,
        version: answer.version,
        content: { ...answer.content },
      };
      this.count("conflicts");
      this.go("version_conflict");
      this.writeDraft();
    } else {
      this.unconfirmed = req;
      this.lastError = JSON.stringify(answer);
      this.dueAt = this.now + this.retryDelay;
      this.count("save_failures");
      this.go("save_failed");
    }
    this.schedule();
    return answer;
  }

  /** Save now, ignoring the debounce (one request). */
  async save(now?: number): Promise<Outcome> {
    const req = this.beginSave(now);
    return this.finishSave(req, await this.exchange(req));
  }

  /** Advance time; when the debounced snapshot is due (or an offline retry), save it. */
  async tick(now?: number): Promise<Outcome> {
    this.at(now);
    if (!this.due(this.now)) return null;
    return this.save(this.now);
  }

  /** Retry a failed save now, without waiting for the retry delay (the browser says it is back
   * online): offline, one request — the table's `save`, as a due tick sends it; else nothing. */
  async retryNow(): Promise<Outcome> {
    if (this.state !== "offline") return null;
    return this.save(this.clock());
  }

  /** Save now, ignoring the debounce, until clean, in conflict, or `maxFailures` failed. */
  async flush(maxFailures = 2): Promise<void> {
    let failures = 0;
    while ((this.state === "dirty" || this.state === "offline") && failures < maxFailures) {
      const answer = await this.save();
      if (answer === null || answer.type !== "saved") failures += 1;
    }
  }

  // -- conflict resolution -------------------------------------------------------------------
  /** Merge (kinds that merge only): base, local and stored copies; `resolve` decides each clash.
   * The result is saved against the stored version on the next tick (it is due at once). */
  rebase(resolve: Resolve): Outcome {
    if (!this.k.canMerge) throw new MergeUnsupported(this.kind);
    this.check("rebase");
    const stored = this.conflict as Snapshot;
    const merged = this.k.merge(this.baseContent, this.local, stored.content, resolve);
    this.k.validateContent(this.schema, merged);
    this.baseVersion = stored.version;
    this.baseContent = { ...stored.content };
    this.local = merged;
    this.conflict = null;
    this.generation += 1;
    this.dueAt = this.now;
    this.count("rebases");
    this.go("rebase");
    this.writeDraft();
    this.schedule();
    return { type: "won", value: this.generation };
  }

  beginCopy(): CopyRequest {
    this.check("copy");
    const c = this.unconfirmedCopy;
    let req: CopyRequest;
    if (c !== null && c.generation === this.generation) {
      req = c; // a retried copy lands on the same new document
    } else {
      req = {
        type: "copy",
        copyOf: this.docId,
        user: this.user,
        writerId: this.writerId,
        seq: this.nextSeq,
        content: { ...this.local },
        generation: this.generation,
      };
      this.nextSeq += 1;
    }
    this.copyInflight = req;
    this.go("copy");
    return req;
  }

  finishCopy(req: CopyRequest, answer: Answer): Outcome {
    if (req !== this.copyInflight) throw new Error("finishCopy: not the copy in flight");
    this.copyInflight = null;
    if (answer.type === "created") {
      this.unconfirmedCopy = null;
      this.takeStoredCopy();
      this.savedGeneration = Math.max(this.savedGeneration, req.generation);
      this.dueAt = null;
      this.deleteDraft(); // the snapshot is saved, as the new document
      this.count("copies");
      this.go("copied");
    } else {
      if (answer.type === "noAnswer") this.unconfirmedCopy = req;
      this.lastError = JSON.stringify(answer);
      this.count("copy_failures");
      this.go("copy_failed");
    }
    return answer;
  }

  protected takeStoredCopy(): void {
    const stored = this.conflict as Snapshot;
    this.baseVersion = stored.version;
    this.baseContent = { ...stored.content };
    this.local = { ...stored.content };
    this.conflict = null;
  }

  /** Save the local copy as a new document (every kind); this document takes the stored copy. */
  async keepLocalAsCopy(): Promise<Outcome> {
    const req = this.beginCopy();
    return this.finishCopy(req, await this.exchange(req));
  }

  /** Drop the local edits: back to the confirmed base (in a conflict: to the stored copy). */
  discard(): Outcome {
    this.check("discard");
    if (this.conflict !== null) this.takeStoredCopy();
    this.local = { ...this.baseContent };
    this.unconfirmed = null;
    this.dueAt = null;
    this.deleteDraft();
    this.count("discarded");
    this.go("discard");
    this.schedule();
    return { type: "won", value: this.state as State };
  }

  // -- sibling drafts ------------------------------------------------------------------------
  protected sibling(writerId: string): DraftRecord {
    const d = this.siblings.find((s) => s.writerId === writerId);
    if (d === undefined) throw new KeyError(`no sibling draft of writer '${writerId}'`);
    return d;
  }

  /** Take over another writer's draft (offered on load). It moves to this writer's slot first;
   * the sibling slot is deleted only once the new one is durable. */
  adopt(writerId: string): Outcome {
    this.check("adopt");
    const offered = this.sibling(writerId);
    const theirs = this.drafts.key(this.kind, this.user, this.docId, writerId);
    const d = this.drafts.read(theirs); // as it is now, not as it was offered
    if (d === null) {
      this.siblings.splice(this.siblings.indexOf(offered), 1);
      this.changed();
      return { type: "rejected", reason: "sibling_gone" };
    }
    const kept = {
      local: this.local,
      baseVersion: this.baseVersion,
      baseContent: this.baseContent,
      generation: this.generation,
      unconfirmed: this.unconfirmed,
      dueAt: this.dueAt,
    };
    this.local = { ...d.content };
    this.baseContent = { ...d.baseContent };
    this.baseVersion = Number(d.baseVersion);
    this.generation += 1;
    this.unconfirmed = null;
    if (d.inflight) {
      const req = saveFromJson(this.docId, this.user, d.inflight);
      // the sibling's unanswered save is retried under its own (writer, seq); it stands for the
      // adopted content only if nothing was typed after it
      const untouched = sameContent(req.content, d.content);
      this.unconfirmed = { ...req, generation: untouched ? this.generation : this.generation - 1 };
    }
    this.dueAt = this.now;
    if (!this.writeDraft()) {
      // the work moves only once its new slot is durable
      Object.assign(this, kept);
      this.draftGeneration = null;
      this.changed();
      return { type: "rejected", reason: "draft_store_failing" };
    }
    this.deleteDraft(theirs);
    this.siblings.splice(this.siblings.indexOf(offered), 1);
    this.count("siblings_adopted");
    this.go("adopt");
    this.schedule();
    return { type: "won", value: writerId };
  }

  discardSibling(writerId: string): Outcome {
    if (this.state === "closed") throw new IllegalTransition("document-session", "closed", "discard_sibling");
    const d = this.sibling(writerId);
    try {
      this.drafts.delete(this.drafts.key(this.kind, this.user, this.docId, writerId));
    } catch (e) {
      if (!(e instanceof DraftStoreError)) throw e;
      this.storeFailed(e);
      this.changed();
      return { type: "rejected", reason: "draft_store_failing" };
    }
    this.storeSucceeded();
    this.siblings.splice(this.siblings.indexOf(d), 1);
    this.count("siblings_discarded");
    this.changed();
    return { type: "won", value: writerId };
  }

  // -- closing -------------------------------------------------------------------------------
  /** Flush, then close; resolves once flushed. Work the server did not take (offline, or a
   * conflict) is parked in this writer's durable draft. If even the draft cannot be written:
   * `UnsavedWork`, and nothing changes — closing never drops an edit. */
  async close(maxFailures = 2): Promise<Outcome> {
    if (this.state === "closed") return { type: "closed", flushed: true, parkedInDraft: false };
    if (this.state === "saving" || this.state === "copying") {
      throw new IllegalTransition("document-session", this.state, "close");
    }
    await this.flush(maxFailures);
    if (this.state === "clean" || this.state === "loading") {
      this.go("close");
      this.schedule();
      return { type: "closed", flushed: true, parkedInDraft: false };
    }
    if (this.draftGeneration !== this.generation || this.draftStatus !== "ok") {
      if (!this.writeDraft()) throw new UnsavedWork();
    }
    this.go("close");
    this.schedule();
    return { type: "closed", flushed: false, parkedInDraft: true };
  }

  /** The page is going away (`pagehide`) and cannot wait for a request: the work is in the
   * writer's draft already (written on every edit and before every save); a draft write that
   * failed is tried once more. Nothing is sent and nothing changes state. */
  park(): void {
    if (this.pending && this.draftGeneration !== this.generation) this.writeDraft();
  }
}
