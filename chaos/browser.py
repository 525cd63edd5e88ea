"""The document session in a real browser: Chromium and the page that hosts a client.

What runs
---------

Debian's Chromium (``/usr/bin/chromium``, or ``KNOWNSTATE_CHROMIUM``), headless, driven through
the Python ``playwright`` package with ``executable_path`` (Playwright never downloads a browser
here). One browser context per user — alice's two tabs share her ``localStorage``, bob's is his
own — and one page per tab slot. Each page is the *harness* (:data:`HARNESS`), served by the
gateway from one origin, which loads the client bundle under test (the reference
``web/dist/knownstate-client.js``, its mutants, or ``--client-bundle``) and opens sessions through
the bundle's driver contract (``globalThis.knownstateClient.open(config)``; README: "Validating
your own client").

The browser check in three modules, one concern each:

- this one: Chromium, its contexts and pages, the harness page, the bundles (:class:`Chromium`);
- :mod:`.browser_gateway`: the HTTP server the pages talk to, which holds every request and
  every answer until the check lets it go (:class:`~.browser_gateway.Gateway`);
- :mod:`.browser_driver`: a tab driven like the model's session, its requests forwarded over
  the tab's link and its outcomes in the model's vocabulary
  (:class:`~.browser_driver.BrowserDriver`, :class:`~.browser_driver.BrowserTab`).

Time in the harness is a number the check passes (the client's clock is injected, its debounce
timer never runs on its own), so nothing waits on a wall clock. Waiting for the browser is polling
with a deadline; a browser that does not answer within it is the environment's failure (exit 3),
never a verdict.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .harness import EnvironmentFault

if TYPE_CHECKING:
    from .browser_gateway import Gateway

CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--process-per-site",
]
"""Headless flags that work on a closed network (no background fetches to Google's hosts). With
``--process-per-site`` the tabs of one user share one renderer, so they share one localStorage
cache: what one tab wrote, the others (and the check) read at once, on every run alike. (In
separate processes a write reaches the others a moment later, which no step could depend on
deterministically.)"""

WAIT_S = 30.0
"""How long the browser may take to answer one step: a backstop, never a verdict."""

DRAFTS_FAULT_KEY = "knownstate-fault:drafts"


def repo_web() -> Path:
    """``web/`` of this checkout (the package is installed editable by the set-up)."""
    return Path(__file__).resolve().parent.parent / "web"


def reference_bundle(mutants: bool = False) -> Path:
    name = "knownstate-client-mutants.js" if mutants else "knownstate-client.js"
    return repo_web() / "dist" / name


def mount_page(app) -> str | None:
    """Serve the built page and bundles of ``web/dist`` at ``/app/`` of the document server's
    ``app`` (``knownstate serve``); the path, or None when the page is not built."""
    dist = repo_web() / "dist"
    if not (dist / "index.html").is_file():
        return None
    from starlette.staticfiles import StaticFiles

    app.mount("/app", StaticFiles(directory=dist, html=True), name="app")
    return "/app/"


def on_a_thread_of_its_own(fn):
    """``fn()``, which uses Playwright's sync API, run on a thread of its own: the sync API allows
    one Playwright per thread, and a check's Chromium is kept for the whole run on the thread
    that started it."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn).result()


def chromium_path() -> str:
    """Debian's Chromium (``chromium`` on PATH: the package puts it in /usr/bin), or
    ``KNOWNSTATE_CHROMIUM``; EnvironmentFault (exit 3) saying what to do when there is none."""
    given = os.environ.get("KNOWNSTATE_CHROMIUM")
    if given:
        if os.access(given, os.X_OK):
            return given
        raise EnvironmentFault(f"KNOWNSTATE_CHROMIUM={given} is not an executable Chromium")
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    raise EnvironmentFault(
        "Chromium is not installed, so the document session cannot be checked in a browser: "
        "run `make setup` as root (apt-get install chromium), or point KNOWNSTATE_CHROMIUM at a "
        "Chromium binary"
    )


def read_bundle(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        hint = (
            "build it with `make setup` (npm ci && npm run build in web/)"
            if path.parent == repo_web() / "dist"
            else "give the path of a built bundle"
        )
        raise EnvironmentFault(f"{what} {path} cannot be read ({e.strerror}): {hint}") from None


# ---------------------------------------------------------------------------------------
# The harness page: the driver's side of the contract, and what it observes.
# ---------------------------------------------------------------------------------------

HARNESS = """<!doctype html>
<html><head><meta charset="utf-8"><title>knownstate harness</title>
<script>
// What the check observes of the network: every fetch is numbered (X-Knownstate-Seq, stripped by
// the gateway) and its fate noted, so a request that never left the browser (offline) is known.
// A fetch that fails is held failing until the check releases it (as the gateway holds answers):
// the check decides when the client hears of it, whatever made it fail. A fetch bypasses the
// HTTP cache unless the client chose a cache mode: Chromium holds a GET back while another GET of
// the same URL is in flight (its cache lock, up to 20 s), so a second read of a document whose
// first read the gateway held never arrived, and the check waited on a timer for it.
(() => {
  const realFetch = window.fetch.bind(window);
  let n = 0;
  window.__ksWire = [];
  window.fetch = (input, init = {}) => {
    const id = ++n;
    const headers = new Headers(init.headers || {});
    headers.set("X-Knownstate-Seq", String(id));
    const url = typeof input === "string" ? input : input.url;
    const entry = { n: id, method: (init.method || "GET").toUpperCase(), url: new URL(url,
      location.href).pathname, user: headers.get("X-User"), body: init.body ?? null,
      failed: null, reported: false, released: false, reject: null };
    window.__ksWire.push(entry);
    const wake = () => window.__ks && window.__ks.wake && window.__ks.wake();
    queueMicrotask(wake);
    return realFetch(input, { cache: "no-store", ...init, headers }).then(
      (r) => { entry.failed = false; return r; },
      (e) => {
        entry.failed = true;
        wake();
        if (entry.released) throw e;
        return new Promise((_, reject) => { entry.reject = () => reject(e); });
      });
  };
  window.__ksRelease = (n) => {
    const e = window.__ksWire.find((x) => x.n === n);
    if (!e) return;
    e.released = true;
    if (e.reject) { const r = e.reject; e.reject = null; r(); }
  };
  // The draft store failing (a quota, a private window): every write and delete of a
  // knownstate key is refused while the flag is set in this origin's storage.
  const S = Storage.prototype, set = S.setItem, remove = S.removeItem, get = S.getItem;
  const failing = (s, k) => String(k).startsWith("knownstate:") &&
    get.call(s, "__FAULT__") === "failing";
  const refuse = () => new DOMException("the draft store is failing", "QuotaExceededError");
  S.setItem = function (k, v) {
    if (failing(this, k)) throw refuse();
    return set.call(this, k, v);
  };
  S.removeItem = function (k) {
    if (failing(this, k)) throw refuse();
    return remove.call(this, k);
  };
})();
</script>
<script src="/knownstate/client.js"></script>
<script>
window.__ks = {
  handle: null, ops: {}, n: 0,
  error(e) { return { name: (e && e.name) || "Error", message: String((e && e.message) || e) }; },
  view() { try { return this.handle ? this.handle.view() : null; } catch (e) { return null; } },
  wire() {
    const out = [];
    for (const e of window.__ksWire) {
      if (e.failed !== null && !e.reported) {
        e.reported = true;
        out.push({ n: e.n, method: e.method, url: e.url, user: e.user, body: e.body,
                   failed: e.failed });
      }
    }
    return out;
  },
  open(config) {
    const c = window.knownstateClient;
    if (!c || typeof c.open !== "function") return { error: { name: "ContractError",
      message: "the bundle defines no globalThis.knownstateClient.open(config)" } };
    try { this.handle = c.open(config); } catch (e) { return { error: this.error(e) }; }
    return { view: this.view(), drafts: this.draftsJson() };
  },
  call(op, args) {
    let result = null, error = null;
    try { result = this.handle[op](...args); } catch (e) { error = this.error(e); }
    return { result: result === undefined ? null : result, error, view: this.view(),
             drafts: this.draftsJson() };
  },
  start(op, args) {
    // the operation runs until it waits on the network (or ends): then its first poll
    const id = ++this.n, rec = this.ops[id] = { done: false };
    let p;
    try { p = Promise.resolve(this.handle[op](...args)); } catch (e) { p = Promise.reject(e); }
    p.then((r) => { rec.done = true; rec.result = r === undefined ? null : r; this.woken(); },
           (e) => { rec.done = true; rec.error = this.error(e); this.woken(); });
    // a message is a task that runs once every microtask has (timers of a hidden page are
    // throttled; messages are not)
    return new Promise((resolve) => {
      const ch = new MessageChannel();
      ch.port1.onmessage = () => resolve({ id, ...this.poll(id), inflight: this.inflight() });
      ch.port2.postMessage(0);
    });
  },
  wake: null,
  woken() { if (this.wake) this.wake(); },
  inflight() { return window.__ksWire.filter((e) => e.failed === null).map((e) => e.n); },
  // until the operation ends, a request starts, or one fails (or ms pass: a backstop)
  waitFor(id, ms) {
    return new Promise((resolve) => {
      let timer = null;
      const finish = () => {
        if (timer !== null) clearTimeout(timer);
        this.wake = null;
        resolve({ ...this.poll(id), inflight: this.inflight() });
      };
      const rec = this.ops[id];
      if (!rec || rec.done || window.__ksWire.some((e) => e.failed !== null && !e.reported)) {
        return finish();
      }
      this.wake = finish;
      timer = setTimeout(finish, ms);
    });
  },
  reset() {
    this.handle = null;
    this.ops = {};
    for (const e of window.__ksWire) e.reported = true;
  },
  poll(id) {
    const rec = this.ops[id];
    if (!rec) return { done: true, result: null, error: null, view: this.view(),
                       wire: this.wire(), drafts: this.draftsJson() };
    if (!rec.done) return { done: false, wire: this.wire(), drafts: this.draftsJson() };
    delete this.ops[id];
    return { done: true, result: rec.result ?? null, error: rec.error ?? null,
             view: this.view(), wire: this.wire(), drafts: this.draftsJson() };
  },
  draftsJson() { return JSON.stringify(this.drafts()); },
  drafts() {
    const out = {};
    for (let i = 0; i < localStorage.length; i++) {
      const k = localStorage.key(i);
      if (!k.startsWith("knownstate:") || !k.includes("-draft:")) continue;
      try { out[k] = JSON.parse(localStorage.getItem(k)); } catch (e) { out[k] = null; }
    }
    return out;
  },
};
</script></head><body></body></html>
""".replace("__FAULT__", DRAFTS_FAULT_KEY)

# ---------------------------------------------------------------------------------------
# Chromium.
# ---------------------------------------------------------------------------------------


class Chromium:
    """Headless Chromium with one context per user and one page per tab slot (started once per
    run, reset between examples)."""

    def __init__(self, gateway: Gateway, slots: dict[str, str]):
        self.gateway, self.slots = gateway, slots
        self.executable = chromium_path()
        self.pw = self.browser = None
        self.contexts: dict[str, Any] = {}
        self.pages: dict[str, Any] = {}
        self.observers: dict[str, Any] = {}
        self.offline: dict[str, bool] = {}
        self.version = ""  # of the bundle the harness loads (its URLs carry it)
        self.user_of: dict[int, str] = {}  # id(page) -> user
        self.touched: set[str] = set(slots.values())
        self.stored: dict[str, dict[str, dict]] = {}

    def describe(self) -> str:
        return f"Chromium ({self.executable})"

    @property
    def running(self) -> bool:
        return self.browser is not None and self.browser.is_connected()

    def start(self) -> "Chromium":
        try:
            from playwright.sync_api import sync_playwright
        except ImportError:
            raise EnvironmentFault(
                "the Python package playwright is missing: run `make setup` (it installs "
                "knownstate's dependencies into .venv)"
            ) from None
        try:
            self.pw = sync_playwright().start()
            self.browser = self.pw.chromium.launch(
                executable_path=self.executable, headless=True, args=CHROMIUM_ARGS
            )
        except Exception as e:
            self.stop()
            raise EnvironmentFault(
                f"{self.describe()} did not start: {str(e).strip().splitlines()[0]}"
            ) from None
        for user in dict.fromkeys(self.slots.values()):
            ctx = self.contexts[user] = self.browser.new_context()
            ctx.set_default_timeout(WAIT_S * 1000)
            self.observers[user] = ctx.new_page()
            self.offline[user] = False
        for slot, user in self.slots.items():
            self.pages[slot] = self.contexts[user].new_page()
        for user, page in self.observers.items():
            self.user_of[id(page)] = user
        for slot, page in self.pages.items():
            self.user_of[id(page)] = self.slots[slot]
        return self

    @property
    def harness_url(self) -> str:
        return f"{self.gateway.url}/knownstate/harness.html?v={self.version}"

    def use_bundle(self, bundle: bytes) -> bool:
        """Serve ``bundle`` as the client under test; whether it changed (every page must then
        load it anew). Each bundle has URLs of its own, so the browser may cache them."""
        version = hashlib.sha256(bundle).hexdigest()[:16]
        if version == self.version:
            return False
        html = HARNESS.replace("/knownstate/client.js", f"/knownstate/client.js?v={version}")
        self.gateway.files["/knownstate/harness.html"] = (html.encode(), "text/html")
        self.gateway.files["/knownstate/client.js"] = (bundle, "text/javascript")
        self.version = version
        return True

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            if self.browser is not None:
                self.browser.close()
        with contextlib.suppress(Exception):
            if self.pw is not None:
                self.pw.stop()
        self.browser = self.pw = None

    def fresh(self, slot: str) -> Any:
        """The slot's page, loaded anew: whatever the tab held in memory is gone. The page itself
        (the app shell) always loads, as from a cache, even while the browser is offline."""
        page, user = self.pages[slot], self.slots[slot]
        offline = self.offline.get(user, False)
        self.touched.add(user)
        try:
            if offline:
                self.contexts[user].set_offline(False)
            page.goto(self.harness_url)
        except Exception as e:
            if not self.running:
                raise EnvironmentFault(
                    f"{self.describe()} died, and not by the harness: was it killed from outside?"
                ) from None
            raise EnvironmentFault(
                f"{self.describe()}: the harness page did not load: "
                f"{str(e).strip().splitlines()[0]}"
            ) from None
        finally:
            if offline:
                self.contexts[user].set_offline(True)
        return page

    def reset(self, reload: bool = False) -> None:
        """Between examples: no session in any page, every user's storage empty and online.
        (A session of the last example that still waits on the network never hears back: its
        requests are cut and their failures never released.)"""
        for slot, page in self.pages.items():
            if reload or page.url != self.harness_url:
                self.fresh(slot)
            else:
                page.evaluate("() => __ks.reset()")
        for user, page in self.observers.items():
            if reload or page.url != self.harness_url:
                page.goto(self.harness_url)
            page.evaluate("() => localStorage.clear()")
            self.set_offline(user, False)
            self.touched.add(user)

    def set_offline(self, user: str, offline: bool) -> None:
        if self.offline.get(user) != offline:
            self.contexts[user].set_offline(offline)
            self.offline[user] = offline

    def drafts(self) -> dict[str, dict]:
        """Every user's drafts, as the user's pages see them (one renderer per user). Only a
        page of the user's own browser writes its storage: a user none of whose pages ran
        anything since the last look is not read again."""
        for user in sorted(self.touched):
            page = self.observers[user]
            self.note_drafts(page, page.evaluate("() => __ks.draftsJson()"))
        self.touched.clear()
        return {k: r for user in self.stored for k, r in self.stored[user].items()}

    def note_drafts(self, page: Any, text: str) -> None:
        """What ``page`` saw of its user's storage at the end of a call (every call of the
        harness returns it: the storage as the user's pages see it, nothing runs after)."""
        user = self.user_of[id(page)]
        records = json.loads(text)
        self.stored[user] = {k: r for k, r in records.items() if isinstance(r, dict)}
        self.touched.discard(user)

    def touch(self, page: Any) -> None:
        """Something ran in ``page``: its user's storage may have changed."""
        self.touched.add(self.user_of[id(page)])

    def set_drafts_failing(self, failing: bool) -> None:
        self.touched.update(self.observers)
        for page in self.observers.values():
            if failing:
                page.evaluate(f"() => localStorage.setItem({DRAFTS_FAULT_KEY!r}, 'failing')")
            else:
                page.evaluate(f"() => localStorage.removeItem({DRAFTS_FAULT_KEY!r})")


class BrowserDrafts:
    """The draft store the check looks at: every user's ``localStorage`` (the check's
    ``drafts``); ``fail_writes`` is the draft store failing, as in the Python check."""

    def __init__(self, chromium: Chromium):
        self.chromium = chromium
        self._failing = False

    @property
    def fail_writes(self) -> bool:
        return self._failing

    @fail_writes.setter
    def fail_writes(self, failing: bool) -> None:
        self.chromium.set_drafts_failing(failing)
        self._failing = failing

    def records(self) -> dict[str, dict]:
        return self.chromium.drafts()
