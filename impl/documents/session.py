"""The client session of one document: save queue, explicit conflict, per-writer drafts,
stale-read guard, reload that cannot destroy work.

The session is a state machine over :data:`knownstate.model.document.TABLE` (the one table;
the model checks against the same object). Every event goes through the table: an event the
table does not have from the current state raises :class:`IllegalTransition` and changes
nothing.

Driving it step by step
-----------------------

Everything that crosses the network is a pair: ``begin_*`` returns a request value (the
session is then waiting for it) and ``finish_*(request, answer)`` hands it the answer. Between
the two a test may do anything: edit (an edit during an in-flight save), start a second read
(reads finished out of order), or hand over :class:`NoAnswer` although the server applied the
request (a lost response). ``transport.send(request)`` performs one real HTTP exchange and
returns the answer, or :class:`NoAnswer` when the network failed. The convenience methods —
``open``, ``tick``, ``reload``, ``discard_and_reload``, ``keep_local_as_copy``, ``close`` — are
exactly ``begin`` + ``send`` + ``finish``, one request each (``close`` loops). Time is a number
the caller passes (``tick(now)``) or an injected clock; nothing sleeps.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Callable, Mapping, Protocol

import httpx

from knownstate.model.contract import IllegalTransition, Rejected, Won
from knownstate.model.document import (
    TABLE,
    Answer,
    CloseResult,
    Content,
    CopyRequest,
    Created,
    Dropped,
    MergeUnsupported,
    NoAnswer,
    ReadRequest,
    Request,
    Resolve,
    Saved,
    SaveRequest,
    SeqTaken,
    Snapshot,
    State,
    TabView,
    UnsavedWork,
    VersionConflict,
    draft_record,
    kind_of,
    same_content,
)

from .drafts import DraftStore, DraftStoreError

__all__ = ["Session", "HttpTransport", "Transport", "Workspace", "State", "TABLE", "CloseResult", "UnsavedWork",
           "IllegalTransition", "MergeUnsupported"]


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
                r = self.client.put(f"/api/desk/files/{request.doc_id}", headers=headers, json={
                    "expectedVersion": request.base_version, "content": request.content,
                    "writerId": request.writer_id, "saveSeq": request.seq})
            elif isinstance(request, ReadRequest):
                r = self.client.get(f"/api/desk/files/{request.doc_id}", headers=headers)
            else:
                r = self.client.post("/api/desk/files", headers=headers, json={
                    "copyOf": request.copy_of, "content": request.content,
                    "writerId": request.writer_id, "saveSeq": request.seq})
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
                return Won(Snapshot(body["id"], body["kind"], body["schema"], body["version"], body["content"]))
            if isinstance(request, SaveRequest):
                return Won(Saved(body["version"], bool(body.get("replayed"))))
            return Won(Created(body["id"], body["version"], bool(body.get("replayed"))))
        body = body if isinstance(body, dict) else {}
        error, message = body.get("error") or f"http_{r.status_code}", body.get("message", "")
        if r.status_code == 409 and error == "version_conflict":
            return VersionConflict("version_conflict", body["version"], body["content"])
        if r.status_code == 409 and error == "save_seq_taken":
            receipt = body["receipt"]
            return SeqTaken(error, receipt["writerId"], receipt["saveSeq"], receipt["version"],
                            body["lastSeq"])
        if error in ("not_found", "forbidden", "precondition_required", "create_conflict"):
            return Rejected(error)          # the model's reasons, word for word
        if error == "invalid_content":
            return Rejected(f"invalid: {message}")
        return Rejected(f"{error}: {message}")


# ---------------------------------------------------------------------------------------
# The session.
# ---------------------------------------------------------------------------------------


class Session:
    """One document's session for one writer (a tab). Generic over content: the kind
    (``record`` or ``sheet``) supplies validation and, for records, the merge."""

    def __init__(self, doc_id: str, *, user: str, kind: str, drafts: DraftStore,
                 transport: Transport | None = None, writer_id: str | None = None, debounce: float = 1.0,
                 retry_delay: float = 0.0, clock: Callable[[], float] = time.monotonic):
        self.doc_id, self.user, self.kind = doc_id, user, kind
        self.k = kind_of(kind)
        self.writer_id = writer_id or uuid.uuid4().hex[:12]
        self.drafts, self.transport = drafts, transport
        self.debounce, self.retry_delay, self.clock = debounce, retry_delay, clock
        self.schema: dict = {}
        self.state: State | None = None
        self.local: Content = {}
        self.base_version = 0
        self.base_content: Content = {}
        self.generation = 0
        self.saved_generation = 0
        self.due_at: float | None = None
        self.inflight: SaveRequest | None = None
        self.unconfirmed: SaveRequest | None = None
        self.copy_inflight: CopyRequest | None = None
        self.unconfirmed_copy: CopyRequest | None = None
        self.conflict: Snapshot | None = None
        self.next_seq = 1
        self.read_seq = 0
        self.applied_read_seq = 0
        self.draft_status = "ok"
        self.draft_error: str | None = None
        self.draft_generation: int | None = None
        self._pending_deletes: set[str] = set()
        self.siblings: list[dict] = []
        self.last_error: str | None = None
        self.now = clock()
        self.counters: dict[str, int] = {}
        self.transitions: list[tuple[str, str, str]] = []
        self.sent: list[SaveRequest] = []
        self._go("open")

    # -- observation ------------------------------------------------------------------------------
    @property
    def key(self) -> str:
        return self.drafts.key(self.kind, self.user, self.doc_id, self.writer_id)

    @property
    def pending(self) -> bool:
        """Local work the server has not confirmed."""
        return self.state in (State.DIRTY, State.SAVING, State.OFFLINE, State.CONFLICT, State.COPYING)

    def view(self, tab: str) -> TabView:
        return TabView(tab, self.user, self.doc_id, self.writer_id, self.kind,
                       self.state.value, dict(self.local), self.base_version, self.generation,
                       self.draft_status, tuple(self.transitions))

    def __repr__(self) -> str:
        return (f"Session({self.doc_id} {self.user}/{self.writer_id} {self.state.value} v{self.base_version} "
                f"gen={self.generation} drafts={self.draft_status})")

    # -- the table ---------------------------------------------------------------------------------
    def _check(self, event: str) -> str:
        return TABLE.next(self.state.value, event)

    def _go(self, event: str) -> None:
        src = self.state.value if self.state is not None else "(new)"
        target = TABLE.next(src, event)
        self.transitions.append((src, event, target))
        self.state = State(target)

    def _count(self, what: str, n: int = 1) -> None:
        self.counters[what] = self.counters.get(what, 0) + n

    # -- drafts -----------------------------------------------------------------------------------
    def _record(self) -> dict:
        return draft_record(self.kind, self.user, self.doc_id, self.writer_id, content=self.local,
                            base_version=self.base_version, base_content=self.base_content,
                            generation=self.generation, next_seq=self.next_seq,
                            inflight=self.inflight or self.unconfirmed)

    def _store_ok(self) -> None:
        if self.draft_status != "ok":
            self.draft_status, self.draft_error = "ok", None
            self._count("draft_recoveries")

    def _store_failed(self, e: Exception) -> None:
        if self.draft_status == "ok":
            self._count("draft_failures")
        self.draft_status, self.draft_error = "failing", str(e)

    def _store_succeeded(self) -> None:
        """A store operation other than writing our own slot went through. The status says "ok"
        only once our own slot holds our work: if it is behind, this is the retry."""
        behind = self.draft_generation != self.generation and self.state in (
            State.DIRTY, State.SAVING, State.OFFLINE, State.CONFLICT, State.COPYING)
        if self.draft_status != "ok" and behind:
            self._write_draft()
        else:
            self._store_ok()

    def _flush_deletes(self) -> None:
        for key in sorted(self._pending_deletes):
            try:
                self.drafts.delete(key)
            except DraftStoreError:
                continue
            self._pending_deletes.discard(key)

    def _write_draft(self) -> bool:
        self._pending_deletes.discard(self.key)  # a pending delete must never remove newer work
        try:
            self.drafts.write(self.key, self._record())
        except DraftStoreError as e:
            self._store_failed(e)
            return False
        self.draft_generation = self.generation
        self._store_ok()
        self._flush_deletes()
        return True

    def _delete_draft(self, key: str | None = None) -> None:
        key = key or self.key
        if key == self.key:
            self.draft_generation = None
        try:
            self.drafts.delete(key)
        except DraftStoreError as e:
            self._pending_deletes.add(key)
            self._store_failed(e)
            return
        self._pending_deletes.discard(key)
        if key == self.key:
            self._store_ok()
        else:
            self._store_succeeded()
        self._flush_deletes()

    # -- network helpers -----------------------------------------------------------------------------
    def _send(self, request: Request) -> Answer:
        if self.transport is None:
            raise RuntimeError("this session has no transport: drive it with begin_* / finish_*")
        return self.transport.send(request)

    # -- reads ------------------------------------------------------------------------------------------
    def begin_read(self, purpose: str = "refresh") -> ReadRequest:
        """A read: ``load`` (the first), ``refresh`` (clean only) or ``replace`` (discard and reload)."""
        if purpose == "load":
            if self.state is not State.LOADING:
                raise IllegalTransition(TABLE.kind, self.state.value, "loaded")
        elif purpose in ("refresh", "replace"):
            self._check("reloaded" if purpose == "refresh" else "discard_reloaded")
        else:
            raise ValueError(f"unknown read purpose {purpose!r}")
        self.read_seq += 1
        return ReadRequest(self.doc_id, self.user, self.read_seq, self.generation,
                           self.base_version if self.state is not State.LOADING else None, purpose)

    def finish_read(self, req: ReadRequest, answer: Answer):
        if not (isinstance(answer, Won) and isinstance(answer.value, Snapshot)):
            if req.purpose == "load" and self.state is State.LOADING:
                self._go("load_failed")
            self.last_error = str(answer)
            self._count("read_failures")
            return answer if isinstance(answer, (Rejected, NoAnswer)) else NoAnswer(str(answer))
        snap: Snapshot = answer.value
        if req.purpose == "load":
            if self.state is not State.LOADING or req.read_seq <= self.applied_read_seq:
                self._count("stale_reads_dropped")
                return Dropped("out_of_order")
            if snap.kind != self.kind:
                self._go("load_failed")
                return Rejected(f"wrong_kind: {self.doc_id} is a {snap.kind}, not a {self.kind}")
            self.applied_read_seq = req.read_seq
            self._load(snap)
            return Won(self.state.value)
        reason = None
        if req.read_seq <= self.applied_read_seq:
            reason = "out_of_order"
        elif req.generation != self.generation:
            reason = "raced_local_edit"
        elif self.inflight is not None or req.base_version != self.base_version:
            reason = "raced_save"
        elif snap.version < self.base_version:
            reason = "older_than_base"
        else:
            event = "reloaded" if req.purpose == "refresh" else "discard_reloaded"
            try:
                TABLE.next(self.state.value, event)
            except IllegalTransition:
                reason = f"state_changed_to_{self.state.value}"
        if reason is not None:
            self._count("stale_reads_dropped")
            return Dropped(reason)
        self.applied_read_seq = req.read_seq
        self.local, self.base_content, self.base_version = dict(snap.content), dict(snap.content), snap.version
        if req.purpose == "replace":
            self.unconfirmed = None
            self.conflict = None
            self.due_at = None
            self._delete_draft()
            self._count("discarded")
            self._go("discard_reloaded")
        else:
            self._go("reloaded")
        return Won(self.state.value)

    def _load(self, snap: Snapshot) -> None:
        self.schema = dict(snap.schema)
        own = self.drafts.read(self.key)
        self.siblings = self.drafts.siblings(self.kind, self.user, self.doc_id, self.writer_id)
        self.base_version, self.base_content, self.local = snap.version, dict(snap.content), dict(snap.content)
        if own is not None and own.get("inflight") is None and same_content(own["content"], snap.content):
            self._delete_draft()  # its work is already the stored content
            own = None
        if own is None:
            self._go("loaded")
            return
        # The writer's own draft (a reopened tab): its work, its base, its unanswered save.
        self.local, self.base_content = dict(own["content"]), dict(own["baseContent"])
        self.base_version, self.generation = int(own["baseVersion"]), int(own["generation"])
        self.next_seq = int(own["nextSeq"])
        self.unconfirmed = SaveRequest.from_json(self.doc_id, self.user, own["inflight"]) if own["inflight"] else None
        self.draft_generation = self.generation
        self.due_at = self.now
        self._count("drafts_restored")
        self._go("restored")

    def open(self):
        """Load the document (one GET): restores this writer's own draft, offers siblings."""
        req = self.begin_read("load")
        return self.finish_read(req, self._send(req))

    def reload(self):
        """Refresh a clean session from the server (one GET). Stale answers are dropped."""
        req = self.begin_read("refresh")
        return self.finish_read(req, self._send(req))

    def discard_and_reload(self):
        """Fetch first; replace local state only once the fetch succeeded. Offline, nothing changes."""
        req = self.begin_read("replace")
        return self.finish_read(req, self._send(req))

    # -- edits ------------------------------------------------------------------------------------------
    def edit(self, patch: Mapping, now: float | None = None) -> Won:
        """Apply a patch (id -> value; ``None`` clears) to the local copy and write the draft."""
        self._check("edit")
        self.k.validate_patch(self.schema, patch)
        self.now = self.clock() if now is None else now
        self.local = self.k.apply(self.local, patch)
        self.generation += 1
        self.due_at = self.now + self.debounce
        self._go("edit")
        self._write_draft()
        return Won(self.generation)

    # -- saves ------------------------------------------------------------------------------------------
    def due(self, now: float) -> bool:
        return (self.state in (State.DIRTY, State.OFFLINE) and self.inflight is None
                and self.due_at is not None and now >= self.due_at)

    def begin_save(self, now: float | None = None) -> SaveRequest:
        """Start a save now (ignoring the debounce). A save whose answer was lost is retried
        unchanged — same writer, seq and snapshot — so the server can answer it from its receipt."""
        self._check("save")
        if now is not None:
            self.now = now
        if self.unconfirmed is not None:
            req = self.unconfirmed
        else:
            req = SaveRequest(self.doc_id, self.user, self.writer_id, self.next_seq, self.base_version,
                              dict(self.local), self.generation)
            self.next_seq += 1
        self.inflight = req
        self._write_draft()  # the snapshot is durable before the request goes out
        self.sent.append(req)
        self._count("saves")
        self._go("save")
        return req

    def finish_save(self, req: SaveRequest, answer: Answer) -> Answer:
        if req != self.inflight:
            raise ValueError("finish_save: not the save in flight")
        self.inflight = None
        if isinstance(answer, Won):
            saved: Saved = answer.value
            self.unconfirmed = None
            self.base_version, self.base_content = saved.version, dict(req.content)
            self.saved_generation = max(self.saved_generation, req.generation)
            if saved.replayed:
                self._count("idempotent_replays")
            if self.generation == req.generation:
                self.due_at = None
                self._delete_draft()   # a save of exactly this snapshot succeeded
                self._go("saved")
            else:
                self._go("saved_pending")  # edits made during the save stay pending
                self._write_draft()
        elif isinstance(answer, SeqTaken):
            # an earlier life of this writer used the seq for other content: this snapshot did
            # not land; it is sent again, at once, under a fresh seq
            self.unconfirmed = None
            self.next_seq = max(self.next_seq, answer.last_seq + 1)
            self.due_at = self.now
            self._count("seqs_taken")
            self._go("seq_taken")
            self._write_draft()
        elif isinstance(answer, VersionConflict):
            self.unconfirmed = None
            self.conflict = Snapshot(self.doc_id, self.kind, self.schema, answer.version, dict(answer.content))
            self._count("conflicts")
            self._go("version_conflict")
            self._write_draft()
        else:
            self.unconfirmed = req
            self.last_error = str(answer)
            self.due_at = self.now + self.retry_delay
            self._count("save_failures")
            self._go("save_failed")
        return answer

    def tick(self, now: float | None = None) -> Answer | None:
        """Advance time; when the debounced snapshot is due (or an offline retry), save it (one request)."""
        self.now = self.clock() if now is None else now
        if not self.due(self.now):
            return None
        req = self.begin_save()
        return self.finish_save(req, self._send(req))

    def flush(self, max_failures: int = 2) -> None:
        """Save now, ignoring the debounce, until clean, in conflict, or ``max_failures`` failed."""
        failures = 0
        while self.state in (State.DIRTY, State.OFFLINE) and failures < max_failures:
            req = self.begin_save()
            if not isinstance(self.finish_save(req, self._send(req)), Won):
                failures += 1

    # -- conflict resolution ---------------------------------------------------------------------------
    def rebase(self, resolve: Resolve) -> Won:
        """Merge (kinds that merge only): the kind's merge gets the confirmed base, the local copy
        and the stored copy; ``resolve(id, base, local, stored)`` decides each clashing id. The
        result is saved against the stored version on the next tick (it is due at once)."""
        if not self.k.can_merge:
            raise MergeUnsupported(self.kind)
        self._check("rebase")
        merged = self.k.merge(self.base_content, self.local, self.conflict.content, resolve)
        self.k.validate_content(self.schema, merged)
        self.base_version, self.base_content = self.conflict.version, dict(self.conflict.content)
        self.local = merged
        self.conflict = None
        self.generation += 1
        self.due_at = self.now
        self._count("rebases")
        self._go("rebase")
        self._write_draft()
        return Won(self.generation)

    def begin_copy(self) -> CopyRequest:
        self._check("copy")
        c = self.unconfirmed_copy
        if c is not None and c.generation == self.generation:
            req = c   # a retried copy lands on the same new document
        else:
            req = CopyRequest(self.doc_id, self.user, self.writer_id, self.next_seq, dict(self.local), self.generation)
            self.next_seq += 1
        self.copy_inflight = req
        self._go("copy")
        return req

    def finish_copy(self, req: CopyRequest, answer: Answer) -> Answer:
        if req != self.copy_inflight:
            raise ValueError("finish_copy: not the copy in flight")
        self.copy_inflight = None
        if isinstance(answer, Won):
            self.unconfirmed_copy = None
            self.base_version, self.base_content = self.conflict.version, dict(self.conflict.content)
            self.local = dict(self.conflict.content)
            self.conflict = None
            self.saved_generation = max(self.saved_generation, req.generation)
            self.due_at = None
            self._delete_draft()   # the snapshot is saved, as the new document
            self._count("copies")
            self._go("copied")
        else:
            if isinstance(answer, NoAnswer):
                self.unconfirmed_copy = req
            self.last_error = str(answer)
            self._count("copy_failures")
            self._go("copy_failed")
        return answer

    def keep_local_as_copy(self) -> Answer:
        """Save the local copy as a new document (every kind); this document takes the stored copy."""
        req = self.begin_copy()
        return self.finish_copy(req, self._send(req))

    def discard(self) -> Won:
        """Drop the local edits: back to the confirmed base (in a conflict: to the stored copy)."""
        self._check("discard")
        if self.conflict is not None:
            self.base_version, self.base_content = self.conflict.version, dict(self.conflict.content)
        self.local = dict(self.base_content)
        self.conflict = None
        self.unconfirmed = None
        self.due_at = None
        self._delete_draft()
        self._count("discarded")
        self._go("discard")
        return Won(self.state.value)

    # -- sibling drafts ---------------------------------------------------------------------------------
    def _sibling(self, writer_id: str) -> dict:
        for d in self.siblings:
            if d["writerId"] == writer_id:
                return d
        raise KeyError(f"no sibling draft of writer {writer_id!r}")

    def adopt(self, writer_id: str) -> Won | Rejected:
        """Take over another writer's draft (offered on load). It moves to this writer's slot
        first; the sibling slot is deleted only once the new one is durable."""
        self._check("adopt")
        offered = self._sibling(writer_id)
        d = self.drafts.read(self.drafts.key(self.kind, self.user, self.doc_id, writer_id))  # as it is now, not as offered
        if d is None:
            self.siblings.remove(offered)
            return Rejected("sibling_gone")
        saved = (self.local, self.base_version, self.base_content, self.generation, self.unconfirmed, self.due_at)
        self.local, self.base_content = dict(d["content"]), dict(d["baseContent"])
        self.base_version = int(d["baseVersion"])
        self.generation += 1
        self.unconfirmed = None
        if d["inflight"]:
            req = SaveRequest.from_json(self.doc_id, self.user, d["inflight"])
            gen = self.generation if same_content(req.content, d["content"]) else self.generation - 1
            self.unconfirmed = SaveRequest(req.doc_id, req.user, req.writer_id, req.seq, req.base_version,
                                           req.content, gen)
        self.due_at = self.now
        if not self._write_draft():
            (self.local, self.base_version, self.base_content, self.generation, self.unconfirmed,
             self.due_at) = saved
            self.draft_generation = None
            return Rejected("draft_store_failing")
        self._delete_draft(self.drafts.key(self.kind, self.user, self.doc_id, writer_id))
        self.siblings.remove(offered)
        self._count("siblings_adopted")
        self._go("adopt")
        return Won(writer_id)

    def discard_sibling(self, writer_id: str) -> Won | Rejected:
        if self.state is State.CLOSED:
            raise IllegalTransition(TABLE.kind, self.state.value, "discard_sibling")
        d = self._sibling(writer_id)
        try:
            self.drafts.delete(self.drafts.key(self.kind, self.user, self.doc_id, writer_id))
        except DraftStoreError as e:
            self._store_failed(e)
            return Rejected("draft_store_failing")
        self._store_succeeded()
        self.siblings.remove(d)
        self._count("siblings_discarded")
        return Won(writer_id)

    # -- closing ------------------------------------------------------------------------------------------
    def close(self, max_failures: int = 2) -> CloseResult:
        """Flush, then close; returns once flushed. Work the server did not take (offline, or a
        conflict) is parked in this writer's durable draft and restored when the document is
        opened again. If even the draft cannot be written: :class:`UnsavedWork`, and nothing
        changes — closing never drops an edit."""
        if self.state is State.CLOSED:
            return CloseResult(flushed=True)
        if self.state in (State.SAVING, State.COPYING):
            raise IllegalTransition(TABLE.kind, self.state.value, "close")
        self.flush(max_failures)
        if self.state in (State.CLEAN, State.LOADING):
            self._go("close")
            return CloseResult(flushed=True)
        if self.draft_generation != self.generation or self.draft_status != "ok":
            if not self._write_draft():
                raise UnsavedWork()
        self._go("close")
        return CloseResult(flushed=False, parked_in_draft=True)

    async def aclose(self, max_failures: int = 2) -> CloseResult:
        """``close()`` for async callers: awaits the flush."""
        return await asyncio.to_thread(self.close, max_failures)


class Workspace:
    """Sessions owned by their documents, not by views: one session per (document, writer),
    shared by every panel showing it. Closing a panel flushes; the session lives on until the
    document itself is closed."""

    def __init__(self, user: str, drafts: DraftStore, transport: Transport, **session_options):
        self.user, self.drafts, self.transport = user, drafts, transport
        self.options = session_options
        self.sessions: dict[str, Session] = {}
        self.panels: dict[str, int] = {}

    def open_panel(self, doc_id: str, kind: str) -> Session:
        s = self.sessions.get(doc_id)
        if s is None or s.state is State.CLOSED:
            s = self.sessions[doc_id] = Session(doc_id, user=self.user, kind=kind, drafts=self.drafts,
                                                transport=self.transport, **self.options)
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
