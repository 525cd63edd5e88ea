// The driver contract of knownstate's browser check, around quill (README: "Validating your own
// client"). Everything here is translation: quill's phases and events to the session table's
// names, its answers to the model's outcomes, its error codes to the model's error names.
(function (global) {
  "use strict";
  const STATES = {
    opening: "loading", synced: "clean", modified: "dirty", uploading: "saving",
    stalled: "offline", conflicted: "conflict", forking: "copying", ended: "closed",
  };
  const EVENTS = {
    start: "open", opened: "loaded", restored: "restored", failed: "load_failed", end: "close",
    type: "edit", adopt: "adopt", refreshed: "reloaded", replaced: "discard_reloaded",
    send: "save", ok: "saved", okMore: "saved_pending", lost: "save_failed",
    renumber: "seq_taken", stale: "version_conflict", merge: "rebase", fork: "copy",
    forked: "copied", forkFailed: "copy_failed", drop: "discard",
  };
  const ERRORS = {
    illegal: "IllegalTransition", kind: "KindError", nomerge: "MergeUnsupported",
    unsaved: "UnsavedWork", nosuch: "KeyError",
  };

  function named(fn) {
    return (...args) => {
      const rename = (e) => {
        if (e instanceof global.QuillError) e.name = ERRORS[e.code] || "Error";
        throw e;
      };
      try {
        const out = fn(...args);
        return out && typeof out.then === "function" ? out.catch(rename) : out;
      } catch (e) {
        return rename(e);
      }
    };
  }

  global.knownstateClient = {
    contract: 1,
    open(config) {
      let now = config.now;
      const moves = [];
      const q = global.quill({
        doc: config.docId, user: config.user, kind: config.kind, writer: config.writerId,
        apiBase: config.apiBase, debounce: config.debounce, retryDelay: config.retryDelay,
        clock: () => now,
        onMove: (from, event, to) => moves.push([from ? STATES[from] : "(new)", EVENTS[event], STATES[to]]),
      });
      const at = (t) => { now = t; return t; };
      return {
        load: named(() => q.read("load")),
        read: named((purpose) => q.read(purpose)),
        save: named((t) => q.send(at(t))),
        tick: named((t) => q.tick(at(t))),
        edit: named((patch, t) => q.edit(patch, at(t))),
        discard: named(() => q.drop()),
        rebase: named((prefer) => q.merge(prefer)),
        keepLocalAsCopy: named(() => q.fork()),
        adopt: named((w) => q.adopt(w)),
        discardSibling: named((w) => q.dismiss(w)),
        close: named(() => q.end()),
        view: () => ({
          user: config.user, docId: config.docId, writerId: config.writerId, kind: config.kind,
          state: STATES[q.s.phase], local: JSON.parse(JSON.stringify(q.s.local)),
          baseVersion: q.s.base.version, generation: q.s.gen,
          draftStatus: q.s.storeOk ? "ok" : "failing", transitions: moves.map((m) => [...m]),
          siblings: q.s.offered.map((d) => d.writerId),
          conflictVersion: q.s.theirs ? q.s.theirs.version : null,
        }),
      };
    },
  };
})(globalThis);
