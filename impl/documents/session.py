"""The client session of one document, with its real ports: HTTP, a clock, a draft store.

The session itself — save queue, explicit conflict, per-writer drafts, stale-read guard,
reload that cannot destroy work — is :class:`knownstate.model.document_session.SessionCore`,
the one pure state machine of the model. This module only plugs real I/O into its ports:

- the network: :class:`HttpTransport` performs one HTTP exchange per request and answers in the
  model's vocabulary (``Won(Snapshot | Saved | Created)``, ``VersionConflict``, ``SeqTaken``,
  ``Rejected(reason)``, ``NoAnswer(reason)``);
- time: ``time.monotonic`` unless a clock is given (tests and checks pass numbers);
- the draft store: :class:`~.drafts.DraftStore`, one JSON file per writer's slot.

Driving it step by step: everything that crosses the network is a pair, ``begin_*`` → request
value, ``finish_*(request, answer)``; ``session.transport.send(request)`` is one real exchange.
So an edit during an in-flight save is ``req = s.begin_save(); s.edit(...);
s.finish_save(req, s.transport.send(req))``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Callable, Protocol

import httpx

from knownstate.model.contract import IllegalTransition, Rejected, Won
from knownstate.model.document_kinds import MergeUnsupported
from knownstate.model.document_protocol import (
    Answer,
    Created,
    NoAnswer,
    ReadRequest,
    Request,
    Saved,
    SaveRequest,
    SeqTaken,
    Snapshot,
    VersionConflict,
)
from knownstate.model.document_session import (
    TABLE,
    CloseResult,
    DraftPort,
    SessionCore,
    State,
    UnsavedWork,
)

__all__ = [
    "Session",
    "HttpTransport",
    "Transport",
    "Workspace",
    "State",
    "TABLE",
    "CloseResult",
    "UnsavedWork",
    "IllegalTransition",
    "MergeUnsupported",
]


# ---------------------------------------------------------------------------------------
# Transport: one request -> one answer, in the model's vocabulary.
# ---------------------------------------------------------------------------------------


class Transport(Protocol):
    def send(self, request: Request) -> Answer: ...


class HttpTransport:
    """httpx to the document server (directly, or through a Toxiproxy link).

    Keep-alive is off by default: each request opens its own connection, so a link taken down
    refuses the next request (``NoAnswer("unreachable: ...")``: it never reached the server)
    instead of failing it on a dead pooled socket (``NoAnswer("lost: ...")``: it may have)."""

    def __init__(self, base_url: str, *, timeout: float = 5.0, keepalive: bool = False):
        limits = httpx.Limits(max_keepalive_connections=None if keepalive else 0)
        self.client = httpx.Client(base_url=base_url, timeout=timeout, limits=limits)
        self.exchanges = 0

    def close(self) -> None:
        self.client.close()

    def send(self, request: Request) -> Answer:
        headers = {"X-User": request.user}
        try:
            if isinstance(request, SaveRequest):
                r = self.client.put(
                    f"/api/desk/files/{request.doc_id}",
                    headers=headers,
                    json={
                        "expectedVersion": request.base_version,
                        "content": request.content,
                        "writerId": request.writer_id,
                        "saveSeq": request.seq,
                    },
                )
            elif isinstance(request, ReadRequest):
                r = self.client.get(f"/api/desk/files/{request.doc_id}", headers=headers)
            else:
                r = self.client.post(
                    "/api/desk/files",
                    headers=headers,
                    json={
                        "copyOf": request.copy_of,
                        "content": request.content,
                        "writerId": request.writer_id,
                        "saveSeq": request.seq,
                    },
                )
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            return NoAnswer(f"unreachable: {type(e).__name__}")
        except httpx.TransportError as e:
            return NoAnswer(f"lost: {type(e).__name__}")
        finally:
            self.exchanges += 1
        return self.answer(request, r)

    @staticmethod
    def answer(request: Request, r: httpx.Response) -> Answer:
        if r.status_code >= 500:
            return NoAnswer(f"server_error: {r.status_code}")
        try:
            body = r.json()
        except ValueError:
            return NoAnswer(f"garbled: {r.status_code} answer is not JSON")
        if r.status_code in (200, 201):
            if isinstance(request, ReadRequest):
                return Won(
                    Snapshot(
                        body["id"], body["kind"], body["schema"], body["version"], body["content"]
                    )
                )
            if isinstance(request, SaveRequest):
                return Won(Saved(body["version"], bool(body.get("replayed"))))
            return Won(Created(body["id"], body["version"], bool(body.get("replayed"))))
        body = body if isinstance(body, dict) else {}
        error, message = body.get("error") or f"http_{r.status_code}", body.get("message", "")
        if r.status_code == 409 and error == "version_conflict":
            return VersionConflict("version_conflict", body["version"], body["content"])
        if r.status_code == 409 and error == "save_seq_taken":
            receipt = body["receipt"]
            return SeqTaken(
                error, receipt["writerId"], receipt["saveSeq"], receipt["version"], body["lastSeq"]
            )
        if error in ("not_found", "forbidden", "precondition_required", "create_conflict"):
            return Rejected(error)  # the model's reasons, word for word
        if error == "invalid_content":
            return Rejected(f"invalid: {message}")
        return Rejected(f"{error}: {message}")


# ---------------------------------------------------------------------------------------
# The session: the model's machine, real ports plugged in.
# ---------------------------------------------------------------------------------------


class Session(SessionCore):
    """One document's session for one writer (a tab), talking to the server through
    ``transport`` and keeping its drafts in ``drafts``. A fresh ``writer_id`` per session
    unless given (give the same one to restore a tab's draft)."""

    def __init__(
        self,
        doc_id: str,
        *,
        user: str,
        kind: str,
        drafts: DraftPort,
        transport: Transport | None = None,
        writer_id: str | None = None,
        debounce: float = 1.0,
        retry_delay: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        super().__init__(
            doc_id,
            user=user,
            kind=kind,
            writer_id=writer_id or uuid.uuid4().hex[:12],
            drafts=drafts,
            send=transport.send if transport is not None else None,
            clock=clock,
            debounce=debounce,
            retry_delay=retry_delay,
        )
        self.transport = transport

    async def aclose(self, max_failures: int = 2) -> CloseResult:
        """``close()`` for async callers: awaits the flush."""
        return await asyncio.to_thread(self.close, max_failures)


class Workspace:
    """Sessions owned by their documents, not by views: one session per (document, writer),
    shared by every panel showing it. Closing a panel flushes; the session lives on until the
    document itself is closed."""

    def __init__(self, user: str, drafts: DraftPort, transport: Transport, **session_options):
        self.user, self.drafts, self.transport = user, drafts, transport
        self.options = session_options
        self.sessions: dict[str, Session] = {}
        self.panels: dict[str, int] = {}

    def open_panel(self, doc_id: str, kind: str) -> Session:
        s = self.sessions.get(doc_id)
        if s is None or s.state is State.CLOSED:
            s = self.sessions[doc_id] = Session(
                doc_id,
                user=self.user,
                kind=kind,
                drafts=self.drafts,
                transport=self.transport,
                **self.options,
            )
            s.open()
        self.panels[doc_id] = self.panels.get(doc_id, 0) + 1
        return s

    def close_panel(self, doc_id: str) -> Session:
        s = self.sessions[doc_id]
        self.panels[doc_id] = max(0, self.panels.get(doc_id, 0) - 1)
        if s.state not in (State.SAVING, State.COPYING, State.LOADING):
            s.flush()
        return s

    def close_document(self, doc_id: str) -> CloseResult:
        s = self.sessions.pop(doc_id)
        self.panels.pop(doc_id, None)
        return s.close()
