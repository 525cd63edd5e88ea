/**
 * The driver contract: what a client bundle exposes so the knownstate browser check can drive
 * it in Chromium (README, "The document session in a browser"). A bundle defines
 * `globalThis.knownstateClient = { contract: 1, open(config) }`; `open` returns a handle whose
 * operations are the session's, in the model's vocabulary (`Outcome`), and whose errors carry
 * the model's names (`IllegalTransition`, `KindError`, `MergeUnsupported`, `UnsavedWork`,
 * `KeyError`). Drafts live in `localStorage` under `knownstate:{kind}-draft:{user}:{file}:{writerId}`
 * in the model's record shape; every request goes through the global `fetch`.
 */
import { LocalStorageDrafts } from "./drafts.js";
import { FetchTransport } from "./http.js";
import { preferLocal, preferStored } from "./kinds.js";
import type { Patch } from "./kinds.js";
import { type Outcome, Session, type SessionOptions, type TabView } from "./session.js";

export interface DriverConfig {
  docId: string;
  user: string;
  kind: string;
  writerId: string;
  /** where `/api/desk/files` lives ("" for the page's own origin) */
  apiBase: string;
  debounce: number;
  retryDelay: number;
  /** the session's clock at creation (seconds); later times come with each operation */
  now: number;
  /** a mutant of the catalogue (the mutants bundle only) */
  mutant?: string;
}

export interface Handle {
  load(): Promise<Outcome>;
  read(purpose: "refresh" | "replace"): Promise<Outcome>;
  save(now: number): Promise<Outcome>;
  tick(now: number): Promise<Outcome>;
  edit(patch: Patch, now: number): Outcome;
  discard(): Outcome;
  rebase(prefer: "local" | "stored"): Outcome;
  keepLocalAsCopy(): Promise<Outcome>;
  adopt(writerId: string): Outcome;
  discardSibling(writerId: string): Outcome;
  close(): Promise<Outcome>;
  view(): TabView;
}

export interface ClientModule {
  contract: 1;
  open(config: DriverConfig): Handle;
  mutants: string[];
}

type SessionClass = new (o: SessionOptions) => Session;

export function driver(variants: Record<string, SessionClass>): ClientModule {
  return {
    contract: 1,
    mutants: Object.keys(variants).filter((name) => name !== "reference"),
    open(config: DriverConfig): Handle {
      const cls = variants[config.mutant ?? "reference"];
      if (cls === undefined) throw new Error(`no mutant '${config.mutant}' in this bundle`);
      let now = config.now;
      const s = new cls({
        docId: config.docId,
        user: config.user,
        kind: config.kind,
        writerId: config.writerId,
        drafts: new LocalStorageDrafts(),
        transport: new FetchTransport(config.apiBase),
        clock: () => now,
        debounce: config.debounce,
        retryDelay: config.retryDelay,
        autosave: false,
      });
      const at = (t: number) => {
        now = t;
      };
      return {
        load: () => s.open(),
        read: (purpose) => s.read(purpose),
        save: (t) => (at(t), s.save(t)),
        tick: (t) => (at(t), s.tick(t)),
        edit: (patch, t) => (at(t), s.edit(patch, t)),
        discard: () => s.discard(),
        rebase: (prefer) => s.rebase(prefer === "local" ? preferLocal : preferStored),
        keepLocalAsCopy: () => s.keepLocalAsCopy(),
        adopt: (w) => s.adopt(w),
        discardSibling: (w) => s.discardSibling(w),
        close: () => s.close(),
        view: () => s.view(),
      };
    },
  };
}
