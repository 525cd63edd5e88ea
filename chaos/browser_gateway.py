"""The gateway between the browser and the document server: it holds what crosses it.

The page's requests go to ``/t/{slot}/api/...`` on the gateway, which holds each one until the
check lets it through (the check then forwards it over the slot's own Toxiproxy link to the
server: :mod:`.browser_driver`), and holds the answer until the check lets the browser have it.
So a check decides, as with the Python session's ``begin_*`` / ``finish_*`` pairs, when a request
is sent and when its answer arrives: an edit typed while a save is in flight, two reads answered
out of order, a tab closed while its save is on the wire. A request whose answer was lost
upstream (a toxic, a link down, a server restarting) reaches the browser as ``502 Bad Gateway``,
what a browser behind a proxy or load balancer gets then (a connection closed without an answer
would be sent again by Chromium on its own, on a socket it believes reused: a second request the
client never made). The browser going offline is Chromium's own offline mode: there the client's
``fetch`` fails, and the request never reaches the gateway.

The gateway also serves the harness page and the bundle under test, so every page has one origin.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from knownstate.model.document import CopyRequest, ReadRequest, SaveRequest

from .browser import WAIT_S

BAD_GATEWAY = (
    502,
    {"Content-Type": "application/json"},
    b'{"error": "bad_gateway", "message": "the server gave no answer"}',
)
"""What the browser gets when the server's answer was lost upstream of the gateway."""


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
