"""The versioned document session, as a pure model: the whole world, and where each part lives.

Theory of operation
-------------------

A user edits a document in a tab while the server, another tab or a server-side writer (the
"AI write") can change the same document. Saves fail on flaky networks; a tab can close
mid-save. The aim: no edit is ever lost silently, and no overwrite is ever silent either.

The model is split by concern; this module puts the parts together and re-exports them, so
``from knownstate.model.document import X`` names any of them:

:mod:`.document_kinds`
    what an id and a value of each kind (``record``, ``sheet``) may be, and the merge;
:mod:`.document_protocol`
    what crosses the network: requests, answers, and the facts both sides share (fingerprints,
    the created-document id, the draft slot key);
:mod:`.document_server`
    the authoritative server: compare-and-swap saves, receipts, authorization, sharing;
:mod:`.document_session`
    the client session, ONE pure state machine driven through ports (network, clock, draft
    store). The real session (:mod:`knownstate.impl.documents.session`) is this machine with
    real ports plugged in: there is no second copy of it anywhere;
:mod:`.document_invariants`
    the seed's invariants as predicates over what can be observed (a :class:`World`), with
    the :class:`Ledger` of edits nothing has covered yet.

:class:`DocumentModel` is the whole world — a server, a draft store, tabs — and keeps the
ledger: it listens to its tabs (:class:`~.document_session.SessionListener`) and records, for
each writer, the latest value of each id the user typed that no accepted save, user discard or
user resolution has covered yet. That is what the seed promises about unsaved work, stated
without looking at how a session stores it; the invariants read it.
"""

from __future__ import annotations

from typing import Mapping

from .contract import IllegalTransition, LostRace, Rejected, Violation, Won  # noqa: F401
from .document_invariants import (  # noqa: F401
    INVARIANTS,
    DocView,
    DraftView,
    Ledger,
    World,
    WriterKey,
    check_invariants,
    close_flushes_never_drops,
    conflict_resolved_by_user,
    no_edit_lost_silently,
    no_last_write_wins,
    no_stale_save_accepted,
    one_version_per_save,
    save_carries_base_version,
    unsaved_work_in_one_place,
)
from .document_kinds import (  # noqa: F401
    ID_PATTERN,
    KINDS,
    MAX_BODY_BYTES,
    MAX_KEYS,
    MAX_NUMBER,
    MAX_TEXT,
    MAX_VERSION,
    RECORD,
    SERVER_AUTHOR,
    SHEET,
    USER_PATTERN,
    WRITER_PATTERN,
    Content,
    Kind,
    KindError,
    MergeUnsupported,
    RecordKind,
    Resolve,
    SheetKind,
    Value,
    kind_of,
    new_document,
    prefer_local,
    prefer_stored,
    same,
    same_content,
)
from .document_protocol import (  # noqa: F401
    FORBIDDEN,
    NOT_FOUND,
    NOT_OWNER,
    OWNER_ACCESS,
    PRECONDITION_REQUIRED,
    Answer,
    CopyRequest,
    Created,
    Dropped,
    NoAnswer,
    ReadRequest,
    Request,
    Saved,
    SaveRequest,
    SeqTaken,
    Snapshot,
    VersionConflict,
    canonical,
    create_fingerprint,
    created_id,
    draft_key,
    draft_prefix,
    save_fingerprint,
)
from .document_server import HistoryEntry, SaveReceipt, ServerDoc, ServerModel  # noqa: F401
from .document_session import (  # noqa: F401
    PENDING,
    TABLE,
    USER_EVENTS,
    CloseResult,
    DraftPort,
    DraftsModel,
    DraftStoreError,
    SessionCore,
    SessionListener,
    State,
    TabView,
    UnsavedWork,
    draft_record,
)


class DocumentModel:
    """Server + draft store + tabs, and the ledger of unsaved edits. Every operation the check
    applies to the real parts has a counterpart here: server-side ones are methods, a tab's are
    its :class:`SessionCore`'s (``model.tabs[name]``), whose network is this model's server
    unless a driver plugs in another (``tab.send = ...``)."""

    def __init__(self, *, debounce: float = 1.0, retry_delay: float = 0.0):
        self.server = ServerModel()
        self.drafts = DraftsModel()
        self.tabs: dict[str, SessionCore] = {}
        self.debounce, self.retry_delay = debounce, retry_delay
        # unsaved[(user, doc, writer)] = {id: value}: the latest local edit of each id that no
        # accepted save, user discard or user resolution has covered yet.
        self.unsaved: dict[WriterKey, dict[str, object]] = {}
        self.lost_visibly: dict[WriterKey, dict[str, object]] = {}
        # undrafted[(user, doc, writer)] = its draft slot: a sibling tab discarded the draft of a
        # writer whose tab is live; its edits stay unsaved work, held by that tab's memory until
        # it writes its draft again (see :meth:`sibling_discarded`)
        self.undrafted: dict[WriterKey, str] = {}
        self._edit_gen: dict[tuple[WriterKey, str], int] = {}

    # -- server side ---------------------------------------------------------------------
    def seed(self, doc_id, kind, schema, content, owner, share=None) -> ServerDoc:
        return self.server.seed(doc_id, kind, schema, content, owner, share)

    def server_write(self, doc_id: str, patch: Mapping):
        return self.server.server_write(doc_id, patch)

    def deliver(self, request: Request) -> Answer:
        """The request reached the server: apply it and return the server's answer."""
        return self.server.handle(request)

    def set_drafts_failing(self, failing: bool) -> None:
        self.drafts.failing = failing

    # -- tabs ------------------------------------------------------------------------------
    def open_tab(
        self, tab: str, user: str, doc_id: str, kind: str, writer_id: str, now: float = 0.0
    ) -> SessionCore:
        if tab in self.tabs and self.tabs[tab].state is not State.CLOSED:
            raise ValueError(f"tab {tab!r} is open")
        self._settle_undrafted()
        t = self.tabs[tab] = SessionCore(
            doc_id,
            user=user,
            kind=kind,
            writer_id=writer_id,
            drafts=self.drafts,
            send=self.deliver,
            listener=self,
            debounce=self.debounce,
            retry_delay=self.retry_delay,
        )
        t.now = now
        return t

    def crash_tab(self, tab: str) -> None:
        """The tab dies (closed mid-save, killed): memory is gone, the draft store stays. Unsaved
        edits its draft does not hold were in memory only, behind a visible failure status."""
        t = self.tabs.pop(tab)
        wk = self._wk(t)
        led = self.unsaved.get(wk, {})
        slot = self.drafts.read(t.key)
        for k, v in list(led.items()):
            if slot is None or not same(slot["content"].get(k), v):
                self.lost_visibly.setdefault(wk, {})[k] = v
                del led[k]
        if not led:
            self.unsaved.pop(wk, None)
        self.undrafted.pop(wk, None)

    # -- the ledger: what each tab tells about the user's work ---------------------------------
    @staticmethod
    def _wk(t: SessionCore) -> WriterKey:
        return (t.user, t.doc_id, t.writer_id)

    def _secure(self, writer: WriterKey, up_to_generation: int) -> None:
        led = self.unsaved.get(writer, {})
        for k in list(led):
            if self._edit_gen.get((writer, k), 0) <= up_to_generation:
                del led[k]
        if not led:
            self.unsaved.pop(writer, None)

    def edited(self, t: SessionCore, patch: Mapping) -> None:
        led = self.unsaved.setdefault(self._wk(t), {})
        for k, v in patch.items():
            led[k] = v
            self._edit_gen[(self._wk(t), k)] = t.generation

    def saved(self, t: SessionCore, req: SaveRequest) -> None:
        """A save landed: the edits it carried are stored (the writer's own, or an adopted
        writer's whose request it retried)."""
        self._secure((t.user, t.doc_id, req.writer_id), req.generation)
        if req.writer_id != t.writer_id:
            self._secure(self._wk(t), req.generation)

    def loaded_clean(self, t: SessionCore) -> None:
        """The writer's own draft held nothing the server lacks: its edits are stored."""
        led = self.unsaved.get(self._wk(t), {})
        for k, v in list(led.items()):
            if same(t.local.get(k), v):
                del led[k]

    def discarded(self, t: SessionCore) -> None:
        self.unsaved.pop(self._wk(t), None)

    def rebased(self, t: SessionCore) -> None:
        led = self.unsaved.get(self._wk(t), {})
        for k, v in list(led.items()):
            if not same(t.local.get(k), v):
                del led[k]  # the user's resolution chose another value
            else:
                self._edit_gen[(self._wk(t), k)] = t.generation

    def copied(self, t: SessionCore, req: CopyRequest) -> None:
        self.unsaved.pop(self._wk(t), None)  # the work is saved, in the copy

    def adopted(self, t: SessionCore, writer_id: str) -> None:
        src = (t.user, t.doc_id, writer_id)
        left = self.unsaved.pop(src, {})
        # what the adopted draft held moves to this writer; what it did not hold (typed while
        # the store was failing) stays with the writer whose tab has it in memory
        moved = {k: v for k, v in left.items() if same(t.local.get(k), v)}
        if len(moved) < len(left):
            self.unsaved[src] = {k: v for k, v in left.items() if k not in moved}
        if moved:
            self.unsaved.setdefault(self._wk(t), {}).update(moved)
            for k in moved:
                self._edit_gen[(self._wk(t), k)] = t.generation

    def sibling_discarded(self, t: SessionCore, writer_id: str) -> None:
        """The user discarded another writer's draft, offered on load. The seed offers the drafts
        tabs left behind ("one tab never erases another's draft"): where that writer's tab is
        gone, the draft held its only copy and the discard covers its edits. Where its tab is
        live, the user discarded a copy, not the work that tab still shows and will save: its
        edits stay unsaved, and need no draft until that tab writes one again. If the tab ends
        first, nothing holds them any more: the discard covers them then."""
        wk = (t.user, t.doc_id, writer_id)
        if self._live(wk):
            self.undrafted[wk] = self.drafts.key(t.kind, *wk)
        else:
            self.unsaved.pop(wk, None)

    def _live(self, wk: WriterKey) -> bool:
        return any(
            self._wk(t) == wk and t.state not in (State.CLOSED, State.LOADING)
            for t in self.tabs.values()
        )

    def _settle_undrafted(self) -> None:
        """A writer whose draft a sibling discarded is undrafted until its tab writes the draft
        again (from then on the draft must hold its work) or ends without (the discard covers
        the work then)."""
        for wk, key in list(self.undrafted.items()):
            if self.drafts.read(key) is not None:
                del self.undrafted[wk]
            elif not self._live(wk):
                del self.undrafted[wk]
                self.unsaved.pop(wk, None)

    # -- the world, as the invariants read it ----------------------------------------------------
    def world(self) -> World:
        docs = {
            d.id: DocView(d.id, d.kind, d.version, dict(d.content), tuple(d.history))
            for d in self.server.docs.values()
        }
        drafts = {k: DraftView.from_record(k, r) for k, r in self.drafts.slots.items()}
        tabs = {name: t.view(name) for name, t in self.tabs.items()}
        return World(docs, drafts, tabs)

    def ledger(self) -> Ledger:
        """The ledger as of now (a writer undrafted until this step is settled first)."""
        self._settle_undrafted()
        return Ledger(
            {k: dict(v) for k, v in self.unsaved.items() if v},
            {k: dict(v) for k, v in self.lost_visibly.items() if v},
            frozenset(self.undrafted),
        )
