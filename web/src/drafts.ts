/**
 * The durable per-writer draft store: `localStorage`, one slot per writer
 * (`knownstate:{kind}-draft:{user}:{file}:{writerId}`), so one tab never erases another's draft.
 * A refused write (quota exceeded, storage disabled, private mode) is a `DraftStoreError`: the
 * session shows it and retries on its next write.
 */
import { type DraftRecord, draftKey, draftPrefix } from "./protocol.js";
import { type DraftPort, DraftStoreError } from "./session.js";

export class LocalStorageDrafts implements DraftPort {
  constructor(readonly storage: Storage = globalThis.localStorage) {}

  key(kind: string, user: string, fileId: string, writerId: string): string {
    return draftKey(kind, user, fileId, writerId);
  }

  write(key: string, record: DraftRecord): void {
    try {
      this.storage.setItem(key, JSON.stringify(record));
    } catch (e) {
      throw new DraftStoreError(`write '${key}': ${String(e)}`);
    }
  }

  delete(key: string): void {
    try {
      this.storage.removeItem(key);
    } catch (e) {
      throw new DraftStoreError(`delete '${key}': ${String(e)}`);
    }
  }

  read(key: string): DraftRecord | null {
    const text = this.storage.getItem(key);
    if (text === null) return null;
    try {
      return JSON.parse(text) as DraftRecord;
    } catch {
      return null; // not a draft this client can read
    }
  }

  keys(prefix = ""): string[] {
    const out: string[] = [];
    for (let i = 0; i < this.storage.length; i++) {
      const k = this.storage.key(i);
      if (k !== null && k.startsWith(prefix)) out.push(k);
    }
    return out.sort();
  }

  /** The drafts other writers of the same user left on the same document. */
  siblings(kind: string, user: string, fileId: string, writerId: string): DraftRecord[] {
    const out: DraftRecord[] = [];
    for (const key of this.keys(draftPrefix(kind, user, fileId))) {
      const r = this.read(key);
      if (r !== null && r.writerId !== writerId) out.push(r);
    }
    return out;
  }
}
