// Unit tests of the reference client's session machine, driven step by step (begin/finish with
// the answers given), with an in-memory draft store: the sans-I/O half of the client. The
// browser half is checked against the Python model in Chromium (tests/test_browser_check.py).
import assert from "node:assert/strict";
import { type TestContext, test } from "node:test";
import { FetchTransport } from "../src/http.js";
import { PAGE_AUTOSAVE, attachLifecycle } from "../src/lifecycle.js";
import { type Content, preferLocal, preferStored } from "../src/kinds.js";
import { type Answer, type DraftRecord, draftPrefix } from "../src/protocol.js";
import { type DraftPort, DraftStoreError, Session, TABLE, UnsavedWork } from "../src/session.js";

class MemoryDrafts implements DraftPort {
  slots = new Map<string, DraftRecord>();
  failing = false;
  key(kind: string, user: string, fileId: string, writerId: string) {
    return `knownstate:${kind}-draft:${user}:${fileId}:${writerId}`;
  }
  write(key: string, r: DraftRecord) {
    if (this.failing) throw new DraftStoreError(`write ${key}: failing`);
    this.slots.set(key, structuredClone(r));
  }
  delete(key: string) {
    if (this.failing) throw new DraftStoreError(`delete ${key}: failing`);
    this.slots.delete(key);
  }
  read(key: string) {
    const r = this.slots.get(key);
    return r === undefined ? null : structuredClone(r);
  }
  siblings(kind: string, user: string, fileId: string, writerId: string) {
    const prefix = draftPrefix(kind, user, fileId);
    return [...this.slots.keys()]
      .sort()
      .filter((k) => k.startsWith(prefix))
      .map((k) => this.slots.get(k) as DraftRecord)
      .filter((r) => r.writerId !== writerId);
  }
}

const SCHEMA = { attributes: { title: "text", qty: "number", done: "bool" } };
const unplugged = { send: async (): Promise<Answer> => ({ type: "noAnswer", reason: "unplugged" }) };

function loaded(drafts = new MemoryDrafts(), writerId = "w1", kind = "record") {
  const s = new Session({ docId: "r1", user: "alice", kind, writerId, drafts, transport: unplugged, clock: () => 0 });
  const schema = kind === "record" ? SCHEMA : { rows: 3, cols: 3 };
  const content: Content = kind === "record" ? { title: "first", qty: 0 } : { A1: "x" };
  s.finishRead(s.beginRead("load"), { type: "snapshot", snapshot: { id: "r1", kind, schema, version: 1, content } });
  return { s, drafts };
}

test("the table has the model's 33 transitions and starts loading", () => {
  assert.equal(TABLE.length, 33);
  const { s } = loaded();
  assert.deepEqual(s.transitions, [["(new)", "open", "loading"], ["loading", "loaded", "clean"]]);
});

test("an edit made during a save stays pending: the success confirms only the snapshot sent", () => {
  const { s, drafts } = loaded();
  s.edit({ title: "a" }, 0);
  const req = s.beginSave(1);
  s.edit({ qty: 5 }, 1);
  s.finishSave(req, { type: "saved", version: 2, replayed: false });
  assert.equal(s.state, "dirty");
  assert.deepEqual(s.local, { title: "a", qty: 5 });
  assert.deepEqual(drafts.read(s.key)?.content, { title: "a", qty: 5 });
  assert.deepEqual(s.transitions.at(-1), ["saving", "saved_pending", "dirty"]);
});

test("a save of exactly the snapshot deletes the draft; the draft is written before the request", () => {
  const { s, drafts } = loaded();
  s.edit({ title: "a" }, 0);
  const req = s.beginSave(1);
  assert.deepEqual(drafts.read(s.key)?.inflight?.seq, 1);
  s.finishSave(req, { type: "saved", version: 2, replayed: false });
  assert.equal(s.state, "clean");
  assert.equal(drafts.read(s.key), null);
});

test("a 409 is an explicit conflict; records rebase by attribute id, sheets do not merge", () => {
  const { s } = loaded();
  s.edit({ title: "mine" }, 0);
  s.finishSave(s.beginSave(1), { type: "conflict", version: 3, content: { title: "theirs", qty: 9 } });
  assert.equal(s.state, "conflict");
  assert.equal(s.view().conflictVersion, 3);
  s.rebase(preferLocal);
  assert.deepEqual(s.local, { title: "mine", qty: 9 });
  assert.equal(s.baseVersion, 3);
  assert.equal(s.state, "dirty");

  const sheet = loaded(new MemoryDrafts(), "w2", "sheet").s;
  sheet.edit({ A1: "y" }, 0);
  sheet.finishSave(sheet.beginSave(1), { type: "conflict", version: 2, content: { A1: "z" } });
  assert.throws(() => sheet.rebase(preferStored), { name: "MergeUnsupported" });
  assert.equal(sheet.state, "conflict");
});

test("a lost answer is retried unchanged (same writer, seq and snapshot)", () => {
  const { s } = loaded();
  s.edit({ title: "a" }, 0);
  const first = s.beginSave(1);
  s.finishSave(first, { type: "noAnswer", reason: "lost" });
  assert.equal(s.state, "offline");
  s.edit({ qty: 3 }, 2);
  const retry = s.beginSave(2);
  assert.equal(retry, first);
});

test("per-writer drafts: a second writer's draft is offered as a sibling, never applied", () => {
  const drafts = new MemoryDrafts();
  const a = loaded(drafts, "w1").s;
  a.edit({ title: "from w1" }, 0);
  const b = loaded(drafts, "w2").s;
  assert.equal(b.state, "clean");
  assert.deepEqual(b.local, { title: "first", qty: 0 });
  assert.deepEqual(b.view().siblings, ["w1"]);
  b.adopt("w1");
  assert.deepEqual(b.local, { title: "from w1", qty: 0 });
  assert.equal(drafts.read(a.key), null);
  assert.ok(drafts.read(b.key));
});

test("stale reads are dropped: out of order, and raced by a local edit", () => {
  const { s } = loaded();
  const snap = (version: number) => ({ type: "snapshot", snapshot: { id: "r1", kind: "record", schema: SCHEMA, version, content: { title: `v${version}` } } }) as Answer;
  const late = s.beginRead("refresh");
  const newer = s.beginRead("refresh");
  assert.deepEqual(s.finishRead(newer, snap(3)), { type: "won", value: "clean" });
  assert.deepEqual(s.finishRead(late, snap(2)), { type: "dropped", reason: "out_of_order" });
  const raced = s.beginRead("replace");
  s.edit({ qty: 1 }, 0);
  assert.deepEqual(s.finishRead(raced, snap(4)), { type: "dropped", reason: "raced_local_edit" });
  assert.equal(s.local.qty, 1);
});

test("discardAndReload fetches first: offline, nothing changes", () => {
  const { s, drafts } = loaded();
  s.edit({ title: "keep" }, 0);
  const req = s.beginRead("replace");
  s.finishRead(req, { type: "noAnswer", reason: "offline" });
  assert.equal(s.state, "dirty");
  assert.equal(s.local.title, "keep");
  assert.equal(drafts.read(s.key)?.content.title, "keep");
});

test("close parks unsaved work in the draft, and refuses rather than drop it", async () => {
  const { s, drafts } = loaded();
  s.edit({ title: "offline work" }, 0);
  assert.deepEqual(await s.close(), { type: "closed", flushed: false, parkedInDraft: true });
  assert.equal(drafts.read(s.key)?.content.title, "offline work");

  const other = loaded(new MemoryDrafts(), "w9");
  other.drafts.failing = true;
  other.s.edit({ title: "nowhere" }, 0);
  await assert.rejects(other.s.close(), UnsavedWork);
  assert.equal(other.s.state, "offline");
  assert.equal(other.s.view().draftStatus, "failing");
});

/** A window for `attachLifecycle`: its events, and a document that is visible. */
function fakeWindow(): Window {
  const w = new EventTarget() as EventTarget & { document: EventTarget & { visibilityState: string } };
  w.document = Object.assign(new EventTarget(), { visibilityState: "visible" });
  return w as unknown as Window;
}

/** The page's session on a fake clock: the page's own timers (setTimeout is mocked, and the
 * session's clock is the same milliseconds; setImmediate, not mocked, lets each save's promises
 * settle), its lifecycle on a fake window, and a transport that records when each request went
 * out and answers `answer.now`. */
function pageSession(t: TestContext) {
  t.mock.timers.enable({ apis: ["setTimeout"] });
  let ms = 0;
  const sent: number[] = [];
  const answer: { now: Answer } = { now: { type: "noAnswer", reason: "transport: TypeError: Failed to fetch" } };
  const transport = {
    send: async (): Promise<Answer> => {
      sent.push(ms / 1000);
      return answer.now;
    },
  };
  const s = new Session({
    docId: "r1", user: "alice", kind: "record", writerId: "w1", drafts: new MemoryDrafts(), transport,
    clock: () => ms / 1000, ...PAGE_AUTOSAVE,
  });
  s.finishRead(s.beginRead("load"), { type: "snapshot", snapshot: { id: "r1", kind: "record", schema: SCHEMA, version: 1, content: {} } });
  const win = fakeWindow();
  attachLifecycle(s, win);
  const advance = async (seconds: number) => {
    for (let step = 0; step < seconds * 10; step++) {
      ms += 100;
      t.mock.timers.tick(100);
      await new Promise((resolve) => setImmediate(resolve));
    }
  };
  return { s, sent, answer, win, advance };
}

test("the page's session, offline, retries after its delay (not every tick), at once back online", async (t) => {
  const { s, sent, answer, win, advance } = pageSession(t);
  s.edit({ title: "typed offline" });
  await advance(1); // the debounce: the first save, which fails
  assert.deepEqual(sent, [1]);
  assert.equal(s.state, "offline");
  await advance(12); // offline for 12 s: one retry every 2 s, not one every tick
  assert.deepEqual(sent, [1, 3, 5, 7, 9, 11, 13]);
  await advance(0.5);
  assert.equal(sent.length, 7);

  answer.now = { type: "saved", version: 2, replayed: false };
  win.dispatchEvent(new Event("online")); // back online: retried at once, not at 15 s
  await new Promise((resolve) => setImmediate(resolve));
  assert.deepEqual(sent.slice(7), [13.5]);
  assert.equal(s.state, "clean");
  win.dispatchEvent(new Event("online")); // nothing waiting: nothing sent
  await advance(5);
  assert.equal(sent.length, 8);
});

test("a save the user asks for, offline, is retried its delay after it was sent", async (t) => {
  const { s, sent, advance } = pageSession(t);
  s.edit({ title: "typed offline" });
  await advance(1.5); // the debounce's save at 1 s fails: retried at 3 s
  await s.flush(1); // "Save now" at 1.5 s, which fails too: the retry moves to 3.5 s
  assert.deepEqual(sent, [1, 1.5]);
  await advance(1.9); // not at 3 s, which the debounce's failure had set
  assert.deepEqual(sent, [1, 1.5]);
  await advance(0.1);
  assert.deepEqual(sent, [1, 1.5, 3.5]);
  assert.equal(s.state, "offline");
});

test("the HTTP answers map to the model's vocabulary", () => {
  const save = { type: "save", docId: "r1", user: "a", writerId: "w", seq: 1, baseVersion: 1, content: {}, generation: 1 } as const;
  assert.deepEqual(FetchTransport.answer(save, 200, '{"id":"r1","version":2,"replayed":true}'), { type: "saved", version: 2, replayed: true });
  assert.deepEqual(FetchTransport.answer(save, 409, '{"error":"version_conflict","version":3,"content":{"a":1}}'), { type: "conflict", version: 3, content: { a: 1 } });
  assert.deepEqual(FetchTransport.answer(save, 503, "{}"), { type: "noAnswer", reason: "server_error: 503" });
  assert.deepEqual(FetchTransport.answer(save, 404, '{"error":"not_found","message":"x"}'), { type: "rejected", reason: "not_found" });
  assert.deepEqual(
    FetchTransport.answer(save, 409, '{"error":"save_seq_taken","receipt":{"writerId":"w","saveSeq":1,"version":2},"lastSeq":4}'),
    { type: "seqTaken", writerId: "w", seq: 1, version: 2, lastSeq: 4 },
  );
});
