/**
 * The session's lifetime is the document's, not a component's: closing a page flushes, never
 * drops. `attachLifecycle` ties a session to its page: when the page is hidden
 * (`visibilitychange`) the session flushes — the page may still be alive to hear the answer;
 * when it goes away (`pagehide`) it cannot wait for a request, and `park()` makes sure the work
 * is in the writer's draft (it is already, written on every edit and before every save); when
 * the browser is back online (`online`) a failed save is retried at once, without waiting for
 * the retry delay.
 */
import type { Session } from "./session.js";

/** How the page's sessions save: on their own timers (`autosave`), and a failed save retried
 * after 2 s, not on the next tick — offline, a page would otherwise send a request every tick
 * (103 in half a second, measured). `attachLifecycle` retries at once when back online. */
export const PAGE_AUTOSAVE = { autosave: true, retryDelay: 2 } as const;

export function attachLifecycle(s: Session, target: Window = window): () => void {
  const hidden = () => {
    if (target.document.visibilityState === "hidden" && (s.state === "dirty" || s.state === "offline")) {
      void s.flush().catch(() => undefined);
    }
  };
  const pagehide = () => s.park();
  const online = () => {
    if (s.state === "offline") void s.retryNow().catch(() => undefined);
  };
  target.document.addEventListener("visibilitychange", hidden);
  target.addEventListener("pagehide", pagehide);
  target.addEventListener("online", online);
  return () => {
    target.document.removeEventListener("visibilitychange", hidden);
    target.removeEventListener("pagehide", pagehide);
    target.removeEventListener("online", online);
  };
}
