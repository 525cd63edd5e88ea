/**
 * The client mutants: realistic bugs of a browser session, each a subclass that overrides one
 * seam of the reference `Session` (never a copy of a method body). The knownstate browser check
 * must catch each, naming the invariant it declares (`chaos/browser_mutants.py` lists them with
 * their invariants). Built into their own bundle (`dist/knownstate-client-mutants.js`), never into
 * the reference one.
 */
import type { Content, Resolve } from "./kinds.js";
import type { Answer, DraftRecord, ReadRequest, SaveRequest, Snapshot } from "./protocol.js";
import { type DraftPort, type Outcome, Session, type SessionOptions } from "./session.js";

/** The save's answer handler takes the saved snapshot as the local copy: an edit typed while
 * the save was in flight is wiped (the autosave bug of the seed). */
export class SuccessWipesPendingEdit extends Session {
  override finishSave(req: SaveRequest, answer: Answer): Outcome {
    if (answer.type === "saved" && req === this.inflight) this.local = { ...req.content };
    return super.finishSave(req, answer);
  }
}

/** The draft is removed as soon as a save starts ("it is on its way to the server"). */
export class DraftClearedWhenSaveStarts extends Session {
  override beginSave(now?: number): SaveRequest {
    const req = super.beginSave(now);
    this.deleteDraft();
    return req;
  }
}

/** A version conflict is resolved on the spot: the local copy is put on the stored version and
 * saved again — last write wins, no user asked. */
export class ConflictResolvedByOverwrite extends Session {
  override finishSave(req: SaveRequest, answer: Answer): Outcome {
    const out = super.finishSave(req, answer);
    if (answer.type === "conflict") {
      // a merge whose base is the stored copy keeps every local value: an overwrite
      this.baseContent = { ...(this.conflict as Snapshot).content };
      const overwrite: Resolve = (_id, _base, local) => local;
      this.rebase(overwrite);
    }
    return out;
  }
}

/** On load, a draft another tab of the same user left is taken as this tab's own and restored:
 * applied without asking, instead of offered. */
export class SiblingDraftAppliedSilently extends Session {
  constructor(o: SessionOptions) {
    const drafts: DraftPort = o.drafts;
    const own = drafts.read.bind(drafts);
    super(o);
    this.drafts = {
      key: drafts.key.bind(drafts),
      write: drafts.write.bind(drafts),
      delete: drafts.delete.bind(drafts),
      siblings: drafts.siblings.bind(drafts),
      read: (key: string): DraftRecord | null => {
        const mine = own(key);
        if (mine !== null || key !== this.key || this.state !== "loading") return mine;
        const other = drafts.siblings(this.kind, this.user, this.docId, this.writerId)[0];
        return other === undefined ? null : { ...other, writerId: this.writerId, inflight: null };
      },
    };
  }
}

/** discardAndReload() clears the local copy and its draft first, then fetches. */
export class ReloadClearsFirst extends Session {
  override beginRead(purpose: ReadRequest["purpose"] = "refresh"): ReadRequest {
    const req = super.beginRead(purpose);
    if (purpose === "replace") {
      this.local = { ...this.baseContent };
      this.deleteDraft();
    }
    return req;
  }
}

/** The stale-read guard checks only a local edit and a save in flight: a read answered late,
 * after a newer one, is applied. */
export class ReadGuardWithoutOrder extends Session {
  override readGuards = ["readRacedLocalEdit", "readDuringSave"];
}

/** A discard-and-reload skips the generation check ("the user discards anyway"): its answer,
 * arriving after the user typed again, wipes the new edit. */
export class ReadGuardWithoutGeneration extends Session {
  override readRacedLocalEdit(req: ReadRequest, snap: Snapshot): string | null {
    return req.purpose === "refresh" ? super.readRacedLocalEdit(req, snap) : null;
  }
}

/** close() cancels the debounce timer: an edit not sent yet is dropped instead of flushed. */
export class CloseDropsPending extends Session {
  override async close(maxFailures = 2): Promise<Outcome> {
    if (this.state === "dirty") {
      this.local = { ...this.baseContent } as Content;
      this.dueAt = null;
      this.deleteDraft();
      this.go("discard");
    }
    return super.close(maxFailures);
  }
}

/** The draft key leaves out the writer id: every tab of a user shares one slot per document. */
export class DraftSlotWithoutWriter extends Session {
  constructor(o: SessionOptions) {
    const drafts = o.drafts;
    super({
      ...o,
      drafts: {
        key: (kind, user, fileId) => `knownstate:${kind}-draft:${user}:${fileId}`,
        write: drafts.write.bind(drafts),
        delete: drafts.delete.bind(drafts),
        read: drafts.read.bind(drafts),
        siblings: drafts.siblings.bind(drafts),
      },
    });
  }
}

export const MUTANTS = {
  "success-wipes-pending-edit": SuccessWipesPendingEdit,
  "draft-cleared-when-save-starts": DraftClearedWhenSaveStarts,
  "conflict-resolved-by-overwrite": ConflictResolvedByOverwrite,
  "sibling-draft-applied-silently": SiblingDraftAppliedSilently,
  "reload-clears-before-fetch": ReloadClearsFirst,
  "stale-read-applied": ReadGuardWithoutOrder,
  "read-that-raced-an-edit-applied": ReadGuardWithoutGeneration,
  "close-drops-pending-edit": CloseDropsPending,
  "draft-key-without-writer": DraftSlotWithoutWriter,
};

