"""The situations reached on purpose, as rules of the document-session check (a mixin of
:class:`~.document_session.DocumentSessionCheck`, and so of the browser kind's).

A seed's length is set by its rarest requirement. Drawn step by step, a sibling draft offered
to a fresh tab takes a tab with work, a free slot beside it, a fresh open and the user's
choice, in that order; a conflict has seven ways out, and a tab's link is often still down when
the draw picks one; a tab with work saves at its next tick. So each is one rule with a budget
per example (``BUDGET``), the way the outbox reaches a batch of mixed attempts:
``sibling_offered``, ``conflict_resolved`` and ``work_left``. Where such a rule first brings a
tab somewhere (a conflict made, a save failed offline, a draft left behind, a fresh tab loaded
beside it), that is a step of its own, compared and judged before the user's next action can
cover it (``_judged``).
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from knownstate.model.document import State, prefer_local, prefer_stored

from .document_plant import DEBOUNCE, SLOTS
from .document_world import fmt_patch

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


class AimedRules:
    """The rules that reach the rare situations on purpose (each capped by its budget)."""

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

    def _judged(self, label: str, script) -> None:
        """A step the rule's next one must not cover: run, compared and judged on its own."""
        self._run(label, script)
        self.model_agrees()

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
