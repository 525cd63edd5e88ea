"""Shrinking a failure (``shrink.shrink_budget``): it keeps to the invariant the first failure
broke, deletes whole steps, stops by counts, and says what it did. Pure Python: a small state
machine stands in for a check (shrinking itself touches no real part). Fast."""

from __future__ import annotations

from hypothesis import HealthCheck, Phase, Verbosity, settings
from hypothesis import seed as hyp_seed
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, get_state_machine_test, invariant, rule

from knownstate.chaos import runner, shrink
from knownstate.chaos.steps import Failure


def new_run(target: str | None = None) -> runner.RunState:
    return runner.RunState(runner.PROFILES["ci"], (), frozenset(), target=target)


def machine(run: runner.RunState):
    class Toy(RuleBasedStateMachine):
        """Two bumps of ``a`` after noise break "alpha" when some noise drew a value other than
        0, "beta" when all of it drew 0s: a second bug, whose examples are smaller (random
        examples seldom draw only 0s, so "alpha" is found first; shrinking lowers values towards
        0). Noise steps draw many values; all but one matter to neither."""

        def __init__(self) -> None:
            super().__init__()
            self.a = self.noise = 0
            self.loud = False

        @rule(junk=st.lists(st.integers(0, 10**6), min_size=8, max_size=12))
        def a_noise(self, junk) -> None:
            self.noise += 1
            self.loud = self.loud or any(junk)

        @rule()
        def bump(self) -> None:
            self.a += 1

        @invariant()
        def judged(self) -> None:
            if self.a >= 2 and self.noise:
                name = "alpha" if self.loud else "beta"
                run.failed(name, (name,), [])  # the check's door (Engine.fail ends here)

    return Toy


SEED = 1
"""A seed whose first failure is "alpha" (random examples find either first)."""


def two_bugs(run: runner.RunState):
    class Two(RuleBasedStateMachine):
        """Two bumps of ``a`` break "alpha", three of ``b`` "beta": random examples meet both,
        "alpha" (shorter) first more often."""

        def __init__(self) -> None:
            super().__init__()
            self.a = self.b = 0

        @rule()
        def bump_a(self) -> None:
            self.a += 1

        @rule()
        def bump_b(self) -> None:
            self.b += 1

        @invariant()
        def judged(self) -> None:
            if self.a >= 2 or self.b >= 3:
                name = "alpha" if self.a >= 2 else "beta"
                run.failed(name, (name,), [])

    return Two


def shrunk(
    replays: int = 1000, seed: int = SEED, target: str | None = None, toy=machine
) -> tuple[runner.RunState, str]:
    run = new_run(target)
    test = get_state_machine_test(
        hyp_seed(seed)(toy(run)),
        settings=settings(
            max_examples=200,
            stateful_step_count=30,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
            verbosity=Verbosity.quiet,
            report_multiple_bugs=False,
            phases=(Phase.generate, Phase.shrink),
        ),
    )
    # as a check runs: drawing no constants from the modules imported so far (which differ with
    # the tests run before this one)
    with shrink.no_local_constants(), shrink.shrink_budget(replays, run):
        try:
            test()
        except Failure as e:
            return run, str(e)
    raise AssertionError("the toy machine never failed")


def test_shrinking_keeps_to_the_invariant_the_first_failure_broke():
    """Hypothesis alone shrinks to two bumps, which break "beta": another failure, not a shorter
    counterexample of this one. Kept to "alpha", the shortest is one noise and two bumps."""
    run, message = shrunk()
    assert run.failures[0][1] == ("alpha",)
    assert message == "alpha"
    assert run.shrinking.steps[1] == 3


def test_a_target_invariant_is_looked_for_and_shrunk_past_the_first_failure():
    """``--invariant beta``: "alpha", found first, is passed over (kept as the shortest other
    failure seen) and does not end the search; "beta" is found, and shrunk to its own shortest,
    three bumps of ``b``. Without a target the same seed reports "alpha", in two steps."""
    run, message = shrunk(toy=two_bugs)
    assert message == "alpha" and run.shrinking.steps[1] == 2
    run, message = shrunk(target="beta", toy=two_bugs)
    assert message == "beta"
    assert {names for _, names, _ in run.failures} == {("beta",)}
    assert run.passed_over is not None and run.passed_over[1] == ("alpha",)
    assert run.shrinking.steps[1] == 3
    again, _ = shrunk(target="beta", toy=two_bugs)  # the same seed, the same search and shrink
    assert again.shrinking.as_dict()["replays"] == run.shrinking.as_dict()["replays"]


def test_shrinking_deletes_steps_and_says_how_long_it_took():
    """Every seed shrinks to the three steps the failure needs; where the first failure had more
    (some seeds find it in exactly three), the report says how many it started from."""
    seen = []
    for seed in range(1, 6):
        run, _ = shrunk(seed=seed)
        k = run.shrinking.as_dict()
        assert k["steps_after"] == 3 and k["steps_before"] >= 3
        assert 0 < k["replays"] <= 1000
        assert k["first_failure_seconds"] >= 0 and k["seconds"] >= 0
        seen.append(k["steps_before"])
    assert max(seen) > 3, seen


def test_shrinking_stops_at_its_count_of_replays():
    run, message = shrunk(replays=3)
    assert run.shrinking.replays == 3
    assert message == "alpha"  # past the budget, the smallest failure so far is the answer
    # and the report still says how many steps it started from and stopped at
    before, after = run.shrinking.steps
    assert before >= after >= 3, run.shrinking.steps


def _shrinker(steps, drawn: list[int]):
    """A shrinker of Hypothesis's own for ``steps`` (a test drawing stateful steps), started
    from the example that draws ``drawn``, one number a step, which must fail."""
    from random import Random

    from hypothesis.internal.conjecture.data import Status
    from hypothesis.internal.conjecture.engine import ConjectureRunner

    engine = ConjectureRunner(
        steps,
        settings=settings(database=None, suppress_health_check=list(HealthCheck)),
        random=Random(0),
    )
    initial = engine.cached_test_function([c for s in drawn for c in (True, s)] + [False])
    assert initial.status == Status.INTERESTING
    return engine.new_shrinker(initial, lambda d: d.status == Status.INTERESTING)


def _drawn_steps(data):
    """Each stateful step of ``data``: the number it draws (0 to 5), until one draws no step."""
    from hypothesis.stateful import STATE_MACHINE_RUN_LABEL

    while True:
        data.start_span(STATE_MACHINE_RUN_LABEL)
        if not data.draw_boolean():
            data.stop_span()
            return
        yield data.draw_integer(0, 5)
        data.stop_span()


TICK, MARK, UP, DOWN, DOWN2 = range(5)


def _ticks_at_level(data) -> None:
    """Fails ("alpha") at a second tick seen at level 0 once a mark was seen: UP raises the
    level by one, DOWN lowers it by one, DOWN2 by two."""
    level = ticks = marks = 0
    for step in _drawn_steps(data):
        level += (step == UP) - (step == DOWN) - 2 * (step == DOWN2)
        marks += step == MARK
        ticks += step == TICK and level == 0
        if ticks >= 2 and marks:
            data.mark_interesting(("alpha",))


def test_the_step_pass_deletes_two_steps_when_no_single_one_goes():
    """A step up and a step down between the two ticks a failure needs: deleting either alone
    moves the second tick off 0 (as deleting one block that moved a run makes a later step draw
    another row), deleting both keeps it there. The pass alone, none of Hypothesis's: one at a
    time it stopped at five steps."""
    shrinker = _shrinker(_ticks_at_level, [TICK, UP, MARK, UP, DOWN, TICK, DOWN, TICK])
    shrinker.fixate_shrink_passes([shrink.step_pass(shrinker)])
    assert shrinker.shrink_target.choices == (True, TICK, True, MARK, True, TICK)


def test_the_step_pass_deletes_a_run_of_steps_when_no_single_one_or_pair_goes():
    """Two steps up and one two down between the ticks: deleting any one or two of them moves
    the second tick off 0, deleting the three keeps it there (a detour the failure does not
    need, as a block with the stall that freed its run). With singles and pairs only, the pass
    stopped at six steps."""
    shrinker = _shrinker(_ticks_at_level, [TICK, MARK, UP, UP, DOWN2, TICK])
    shrinker.fixate_shrink_passes([shrink.step_pass(shrinker)])
    assert shrinker.shrink_target.choices == (True, TICK, True, MARK, True, TICK)


def test_runs_of_steps_tried_in_vain_do_not_count_towards_the_stall():
    """Six steps, each needed: the pass tries singles, runs and then pairs, deleting none
    (singles and pairs 15 replays, runs 6: Hypothesis knows some outcomes without one). A stall
    of 18 replays is past with all of them; the runs are not counted, so shrinking goes on to
    Hypothesis's passes as it did before runs were tried (the outbox's
    ``unconditional-complete`` at seed 2 stopped at 17 steps where it had reached 6)."""

    def every_number(data) -> None:
        seen = set()
        for step in _drawn_steps(data):
            seen.add(step)
            if seen == set(range(6)):
                data.mark_interesting(("alpha",))

    shrinker = _shrinker(every_number, list(range(6)))
    shrink._stop_when_no_step_goes(shrinker, stall=18)
    before = shrinker.calls
    shrinker.fixate_shrink_passes([shrink.step_pass(shrinker)])  # no StopShrinking
    assert shrinker.calls - before > 18 and shrink._excused(shrinker) > 0
    assert shrinker.calls - before - shrink._excused(shrinker) < 18


def test_a_budget_over_the_default_lets_shrinking_go_on_longer_without_deleting_a_step():
    """The default budget and smaller ones keep 200 replays; a larger one a fifth of itself
    (pgqueuer's stale finish at seed 5: 12 steps at 200, 5 at 400)."""
    assert shrink.step_stall(shrink.SHRINKS) == shrink.STEP_STALL == 200
    assert shrink.step_stall(100) == 200 and shrink.step_stall(2000) == 400


def test_a_short_example_stops_shrinking_after_fewer_replays_without_a_deletion():
    """35 replays per step left, at least 50, at most the stall: a two-step failure stops after
    70 replays that deleted nothing, an eleven-step one after the whole 200. (The helper's
    examples end with a step span that draws no step: one drawn number is two steps.)"""
    from hypothesis.internal.conjecture.shrinker import StopShrinking

    def fails(data) -> None:
        list(_drawn_steps(data))
        data.mark_interesting(("alpha",))

    for drawn, stops in (([], 50), ([1], 70), ([1] * 10, 200)):
        shrinker = _shrinker(fails, drawn)
        shrink._stop_when_no_step_goes(shrinker)
        start = shrinker.calls
        for n in range(1, 300):
            shrinker.engine.call_count = start + n
            try:
                shrinker.check_calls()
            except StopShrinking:
                break
        assert n == stops, (drawn, n)
    assert shrink.stall_at(6, 18) == 18  # never past the stall it is given


def test_the_step_pass_runs_before_hypothesis_lowers_anything(monkeypatch):
    """Hypothesis's shrinker starts by lowering each small number that may choose a branch
    (every rule and row drawn), a replay each, deleting no step: on a long failure it took the
    whole idle stop, and the 35 steps found were the counterexample. Our pass runs first, so
    with an idle stop of 5 replays every seed whose first failure had more than the three steps
    it needs still shrinks to them."""
    monkeypatch.setattr(shrink, "step_stall", lambda replays: 5)
    longer = 0
    for seed in range(1, 11):
        run, _ = shrunk(seed=seed)
        before, after = run.shrinking.steps
        if before > 3:
            assert after == 3, (seed, run.shrinking.steps)
            longer += 1
    assert longer >= 3


def test_a_shrink_stopped_by_an_error_says_so_and_not_that_a_replay_did_not_reproduce():
    """Shrinking that stops early reports the shortest failure seen, and why it stopped: a
    replay Hypothesis found inconsistent (Flaky), or an error raised while replaying (before,
    such an error was reported as a replay that did not reproduce, and a Flaky as nothing)."""
    from hypothesis.errors import FlakyFailure

    run = new_run()
    run.failures += [("alpha broke", ("alpha",), ["a", "b", "c"]), ("alpha", ("alpha",), ["a"])]
    message, names, trace = runner._failure_of(RuntimeError("no such pass"), run)
    assert (names, trace) == (("alpha",), ["a"])
    assert "RuntimeError" in message and "no such pass" in message
    assert "did not reproduce" not in message
    flaky = FlakyFailure("inconsistent", [Failure("alpha, otherwise", ("alpha",))])
    message, _, _ = runner._failure_of(flaky, run)
    assert message.startswith("alpha\n") and "did not reproduce exactly" in message


def test_an_example_that_ran_differently_before_any_failure_names_the_likely_causes():
    """Hypothesis's FlakyStrategyDefinition with no failure seen (a reaper reading its rows in
    the order they sit on disk did this, at seeds 1 and 3): the report says what it means and
    what to do, not only Hypothesis's words."""
    from hypothesis.errors import FlakyStrategyDefinition

    message, names, _ = runner._failure_of(FlakyStrategyDefinition("drew less"), new_run())
    assert names == () and "ran differently when run again" in message
    assert "ORDER BY" in message and "FlakyStrategyDefinition" in message
