"""The document session checked in a real browser: the same check, another client shell.

``knownstate verify document-session --client browser`` (this kind, ``document-session-browser``)
runs the document-session check — its rules, faults, model, invariants, judge and report, all of
:class:`~.document_session.DocumentSessionCheck` — with the tabs played by a client in headless
Chromium (:mod:`knownstate.chaos.browser`, :mod:`~knownstate.chaos.browser_gateway`,
:mod:`~knownstate.chaos.browser_driver`): the reference TypeScript client of ``web/``, one of its
mutants, or a bundle of your own (``--client-bundle``). Every step is run in the browser and
replayed on the model's sessions (:class:`~knownstate.model.document_session.SessionCore`), whose
network is the recording the gateway made of what the browser sent and got back; what is
compared is what can be observed — the stored documents, each user's ``localStorage`` drafts, each
tab's view — and the invariants are judged on it after every step.

What this shell adds to the Python one: the browser offline (Chromium's offline mode, for the
step's requests), a page reloaded (memory gone; the same writer opens the document again and
restores its draft), a tab closed mid-save (its page torn down while its request is held at the
gateway, before or after the server saw it), the document server restarted while a save is on
its way, and two tabs of one user sharing one ``localStorage``. Requests are compared as they
cross the wire (:meth:`on_the_wire`): the generation and read sequence are the client's own.

A seed's length is set by its rarest requirement, so the rare situations are reached on purpose,
each by a rule with a budget per example (as the outbox reaches a batch of mixed attempts): a
sibling draft offered to a fresh tab (``sibling_offered``), a conflict left each of its seven
ways (``conflict_resolved``), unsaved work left after a save failed offline (``work_left``),
and alice's two tabs saving back to back (``alice_tabs_race``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any, ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from knownstate.impl.documents.server import DocumentServer
from knownstate.model.contract import Violation
from knownstate.model.document import (
    CopyRequest,
    DraftView,
    ReadRequest,
    SaveRequest,
    State,
    VersionConflict,
    World,
    prefer_local,
    prefer_stored,
)

from .. import browser, browser_driver, browser_gateway
from ..replay import Exchange
from .document_blocks import SERVER_BLOCKS
from .document_judge import Seen
from .document_plant import CLIENT, DEBOUNCE, DOC, SLOTS, ModelSide, Plant, RealSide
from .document_session import DocumentSessionCheck
from .document_world import fmt_patch

KIND = "document-session-browser"

OWN_INVARIANTS = {
    "sibling-draft-offered-not-applied": (
        "On load a writer restores only its own draft: other writers' drafts are offered to "
        "adopt or discard, never applied silently."
    )
}

BROWSER_BUDGET = {"reload": 1, "restart": 1, "race": 1, "sibling": 2, "conflict": 3, "work": 2}
"""Steps per example for the browser's own faults and the situations reached on purpose (they
share the example with the session's work, like the Python check's BUDGET)."""


class BrowserPlant(Plant):
    """The Python check's plant (document server, links, recorder, the client wire) plus the
    gateway and Chromium."""

    link_prefix = KIND

    def start(self) -> "BrowserPlant":
        super().start()
        self.gateway = browser_gateway.Gateway({}).start()
        upstream = {slot: f"http://127.0.0.1:{link.port}" for slot, link in self.links.items()}
        try:
            self.chromium = browser.Chromium(self.gateway, SLOTS).start()
        except BaseException:
            self.gateway.stop()
            raise
        self.driver = browser_driver.BrowserDriver(
            self.chromium, self.gateway, upstream, self.recorder
        )
        return self

    def describe(self) -> str:
        return self.chromium.describe()

    @property
    def running(self) -> bool:
        return self.chromium.running

    def restart_server(self, store, reader) -> None:
        """The document server process goes away and comes back on the same port."""
        port = self.server.port
        self.server.stop()
        self.server = DocumentServer(self.server_dsn, port=port, connect_timeout=2, pool_size=None)
        self.server.start()
        self.server.use(store=store, reader=reader)

    def stop(self) -> None:
        for part in ("driver", "chromium", "gateway"):
            with contextlib.suppress(Exception):
                if hasattr(self, part):
                    getattr(self, part).close() if part == "driver" else getattr(self, part).stop()
        super().stop()


class BrowserRealSide(RealSide):
    """The real parts, with tabs in Chromium."""

    def send(self, slot: str, req):
        if slot == CLIENT:
            return super().send(slot, req)
        return self.check.sessions[slot].send(req)

    def open(self, slot: str, user: str, writer: str):
        c = self.check
        config = {
            "docId": DOC,
            "user": user,
            "kind": "record",
            "writerId": writer,
            "apiBase": f"/t/{slot}",
            "debounce": 1.0,
            "retryDelay": 0.0,
            "now": c.clock,
        }
        if c.client_mutant:
            config["mutant"] = c.client_mutant
        tab = c.sessions[slot] = c.plant.driver.open(slot, user, config)
        return tab

    def crash(self, slot: str) -> None:
        """The tab dies: its page is torn down (a new document loads in its place), and whatever
        it had on the wire gets no answer."""
        c = self.check
        tab = c.sessions.pop(slot)
        mid_save = any(isinstance(p.request, SaveRequest) for p in tab.pending)
        c.plant.chromium.fresh(slot)
        c.plant.gateway.cut(slot)
        if mid_save:
            c.event("tab closed mid-save")

    def reload(self, slot: str, user: str, writer: str):
        self.crash(slot)
        self.check.event("page reloaded")
        return self.open(slot, user, writer)

    def restart_server(self) -> None:
        c = self.check
        store = c.store_class(
            c.plant.server_dsn, connect_timeout=2, pool_size=None, queries=c.queries
        )
        c.plant.restart_server(store, c.reader_class())
        c.event("document server restarted")


class BrowserModelSide(ModelSide):
    def reload(self, slot: str, user: str, writer: str):
        self.m.crash_tab(slot)
        return self.open(slot, user, writer)

    def restart_server(self) -> None:
        pass  # the model's server keeps everything in the database: nothing to lose


SIBLING_LEAVES = (
    "stays open",
    "is killed",
    "is killed mid-save, before the request",
    "is killed mid-save, after the request",
)
"""How alice's tab leaves the draft a new tab of hers is offered (``sibling_offered``)."""

LEAVE_CONFLICT = (
    "discard",
    "discard and reload",
    "close",
    "rebase, a clash keeps the local value",
    "rebase, a clash keeps the stored value",
    "keep a copy",
    "keep a copy, offline",
)
LEAVE_OFFLINE = ("discard", "discard and reload", "close, offline")
"""How a user leaves a conflict, or work waiting to retry (``conflict_resolved``,
``work_left``)."""


DRAFT_FIELDS = ("kind", "user", "fileId", "writerId", "content", "baseVersion")


def projected_draft(r: dict) -> dict:
    """A draft record as the check compares it (see the contract in the README)."""
    out = {k: r.get(k) for k in DRAFT_FIELDS}
    inflight = r.get("inflight")
    out["inflight"] = {"seq": inflight.get("seq")} if isinstance(inflight, dict) else None
    out["generation"] = 0
    return out


def projected(seen: Seen) -> Seen:
    drafts = {k: projected_draft(r) for k, r in seen.drafts.items()}
    world = seen.world
    tabs = {k: dataclasses.replace(t, generation=0) for k, t in world.tabs.items()}
    views = {k: DraftView.from_record(k, r) for k, r in drafts.items()}
    return Seen(World(world.docs, views, tabs), drafts)


class OwnDraftsOnly:
    """A tab that restored a draft on load (``loading -restored-> dirty``) had a draft of its
    own writer before the step: what it restored was its own, not a sibling's."""

    def __init__(self) -> None:
        self.keys: set[str] = set()
        self.seen: dict[str, tuple[str, int]] = {}

    def judge(self, world: World) -> list[Violation]:
        out, before_keys, before = [], self.keys, self.seen
        self.keys = set(world.drafts)
        self.seen = {slot: (t.writer_id, len(t.transitions)) for slot, t in world.tabs.items()}
        for slot, t in world.tabs.items():
            prev = before.get(slot)
            start = prev[1] if prev is not None and prev[0] == t.writer_id else 0
            if start > len(t.transitions):
                start = 0
            if ("loading", "restored", "dirty") not in t.transitions[start:]:
                continue
            own = f"knownstate:{t.kind}-draft:{t.user}:{t.doc_id}:{t.writer_id}"
            if own not in before_keys:
                out.append(
                    Violation(
                        "sibling-draft-offered-not-applied",
                        f"tab {slot} (writer {t.writer_id}) restored a draft on load, but it "
                        "had none of its own: another writer's draft was applied",
                    )
                )
        return out


class BrowserDocumentSessionCheck(DocumentSessionCheck):
    """The document-session check with its tabs in Chromium."""

    kind = KIND
    plant_name = KIND
    plant_class = BrowserPlant
    own_invariants = {**DocumentSessionCheck.own_invariants, **OWN_INVARIANTS}
    server_blocks = False  # the server's races are the Python check's; this one is the client's
    required_events = (
        *(r for r in DocumentSessionCheck.required_events if r not in SERVER_BLOCKS),
        "request failed offline in the browser",
        "tab closed mid-save",
        "two tabs of one user raced",
        "page reloaded",
        "document server restarted",
    )
    client_bundle: ClassVar[str | None] = None
    """``--client-bundle``: the bundle under test (default: the reference client of web/)."""
    client_mutant: ClassVar[str | None] = None
    """A mutant of the TypeScript catalogue (served from the mutants bundle)."""

    # -- the parts -------------------------------------------------------------------------------
    @classmethod
    def bundle(cls) -> bytes:
        if cls.client_bundle:
            return browser.read_bundle(Path(cls.client_bundle), "--client-bundle")
        path = browser.reference_bundle(mutants=cls.client_mutant is not None)
        return browser.read_bundle(path, "the reference client bundle")

    def reset_example(self) -> None:
        super().reset_example()
        plant: BrowserPlant = self.plant
        changed = plant.chromium.use_bundle(self.bundle())
        for slot in SLOTS:
            plant.gateway.cut(slot)
        plant.chromium.reset(reload=changed)
        self.drafts = browser.BrowserDrafts(plant.chromium)
        plant.driver.on_offline = lambda: self.event("request failed offline in the browser")
        self.budget.update(BROWSER_BUDGET)
        self.own_drafts = OwnDraftsOnly()
        self.raced: set[tuple[str, int]] = set()

    def real_side(self) -> BrowserRealSide:
        return BrowserRealSide(self)

    def model_side(self, model, deliver) -> BrowserModelSide:
        return BrowserModelSide(self, model, deliver)

    def observe_drafts(self) -> dict[str, dict]:
        return {k: projected_draft(r) for k, r in self.drafts.records().items()}

    # What is compared: the seed's observable session, not the client's bookkeeping. A draft is
    # compared by the slot it is in, whose work it holds and on which base (and whether it holds
    # a save in flight, by its seq); a tab by its view less its edit generation. The reference
    # client keeps the rest exactly as the model does; a client of your own need not.
    def observe_model(self, m) -> Seen:
        return projected(super().observe_model(m))

    def observe_impl(self) -> Seen:
        return projected(super().observe_impl())

    def on_the_wire(self, r: Any) -> Any:
        """A request as it crosses the wire (what the gateway can read of the browser's)."""
        if isinstance(r, SaveRequest):
            return ("PUT", r.doc_id, r.user, r.writer_id, r.seq, r.base_version, r.content)
        if isinstance(r, ReadRequest):
            return ("GET", r.doc_id, r.user)
        if isinstance(r, CopyRequest):
            return ("POST", r.copy_of, r.user, r.writer_id, r.seq, r.content)
        return r

    def judge(self, real: Seen, m, exchanges: list[Exchange]) -> list:
        out = super().judge(real, m, exchanges)
        out += self.own_drafts.judge(real.world)
        self.stats.invariants_checked += len(OWN_INVARIANTS)
        self._count_races(real.world, exchanges)
        return out

    def _count_races(self, world: World, exchanges: list[Exchange]) -> None:
        """A save of one of alice's tabs refused because her other tab saved since its base."""
        doc = world.docs.get(DOC)
        if doc is None:
            return
        for slot, req, answer in exchanges:
            if slot not in ("a1", "a2") or not isinstance(answer, VersionConflict):
                continue
            other = "a2" if slot == "a1" else "a1"
            if (
                any(
                    h.writer_id
                    and h.writer_id.startswith(f"{other}-")
                    and h.version > req.base_version
                    for h in doc.history
                )
                and (slot, req.seq) not in self.raced
            ):
                self.raced.add((slot, req.seq))
                self.event("two tabs of one user raced")

    # -- faults of the browser -------------------------------------------------------------------
    @contextlib.contextmanager
    def _net(self, slot: str, net: str):
        """Offline is the browser's own offline mode (the user's browser, for this step); an
        answer lost is lost upstream of the gateway (a toxic on the tab's link)."""
        if net != "offline":
            with super()._net(slot, net) as tag:
                yield tag
            return
        user = SLOTS[slot]
        self.plant.chromium.set_offline(user, True)
        self.stats.faults["browser offline"] += 1
        try:
            yield " [browser offline]"
        finally:
            self.plant.chromium.set_offline(user, False)

    def _reopenable(self) -> list[str]:
        model = self.worlds[0].model
        return [
            slot
            for slot in self._slots(State.CLEAN)
            if slot in model.tabs and model.tabs[slot].next_seq > 1
        ]

    @precondition(lambda self: self._slots(*self.EDITABLE) and self.budget["reload"])
    @rule(data=st.data())
    def reload_page(self, data) -> None:
        """The user reloads the page: the tab's memory is gone, and the same tab opens the
        document again as the same writer (a page keeps its writer id in sessionStorage), which
        restores its draft."""
        slot = self._pick(data, self._slots(*self.EDITABLE))
        self.budget["reload"] -= 1
        user, writer = SLOTS[slot], self.sessions[slot].writer_id

        def script(side):
            t = side.reload(slot, user, writer)
            req = t.begin_read("load")
            return t.finish_read(req, side.send(slot, req))

        self._run(f"reload the page of {slot} (writer {writer})", script)

    # -- situations reached on purpose -----------------------------------------------------------
    # A seed's length is set by its rarest requirement. These rules reach the rare ones in one
    # step each (a budget per example), the way the outbox reaches a batch of mixed attempts.
    RACE_READY = (State.CLEAN, State.DIRTY, State.OFFLINE)

    def _alice_both_open(self) -> bool:
        return all(self._state(slot) in self.RACE_READY for slot in ("a1", "a2"))

    @precondition(lambda self: self._alice_both_open() and self.budget["race"])
    @rule(first=st.sampled_from(["a1", "a2"]))
    def alice_tabs_race(self, first: str) -> None:
        """alice types in both her tabs (a clean one gets an edit; one with unsaved work keeps
        it), and their debounce falls due in the same moment: one saves, then the other, whose
        base its sibling tab has just replaced (a conflict with herself). Reached on purpose:
        the single-tab saves reach it only when the draw leaves both tabs dirty and saves them
        back to back."""
        second = "a2" if first == "a1" else "a1"
        self.budget["race"] -= 1
        now = self.clock
        patches = {
            slot: self._patch(slot, "title")
            for slot in (first, second)
            if self._state(slot) is State.CLEAN
        }
        self.clock += DEBOUNCE
        later = self.clock

        def script(side):
            for slot, patch in patches.items():
                side.tab(slot).edit(patch, now)
            return side.tab(first).tick(later), side.tab(second).tick(later)

        typed = "".join(f"edit {slot} {fmt_patch(p)}, " for slot, p in patches.items())
        self._run(f"{typed}{first}, then {second}, save as their debounce falls due", script)

    def _sibling_scenes(self) -> list[tuple[str, str]]:
        """(a tab of alice's that is free or clean, her other tab, open)."""
        if not self.budget["sibling"]:
            return []
        return [
            (free, other)
            for free, other in (("a1", "a2"), ("a2", "a1"))
            if self._state(free) in (None, State.CLOSED, State.CLEAN)
            and self._state(other) in self.EDITABLE
        ]

    @precondition(lambda self: self._sibling_scenes())
    @rule(
        data=st.data(),
        leaves=st.sampled_from(SIBLING_LEAVES),
        adopt=st.sampled_from([True, True, False]),
    )
    def sibling_offered(self, data, leaves: str, adopt: bool) -> None:
        """alice's tab with unsaved work (a clean one gets an edit) leaves its draft: it stays
        open, or it is killed, possibly mid-save (its draft then holds the unanswered save).
        A new tab of hers (where her other tab was, closed first if it was open) opens as a
        fresh writer: the draft is offered, never applied; she adopts it (a clean tab can) or
        discards it. Reached on purpose: it takes a tab with work, a free slot beside it, a
        fresh open and the choice, in that order. Each is a step of its own, compared and
        judged before the next (``_judged``): what the leaving tab left, and what the new tab
        did on load, are seen before the user's choice can cover them."""
        free, other = data.draw(st.sampled_from(self._sibling_scenes()), label="tabs")
        self.budget["sibling"] -= 1
        now = self.clock
        patch = self._patch(other, "title") if self._state(other) is State.CLEAN else None
        if self._state(other) is State.CONFLICT:
            leaves = leaves.split(" mid-save")[0]
        close_first = self._state(free) is State.CLEAN
        self.writer_n[free] += 1
        writer, theirs = f"{free}-{self.writer_n[free]}", self.sessions[other].writer_id

        def leave(side):
            if close_first:
                side.tab(free).close()
            if patch is not None:
                side.tab(other).edit(patch, now)
            if leaves.startswith("is killed"):
                if "mid-save" in leaves:
                    req = side.tab(other).begin_save(now)
                    if leaves.endswith("after the request"):
                        side.send(other, req)
                side.crash(other)

        def load(side):
            t = side.open(free, "alice", writer)
            req = t.begin_read("load")
            return t.finish_read(req, side.send(free, req))

        steps = [f"close {free}"] if close_first else []
        steps += [f"edit {other} {fmt_patch(patch)}"] if patch is not None else []
        steps += [] if leaves == "stays open" else [f"{other} {leaves}"]
        if steps:
            self._judged(", ".join(steps), leave)
        self._judged(f"{free} opens (alice, writer {writer}) beside {other}'s draft", load)
        t = self.sessions.get(free)
        offered = [d["writerId"] for d in t.siblings] if t is not None else []
        if not offered:
            return
        chosen = theirs if theirs in offered else min(offered)
        if adopt and t.state is State.CLEAN:
            self._run(
                f"{free} adopts the sibling draft of {chosen}", lambda s: s.tab(free).adopt(chosen)
            )
        else:
            self._run(
                f"{free} discards the sibling draft of {chosen}",
                lambda s: s.tab(free).discard_sibling(chosen),
            )

    def _calm_slots(self, budget: str, *states: State) -> list[str]:
        """Tabs in ``states`` whose way to the server works (no fault on their link nor on the
        server's database link), while the ``budget`` lasts."""
        if not self.budget[budget] or not self._server_calm():
            return []
        return [
            slot
            for slot in self._slots(*states)
            if not self.links[slot].toxics and self.links[slot].enabled
        ]

    def _leave(self, slot: str, how: str, side) -> Any:
        """The user's way out of a conflict or of unsaved work (``LEAVE_CONFLICT``,
        ``LEAVE_OFFLINE``)."""
        t = side.tab(slot)
        if how == "close, offline":
            with side.offline(slot):
                return t.close()
        if how == "keep a copy, offline":
            with side.offline(slot):
                req = t.begin_copy()
                return t.finish_copy(req, side.send(slot, req))
        if how == "keep a copy":
            req = t.begin_copy()
            return t.finish_copy(req, side.send(slot, req))
        if how.startswith("rebase"):
            return t.rebase(prefer_local if how.endswith("local value") else prefer_stored)
        if how.startswith("close"):
            return t.close()
        if how == "discard":
            return t.discard()
        req = t.begin_read("replace")
        return t.finish_read(req, side.send(slot, req))

    def _conflict_slots(self) -> list[str]:
        """Tabs in conflict, and (while the budget lasts) calm tabs with unsaved work that the
        server-side writer can put in conflict."""
        calm = self._calm_slots("conflict", State.DIRTY)
        return [slot for slot in SLOTS if self._state(slot) is State.CONFLICT or slot in calm]

    @precondition(lambda self: self._conflict_slots())
    @rule(
        data=st.data(),
        how=st.sampled_from(LEAVE_CONFLICT),
        attr=st.sampled_from(["title", "qty"]),
        net=st.sampled_from(("ok", "ok", "offline", "answer lost")),
    )
    def conflict_resolved(self, data, how: str, attr: str, net: str) -> None:
        """The user leaves a conflict: discards it, discards and reloads, closes the tab (its
        work parked in the draft), rebases, or keeps the local copy as a new document (offline,
        the copy fails). A tab with unsaved work on a calm link is first put in conflict (the
        server-side writer writes, then the tab saves: a step of its own; a budget per example)
        and left with the network working; a tab already in conflict is left under the step's
        network fate (``net``: offline, or the answer lost, for a way that sends). Reached on
        purpose: a conflict has seven ways out, and a tab's link is often still down when the
        draw picks one. (One rule for every way out: the browser's own faults take a share of
        the steps the Python check's ``resolve`` and ``keep_copy`` would have.)"""
        slot = self._pick(data, self._conflict_slots())
        make = self._state(slot) is State.DIRTY
        if make:
            self.budget["conflict"] -= 1
            self.edits += 1
            k = self.edits
            patch = {attr: {"title": f"ai.{k}", "qty": 1000 + k}[attr]}
            self.clock += DEBOUNCE
        later = self.clock
        sends = how in ("discard and reload", "close", "keep a copy")
        fate = (slot, net) if sends and not make else None

        def conflict(side):
            side.server_write(patch)
            return side.tab(slot).tick(later)

        made = f"server-side write {fmt_patch(patch)}, then {slot} saves" if make else ""
        if made and not self._step_before(made, conflict, slot, State.CONFLICT):
            return
        self._run(f"{how} {slot}", lambda side: self._leave(slot, how, side), fate)

    def _step_before(self, label: str, script, slot: str, state: State) -> bool:
        """A rule's first step, which brings ``slot`` to ``state`` for the user to act on: it is
        compared and judged as a step of its own (what the tab does on its way there is seen
        before the user's next action can cover it). True when ``slot`` got there."""
        self._judged(label, script)
        return self._state(slot) is state

    def _judged(self, label: str, script) -> None:
        """A step the rule's next one must not cover: run, compared and judged on its own."""
        self._run(label, script)
        self.model_agrees()

    # Listed twice (drawn twice as often while enabled; the budget still caps it): a tab is
    # calm and holds work for only part of an example, and a conflict has seven ways out.
    conflict_resolved_more = conflict_resolved

    @precondition(lambda self: self._calm_slots("work", *self.PENDING))
    @rule(data=st.data(), how=st.sampled_from(LEAVE_OFFLINE), offline_first=st.booleans())
    def work_left(self, data, how: str, offline_first: bool) -> None:
        """The user leaves unsaved work: discards it, discards and reloads, or closes the tab
        (the close flushes). With ``offline_first`` the tab first saves while the browser is
        offline (a step of its own: the save fails in the browser, the work waits to retry) and
        the close happens still offline (its work parked in its draft). Reached on purpose: a
        tab with work saves at its next tick, and its link is often down when the draw picks a
        way out."""
        slot = self._pick(data, self._calm_slots("work", *self.PENDING))
        self.budget["work"] -= 1
        now, way = self.clock, how if offline_first else how.split(",")[0]

        def save_offline(side):
            t = side.tab(slot)
            with side.offline(slot):
                req = t.begin_save(now)
                return t.finish_save(req, side.send(slot, req))

        if offline_first and not self._step_before(
            f"{slot} saves offline", save_offline, slot, State.OFFLINE
        ):
            return
        self._run(f"{way} {slot}", lambda side: self._leave(slot, way, side))

    # Listed twice, like the Python check's busiest rules (the budget still caps each).
    work_left_more = work_left
    sibling_offered_more = sibling_offered

    @precondition(
        lambda self: self._slots(*self.PENDING) and self._server_calm() and self.budget["restart"]
    )
    @rule(data=st.data())
    def restart_server(self, data) -> None:
        """The document server restarts while a tab's save is on its way: the save never gets
        an answer; the tab waits to retry it, unchanged, against the server back up."""
        slot = self._pick(data, self._slots(*self.PENDING))
        self.budget["restart"] -= 1
        now = self.clock

        def script(side):
            t = side.tab(slot)
            req = t.begin_save(now)
            side.restart_server()
            return t.finish_save(req, side.send(slot, req))

        self._run(f"save {slot} while the document server restarts", script)


CHECK = BrowserDocumentSessionCheck

# The catalogue, this kind's MUTANTS (web/src/mutants.ts); it needs nothing from here.
from ..browser_mutants import MUTANTS  # noqa: E402, F401
