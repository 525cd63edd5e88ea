"""The versioned document session's model-versus-implementation check.

What runs
---------

Real client sessions (:class:`~knownstate.impl.documents.session.Session`), tabs of two users
(alice in slots ``a1`` and ``a2``, bob in ``b1``), talk HTTP to the real document server over
real PostgreSQL; each slot's requests go through its own Toxiproxy link, and so do the
server's database connections; the drafts are the real files. Clients that are not sessions
send what the contract refuses, save under someone else's writer id, or reuse a save identity
(:mod:`.document_requests`). The real parts are in :mod:`.document_plant`.

Rules are the user's and the world's actions: open (a fresh writer, or the same writer again,
which restores its draft), load, edit, the debounce tick (which saves when due), an edit made
while a save is in flight, discard, discard-and-reload, reload, reads that race (out of order,
against a local edit, against a save), conflict resolution by rebase, copy or discard, adopting
or discarding a sibling draft, close, a tab killed mid-save, the server-side writer, the draft
store failing and recovering, and the other clients (:mod:`.document_world`). The rare
situations are reached on purpose, each by a rule with a budget per example
(:mod:`.document_aimed`): a sibling draft offered to a fresh tab, a conflict left each of its
seven ways, unsaved work left after a save failed offline. The server's own
operations are also raced at statement level, judged by linearizability against its model
(:mod:`.document_blocks`). Faults are rules too: a request made offline or whose answer is lost
(per step), toxics with concrete values and links taken down (on a tab's link or on the server's
database link), and a database crash.

How model and implementation are compared
-----------------------------------------

Each rule is one script, run on the real parts and replayed on the model by the engine of
:mod:`knownstate.chaos.replay` (lost answers keep both worlds until an observation decides).
The model's sessions are the same machine as the real ones
(:class:`~knownstate.model.document_session.SessionCore`); what is compared is only what can
be observed, and what makes the check independent is what it judges on the real world after
every step — the model's eight invariants over the ledger of unsaved edits, and the check's own
(:mod:`.document_judge`). When the implementation disagrees with the model the judge runs
first, so a failure names the invariant it broke; otherwise it shows the difference.

What this check overrides of :class:`~knownstate.chaos.check.KindCheck`
-----------------------------------------------------------------------

The session is not a durable run kind: ``contract`` is None, :meth:`table` is the session's
:data:`~knownstate.model.document_session.TABLE` (vacuity counts its every row). There are no
workers: the base's link faults act on the tabs' links and the server's database link
(``all_links``), paced by the kind's :class:`FaultPolicy` (a few operations of calm between two
faults, a heal after ``FAULT_STEPS`` operations); a database crash is drawn only while a tab
waits to retry a save (``crash_matters``); the database clock plays no role (``clock_matters``).
"""

from __future__ import annotations

import contextlib
import shutil
from typing import Any, Callable

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from knownstate.impl.documents import store as store_impl
from knownstate.impl.documents.drafts import DraftStore
from knownstate.impl.documents.reading import RequestReader
from knownstate.impl.documents.session import Session
from knownstate.impl.documents.store import DocumentStore
from knownstate.model.contract import IllegalTransition, Won
from knownstate.model.document import (
    INVARIANTS as SESSION_INVARIANTS,
    TABLE,
    DraftView,
    KindError,
    NoAnswer,
    ReadRequest,
    SaveRequest,
    State,
    UnsavedWork,
    World,
    check_invariants,
    prefer_local,
    prefer_stored,
)

from ..check import FaultPolicy
from ..toxi import Toxic
from ..replay import Candidate, Exchange, ReplayCheck
from .document_judge import (
    CHECK_INVARIANTS,
    ReadsApplied,
    Seen,
    describe_difference,
    receipt_answers,
    show,
    show_request,
)
from .document_plant import (
    DOC,
    INITIAL,
    SCHEMA,
    SLOTS,
    CheckedModel,
    ModelSide,
    Observer,
    Plant,
    RealSide,
)
from .document_aimed import AimedRules
from .document_blocks import SERVER_BLOCKS, ServerBlocks
from .document_world import WorldRules, fmt_patch
from .document_requests import HOSTILE_EVENTS, REQUEST_INVARIANTS

NETS = ("ok",) * 6 + ("offline", "answer lost")  # for a step that reads
NETS_WRITE = ("ok",) * 3 + ("offline", "answer lost", "answer lost")  # for a step that may write
NETS_COPY = ("ok", "offline", "answer lost")  # for keeping a copy
BUDGET = {
    "other client": 2,
    "impostor": 1,
    "reopen": 1,
    "server block": 2,
    "sibling": 2,
    "conflict": 3,
    "work": 2,
}
"""Steps per example for the rules that are not the session's own work, and for the situations
reached on purpose (:mod:`.document_aimed`): they share the example with it, and the vacuity
rule wants the session's every transition in a CI-size run."""
FAULT_STEPS = 4  # a link fault heals by itself after this many operations (work keeps flowing)
DEBOUNCE = 1.0


class DocumentSessionCheck(AimedRules, WorldRules, ServerBlocks, ReplayCheck):
    kind = "document-session"
    contract = None
    schema = store_impl.schema_sql()
    n_workers = 0
    policy = FaultPolicy(gap=2, heal_after=FAULT_STEPS, commit_faults=())
    own_invariants = {**SESSION_INVARIANTS, **CHECK_INVARIANTS}
    domain_errors = (UnsavedWork, IllegalTransition, KindError, KeyError)
    # The mutant catalogue replaces these (never the reference's behaviour).
    session_class: type[Session] = Session
    store_class: type[DocumentStore] = DocumentStore
    reader_class: type[RequestReader] = RequestReader
    drafts_class: type[DraftStore] = DraftStore
    queries: dict[str, str] | None = None
    # The real parts (a client shell of another kind, the browser, brings its own plant).
    plant_name = "document-session"
    plant_class: type[Plant] = Plant
    required_events = (
        "conflict",
        "rebase",
        "copy",
        "sibling draft adopted",
        "sibling draft discarded",
        "stale read dropped",
        "idempotent retry answered",
        "draft-store failure",
        "draft-store recovery",
        "lost response",
        "hostile request refused",
        *HOSTILE_EVENTS,
        *SERVER_BLOCKS,
    )
    EVENTS = {  # counter of the model -> event name
        "conflicts": "conflict",
        "rebases": "rebase",
        "copies": "copy",
        "siblings_adopted": "sibling draft adopted",
        "siblings_discarded": "sibling draft discarded",
        "stale_reads_dropped": "stale read dropped",
        "idempotent_replays": "idempotent retry answered",
        "draft_failures": "draft-store failure",
        "draft_recoveries": "draft-store recovery",
        "drafts_restored": "own draft restored",
        "discarded": "discard",
        "save_failures": "save failed",
        "copy_failures": "copy failed",
        "seqs_taken": "save seq taken",
    }

    @classmethod
    def table(cls):
        return TABLE

    # -- hooks of KindCheck ------------------------------------------------------------------
    def reset_example(self) -> None:
        plant = self.env.stand_in(self.plant_name, lambda: self.plant_class(self.env, self.ws))
        self.plant, self.recorder, self.links = plant, plant.recorder, plant.links
        store = self.store_class(
            plant.server_dsn, connect_timeout=2, pool_size=None, queries=self.queries
        )
        plant.server.use(store=store, reader=self.reader_class())
        self.observer = Observer(self.ws)
        self.observer.seed(DOC, "record", SCHEMA, INITIAL, "alice", {"bob": True})
        shutil.rmtree(plant.draft_dir, ignore_errors=True)
        self.drafts = self.drafts_class(plant.draft_dir)
        self.sessions: dict[str, Session] = {}
        self.writer_n = {slot: 0 for slot in SLOTS}
        self.clock = 0.0
        self.time = lambda: self.clock  # the sessions' clock port (a function, not a method)
        self.edits = 0
        self.seen_totals: dict[str, int] = {}
        self.reads = ReadsApplied()
        self.drafts_failing = False
        self.hostile_n = 0
        self.budget = dict(BUDGET)
        self.refusals: list = []  # the verdict on a hostile request, judged after its step
        plant.recorder.take()

    def new_model(self) -> CheckedModel:
        m = CheckedModel()
        m.seed(DOC, "record", SCHEMA, INITIAL, "alice", {"bob": True})
        return m

    def observe_model(self, m: CheckedModel) -> Seen:
        return Seen(m.world(), dict(m.drafts.slots))

    def observe_impl(self) -> Seen:
        if self.plant.db_link.toxics or not self.plant.db_link.enabled:
            # a statement the server sent before its connection was cut may still be running
            self.env.settle(self.plant.server_app)
        docs = self.observer.documents()
        drafts = self.observe_drafts()
        views = {k: DraftView.from_record(k, r) for k, r in drafts.items()}
        tabs = {slot: s.view(slot) for slot, s in self.sessions.items()}
        return Seen(World(docs, views, tabs), drafts)

    def observe_drafts(self) -> dict[str, dict]:
        """Every draft record as stored, by the slot it is in."""
        drafts = {k: self.drafts.read(k) for k in self.drafts.keys()}
        return {k: r for k, r in drafts.items() if r is not None}

    def clock_matters(self) -> bool:
        return False  # session time is a number the check passes; the database clock plays no role

    # -- hooks of the replay engine ------------------------------------------------------------
    def real_side(self) -> RealSide:
        return RealSide(self)

    def model_side(self, model: CheckedModel, deliver: Callable) -> ModelSide:
        return ModelSide(self, model, deliver)

    def lost(self, answer: Any) -> bool:
        return isinstance(answer, NoAnswer)

    def may_change(self, request: Any) -> bool:
        return not isinstance(request, ReadRequest)

    def compared(self, outcome: Any) -> Any:
        """A lost answer by what was lost (``lost``, ``unreachable``, ...), not by the
        transport's error: of two requests lost in one step, which one's error the client
        reports is timing (the browser's driver reports the last it saw)."""
        if isinstance(outcome, NoAnswer):
            return NoAnswer(outcome.reason.partition(":")[0])
        return outcome

    def unanswered(self, why: str) -> NoAnswer:
        return NoAnswer(why)

    def deliver_to_model(self, model: CheckedModel, request: Any) -> Any:
        return model.deliver(request)

    def landing_changes(self, answer: Any) -> bool:
        return isinstance(answer, Won) and not getattr(answer.value, "replayed", False)

    def describe(self, x: Any) -> str:
        return show(x)

    def describe_request(self, request: Any) -> str:
        return show_request(request)

    def difference(self, expected: Seen, real: Seen) -> str:
        return describe_difference(expected, real)

    def after_step(self) -> None:
        self._age_faults()

    def judge(self, real: Seen, m: CheckedModel, exchanges: list[Exchange]) -> list:
        sent = [x.request for x in exchanges if isinstance(x.request, SaveRequest)]
        out = check_invariants(real.world, m.ledger(), expected=m.world(), sent=sent)
        out += receipt_answers(self.ws.query, exchanges)
        out += self.reads.judge(real.world, exchanges)
        out += self.refusals
        self.refusals = []
        self.stats.invariants_checked += (
            len(SESSION_INVARIANTS) + len(CHECK_INVARIANTS) - len(REQUEST_INVARIANTS)
        )
        return out

    def counted(self, chosen: Candidate) -> None:
        for t in chosen.model.drain():
            self.stats.transitions[t] += 1
        totals = chosen.model.totals()
        for counter, event in self.EVENTS.items():
            self.event(event, totals.get(counter, 0) - self.seen_totals.get(counter, 0))
        self.event("lost response", chosen.landed - self.seen_totals.get("landed", 0))
        self.event("lost request", chosen.not_landed - self.seen_totals.get("not landed", 0))
        self.seen_totals = {**totals, "landed": chosen.landed, "not landed": chosen.not_landed}

    # -- the base's faults act on the tabs' links and the server's database link ---------------
    def all_links(self):
        return [*self.links.values(), self.plant.db_link]

    def crash_matters(self) -> bool:
        """A database crash and restart while a tab waits to retry a save: the receipt that
        answers the retry must have survived."""
        return bool(self._slots(State.OFFLINE))

    # -- a step --------------------------------------------------------------------------------
    def _run(
        self, label: str, script: Callable[[Any], Any], net: tuple[str, str] | None = None
    ) -> Any:
        return self.play(label, script, self._net(*net) if net else None)

    @contextlib.contextmanager
    def _net(self, slot: str, net: str):
        """A per-step network fate on one tab's link: offline (the link is down) or the answer
        lost (the server gets the request and answers; the answer never arrives)."""
        link = self.links[slot]
        if net == "ok" or link.toxics or not link.enabled:
            yield ""
            return
        if net == "offline":
            self._toxi(link.down)
            undo = link.up
        else:
            toxic = Toxic("limit_data", "downstream", {"bytes": 0})
            self._toxi(lambda: link.add(toxic))
            undo = lambda: link.remove(toxic)  # noqa: E731
        self.stats.faults["link-down" if net == "offline" else "reply-lost"] += 1
        try:
            yield f" [{net}]"
        finally:
            self._toxi(undo)

    # -- helpers --------------------------------------------------------------------------------
    def _state(self, slot: str) -> State | None:
        s = self.sessions.get(slot)
        return None if s is None else s.state

    def _slots(self, *states: State) -> list[str]:
        return [slot for slot in SLOTS if self._state(slot) in states]

    def _free_slots(self) -> list[str]:
        return [slot for slot in SLOTS if self._state(slot) in (None, State.CLOSED)]

    def _patch(self, slot: str, attr: str) -> dict:
        """A new value nobody else writes (the count of edits so far makes it unique)."""
        self.edits += 1
        k = self.edits
        if attr == "clear":
            return {"qty": None}
        return {attr: {"title": f"{slot}.{k}", "qty": k, "done": k % 2 == 1}[attr]}

    def _pick(self, data, slots: list[str]) -> str:
        return data.draw(st.sampled_from(slots), label="tab")

    # -- opening and loading --------------------------------------------------------------------
    def _open(self, slot: str, fresh: bool, net: str = "ok") -> None:
        fresh = fresh or self.writer_n[slot] == 0
        if fresh:
            self.writer_n[slot] += 1
        writer = f"{slot}-{self.writer_n[slot]}"
        user = SLOTS[slot]

        def script(side):
            t = side.open(slot, user, writer)
            req = t.begin_read("load")
            return t.finish_read(req, side.send(slot, req))

        again = "" if fresh else ", again"
        self._run(f"open {slot} ({user}, writer {writer}{again})", script, (slot, net))

    @precondition(lambda self: self._free_slots())
    @rule(data=st.data(), fresh=st.booleans(), net=st.sampled_from(NETS))
    def open(self, data, fresh: bool, net: str) -> None:
        """A tab (re)opens: the same writer again (its draft is restored) or a fresh one (the drafts
        of the user's other writers are offered as siblings)."""
        self._open(self._pick(data, self._free_slots()), fresh, net)

    def _reopenable(self) -> list[str]:
        return [slot for slot in self._slots(State.CLEAN) if self.sessions[slot].next_seq > 1]

    @precondition(lambda self: self._reopenable() and self.budget["reopen"])
    @rule(data=st.data())
    def reopen_without_draft(self, data) -> None:
        """A tab that saved closes clean, and its writer opens the document again: no draft is
        left, so it counts its saves from 1 again. Its next save reuses an identity that saved:
        the server says so (409 save_seq_taken) and the tab goes on under a fresh seq."""
        slot = self._pick(data, self._reopenable())
        self.budget["reopen"] -= 1
        user, writer = SLOTS[slot], self.sessions[slot].writer_id
        patch, now = self._patch(slot, "title"), self.clock
        self.clock += DEBOUNCE
        later = self.clock

        def script(side):
            side.tab(slot).close()
            t = side.open(slot, user, writer)
            req = t.begin_read("load")
            t.finish_read(req, side.send(slot, req))
            t.edit(patch, now)
            return t.tick(later)

        self._run(
            f"close {slot} and open it again (writer {writer}, no draft), edit "
            f"{fmt_patch(patch)}, then wait {DEBOUNCE}s",
            script,
        )

    @precondition(lambda self: self._slots(State.LOADING))
    @rule(data=st.data(), give_up=st.sampled_from([False, False, True]), net=st.sampled_from(NETS))
    def load(self, data, give_up: bool, net: str) -> None:
        """A tab whose first read failed tries again, or the user closes it while it is still
        loading."""
        slot = self._pick(data, self._slots(State.LOADING))
        if give_up:
            self._run(
                f"close {slot} while it is still loading", lambda side: side.tab(slot).close()
            )
            return

        def script(side):
            t = side.tab(slot)
            req = t.begin_read("load")
            return t.finish_read(req, side.send(slot, req))

        self._run(f"load {slot}", script, (slot, net))

    # -- editing and saving ---------------------------------------------------------------------
    EDITABLE = (State.CLEAN, State.DIRTY, State.OFFLINE, State.CONFLICT)
    PENDING = (State.DIRTY, State.OFFLINE)

    @precondition(lambda self: self._slots(*self.EDITABLE))
    @rule(
        data=st.data(),
        attr=st.sampled_from(["title", "qty", "done", "clear"]),
        then=st.sampled_from(["", "", "tick"]),
        net=st.sampled_from(NETS_WRITE),
    )
    def edit(self, data, attr: str, then: str, net: str) -> None:
        """The user types (and, with ``then=tick``, waits: the debounce fires and the tab saves)."""
        slot = self._pick(data, self._slots(*self.EDITABLE))
        patch = self._patch(slot, attr)
        now = self.clock
        if then:
            self.clock += DEBOUNCE
        later = self.clock

        def script(side):
            t = side.tab(slot)
            out = t.edit(patch, now)
            return t.tick(later) if then else out

        wait = f", then wait {DEBOUNCE}s" if then else ""
        self._run(f"edit {slot} {fmt_patch(patch)}{wait}", script, (slot, net) if then else None)

    @precondition(lambda self: self._slots(*self.PENDING))
    @rule(data=st.data(), advance=st.sampled_from([1.0, 1.0, 0.5]), net=st.sampled_from(NETS_WRITE))
    def tick(self, data, advance: float, net: str) -> None:
        """Time passes; the tab saves when its debounce is due (or at once, to retry a failed
        save)."""
        slot = self._pick(data, self._slots(*self.PENDING))
        self.clock += advance
        now = self.clock
        self._run(f"tick {slot} +{advance}s", lambda side: side.tab(slot).tick(now), (slot, net))

    @precondition(lambda self: self._slots(*self.PENDING))
    @rule(
        data=st.data(),
        attr=st.sampled_from(["title", "qty", "done"]),
        net=st.sampled_from(NETS_WRITE),
    )
    def edit_during_save(self, data, attr: str, net: str) -> None:
        """The user types while a save is in flight: the edit stays pending, whatever the answer."""
        slot = self._pick(data, self._slots(*self.PENDING))
        patch = self._patch(slot, attr)
        now = self.clock

        def script(side):
            t = side.tab(slot)
            req = t.begin_save(now)
            t.edit(patch, now)
            return t.finish_save(req, side.send(slot, req))

        self._run(
            f"save {slot}, and edit {fmt_patch(patch)} while it is in flight", script, (slot, net)
        )

    @precondition(lambda self: self._slots(*self.PENDING))
    @rule(data=st.data(), reload=st.booleans(), net=st.sampled_from(NETS))
    def discard(self, data, reload: bool, net: str) -> None:
        """The user throws the local edits away: ``discard()``, or ``discard_and_reload()``, which
        fetches first and replaces the local state only once the fetch succeeded."""
        slot = self._pick(data, self._slots(*self.PENDING))
        self._discard(slot, reload, net)

    @precondition(lambda self: self._slots(State.OFFLINE))
    @rule(
        data=st.data(),
        how=st.sampled_from(["discard", "discard and reload", "close", "discard"]),
        net=st.sampled_from(NETS_WRITE),
    )
    def leave_offline_work(self, data, how: str, net: str) -> None:
        """While a tab waits to retry a save, the user leaves its work: discards it (the retry is
        dropped, not the server's copy), discards and reloads (offline, nothing changes), or
        closes the tab (the close flushes; what the server does not take is parked)."""
        slot = self._pick(data, self._slots(State.OFFLINE))
        if how == "close":
            self._run(f"close {slot}", lambda side: side.tab(slot).close(), (slot, net))
        else:
            self._discard(slot, how.endswith("reload"), net)

    def _discard(self, slot: str, reload: bool, net: str) -> None:
        if not reload:
            self._run(f"discard {slot}", lambda side: side.tab(slot).discard())
            return

        def script(side):
            t = side.tab(slot)
            req = t.begin_read("replace")
            return t.finish_read(req, side.send(slot, req))

        self._run(f"discard and reload {slot}", script, (slot, net))

    # -- reads ----------------------------------------------------------------------------------
    @precondition(lambda self: self._slots(*self.EDITABLE))
    @rule(
        data=st.data(),
        race=st.sampled_from(["none", "newer read first", "local edit", "save"]),
        replace=st.booleans(),
    )
    def read(self, data, race: str, replace: bool) -> None:
        """A read (reload when clean, discard-and-reload otherwise), possibly answered late: after a
        newer read was applied, after a local edit, or after a save moved the base. The guard drops
        a late answer."""
        if race in ("none", "newer read first") and not self._slots(State.CLEAN):
            race = "local edit"
        if race == "save" and not self._slots(*self.PENDING):
            race = "local edit"
        slots = {
            "none": self._slots(State.CLEAN),
            "newer read first": self._slots(State.CLEAN),
            "save": self._slots(*self.PENDING),
        }.get(race, self._slots(*self.EDITABLE))
        slot = self._pick(data, slots)
        clean = self._state(slot) is State.CLEAN
        purpose = "refresh" if clean and not (replace and race == "none") else "replace"
        patch = self._patch(slot, "title") if race == "local edit" else None
        server_patch = {"done": self.edits % 2 == 1}
        now = self.clock

        def script(side):
            t = side.tab(slot)
            late = t.begin_read(purpose)
            late_answer = side.send(slot, late)
            if race == "newer read first":
                side.server_write(server_patch)
                newer = t.begin_read("refresh")
                t.finish_read(newer, side.send(slot, newer))
            elif race == "local edit":
                t.edit(patch, now)
            elif race == "save":
                req = t.begin_save(now)
                t.finish_save(req, side.send(slot, req))
            return t.finish_read(late, late_answer)

        what = {
            "none": "",
            "newer read first": ", answered after a server-side write and a newer read",
            "local edit": f", answered after an edit {fmt_patch(patch or {})}",
            "save": ", answered after a save",
        }
        verb = "reload" if purpose == "refresh" else "discard and reload"
        self._run(f"{verb} {slot}{what[race]}", script)

    # -- conflicts ------------------------------------------------------------------------------
    @precondition(lambda self: self._slots(State.CONFLICT))
    @rule(
        data=st.data(),
        how=st.sampled_from(
            [
                "discard",
                "rebase, a clash keeps the local value",
                "rebase, a clash keeps the stored value",
                "discard and reload",
                "rebase, a clash keeps the local value",
            ]
        ),
        net=st.sampled_from(NETS),
    )
    def resolve(self, data, how: str, net: str) -> None:
        """The user resolves the conflict: rebase (records merge by attribute id), discard (take the
        stored copy), or discard and reload."""
        slot = self._pick(data, self._slots(State.CONFLICT))
        if how.startswith("discard"):
            self._discard(slot, how.endswith("reload"), net)
        else:
            resolve = prefer_local if how.endswith("local value") else prefer_stored
            self._run(f"resolve {slot}: {how}", lambda side: side.tab(slot).rebase(resolve))

    @precondition(lambda self: self._slots(State.CONFLICT))
    @rule(data=st.data(), net=st.sampled_from(NETS_COPY))
    def keep_copy(self, data, net: str) -> None:
        """The user resolves the conflict by keeping the local copy as a new document (every kind
        can); this document takes the stored copy."""
        slot = self._pick(data, self._slots(State.CONFLICT))

        def script(side):
            t = side.tab(slot)
            req = t.begin_copy()
            return t.finish_copy(req, side.send(slot, req))

        self._run(f"resolve {slot}: keep the local copy as a new document", script, (slot, net))

    # -- sibling drafts -------------------------------------------------------------------------
    def _with_siblings(self) -> list[str]:
        return [
            slot for slot, s in self.sessions.items() if s.siblings and s.state is not State.CLOSED
        ]

    @precondition(lambda self: self._with_siblings())
    @rule(data=st.data(), adopt=st.sampled_from([True, True, False]))
    def sibling(self, data, adopt: bool) -> None:
        """A draft another writer of the same user left is offered on load: adopt it (only a clean
        tab can) or discard it. Never applied silently."""
        clean = [slot for slot in self._with_siblings() if self._state(slot) is State.CLEAN]
        adopt = adopt and bool(clean)
        slot = self._pick(data, clean if adopt else self._with_siblings())
        s = self.sessions[slot]
        writer = data.draw(st.sampled_from([d["writerId"] for d in s.siblings]), label="sibling")
        if adopt:
            self._run(
                f"{slot} adopts the draft of writer {writer}",
                lambda side: side.tab(slot).adopt(writer),
            )
        else:
            self._run(
                f"{slot} discards the draft of writer {writer}",
                lambda side: side.tab(slot).discard_sibling(writer),
            )

    # -- closing and dying ----------------------------------------------------------------------
    CLOSABLE = (State.LOADING, State.CLEAN, State.DIRTY, State.OFFLINE, State.CONFLICT)

    @precondition(lambda self: self._slots(*self.CLOSABLE))
    @rule(
        data=st.data(),
        how=st.sampled_from(
            [
                "close",
                "close",
                "close",
                "killed",
                "killed mid-save, before the request",
                "killed mid-save, after the request",
            ]
        ),
        net=st.sampled_from(NETS_WRITE),
    )
    def close(self, data, how: str, net: str) -> None:
        """The tab is closed (it flushes; work the server did not take is parked in the writer's
        draft), or it dies — possibly mid-save: its memory is gone, the draft store stays."""
        slot = self._pick(data, self._slots(*self.CLOSABLE))
        if how == "close":
            self._run(f"close {slot}", lambda side: side.tab(slot).close(), (slot, net))
            return
        if self._state(slot) not in self.PENDING:
            how = "killed"
        now = self.clock

        def script(side):
            if how != "killed":
                t = side.tab(slot)
                req = t.begin_save(now)
                if how.endswith("after the request"):
                    side.send(slot, req)
            side.crash(slot)
            return None

        self._run(
            f"tab {slot} {how}", script, (slot, net) if how.endswith("after the request") else None
        )

    # Drawn twice as often as the other rules (Hypothesis draws a rule uniformly among the enabled
    # ones; a rule listed under two names counts twice): they keep work flowing towards saves,
    # conflicts and their resolutions, which the vacuity rule requires.
    edit_more = edit
    tick_more = tick
    resolve_more = resolve
    keep_copy_more = keep_copy


CHECK = DocumentSessionCheck

# The catalogue, this kind's MUTANTS; it needs nothing from here.
from .document_mutants import MUTANTS  # noqa: E402, F401
