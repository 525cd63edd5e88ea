"""The notification sink: a real HTTP server on loopback standing in for an email or chat API.

It records every delivery it receives, ``(delivery_id, attempt)``, so the check can count
duplicates (the outbox's send is at-least-once), and it answers with whatever the check
planned: 200, a retryable 503 or a permanent 422. Workers reach it through their own
Toxiproxy link, so a response can be lost after the delivery was recorded. The check runs it in
a process of its own (:mod:`.standin`), killable from outside like every real part.
"""

from __future__ import annotations

import json
import threading
from collections import Counter, deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class JsonHandler(BaseHTTPRequestHandler):
    """A stand-in's request handler: quiet (the check reports, not the server), JSON answers."""

    def log_message(self, *args) -> None:
        pass

    def _answer(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class QuietServer(ThreadingHTTPServer):
    """A client that went away mid-request (a reset or a cut link: the faults the checks inject)
    is not the server's error: nothing is printed."""

    def handle_error(self, request, client_address) -> None:
        pass


class _Handler(JsonHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        sink: NotificationSink = self.server.sink  # type: ignore[attr-defined]
        length = int(self.headers.get("Content-Length") or 0)
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
            key = (int(body["delivery_id"]), int(body["attempt"]))
        except (ValueError, KeyError, TypeError):
            return self._answer(400, {"error": "bad delivery: need delivery_id and attempt"})
        code = sink._record(key)
        self._answer(code, {"received": True} if code == 200 else {"error": f"planned {code}"})


class NotificationSink:
    """Start/stop and a context manager, like every real part in chaos/."""

    handler: type[BaseHTTPRequestHandler] = _Handler
    """How a request is read (a stand-in for another external API gives its own)."""

    def __init__(self):
        self.host = "127.0.0.1"
        self.port: int | None = None
        self._server: ThreadingHTTPServer | None = None
        self._lock = threading.Lock()
        self.reset()

    def start(self) -> "NotificationSink":
        self._server = QuietServer((self.host, 0), self.handler)  # the port the kernel picks
        self.port = self._server.server_address[1]
        self._server.daemon_threads = True
        self._server.sink = self  # type: ignore[attr-defined]
        threading.Thread(
            target=self._server.serve_forever, name="notification-sink", daemon=True
        ).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> "NotificationSink":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # -- what the check controls and reads -----------------------------------------
    def reset(self) -> None:
        with self._lock:
            self.log: list[tuple[int, int]] = []
            self._planned: deque[int] = deque()

    def plan(self, *codes: int) -> None:
        """Answer the next requests with these status codes (then 200 again)."""
        with self._lock:
            self._planned.extend(codes)

    def reset_plan(self) -> None:
        with self._lock:
            self._planned.clear()

    def _record(self, key: tuple[int, int], asked: int | None = None) -> int:
        """Log a request and answer it: the code it ``asked`` for, else the next planned."""
        with self._lock:
            self.log.append(key)
            if asked is not None:
                return asked
            return self._planned.popleft() if self._planned else 200

    def received(self) -> Counter:
        """Deliveries recorded per delivery id (more than one: a duplicate)."""
        with self._lock:
            return Counter(d for d, _ in self.log)

    def duplicates(self) -> int:
        return sum(n - 1 for n in self.received().values() if n > 1)
