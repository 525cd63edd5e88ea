/**
 * The session's lifetime is the document's, not a component's: closing a page flushes, never
 * drops. `attachLifecycle` ties a session to its page: when the page is hidden
 * (`visibilitychange`) the session flushes — the page may still be alive to hear the answer;
 * when it goes away (`pagehide`) it cannot wait for a request, and `park()` makes sure the work
 * is in the writer's draft (it is already, written on every edit and before every save); when
 * the browser is back online a waiting save is retried.
 */
import type { Session } from "./session.js";

export function attachLifecycle(s: Session, target: Window = window): () => void {
  const hidden = () => {
    if (target.document.visibilityState === "hidden" && (s.state === "dirty" || s.state === "offline")) {
      void s.flush().catch(() => undefined);
    }
  };
  const pagehide = () => s.park();
  const online = () => {
    if (s.state === "offline") void s.tick().catch(() => undefined);
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
