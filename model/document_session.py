"""The client session of one document: ONE state machine, pure (sans-IO), used by everyone.

Theory of operation
-------------------

One :class:`SessionCore` per (tab, document), owned by the document rather than by a view. It is
the whole session: everything that affects the session's state lives in this file, in the
manner of h11's ``_state.py``. It does no I/O of its own; it is driven through three ports:

``send(request) -> answer``
    the network: one HTTP exchange (:class:`knownstate.impl.documents.session.HttpTransport`),
    or the model's server (:class:`knownstate.model.document.DocumentModel`), or whatever a test
    hands it. Every request is also a ``begin_*`` / ``finish_*(request, answer)`` pair, so a
    driver decides when an answer arrives, whether it is lost, and in which order reads
    complete; ``open``, ``reload``, ``discard_and_reload``, ``tick``, ``flush``,
    ``keep_local_as_copy`` and ``close`` are exactly ``begin`` + ``send`` + ``finish``.
``clock() -> seconds``
    time, when an operation is not given ``now`` (a check passes time as a number).
``drafts``
    the durable per-writer draft store (the browser's localStorage; :class:`DraftsModel` in
    memory, :class:`knownstate.impl.documents.drafts.DraftStore` on disk). A refused write or
    delete raises :class:`DraftStoreError`; the session shows it and retries on its next write.

The states are :class:`State`, the transitions the one table :data:`TABLE` (data, not ``if``
chains). An event the table does not have from the current state raises
:class:`~knownstate.model.contract.IllegalTransition` naming state and event, and changes
nothing.

- **Save queue.** Edits debounce into one latest snapshot; saves are serialised; an edit made
  while a save is in flight stays pending — a success confirms the snapshot it carried (its
  generation), never a later edit.
- **Compare-and-swap.** Every save carries its base version. A stale one is a conflict: an
  explicit state left only by user events — rebase (kinds that merge), keep a copy, discard,
  discard and reload, close. A lost answer leaves the request *unconfirmed*; it is retried
  unchanged (same writer, seq, snapshot) so the server answers it from its receipt. A save
  identity the server says is taken (a writer reopened without its draft counts from 1) is sent
  again at once under a fresh seq.
- **Per-writer drafts.** Every unsaved snapshot is written to the writer's own slot before the
  save request goes out; a slot is deleted only after a save of that exact snapshot succeeded,
  or it was copied, or the user discarded it. On load a writer's own draft is restored; other
  writers' drafts are offered (``siblings``) to adopt or discard, never applied.
- **Stale reads** carry a read sequence, the edit generation and the base version they started
  from; :attr:`SessionCore.read_guards` drop those that arrive stale.
- **Closing** flushes; work the server did not take is parked in the durable draft, and if even
  that fails, :class:`UnsavedWork` and nothing changes.

A ``listener`` hears what the session did with the user's work (an edit, a save that landed, a
discard, a resolution, an adoption): the model's ledger of unsaved edits listens, so the check
knows which edits nothing has covered yet.

The ports' types, the in-memory draft store and what a tab shows are in
:mod:`.document_ports` (re-exported here): none of them changes a session's state.
"""

from __future__ import annotations

import enum
from dataclasses import replace
from typing import Callable, Mapping

from .contract import CREATED, IllegalTransition, Rejected, TransitionTable, Won
from .document_kinds import Content, MergeUnsupported, Resolve, kind_of, same_content
from .document_ports import (  # noqa: F401 (re-exported: the session's ports, importable here)
    CloseResult,
    DraftPort,
    DraftsModel,
    DraftStoreError,
    SessionListener,
    TabView,
    UnsavedWork,
    draft_record,
)
from .document_protocol import (
    Answer,
    CopyRequest,
    Dropped,
    NoAnswer,
    ReadRequest,
    Request,
    Saved,
    SaveRequest,
    SeqTaken,
    Snapshot,
    VersionConflict,
)

# ---------------------------------------------------------------------------------------
# States and the one table.
# ---------------------------------------------------------------------------------------


class State(enum.StrEnum):
    LOADING = "loading"  # created; the first read has not answered yet
    CLEAN = "clean"  # local copy == confirmed base; nothing to save
    DIRTY = "dirty"  # local edits not yet sent (debouncing, or due)
    SAVING = "saving"  # one save request in flight (edits may continue: they stay pending)
    OFFLINE = "offline"  # the last request got no answer; edits kept, the save retried unchanged
    CONFLICT = "conflict"  # the server refused a stale base; the user resolves
    COPYING = "copying"  # keeping the local copy as a new document
    CLOSED = "closed"  # the session ended: flushed, or its work parked in its durable draft


TABLE = TransitionTable(
    "document-session",
    [
        (CREATED, "open", State.LOADING),
        (State.LOADING, "loaded", State.CLEAN),
        (State.LOADING, "restored", State.DIRTY),
        (State.LOADING, "load_failed", State.LOADING),
        (State.LOADING, "close", State.CLOSED),
        (State.CLEAN, "edit", State.DIRTY),
        (State.CLEAN, "adopt", State.DIRTY),
        (State.CLEAN, "reloaded", State.CLEAN),
        (State.CLEAN, "discard_reloaded", State.CLEAN),
        (State.CLEAN, "close", State.CLOSED),
        (State.DIRTY, "edit", State.DIRTY),
        (State.DIRTY, "save", State.SAVING),
        (State.DIRTY, "discard", State.CLEAN),
        (State.DIRTY, "discard_reloaded", State.CLEAN),
        (State.SAVING, "edit", State.SAVING),
        (State.SAVING, "saved", State.CLEAN),
        (State.SAVING, "saved_pending", State.DIRTY),
        (State.SAVING, "save_failed", State.OFFLINE),
        (State.SAVING, "seq_taken", State.DIRTY),
        (State.SAVING, "version_conflict", State.CONFLICT),
        (State.OFFLINE, "edit", State.OFFLINE),
        (State.OFFLINE, "save", State.SAVING),
        (State.OFFLINE, "discard", State.CLEAN),
        (State.OFFLINE, "discard_reloaded", State.CLEAN),
        (State.OFFLINE, "close", State.CLOSED),
        (State.CONFLICT, "edit", State.CONFLICT),
        (State.CONFLICT, "rebase", State.DIRTY),
        (State.CONFLICT, "copy", State.COPYING),
        (State.CONFLICT, "discard", State.CLEAN),
        (State.CONFLICT, "discard_reloaded", State.CLEAN),
        (State.CONFLICT, "close", State.CLOSED),
        (State.COPYING, "copied", State.CLEAN),
        (State.COPYING, "copy_failed", State.CONFLICT),
    ],
)

USER_EVENTS = frozenset(
    {"open", "edit", "adopt", "rebase", "copy", "discard", "discard_reloaded", "close"}
)
"""Events only a user action causes. Every way out of ``conflict`` is one of them."""

PENDING = (State.DIRTY, State.SAVING, State.OFFLINE, State.CONFLICT, State.COPYING)
"""States in which the session holds work the server has not confirmed."""


Send = Callable[[Request], Answer]


def _unplugged(request: Request) -> Answer:
    raise RuntimeError("this session has no transport: drive it with begin_* / finish_*")


# ---------------------------------------------------------------------------------------
# The session.
# ---------------------------------------------------------------------------------------


class SessionCore:
    """One document's session for one writer (a tab). Generic over content: the kind
    (``record`` or ``sheet``) supplies validation and, for records, the merge."""

    read_guards: tuple[str, ...] = (
        "_read_out_of_order",
        "_read_raced_local_edit",
        "_read_during_save",
        "_read_after_save",
        "_read_older_than_base",
    )
    """The stale-read guard, one method per reason a read that arrives is dropped (in order)."""

    def __init__(
        self,
        doc_id: str,
        *,
        user: str,
        kind: str,
        writer_id: str,
        drafts: DraftPort,
        send: Send | None = None,
        clock: Callable[[], float] | None = None,
        listener: SessionListener | None = None,
        debounce: float = 1.0,
        retry_delay: float = 0.0,
    ):
        self.doc_id, self.user, self.kind, self.writer_id = doc_id, user, kind, writer_id
        self.k = kind_of(kind)
        self.drafts, self.clock, self.listener = drafts, clock, listener
        self.send: Send = send or _unplugged
        self.debounce, self.retry_delay = debounce, retry_delay
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
        self.draft_generation: int | None = None  # the generation the durable slot holds
        self.pending_deletes: set[str] = set()
        self.siblings: list[dict] = []
        self.last_error: str | None = None
        self.now = clock() if clock is not None else 0.0
        self.counters: dict[str, int] = {}
        self.transitions: list[tuple[str, str, str]] = []
        self._go("open")

    # -- observation ---------------------------------------------------------------------
    @property
    def key(self) -> str:
        return self.drafts.key(self.kind, self.user, self.doc_id, self.writer_id)

    @property
    def pending(self) -> bool:
        """Local work the server has not confirmed."""
        return self.state in PENDING

    def view(self, tab: str) -> TabView:
        return TabView(
            tab,
            self.user,
            self.doc_id,
            self.writer_id,
            self.kind,
            self.state.value,
            dict(self.local),
            self.base_version,
            self.generation,
            self.draft_status,
            tuple(self.transitions),
            tuple(d["writerId"] for d in self.siblings),
            self.conflict.version if self.conflict is not None else None,
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.doc_id} {self.user}/{self.writer_id} "
            f"{self.state.value} v{self.base_version} gen={self.generation} "
            f"drafts={self.draft_status})"
        )

    # -- the table, time, counts -----------------------------------------------------------
    def _check(self, event: str) -> str:
        return TABLE.next(self.state.value, event)

    def _go(self, event: str) -> None:
        src = self.state.value if self.state is not None else CREATED
        target = TABLE.next(src, event)
        self.transitions.append((src, event, target))
        self.state = State(target)

    def _at(self, now: float | None) -> None:
        if now is not None:
            self.now = now
        elif self.clock is not None:
            self.now = self.clock()

    def _count(self, what: str, n: int = 1) -> None:
        self.counters[what] = self.counters.get(what, 0) + n

    def _tell(self, event: str, *args) -> None:
        if self.listener is not None:
            getattr(self.listener, event)(self, *args)

    # -- drafts ----------------------------------------------------------------------------
    def _record(self) -> dict:
        return draft_record(
            self.kind,
            self.user,
            self.doc_id,
            self.writer_id,
            content=self.local,
            base_version=self.base_version,
            base_content=self.base_content,
            generation=self.generation,
            next_seq=self.next_seq,
            inflight=self.inflight or self.unconfirmed,
        )

    def _store_ok(self) -> None:
        if self.draft_status != "ok":
            self.draft_status, self.draft_error = "ok", None
            self._count("draft_recoveries")

    def _store_failed(self, e: DraftStoreError) -> None:
        if self.draft_status == "ok":
            self._count("draft_failures")
        self.draft_status, self.draft_error = "failing", str(e)

    def _store_succeeded(self) -> None:
        """A store operation other than writing our own slot went through. The status says "ok"
        only once our own slot holds our work: if it is behind, this is the retry."""
        behind = self.draft_generation != self.generation and self.state in PENDING
        if self.draft_status != "ok" and behind:
            self._write_draft()
        else:
            self._store_ok()

    def _flush_deletes(self) -> None:
        for key in sorted(self.pending_deletes):
            try:
                self.drafts.delete(key)
            except DraftStoreError:
                continue
            self.pending_deletes.discard(key)

    def _write_draft(self) -> bool:
        self.pending_deletes.discard(self.key)  # a pending delete must never remove newer work
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
            self.pending_deletes.add(key)
            self._store_failed(e)
            return
        self.pending_deletes.discard(key)
        if key == self.key:
            self._store_ok()
        else:
            self._store_succeeded()
        self._flush_deletes()

    # -- reads -------------------------------------------------------------------------------
    def begin_read(self, purpose: str = "refresh") -> ReadRequest:
        """A read: ``load`` (the first), ``refresh`` (clean only) or ``replace`` (discard and
        reload)."""
        if purpose == "load":
            if self.state is not State.LOADING:
                raise IllegalTransition(TABLE.kind, self.state.value, "loaded")
        elif purpose in ("refresh", "replace"):
            self._check("reloaded" if purpose == "refresh" else "discard_reloaded")
        else:
            raise ValueError(f"unknown read purpose {purpose!r}: load, refresh or replace")
        self.read_seq += 1
        base = self.base_version if self.state is not State.LOADING else None
        return ReadRequest(self.doc_id, self.user, self.read_seq, self.generation, base, purpose)

    def finish_read(self, req: ReadRequest, answer: Answer) -> Won | Dropped | Rejected | NoAnswer:
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
        reason = self.stale_reason(req, snap)
        if reason is not None:
            self._count("stale_reads_dropped")
            return Dropped(reason)
        self.applied_read_seq = max(self.applied_read_seq, req.read_seq)
        self.local, self.base_content = dict(snap.content), dict(snap.content)
        self.base_version = snap.version
        if req.purpose == "replace":
            self.conflict = None
            self._discarded("discard_reloaded")
        else:
            self._go("reloaded")
        return Won(self.state.value)

    def stale_reason(self, req: ReadRequest, snap: Snapshot) -> str | None:
        """Why a read that arrived must be dropped, or None to apply it."""
        for guard in self.read_guards:
            reason = getattr(self, guard)(req, snap)
            if reason is not None:
                return reason
        event = "reloaded" if req.purpose == "refresh" else "discard_reloaded"
        try:
            TABLE.next(self.state.value, event)
        except IllegalTransition:
            return f"state_changed_to_{self.state.value}"
        return None

    def _read_out_of_order(self, req: ReadRequest, snap: Snapshot) -> str | None:
        return "out_of_order" if req.read_seq <= self.applied_read_seq else None

    def _read_raced_local_edit(self, req: ReadRequest, snap: Snapshot) -> str | None:
        return "raced_local_edit" if req.generation != self.generation else None

    def _read_during_save(self, req: ReadRequest, snap: Snapshot) -> str | None:
        return "raced_save" if self.inflight is not None else None

    def _read_after_save(self, req: ReadRequest, snap: Snapshot) -> str | None:
        return "raced_save" if req.base_version != self.base_version else None

    def _read_older_than_base(self, req: ReadRequest, snap: Snapshot) -> str | None:
        return "older_than_base" if snap.version < self.base_version else None

    def _load(self, snap: Snapshot) -> None:
        self.schema = dict(snap.schema)
        own = self.drafts.read(self.key)
        self.siblings = self.drafts.siblings(self.kind, self.user, self.doc_id, self.writer_id)
        self.base_version, self.base_content = snap.version, dict(snap.content)
        self.local = dict(snap.content)
        if (
            own is not None
            and own.get("inflight") is None
            and same_content(own["content"], snap.content)
        ):
            self._delete_draft()  # its work is already the stored content
            own = None
        if own is None:
            self._go("loaded")
            self._tell("loaded_clean")
            return
        # The writer's own draft (a reopened tab): its work, its base, its unanswered save.
        self.local, self.base_content = dict(own["content"]), dict(own["baseContent"])
        self.base_version, self.generation = int(own["baseVersion"]), int(own["generation"])
        self.next_seq = int(own["nextSeq"])
        inflight = own["inflight"]
        if inflight:
            self.unconfirmed = SaveRequest.from_json(self.doc_id, self.user, inflight)
        self.draft_generation = self.generation
        self.due_at = self.now
        self._count("drafts_restored")
        self._go("restored")

    def open(self):
        """Load the document (one read): restores this writer's own draft, offers siblings."""
        req = self.begin_read("load")
        return self.finish_read(req, self.send(req))

    def reload(self):
        """Refresh a clean session from the server (one read). Stale answers are dropped."""
        req = self.begin_read("refresh")
        return self.finish_read(req, self.send(req))

    def discard_and_reload(self):
        """Fetch first; replace local state only once the fetch succeeded. Offline, nothing
        changes."""
        req = self.begin_read("replace")
        return self.finish_read(req, self.send(req))

    # -- edits -------------------------------------------------------------------------------
    def edit(self, patch: Mapping, now: float | None = None) -> Won:
        """Apply a patch (id -> value; ``None`` clears) to the local copy and write the draft."""
        self._check("edit")
        self.k.validate_patch(self.schema, patch)
        self._at(now)
        self.local = self.k.apply(self.local, patch)
        self.generation += 1
        self.due_at = self.now + self.debounce
        self._go("edit")
        self._write_draft()
        self._tell("edited", patch)
        return Won(self.generation)

    # -- saves -------------------------------------------------------------------------------
    def due(self, now: float) -> bool:
        return (
            self.state in (State.DIRTY, State.OFFLINE)
            and self.inflight is None
            and self.due_at is not None
            and now >= self.due_at
        )

    def begin_save(self, now: float | None = None) -> SaveRequest:
        """Start a save now (ignoring the debounce). A save whose answer was lost is retried
        unchanged — same writer, seq and snapshot — so the server can answer it from its
        receipt."""
        self._check("save")
        self._at(now)  # a save asked for without a time is sent now: its retry counts from it
        if self.unconfirmed is not None:
            req = self.unconfirmed
        else:
            req = SaveRequest(
                self.doc_id,
                self.user,
                self.writer_id,
                self.next_seq,
                self.base_version,
                dict(self.local),
                self.generation,
            )
            self.next_seq += 1
        self.inflight = req
        self._write_draft()  # the snapshot is durable before the request goes out
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
                self._delete_draft()  # a save of exactly this snapshot succeeded
                self._go("saved")
            else:
                self._go("saved_pending")  # edits made during the save stay pending
                self._write_draft()
            self._tell("saved", req)
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
            self.conflict = Snapshot(
                self.doc_id, self.kind, self.schema, answer.version, dict(answer.content)
            )
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
        """Advance time; when the debounced snapshot is due (or an offline retry), save it (one
        request)."""
        self._at(now)
        if not self.due(self.now):
            return None
        req = self.begin_save(self.now)
        return self.finish_save(req, self.send(req))

    def flush(self, max_failures: int = 2) -> None:
        """Save now, ignoring the debounce, until clean, in conflict, or ``max_failures``
        failed."""
        failures = 0
        while self.state in (State.DIRTY, State.OFFLINE) and failures < max_failures:
            req = self.begin_save()
            if not isinstance(self.finish_save(req, self.send(req)), Won):
                failures += 1

    # -- conflict resolution -------------------------------------------------------------------
    def rebase(self, resolve: Resolve) -> Won:
        """Merge (kinds that merge only): the kind's merge gets the confirmed base, the local
        copy and the stored copy; ``resolve(id, base, local, stored)`` decides each clashing id.
        The result is saved against the stored version on the next tick (it is due at once)."""
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
        self._tell("rebased")
        return Won(self.generation)

    def begin_copy(self) -> CopyRequest:
        self._check("copy")
        c = self.unconfirmed_copy
        if c is not None and c.generation == self.generation:
            req = c  # a retried copy lands on the same new document
        else:
            req = CopyRequest(
                self.doc_id,
                self.user,
                self.writer_id,
                self.next_seq,
                dict(self.local),
                self.generation,
            )
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
            self._take_stored_copy()
            self.saved_generation = max(self.saved_generation, req.generation)
            self.due_at = None
            self._delete_draft()  # the snapshot is saved, as the new document
            self._count("copies")
            self._go("copied")
            self._tell("copied", req)
        else:
            if isinstance(answer, NoAnswer):
                self.unconfirmed_copy = req
            self.last_error = str(answer)
            self._count("copy_failures")
            self._go("copy_failed")
        return answer

    def _take_stored_copy(self) -> None:
        self.base_version, self.base_content = self.conflict.version, dict(self.conflict.content)
        self.local = dict(self.conflict.content)
        self.conflict = None

    def keep_local_as_copy(self) -> Answer:
        """Save the local copy as a new document (every kind); this document takes the stored
        copy."""
        req = self.begin_copy()
        return self.finish_copy(req, self.send(req))

    def discard(self) -> Won:
        """Drop the local edits: back to the confirmed base (in a conflict: to the stored
        copy)."""
        self._check("discard")
        if self.conflict is not None:
            self._take_stored_copy()
        self.local = dict(self.base_content)
        self._discarded("discard")
        return Won(self.state.value)

    def _discarded(self, event: str) -> None:
        """The user dropped the local work: its unanswered save and its draft go with it."""
        self.unconfirmed = None
        self.due_at = None
        self._delete_draft()
        self._count("discarded")
        self._go(event)
        self._tell("discarded")

    # -- sibling drafts ----------------------------------------------------------------------------
    ADOPTED = ("local", "base_version", "base_content", "generation", "unconfirmed", "due_at")
    """What an adoption changes, and puts back when the adopted work cannot be made durable."""

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
        theirs = self.drafts.key(self.kind, self.user, self.doc_id, writer_id)
        d = self.drafts.read(theirs)  # as it is now, not as it was offered
        if d is None:
            self.siblings.remove(offered)
            return Rejected("sibling_gone")
        kept = {name: getattr(self, name) for name in self.ADOPTED}
        self.local, self.base_content = dict(d["content"]), dict(d["baseContent"])
        self.base_version = int(d["baseVersion"])
        self.generation += 1
        self.unconfirmed = None
        if d["inflight"]:
            req = SaveRequest.from_json(self.doc_id, self.user, d["inflight"])
            # the sibling's unanswered save is retried under its own (writer, seq); it stands
            # for the adopted content only if nothing was typed after it
            untouched = same_content(req.content, d["content"])
            generation = self.generation if untouched else self.generation - 1
            self.unconfirmed = replace(req, generation=generation)
        self.due_at = self.now
        if not self._write_draft():  # the work moves only once its new slot is durable
            vars(self).update(kept)
            self.draft_generation = None
            return Rejected("draft_store_failing")
        self._delete_draft(theirs)
        self.siblings.remove(offered)
        self._count("siblings_adopted")
        self._go("adopt")
        self._tell("adopted", writer_id)
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
        self._tell("sibling_discarded", writer_id)
        return Won(writer_id)

    # -- closing -----------------------------------------------------------------------------------
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
