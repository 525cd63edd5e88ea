"""Shrinking a failure by a count of replays, whatever the machine's load.

Hypothesis shrinks until 500 successful shrinks or five minutes: here a budget of replays
(``--shrinks``) bounds it instead, our own pass deletes whole steps before Hypothesis's passes
lower the values they draw, and shrinking stops after a count of replays that deleted no step.
The same seed gives the same counterexample on any machine. :class:`Shrinking` is what the
report says of it: when the first failure came, how many replays, how many steps before and after.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .runner import RunState


@dataclass
class Shrinking:
    """How a run's failure was found and shrunk: reported, never part of a verdict."""

    first_failure: float | None = None
    """Seconds from the run's start to its first failing example."""
    broke: frozenset[str] | None = None
    """The invariants the first failing example broke."""
    started: float | None = None
    replays: int = 0
    """Examples replayed while shrinking (the budget ``--shrinks`` counts these)."""
    steps: tuple[int, int] = (0, 0)
    """Steps of the first failing example, and of the shrunk one."""
    seconds: float = 0.0

    def another_bug(self, names: tuple[str, ...]) -> bool:
        """A failure that breaks none of the invariants the first one broke: another bug, not a
        shorter counterexample of the first (shrinking would slip to it, its examples being
        smaller)."""
        return bool(self.broke) and not self.broke & set(names)

    def as_dict(self) -> dict:
        return {
            "first_failure_seconds": round(self.first_failure or 0.0, 3),
            "replays": self.replays,
            "steps_before": self.steps[0],
            "steps_after": self.steps[1],
            "seconds": round(self.seconds, 3),
        }


SHRINKS = 1000
"""Replays at most to shrink a failure (``--shrinks``): a count, so the same seed gives the same
counterexample on any machine, whatever its load. (At 500, 4 of the outbox catalogue's 70 runs
at seeds 836747..836751 stopped above 15 steps; a larger budget only goes on from where a
smaller one stopped.)"""


def step_pass(shrinker, pairs: bool = True):
    """Our own shrink pass, first of all: delete whole steps (an operation, a fault, a
    block) until none goes, one at a time (last first); when no single one goes, a run of three
    or more in a row (the longest first), then two at once (the later one last first), each
    deletion one replay. It runs once for each new target
    in each of Hypothesis's rounds: after its passes lower a step's values (an earlier rule, a
    smaller id), a step that was needed often no longer is. Hypothesis's passes delete a few
    choices at a time, so a step that draws many (a block, a fault with its parameters) took
    them many replays to remove, or none did.

    Two at once: a later step draws its row as a place in a list of the rows it can act on now,
    so deleting one earlier step (a block that moved a run) may make a later one draw another
    row and the race never happen, while deleting it with the step that then moves the other
    row keeps every later draw where it was (a step up and a step down between two ticks that
    must both see 0: ``tests/test_shrinking.py``). A run of three or more steps in a row: a
    detour the failure does not need (a block and the stall that freed its run, which another
    path reaches too) goes only whole. The outbox's ``never-dead`` at seed 4 stopped at 15 rule
    steps with singles and pairs, and goes to 7 with runs (eight in a row went), in the same
    time. Runs go before pairs: a long run that goes leaves the pairs' n² fewer replays
    (approved-plan's ``failed-step-continues`` at seed 1 went from 13 rule steps to 3 at replay
    156, not 216). The catalogues at seeds 1-2, runs first against pairs first: approved-plan
    149 counterexample lines against 154 and 6,377 replays against 6,670; the outbox (153
    lines), branch-reset (85) and document-session (77) the same lines, 6,094 replays against
    6,158, 3,738 against 3,737, 6,899 against 6,929. Runs tried in vain are not counted in the
    stall (:data:`STEP_STALL`): counted, they took the replays in which Hypothesis's passes had
    found shorter (``unconditional-complete`` at seed 2 stopped at 12 rule steps, not 5), so
    where no run goes shrinking mostly takes its old course, a few replays longer (Hypothesis's
    own stop, 200 replays without any shrink, counts them). Bounded by the replay budget.
    ``pairs=False``: single steps only (the pass run once before Hypothesis's coarse
    reduction)."""
    from hypothesis.internal.conjecture.shrinker import ShrinkPass

    def without(*spans) -> bool:
        nodes, kept, start = shrinker.nodes, [], 0
        for span in sorted(spans, key=lambda s: s.start):
            kept += nodes[start : span.start]
            start = span.end
        return shrinker.consider_new_nodes(kept + list(nodes[start:]))

    def one() -> bool:
        steps = _step_spans(shrinker.shrink_target)
        return any(without(steps[i]) for i in reversed(range(len(steps))))

    def two() -> bool:
        steps = _step_spans(shrinker.shrink_target)
        return any(
            without(steps[i], steps[j])
            for j in reversed(range(len(steps)))
            for i in reversed(range(j))
        )

    def runs() -> bool:
        steps = _step_spans(shrinker.shrink_target)
        n = len(steps)
        shrinker.knownstate_runs_from = start = shrinker.calls
        try:
            found = any(
                without(*steps[i : i + k])
                for k in range(n - 1, 2, -1)
                for i in reversed(range(n - k + 1))
            )
        finally:
            shrinker.knownstate_runs_from = None
        if not found:  # replays that shrinking's stall does not count (_stop_when_no_step_goes)
            shrinker.knownstate_excused = _excused(shrinker) + shrinker.calls - start
        return found

    def delete_steps(chooser) -> None:
        while one() or (pairs and (runs() or two())):
            pass

    return ShrinkPass(delete_steps)


STEP_STALL = 200
"""Replays Hypothesis's passes may go on without deleting a step before shrinking stops, at most:
its later passes lower the values a step draws (a smaller id, an earlier rule), which reads a
little simpler, at hundreds of replays on real parts. At 100, 4 of 20 catalogue runs stopped one
to four steps longer than before; at 200, 2 stopped one step longer, with about half the
replays. A budget over 1,000 (``--shrinks``) raises it to a fifth of the budget
(:func:`step_stall`): pgqueuer's stale finish at seed 5 stops at 12 steps at 200, and reaches 5
at 400 (805 replays); the default budget keeps 200."""

STALL_PER_STEP, STALL_FLOOR = 35, 50
"""A shorter example stalls sooner: ``STALL_PER_STEP`` replays per rule step it has left, at
least ``STALL_FLOOR``, at most the stall above (:func:`stall_at`). A short one has fewer values
for Hypothesis's passes to lower before the one that frees a step. The four catalogues at seeds
1-2 (118 runs): 19,848 replays against 23,108, and 465 counterexample lines against 464 (the
approved plan's ``repeat-reexecutes`` at seed 1 stopped at its 4 rule steps as before, one of
them a line longer: a value not lowered); the approved plan 4,851 replays against 6,377, the
document session 5,868 against 6,899, the outbox 5,703 against 6,094, branch-reset 3,426 against
3,738.
Simulated on the recorded deletions first: at 28 per step two runs stop with more rule steps."""


def step_stall(replays: int) -> int:
    return max(STEP_STALL, replays // 5)


def stall_at(steps: int, stall: int) -> int:
    """The replays without a step deleted that stop an example of ``steps`` rule steps."""
    return min(stall, max(STALL_FLOOR, STALL_PER_STEP * steps))


def _step_spans(result) -> list:
    """The spans of a stateful example's steps (each a rule and what it drew)."""
    from hypothesis.stateful import STATE_MACHINE_RUN_LABEL

    return [s for s in result.spans if s.label == STATE_MACHINE_RUN_LABEL]


def _steps(result) -> int:
    return len(_step_spans(result))


def _excused(shrinker) -> int:
    """Replays the step pass spent on runs of steps and deleted none with, since the last step
    deleted (and so far in a pass of runs under way): not counted in the stall."""
    start = getattr(shrinker, "knownstate_runs_from", None)
    under_way = shrinker.calls - start if start is not None else 0
    return getattr(shrinker, "knownstate_excused", 0) + under_way


def _stop_when_no_step_goes(shrinker, stall: int = STEP_STALL) -> None:
    """Stop ``shrinker`` after ``stall`` replays that deleted no step, fewer for a short
    example (:func:`stall_at`): a count, so the same seed shrinks to the same counterexample on
    any machine."""
    from hypothesis.internal.conjecture.shrinker import StopShrinking

    best = [_steps(shrinker.shrink_target), shrinker.calls]
    update, check = shrinker.update_shrink_target, shrinker.check_calls

    def updated(new) -> None:
        update(new)
        if _steps(new) < best[0]:
            best[:] = [_steps(new), shrinker.calls]
            shrinker.knownstate_excused = 0

    def checked() -> None:
        check()
        if shrinker.calls - best[1] - _excused(shrinker) >= stall_at(best[0], stall):
            raise StopShrinking

    shrinker.update_shrink_target, shrinker.check_calls = updated, checked


@contextlib.contextmanager
def no_local_constants():
    """Hypothesis draws, one value in twenty, a constant found in the source of every *local*
    module imported so far, and an editable install makes knownstate's own modules local. So a
    seed ran other examples depending on which modules the process had imported: the outbox at
    seed 1 ran 202 examples under ``verify outbox`` and 431 under ``verify`` of every kind, and a
    replay command could not replay. A run draws from Hypothesis's fixed global constants only,
    whatever is imported and however knownstate is installed."""
    from hypothesis.internal.conjecture import providers

    original = providers._get_local_constants
    empty = providers.Constants()
    providers._get_local_constants = lambda: empty
    providers.CONSTANTS_CACHE.cache.clear()  # choices computed with the local ones
    try:
        yield
    finally:
        providers._get_local_constants = original
        providers.CONSTANTS_CACHE.cache.clear()


@contextlib.contextmanager
def shrink_budget(replays: int, run: RunState | None = None):
    """Bound shrinking by a count of replays (Hypothesis's own bounds are 500 successful shrinks
    and five minutes): deterministic, whatever the machine's load. Time never stops a shrink
    here. Past the budget the smallest failing example found so far is the counterexample.

    With ``run``, shrinking starts with our own pass (:func:`step_pass`), stops after
    :func:`step_stall` replays that deleted no step, and ``run.shrinking`` says how long it took
    and how many replays. (It keeps to the bug it was given through :meth:`RunState.failed`.)"""
    from hypothesis.internal.conjecture import engine

    runner = engine.ConjectureRunner
    original_test, original_shrink = runner.test_function, runner.shrink

    def counted(self, data):
        try:
            return original_test(self, data)
        finally:
            if self.finish_shrinking_deadline is not None:
                self._knownstate_replays = getattr(self, "_knownstate_replays", 0) + 1
                if run is not None:
                    k = run.shrinking
                    k.started = k.started or time.monotonic()
                    k.replays += 1
                    k.seconds = time.monotonic() - k.started
                if self._knownstate_replays >= replays:
                    self.exit_with(engine.ExitReason.max_shrinks)

    def shrink(self, initial, predicate=None, allow_transition=None):
        s = self.new_shrinker(initial, predicate, allow_transition)
        s.shrink_passes.insert(0, step_pass(s))
        # single steps deleted before anything of Hypothesis's: its coarse reduction (lowering
        # each small number that may choose a branch: every rule, row and fault drawn) took the
        # whole idle stop on a long failure before one step was deleted (outbox,
        # complete-reads-attempt-first at seed 2, rows drawn by name: 35 steps; so: 5). Pairs
        # wait for the passes: tried first, their n² replays took the idle stop instead
        # (approved-plan, count-before-lock-wait at seed 2: 23 steps; so: 8)
        coarse = s.initial_coarse_reduction

        def singles_then_coarse() -> None:
            step_pass(s, pairs=False).function(None)
            coarse()

        s.initial_coarse_reduction = singles_then_coarse
        _stop_when_no_step_goes(s, step_stall(replays))
        try:
            s.shrink()
        finally:  # also when the budget ends it (the engine's exit raises through the shrinker)
            run.shrinking.steps = (_steps(initial), _steps(s.shrink_target))
        return s.shrink_target

    old = engine.MAX_SHRINKING_SECONDS
    runner.test_function, engine.MAX_SHRINKING_SECONDS = counted, 10**9
    if run is not None:
        runner.shrink = shrink
    try:
        yield
    finally:
        runner.test_function, runner.shrink = original_test, original_shrink
        engine.MAX_SHRINKING_SECONDS = old
