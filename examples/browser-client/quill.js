// quill: a small document session for the browser, written from the seed alone (not from
// knownstate's web/ client). Its own names, its own shape: one plain state object, one table of
// moves, one function per user action. It keeps the seed's promises: saves carry their base
// version and are serialised, an edit made during a save stays pending, a 409 is a conflict the
// user resolves, every unsaved snapshot sits in the writer's own localStorage slot, other writers'
// drafts are offered and never applied, stale reads are dropped, and closing never drops an edit.
(function (global) {
  "use strict";

  // phase -> event -> phase
  const MOVES = {
    opening: { opened: "synced", restored: "modified", failed: "opening", end: "ended" },
    synced: { type: "modified", adopt: "modified", refreshed: "synced", replaced: "synced", end: "ended" },
    modified: { type: "modified", send: "uploading", drop: "synced", replaced: "synced" },
    uploading: { type: "uploading", ok: "synced", okMore: "modified", lost: "stalled", renumber: "modified", stale: "conflicted" },
    stalled: { type: "stalled", send: "uploading", drop: "synced", replaced: "synced", end: "ended" },
    conflicted: { type: "conflicted", merge: "modified", fork: "forking", drop: "synced", replaced: "synced", end: "ended" },
    forking: { forked: "synced", forkFailed: "conflicted" },
    ended: {},
  };

  class QuillError extends Error {
    constructor(code, message) { super(message); this.code = code; }
  }

  const same = (a, b) => typeof a === typeof b && a === b;
  const sameDoc = (a, b) => {
    const ka = Object.keys(a);
    return ka.length === Object.keys(b).length && ka.every((k) => k in b && same(a[k], b[k]));
  };
  const copy = (o) => JSON.parse(JSON.stringify(o));

  function slotKey(kind, user, file, writer) { return `knownstate:${kind}-draft:${user}:${file}:${writer}`; }

  async function call(apiBase, user, method, path, body) {
    const headers = { "X-User": user };
    if (body) headers["Content-Type"] = "application/json";
    let r, text;
    try {
      r = await fetch(apiBase + path, { method, headers, body: body && JSON.stringify(body) });
      text = await r.text();
    } catch (e) {
      return { kind: "gone" };
    }
    if (r.status >= 500) return { kind: "gone" };
    let json;
    try { json = JSON.parse(text); } catch (e) { return { kind: "gone" }; }
    return { kind: "http", status: r.status, json };
  }

  // One session of one document in one tab.
  function quill({ doc, user, kind, writer, apiBase, debounce, retryDelay, clock, onMove }) {
    const s = {
      phase: null, local: {}, base: { version: 0, content: {} }, schema: {}, gen: 0, due: null,
      sending: null, unconfirmed: null, forkSending: null, forkUnconfirmed: null, theirs: null,
      next: 1, reads: 0, lastRead: 0, storeOk: true, slotGen: null, deletesOwed: new Set(),
      offered: [], now: clock(),
    };
    const mine = slotKey(kind, user, doc, writer);
    const move = (event) => {
      const to = MOVES[s.phase][event];
      if (!to) throw new QuillError("illegal", `cannot ${event} while ${s.phase}`);
      const from = s.phase;
      s.phase = to;
      onMove(from, event, to);
    };
    const can = (event) => {
      if (!MOVES[s.phase][event]) throw new QuillError("illegal", `cannot ${event} while ${s.phase}`);
    };
    s.phase = "opening";
    onMove(null, "start", "opening");

    // -- the slot -------------------------------------------------------------------------------
    const snapshot = () => {
      const flying = s.sending || s.unconfirmed;
      return {
        kind, user, fileId: doc, writerId: writer, content: copy(s.local),
        baseVersion: s.base.version, base: copy(s.base.content), gen: s.gen, next: s.next,
        inflight: flying && {
          writer: flying.writer, seq: flying.seq, base: flying.base, content: copy(flying.content), gen: flying.gen,
        },
      };
    };
    const flushDeletes = () => {
      for (const key of [...s.deletesOwed].sort()) {
        try { localStorage.removeItem(key); s.deletesOwed.delete(key); } catch (e) { /* later */ }
      }
    };
    const save = () => {
      s.deletesOwed.delete(mine);
      try { localStorage.setItem(mine, JSON.stringify(snapshot())); } catch (e) { s.storeOk = false; return false; }
      s.slotGen = s.gen;
      s.storeOk = true;
      flushDeletes();
      return true;
    };
    const unslot = (key = mine) => {
      if (key === mine) s.slotGen = null;
      try { localStorage.removeItem(key); } catch (e) { s.deletesOwed.add(key); s.storeOk = false; return; }
      s.deletesOwed.delete(key);
      if (key !== mine && !s.storeOk && s.slotGen !== s.gen && holding()) save();
      else s.storeOk = true;
      flushDeletes();
    };
    const holding = () => ["modified", "uploading", "stalled", "conflicted", "forking"].includes(s.phase);
    const readSlot = (key) => { const t = localStorage.getItem(key); return t === null ? null : JSON.parse(t); };

    // -- reading ------------------------------------------------------------------------------
    async function read(why) {
      if (why === "load") { if (s.phase !== "opening") throw new QuillError("illegal", "already open"); }
      else can(why === "refresh" ? "refreshed" : "replaced");
      const ticket = { seq: ++s.reads, gen: s.gen, base: s.phase === "opening" ? null : s.base.version };
      const a = await call(apiBase, user, "GET", `/api/desk/files/${encodeURIComponent(doc)}`);
      if (a.kind !== "http" || a.status !== 200) {
        if (why === "load" && s.phase === "opening") move("failed");
        return a.kind === "http" ? { type: "rejected", reason: a.json.error } : { type: "noAnswer" };
      }
      const got = a.json;
      if (why === "load") {
        if (s.phase !== "opening" || ticket.seq <= s.lastRead) return { type: "dropped", reason: "out_of_order" };
        s.lastRead = ticket.seq;
        s.schema = got.schema;
        s.base = { version: got.version, content: copy(got.content) };
        s.local = copy(got.content);
        let own = readSlot(mine);
        s.offered = [];
        const prefix = slotKey(kind, user, doc, "");
        const keys = [];
        for (let i = 0; i < localStorage.length; i++) keys.push(localStorage.key(i));
        for (const k of keys.filter((k) => k.startsWith(prefix)).sort()) {
          const d = readSlot(k);
          if (d && d.writerId !== writer) s.offered.push(d);
        }
        if (own && !own.inflight && sameDoc(own.content, got.content)) { unslot(); own = null; }
        if (!own) { move("opened"); return { type: "won", value: "clean" }; }
        s.local = own.content; s.base = { version: own.baseVersion, content: own.base };
        s.gen = own.gen; s.next = own.next; s.slotGen = s.gen; s.due = s.now;
        if (own.inflight) s.unconfirmed = { ...own.inflight };
        move("restored");
        return { type: "won", value: "dirty" };
      }
      const why2 = ticket.seq <= s.lastRead ? "out_of_order"
        : ticket.gen !== s.gen ? "raced_local_edit"
        : s.sending ? "raced_save"
        : ticket.base !== s.base.version ? "raced_save"
        : got.version < s.base.version ? "older_than_base"
        : !MOVES[s.phase][why === "refresh" ? "refreshed" : "replaced"] ? `state_changed_to_${s.phase}`
        : null;
      if (why2) return { type: "dropped", reason: why2 };
      s.lastRead = Math.max(s.lastRead, ticket.seq);
      s.local = copy(got.content);
      s.base = { version: got.version, content: copy(got.content) };
      if (why === "replace") {
        s.unconfirmed = null; s.theirs = null; s.due = null;
        unslot();
        move("replaced");
      } else move("refreshed");
      return { type: "won", value: "clean" };
    }

    // -- saving -------------------------------------------------------------------------------
    async function send(now) {
      can("send");
      s.now = now;
      const req = s.unconfirmed || { writer, seq: s.next++, base: s.base.version, content: copy(s.local), gen: s.gen };
      s.sending = req;
      save();
      move("send");
      const a = await call(apiBase, user, "PUT", `/api/desk/files/${encodeURIComponent(doc)}`,
        { expectedVersion: req.base, content: req.content, writerId: req.writer, saveSeq: req.seq });
      s.sending = null;
      if (a.kind === "http" && a.status === 200) {
        s.unconfirmed = null;
        s.base = { version: a.json.version, content: copy(req.content) };
        if (s.gen === req.gen) { s.due = null; unslot(); move("ok"); }
        else { move("okMore"); save(); }
        return { type: "saved", version: a.json.version, replayed: !!a.json.replayed };
      }
      if (a.kind === "http" && a.status === 409 && a.json.error === "save_seq_taken") {
        s.unconfirmed = null;
        s.next = Math.max(s.next, a.json.lastSeq + 1);
        s.due = s.now;
        move("renumber");
        save();
        const r = a.json.receipt;
        return { type: "seqTaken", writerId: r.writerId, seq: r.saveSeq, version: r.version, lastSeq: a.json.lastSeq };
      }
      if (a.kind === "http" && a.status === 409) {
        s.unconfirmed = null;
        s.theirs = { version: a.json.version, content: copy(a.json.content) };
        move("stale");
        save();
        return { type: "conflict", version: a.json.version, content: a.json.content };
      }
      s.unconfirmed = req;
      s.due = s.now + retryDelay;
      move("lost");
      return a.kind === "http" ? { type: "rejected", reason: a.json.error } : { type: "noAnswer" };
    }

    async function tick(now) {
      s.now = now;
      const due = ["modified", "stalled"].includes(s.phase) && !s.sending && s.due !== null && now >= s.due;
      return due ? send(now) : null;
    }

    function edit(patch, now) {
      can("type");
      const attrs = (s.schema.attributes || {});
      for (const k of Object.keys(patch)) {
        if (kind === "record" && !(k in attrs)) throw new QuillError("kind", `unknown attribute ${k}`);
      }
      s.now = now;
      for (const [k, v] of Object.entries(patch)) { if (v === null) delete s.local[k]; else s.local[k] = v; }
      s.gen += 1;
      s.due = s.now + debounce;
      move("type");
      save();
      return { type: "won", value: s.gen };
    }

    // -- conflicts ------------------------------------------------------------------------------
    function takeTheirs() {
      s.base = { version: s.theirs.version, content: copy(s.theirs.content) };
      s.local = copy(s.theirs.content);
      s.theirs = null;
    }

    function merge(prefer) {
      if (kind !== "record") throw new QuillError("nomerge", `${kind} documents do not merge`);
      can("merge");
      const b = s.base.content, l = s.local, t = s.theirs.content, out = {};
      for (const k of [...new Set([...Object.keys(b), ...Object.keys(l), ...Object.keys(t)])].sort()) {
        const v = same(l[k], t[k]) ? l[k] : same(l[k], b[k]) ? t[k] : same(t[k], b[k]) ? l[k]
          : prefer === "local" ? l[k] : t[k];
        if (v !== undefined) out[k] = v;
      }
      s.base = { version: s.theirs.version, content: copy(s.theirs.content) };
      s.local = out;
      s.theirs = null;
      s.gen += 1;
      s.due = s.now;
      move("merge");
      save();
      return { type: "won", value: s.gen };
    }

    async function fork() {
      can("fork");
      const c = s.forkUnconfirmed;
      const req = c && c.gen === s.gen ? c : { seq: s.next++, content: copy(s.local), gen: s.gen };
      s.forkSending = req;
      move("fork");
      const a = await call(apiBase, user, "POST", "/api/desk/files",
        { copyOf: doc, content: req.content, writerId: writer, saveSeq: req.seq });
      s.forkSending = null;
      if (a.kind === "http" && (a.status === 200 || a.status === 201)) {
        s.forkUnconfirmed = null;
        takeTheirs();
        s.due = null;
        unslot();
        move("forked");
        return { type: "created", id: a.json.id, version: a.json.version, replayed: !!a.json.replayed };
      }
      if (a.kind !== "http") s.forkUnconfirmed = req;
      move("forkFailed");
      return a.kind === "http" ? { type: "rejected", reason: a.json.error } : { type: "noAnswer" };
    }

    function drop() {
      can("drop");
      if (s.theirs) takeTheirs();
      s.local = copy(s.base.content);
      s.unconfirmed = null;
      s.due = null;
      unslot();
      move("drop");
      return { type: "won", value: "clean" };
    }

    // -- other writers' drafts --------------------------------------------------------------------
    function offeredBy(w) {
      const d = s.offered.find((x) => x.writerId === w);
      if (!d) throw new QuillError("nosuch", `no draft of writer ${w} is offered`);
      return d;
    }

    function adopt(w) {
      can("adopt");
      const offered = offeredBy(w);
      const theirs = slotKey(kind, user, doc, w);
      const d = readSlot(theirs);
      if (!d) { s.offered.splice(s.offered.indexOf(offered), 1); return { type: "rejected", reason: "sibling_gone" }; }
      const kept = { local: s.local, base: s.base, gen: s.gen, unconfirmed: s.unconfirmed, due: s.due };
      s.local = copy(d.content);
      s.base = { version: d.baseVersion, content: copy(d.base) };
      s.gen += 1;
      s.unconfirmed = d.inflight
        ? { ...d.inflight, gen: sameDoc(d.inflight.content, d.content) ? s.gen : s.gen - 1 }
        : null;
      s.due = s.now;
      if (!save()) { Object.assign(s, kept); s.slotGen = null; return { type: "rejected", reason: "draft_store_failing" }; }
      unslot(theirs);
      s.offered.splice(s.offered.indexOf(offered), 1);
      move("adopt");
      return { type: "won", value: w };
    }

    function dismiss(w) {
      if (s.phase === "ended") throw new QuillError("illegal", "ended");
      const d = offeredBy(w);
      try { localStorage.removeItem(slotKey(kind, user, doc, w)); } catch (e) { s.storeOk = false; return { type: "rejected", reason: "draft_store_failing" }; }
      if (!s.storeOk && s.slotGen !== s.gen && holding()) save(); else s.storeOk = true;
      s.offered.splice(s.offered.indexOf(d), 1);
      return { type: "won", value: w };
    }

    // -- closing --------------------------------------------------------------------------------
    async function end() {
      if (s.phase === "ended") return { type: "closed", flushed: true, parkedInDraft: false };
      if (s.phase === "uploading" || s.phase === "forking") throw new QuillError("illegal", "busy");
      let failures = 0;
      while (["modified", "stalled"].includes(s.phase) && failures < 2) {
        const a = await send(s.now);
        if (a.type !== "saved") failures += 1;
      }
      if (s.phase === "synced" || s.phase === "opening") { move("end"); return { type: "closed", flushed: true, parkedInDraft: false }; }
      if ((s.slotGen !== s.gen || !s.storeOk) && !save()) throw new QuillError("unsaved", "the work is in no draft");
      move("end");
      return { type: "closed", flushed: false, parkedInDraft: true };
    }

    return { s, read, send, tick, edit, merge, fork, drop, adopt, dismiss, end };
  }

  global.quill = quill;
  global.QuillError = QuillError;
})(globalThis);
