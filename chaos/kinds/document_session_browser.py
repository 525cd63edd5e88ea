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

The situations the check reaches on purpose (:mod:`.document_aimed`: a sibling draft offered
to a fresh tab, a conflict left each of its seven ways, unsaved work left after a save failed
offline) are the Python shell's too; this shell adds one of its own, with a budget per example
like theirs: alice's two tabs saving back to back (``alice_tabs_race``).
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
)

from .. import browser, browser_driver, browser_gateway
from ..replay import Exchange
from .document_blocks import SERVER_BLOCKS
from .document_requests import HOSTILE_EVENTS
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

BROWSER_BUDGET = {"reload": 1, "restart": 1, "race": 1}
"""Steps per example for the browser's own faults and its own situation reached on purpose (they
share the example with the session's work, like the check's BUDGET)."""


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
    required_events = (  # and so are the server's refusals, case by case
        *(
            r
            for r in DocumentSessionCheck.required_events
            if r not in SERVER_BLOCKS and r not in HOSTILE_EVENTS
        ),
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

    # -- a situation reached on purpose (the others are the check's: document_aimed) ----------
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
