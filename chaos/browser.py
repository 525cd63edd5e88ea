"""The document session in a real browser: Chromium, the page that hosts a client, the gateway.

What runs
---------

Debian's Chromium (``/usr/bin/chromium``, or ``KNOWNSTATE_CHROMIUM``), headless, driven through
the Python ``playwright`` package with ``executable_path`` (Playwright never downloads a browser
here). One browser context per user — alice's two tabs share her ``localStorage``, bob's is his
own — and one page per tab slot. Each page is the *harness* (:data:`HARNESS`), served by the
:class:`Gateway` from one origin, which loads the client bundle under test (the reference
``web/dist/knownstate-client.js``, its mutants, or ``--client-bundle``) and opens sessions through
the bundle's driver contract (``globalThis.knownstateClient.open(config)``; README: "Validating
your own client").

The gateway stands between the browser and the document server: the page's requests go to
``/t/{slot}/api/...`` on the gateway, which holds each one until the check lets it through, then
forwards it over the slot's own Toxiproxy link to the server, and holds the answer until the check
lets the browser have it. So a check decides, as with the Python session's ``begin_*`` /
``finish_*`` pairs, when a request is sent and when its answer arrives: an edit typed while a save
is in flight, two reads answered out of order, a tab closed while its save is on the wire. A
request whose answer was lost upstream (a toxic, a link down, a server restarting) reaches the
browser as ``502 Bad Gateway``, what a browser behind a proxy or load balancer gets then (a
connection closed without an answer would be sent again by Chromium on its own, on a socket it
believes reused: a second request the client never made). The browser going offline is
Chromium's own offline mode: there the client's ``fetch`` fails.

Time in the harness is a number the check passes (the client's clock is injected, its debounce
timer never runs on its own), so nothing waits on a wall clock. Waiting for the browser is polling
with a deadline; a browser that does not answer within it is the environment's failure (exit 3),
never a verdict.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import json
import os
import shutil
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from knownstate.impl.documents.session import HttpTransport
from knownstate.model.contract import IllegalTransition, Rejected, Won
from knownstate.model.document import (
    CloseResult,
    CopyRequest,
    Created,
    Dropped,
    KindError,
    MergeUnsupported,
    NoAnswer,
    ReadRequest,
    Saved,
    SaveRequest,
    SeqTaken,
    Snapshot,
    State,
    TabView,
    UnsavedWork,
    VersionConflict,
)

from .harness import EnvironmentFault

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

BAD_GATEWAY = (
    502,
    {"Content-Type": "application/json"},
    b'{"error": "bad_gateway", "message": "the server gave no answer"}',
)
"""What the browser gets when the server's answer was lost upstream of the gateway."""

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
    """Debian's Chromium, or ``KNOWNSTATE_CHROMIUM``; EnvironmentFault (exit 3) saying what to do
    when there is none."""
    given = os.environ.get("KNOWNSTATE_CHROMIUM")
    if given:
        if os.access(given, os.X_OK):
            return given
        raise EnvironmentFault(f"KNOWNSTATE_CHROMIUM={given} is not an executable Chromium")
    for name in ("/usr/bin/chromium", "chromium", "chromium-browser"):
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
// the check decides when the client hears of it, whatever made it fail.
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
    return realFetch(input, { ...init, headers }).then(
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
# The gateway: one origin for the harness and the bundle, and the held requests of each tab.
# ---------------------------------------------------------------------------------------


@dataclass(eq=False)
class Held:
    """A request the browser made, held at the gateway: first until the check sends it, then
    (its answer known) until the check lets the browser have the answer."""

    slot: str
    seq: int | None
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    request: Any  # in the model's vocabulary (SaveRequest, ReadRequest, CopyRequest)
    reply: tuple[int, dict[str, str], bytes] | None = None  # None: cut (its tab is gone)
    replied: threading.Event = field(default_factory=threading.Event)


def parse_request(method: str, path: str, headers: dict[str, str], body: bytes) -> Any:
    """The model's request for what the browser sent (client-side fields, the generation and the
    read's sequence, are not on the wire: the check compares requests as they are on it)."""
    user = headers.get("x-user", "")
    parts = path.split("?")[0].split("/")
    if parts[:4] != ["", "api", "desk", "files"]:
        return ("unknown request", method, path)
    try:
        data = json.loads(body) if body else {}
    except ValueError:
        data = {"unreadable body": body.decode("utf-8", "replace")}
    if not isinstance(data, dict):
        data = {"body": data}
    if method == "GET" and len(parts) == 5:
        return ReadRequest(parts[4], user, 0, 0, None, "load")
    if method == "PUT" and len(parts) == 5:
        base = data.get("expectedVersion")
        tag = headers.get("if-match", "")
        if base is None and tag.startswith('"') and tag[1:-1].isdigit():
            base = int(tag[1:-1])
        return SaveRequest(
            parts[4], user, data.get("writerId"), data.get("saveSeq"), base, data.get("content"), 0
        )
    if method == "POST" and len(parts) == 4:
        writer, seq, content = data.get("writerId"), data.get("saveSeq"), data.get("content")
        return CopyRequest(data.get("copyOf"), user, writer, seq, content, 0)
    return ("unknown request", method, path, data)


class Gateway:
    """A threaded HTTP server on loopback: the harness and the bundle, and ``/t/{slot}/...``
    held for the check. HTTP/1.0, one connection per request: a connection cut without an
    answer is never retried by the browser on a reused socket."""

    def __init__(self, files: dict[str, tuple[bytes, str]]):
        self.files = files
        self.lock = threading.Condition()
        self.arrived: dict[str, deque[Held]] = {}
        self.open: list[Held] = []  # taken by the check, not yet replied
        self.seen: dict[str, set[int]] = {}
        self.server: http.server.ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> "Gateway":
        gateway = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *args) -> None:
                pass

            def _serve(self) -> None:
                gateway.handle(self)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _serve

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(
            target=self.server.serve_forever, name="knownstate-gateway", daemon=True
        ).start()
        return self

    def stop(self) -> None:
        with self.lock:
            for h in [*self.open, *(h for q in self.arrived.values() for h in q)]:
                h.replied.set()
            self.open.clear()
            self.arrived.clear()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    # -- the handler's side (a server thread) -------------------------------------------------
    def handle(self, h: http.server.BaseHTTPRequestHandler) -> None:
        path = h.path.split("?")[0]
        if path in self.files:
            body, ctype = self.files[path]
            h.send_response(200)
            h.send_header("Content-Type", ctype)
            h.send_header("Content-Length", str(len(body)))
            h.send_header("Cache-Control", "max-age=86400")  # each bundle has its own URL
            h.end_headers()
            h.wfile.write(body)
            return
        parts = h.path.split("/", 3)
        if len(parts) < 4 or parts[1] != "t":
            h.send_error(404)
            return
        slot, rest = parts[2], "/" + parts[3]
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length else b""
        headers = {k.lower(): v for k, v in h.headers.items()}
        seq = headers.pop("x-knownstate-seq", None)
        held = Held(
            slot,
            int(seq) if seq and seq.isdigit() else None,
            h.command,
            rest,
            headers,
            body,
            parse_request(h.command, rest, headers, body),
        )
        with self.lock:
            if held.seq is not None:
                self.seen.setdefault(slot, set()).add(held.seq)
            self.arrived.setdefault(slot, deque()).append(held)
            self.lock.notify_all()
        if not held.replied.wait(WAIT_S * 4) or held.reply is None:
            h.close_connection = True  # cut: the browser gets no answer
            with contextlib.suppress(OSError):
                h.connection.shutdown(2)
            return
        status, out_headers, out = held.reply
        h.send_response(status)
        for k, v in out_headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(out)))
        h.end_headers()
        with contextlib.suppress(OSError):
            h.wfile.write(out)

    # -- the check's side ---------------------------------------------------------------------
    def take(self, slot: str, timeout: float = 0.0) -> Held | None:
        """The oldest request of ``slot`` not yet taken, waiting up to ``timeout`` for one."""
        with self.lock:
            q = self.arrived.setdefault(slot, deque())
            if not q and timeout > 0:
                self.lock.wait_for(lambda: bool(q), timeout)
            if not q:
                return None
            held = q.popleft()
            self.open.append(held)
            return held

    def take_wait(self, slot: str, timeout: float) -> None:
        """Wait up to ``timeout`` for a request of ``slot`` (the poll's interval)."""
        with self.lock:
            q = self.arrived.setdefault(slot, deque())
            if not q:
                self.lock.wait_for(lambda: bool(q), timeout)

    def was_seen(self, slot: str, seq: int) -> bool:
        with self.lock:
            return seq in self.seen.get(slot, set())

    def reply(self, held: Held, reply: tuple[int, dict[str, str], bytes] | None) -> None:
        with self.lock:
            held.reply = reply
            if held in self.open:
                self.open.remove(held)
        held.replied.set()

    def cut(self, slot: str) -> int:
        """Every request of ``slot`` still held gets no answer (its tab is gone); how many."""
        with self.lock:
            gone = [h for h in self.open if h.slot == slot]
            gone += list(self.arrived.pop(slot, deque()))
            self.open = [h for h in self.open if h.slot != slot]
            self.seen.pop(slot, None)
        for h in gone:
            h.reply = None
            h.replied.set()
        return len(gone)


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


# ---------------------------------------------------------------------------------------
# A tab: the client in one page, driven like the model's session.
# ---------------------------------------------------------------------------------------

ERRORS: dict[str, type[Exception]] = {
    "IllegalTransition": IllegalTransition,
    "KindError": KindError,
    "MergeUnsupported": MergeUnsupported,
    "UnsavedWork": UnsavedWork,
    "KeyError": KeyError,
}


class ClientError(Exception):
    """The client threw something the driver contract does not name (a bug of the client, or
    a broken bundle): reported as the failure it is, never as a lost connection."""


def raise_client_error(error: dict) -> None:
    name, message = error.get("name", "Error"), error.get("message", "")
    cls = ERRORS.get(name)
    if cls is None:
        raise ClientError(f"the client threw {name}: {message}")
    e = Exception.__new__(cls)
    Exception.__init__(e, message)
    raise e


@dataclass(eq=False)
class Op:
    """An operation started in the page: its id, and its first poll (not read yet)."""

    id: int
    first: dict | None


@dataclass(eq=False)
class Pending:
    """An operation started in the page and the request it made (``begin_*``)."""

    op: Op
    request: Any
    held: Held | None = None  # at the gateway (None: it never left the browser)
    seq: int | None = None  # the page's number for the request (to release its failure)
    answer: Any = None  # what the check recorded for it, once sent


class Unsent:
    """A ``begin_*`` after which the client sent nothing (it refused, or it is wrong)."""

    def __init__(self, done: dict):
        self.done = done


class BrowserTab:
    """One tab: a session of the client under test in one page. Its methods are the model
    session's (``begin_save`` / ``finish_save``, ``tick``, ``edit``, ...), each carried out in the
    page through the driver contract, with the gateway deciding when requests go out and
    answers come back; outcomes and errors come back in the model's vocabulary."""

    def __init__(self, driver: "BrowserDriver", slot: str, user: str, view: dict):
        self.driver, self.slot, self.user = driver, slot, user
        self.page = driver.chromium.pages[slot]
        self.last = view
        self.pending: list[Pending] = []
        self.last_answer: Any = None

    # -- what the check reads ------------------------------------------------------------------
    @property
    def state(self) -> State:
        return State(self.last["state"])

    @property
    def writer_id(self) -> str:
        return self.last["writerId"]

    @property
    def draft_status(self) -> str:
        return self.last["draftStatus"]

    @property
    def siblings(self) -> list[dict]:
        return [{"writerId": w} for w in self.last["siblings"]]

    def view(self, tab: str) -> TabView:
        v = self.last
        return TabView(
            tab,
            v["user"],
            v["docId"],
            v["writerId"],
            v["kind"],
            v["state"],
            dict(v["local"]),
            v["baseVersion"],
            v["generation"],
            v["draftStatus"],
            tuple(tuple(t) for t in v["transitions"]),
            tuple(v["siblings"]),
            v["conflictVersion"],
        )

    # -- synchronous operations ------------------------------------------------------------------
    def _call(self, op: str, *args) -> Any:
        out = self.driver.evaluate(self.page, "([op, args]) => __ks.call(op, args)", [op, args])
        self._seen(out.get("view"))
        if out.get("error"):
            raise_client_error(out["error"])
        return self.outcome(out.get("result"))

    def edit(self, patch: dict, now: float):
        return self._call("edit", patch, now)

    def discard(self):
        return self._call("discard")

    def rebase(self, resolve):
        from knownstate.model.document import prefer_local

        return self._call("rebase", "local" if resolve is prefer_local else "stored")

    def adopt(self, writer_id: str):
        return self._call("adopt", writer_id)

    def discard_sibling(self, writer_id: str):
        return self._call("discardSibling", writer_id)

    # -- operations that talk to the server --------------------------------------------------------
    def tick(self, now: float):
        return self._pump(self._start("tick", now))

    def close(self, max_failures: int = 2):
        return self._pump(self._start("close"))

    def begin_read(self, purpose: str = "refresh"):
        op = self._start("load") if purpose == "load" else self._start("read", purpose)
        return self._begin(op, purpose)

    def finish_read(self, req, answer):
        return self._finish(req)

    def begin_save(self, now: float | None = None):
        return self._begin(self._start("save", now if now is not None else 0.0))

    def finish_save(self, req, answer):
        return self._finish(req)

    def begin_copy(self):
        return self._begin(self._start("keepLocalAsCopy"))

    def finish_copy(self, req, answer):
        return self._finish(req)

    # -- the machinery -----------------------------------------------------------------------------
    def _start(self, op: str, *args) -> "Op":
        first = self.driver.evaluate(self.page, "([op, args]) => __ks.start(op, args)", [op, args])
        return Op(first["id"], first)

    def _seen(self, view: dict | None) -> None:
        if view is not None:
            self.last = view

    def _next(self, op: "Op", purpose: str | None) -> tuple[str, Any]:
        """Wait until the operation makes a request (``("request", Pending)``) or finishes
        (``("done", poll)``)."""
        deadline = time.monotonic() + WAIT_S
        out, op.first = op.first, None
        gateway, wait_ms = self.driver.gateway, 1000
        while True:
            held = gateway.take(self.slot)
            if held is not None:
                return "request", self._pending(op, held.request, purpose, held=held)
            if out is None:
                out = self.driver.evaluate(
                    self.page, "([id, ms]) => __ks.waitFor(id, ms)", [op.id, wait_ms]
                )
            offline = self.driver.failed_in_browser(self.slot, out.get("wire", []))
            if offline:  # it never left the browser (offline): known from the page's own record
                for seq, extra in offline[1:]:
                    self.driver.record_offline(self, extra)
                    self.driver.release(self.page, seq)
                seq, request = offline[0]
                return "request", self._pending(op, request, purpose, seq=seq)
            if out["done"]:
                return "done", out
            if time.monotonic() > deadline:
                raise EnvironmentFault(
                    f"{self.driver.chromium.describe()}: tab {self.slot} did not finish an "
                    f"operation within {WAIT_S:.0f} s (is the machine overloaded?)"
                )
            # a request on its way to the gateway, or failing in the browser: look at both
            unseen = any(not gateway.was_seen(self.slot, n) for n in out.get("inflight", []))
            if unseen:
                gateway.take_wait(self.slot, 0.005)
            wait_ms = 20 if unseen else 1000
            out = None

    def _pending(
        self,
        op: "Op",
        request: Any,
        purpose: str | None,
        held: Held | None = None,
        seq: int | None = None,
    ) -> Pending:
        if isinstance(request, ReadRequest) and purpose is not None:
            request = ReadRequest(request.doc_id, request.user, 0, 0, None, purpose)
            if held is not None:
                held.request = request
        p = Pending(op, request, held, held.seq if held is not None else seq)
        self.pending.append(p)
        return p

    def _begin(self, op: "Op", purpose: str | None = None):
        kind, got = self._next(op, purpose)
        if kind == "done":
            self._seen(got.get("view"))
            if got.get("error"):
                raise_client_error(got["error"])
            return Unsent(got)
        return got.request

    def _find(self, req) -> Pending | None:
        return next((p for p in self.pending if p.request is req), None)

    def send(self, req) -> Any:
        """The request goes out (``side.send``): forwarded and recorded, or, if it never left the
        browser, recorded as unanswered."""
        if isinstance(req, Unsent):
            return NoAnswer("never sent")
        p = self._find(req)
        if p is None:
            raise RuntimeError(f"tab {self.slot}: no request {req!r} in flight")
        p.answer = self.driver.forward(self, p)
        return p.answer

    def _finish(self, req):
        if isinstance(req, Unsent):
            return self._result(req.done)
        p = self._find(req)
        if p is None:
            raise RuntimeError(f"tab {self.slot}: no request {req!r} in flight")
        if p.answer is None:
            p.answer = self.driver.forward(self, p)
        self.driver.deliver(self.page, p)
        self.pending.remove(p)
        return self._pump(p.op)

    def _pump(self, op: "Op"):
        """Carry the operation to its end: every request it makes is sent and answered at once."""
        while True:
            kind, got = self._next(op, None)
            if kind == "done":
                return self._result(got)
            got.answer = self.driver.forward(self, got)
            self.driver.deliver(self.page, got)
            self.pending.remove(got)

    def _result(self, done: dict):
        self._seen(done.get("view"))
        if done.get("error"):
            raise_client_error(done["error"])
        return self.outcome(done.get("result"))

    def outcome(self, r: Any) -> Any:
        """The client's outcome in the model's vocabulary."""
        if r is None or not isinstance(r, dict):
            return r
        t = r.get("type")
        if t == "won":
            return Won(r["value"])
        if t == "saved":
            return Won(Saved(r["version"], bool(r["replayed"])))
        if t == "created":
            return Won(Created(r["id"], r["version"], bool(r["replayed"])))
        if t == "snapshot":
            s = r["snapshot"]
            return Won(Snapshot(s["id"], s["kind"], s["schema"], s["version"], s["content"]))
        if t == "conflict":
            return VersionConflict("version_conflict", r["version"], r["content"])
        if t == "seqTaken":
            return SeqTaken("save_seq_taken", r["writerId"], r["seq"], r["version"], r["lastSeq"])
        if t == "rejected":
            return Rejected(r["reason"])
        if t == "noAnswer":
            last = self.last_answer
            return last if isinstance(last, NoAnswer) else NoAnswer(r.get("reason", ""))
        if t == "dropped":
            return Dropped(r["reason"])
        if t == "closed":
            return CloseResult(bool(r["flushed"]), bool(r["parkedInDraft"]))
        raise ClientError(f"the client answered an outcome the contract does not name: {r!r}")


class BrowserDriver:
    """The tabs of one run, the gateway they talk through, and the forwarding of their requests
    (over each slot's own Toxiproxy link, every exchange recorded for the replay)."""

    def __init__(self, chromium: Chromium, gateway: Gateway, upstream: dict[str, str], recorder):
        self.chromium, self.gateway, self.recorder = chromium, gateway, recorder
        limits = httpx.Limits(max_keepalive_connections=0)
        self.http = {
            slot: httpx.Client(base_url=url, timeout=5, limits=limits)
            for slot, url in upstream.items()
        }
        self.on_offline = lambda: None  # told of every request that failed in the browser

    def close(self) -> None:
        for c in self.http.values():
            with contextlib.suppress(Exception):
                c.close()

    def evaluate(self, page, script: str, arg: Any = None) -> Any:
        self.chromium.touch(page)
        try:
            out = page.evaluate(script, arg)
            if isinstance(out, dict) and "drafts" in out:
                self.chromium.note_drafts(page, out.pop("drafts"))
            return out
        except Exception as e:
            if not self.chromium.running:
                raise EnvironmentFault(
                    f"{self.chromium.describe()} died, and not by the harness: was it killed "
                    "from outside?"
                ) from None
            raise ClientError(f"the page failed: {str(e).strip().splitlines()[0]}") from None

    def open(self, slot: str, user: str, config: dict) -> BrowserTab:
        page = self.chromium.pages[slot]
        if page.url != self.chromium.harness_url:
            self.chromium.fresh(slot)
        out = self.evaluate(page, "config => __ks.open(config)", config)
        if out.get("error"):
            if out["error"].get("name") == "ContractError":
                raise ClientError(out["error"]["message"])
            raise_client_error(out["error"])
        return BrowserTab(self, slot, user, out["view"])

    def failed_in_browser(self, slot: str, wire: list[dict]) -> list[tuple[int, Any]]:
        """The requests the page says failed without reaching the gateway (the browser was
        offline), in the model's vocabulary."""
        out = []
        for e in wire:
            if e["failed"] and not self.gateway.was_seen(slot, e["n"]):
                body = (e.get("body") or "").encode()
                headers = {"x-user": e.get("user") or ""}
                path = e["url"].split(f"/t/{slot}", 1)[-1]
                out.append((e["n"], parse_request(e["method"], path, headers, body)))
        return out

    def record_offline(self, tab: BrowserTab, request: Any) -> NoAnswer:
        answer = NoAnswer("offline: the browser is offline")
        self.recorder.record(tab.slot, request, answer)
        tab.last_answer = answer
        self.on_offline()
        return answer

    def forward(self, tab: BrowserTab, p: Pending) -> Any:
        """Send the held request to the server over the slot's link; record what came back."""
        if p.held is None:
            return self.record_offline(tab, p.request)
        h = p.held
        headers = {
            k: v for k, v in h.headers.items() if k in ("x-user", "content-type", "if-match")
        }
        try:
            r = self.http[tab.slot].request(h.method, h.path, headers=headers, content=h.body)
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            answer, h.reply = NoAnswer(f"unreachable: {type(e).__name__}"), BAD_GATEWAY
        except httpx.TransportError as e:
            answer, h.reply = NoAnswer(f"lost: {type(e).__name__}"), BAD_GATEWAY
        else:
            kept = {k: v for k, v in r.headers.items() if k.lower() in ("content-type", "etag")}
            h.reply = (r.status_code, kept, r.content)
            if isinstance(p.request, (SaveRequest, ReadRequest, CopyRequest)):
                answer = HttpTransport.answer(p.request, r)
            else:
                answer = ("answered", r.status_code, r.text[:200])
        self.recorder.record(tab.slot, p.request, answer)
        tab.last_answer = answer
        return answer

    def deliver(self, page, p: Pending) -> None:
        """The browser gets the answer (or, if it was lost, a connection closed without one; or,
        if it never left the browser, its failure)."""
        if p.held is not None:
            self.gateway.reply(p.held, p.held.reply)
        if (p.held is None or p.held.reply is None) and p.seq is not None:
            self.release(page, p.seq)

    def release(self, page, seq: int) -> None:
        """The page's fetch number ``seq`` may fail now (its failure was held)."""
        self.evaluate(page, "n => __ksRelease(n)", seq)
