"""The document server's HTTP layer: uvicorn's h11 protocol, held to what the contract needs.

Requests are read with h11, which parses a pipelined request only once the one before it has
been answered. So the answer to a valid request always goes out before the refusal of whatever
follows it on the same connection: a save that landed is never answered only with the 400 of
junk sent after it. On top of h11 this protocol adds, all in :class:`Limits`:

- **the one error format** for the HTTP layer's own refusals: a request h11 cannot read (400),
  a request head over ``header_bytes`` (431), a Host header RFC 9112 refuses (400: missing in
  HTTP/1.1, sent twice, or not ``host[:port]``), a client too slow to send (408). Each is JSON
  ``{"error", "message"}`` with ``Connection: close``, and the connection is closed after it;
- **deadlines for slow clients**: a connection that sends no complete request head within
  ``head_seconds`` is closed (with a 408 when part of a head had come); a body that has not
  arrived whole within ``body_seconds`` gets a 408 and the connection is closed — the request
  is never handed to the application, so nothing of it is applied; a keep-alive connection
  idle for ``idle_seconds`` after an answer is closed.

The deadline of the answer itself (``request_seconds``: the database work, 503 after it) is
the application's, :mod:`.server`.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from http import HTTPStatus

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


@dataclass(frozen=True)
class Limits:
    """What the server allows a client, in bytes and seconds (README: "The document server")."""

    request_seconds: float = 10.0
    """From a request read whole to its answer: past it the answer is 503, and a write that has
    not committed by then never will (see :mod:`.store`)."""
    head_seconds: float = 10.0
    """From a connection's first byte of a request (or its opening) to the end of the head."""
    body_seconds: float = 30.0
    """From the end of a request's head to the end of its body."""
    idle_seconds: float = 5.0
    """A keep-alive connection with no new request after an answer."""
    header_bytes: int = 16 * 1024
    """The request line and headers together (431 above it)."""


_HOST = re.compile(
    r"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9\-._~!$&'()*+,;=]|%[0-9A-Fa-f]{2})*(?::[0-9]*)?"
)
"""RFC 9112 Host: ``uri-host [ ":" port ]`` (an IP literal, or a reg-name), possibly empty."""


def refusal(status: int, error: str, message: str) -> bytes:
    """A whole HTTP/1.1 response in the one error format, closing the connection."""
    body = json.dumps({"error": error, "message": message}).encode()
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class _Connection(h11.Connection):
    """h11's connection, telling the protocol about each event it reads (and the error it
    raised), and refusing a Host header RFC 9112 refuses."""

    def __init__(self, protocol: "DocumentProtocol", max_head: int):
        super().__init__(h11.SERVER, max_incomplete_event_size=max_head)
        self.protocol = protocol
        self.error: h11.RemoteProtocolError | None = None

    def next_event(self):
        try:
            event = super().next_event()
            if isinstance(event, h11.Request):
                self._check(event)
        except h11.RemoteProtocolError as e:
            self.error = e
            raise
        self.protocol.event_read(event)
        return event

    def _check(self, request: h11.Request) -> None:
        """What h11 lets through and this server refuses: a head over the limit that came in
        one piece (h11 limits only a head still incomplete), another HTTP version, a Host that
        is not host[:port], and a body framed both ways (RFC 9112 6.3: a smuggling attempt)."""
        size = len(request.method) + len(request.target) + 12
        size += sum(len(k) + len(v) + 4 for k, v in request.headers)
        if size > self._max_incomplete_event_size:
            raise h11.RemoteProtocolError("request head too long", error_status_hint=431)
        if request.http_version not in (b"1.0", b"1.1"):
            raise h11.RemoteProtocolError(
                f"HTTP/{request.http_version.decode()} is not a version this server speaks"
            )
        names = [k for k, _ in request.headers]
        hosts = [v for k, v in request.headers if k == b"host"]
        if hosts and not _HOST.fullmatch(hosts[0].decode("latin-1")):
            raise h11.RemoteProtocolError(
                f"Host header {hosts[0].decode('latin-1')!r} is not host[:port]"
            )
        if b"content-length" in names and b"transfer-encoding" in names:
            raise h11.RemoteProtocolError("both Content-Length and Transfer-Encoding")


class DocumentProtocol(H11Protocol):
    """uvicorn's h11 protocol with :class:`Limits` (a subclass per server sets ``limits``)."""

    limits = Limits()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.conn = _Connection(self, self.limits.header_bytes)
        self.timeout_keep_alive = self.limits.idle_seconds
        self._timer: asyncio.TimerHandle | None = None
        self._waiting = "head"  # what the client owes: a request head, or a body
        self._head_started = False  # some bytes of the next head have come

    # -- deadlines ---------------------------------------------------------------------------
    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, self._too_slow)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm(self.limits.head_seconds)

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._waiting == "head":
            self._head_started = True
            if self._timer is None:  # the first bytes after an answer: a new head's deadline
                self._arm(self.limits.head_seconds)
        super().data_received(data)

    def event_read(self, event) -> None:
        if isinstance(event, h11.Request):
            self._waiting, self._head_started = "body", False
            self._arm(self.limits.body_seconds)
        elif isinstance(event, h11.EndOfMessage):
            self._waiting = "head"
            self._disarm()

    def on_response_complete(self) -> None:
        if self._waiting == "head":
            self._disarm()  # uvicorn's keep-alive timer takes over (idle_seconds)
        super().on_response_complete()

    def _too_slow(self) -> None:
        self._timer = None
        if self.transport is None or self.transport.is_closing():
            return
        answered = self.cycle is not None and self.cycle.response_started
        if self._waiting == "body" and not answered:
            if self.cycle is not None:
                self.cycle.disconnected = True  # the application sees the client gone
                self.cycle.message_event.set()
            self._refuse(
                408,
                "request_timeout",
                f"the request body did not arrive whole within {self.limits.body_seconds:g} s: "
                "nothing of the request was applied; send it again, all of it",
            )
        elif self._waiting == "head" and self._head_started:
            self._refuse(
                408,
                "request_timeout",
                f"the request line and headers did not arrive within "
                f"{self.limits.head_seconds:g} s: send the whole request",
            )
        else:
            self.transport.close()  # an idle connection: nothing owed, nothing to say

    # -- refusals ----------------------------------------------------------------------------
    def _refuse(self, status: int, error: str, message: str) -> None:
        self._disarm()
        self.transport.write(refusal(status, error, message))
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot read (uvicorn calls this): answered in the one format."""
        e = self.conn.error
        reason = str(e) if e is not None else msg
        if e is not None and e.error_status_hint == 431:
            self._refuse(
                431,
                "header_too_large",
                f"the request line and headers are over {self.limits.header_bytes} bytes: "
                "send smaller headers",
            )
            return
        self._refuse(
            400,
            "bad_request",
            f"not an HTTP/1.1 request this server reads: {reason}; send one request line, "
            "header lines with one Host, and a body framed by Content-Length or chunked",
        )


def protocol(limits: Limits) -> type[DocumentProtocol]:
    """The protocol class a server with these limits hands to uvicorn (``Config(http=...)``)."""
    return type("DocumentProtocol", (DocumentProtocol,), {"limits": limits})
