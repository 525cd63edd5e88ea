"""The branch reset's stateful check, as the suite runs it: the reference passes, seeded bugs are
caught with short counterexamples, the application-clock skew is shown on both sides of its
bound (past it, labelled as the known deviation), and a seed replays the same run."""

from __future__ import annotations

import pytest

from knownstate.chaos.check import run_check
from knownstate.chaos.kinds.branch_reset import MUTANTS, BranchResetCheck
from knownstate.chaos.kinds.branch_reset_clocks import BOUND, LEASE, MARGIN
from knownstate.model.branch_reset import BranchResetModel, skew_bound
from knownstate.model.contract import Won
from profiles import ONCE
from replays import assert_same_traces

pytestmark = pytest.mark.slow

MUTANT_INVARIANT = {m.name: m.invariant for m in MUTANTS}

MUTANT = {m.name: m for m in MUTANTS}
DEVIATION = "reaped live run under skew past bound (known deviation)"


@pytest.fixture(scope="session")
def reference_run(knownstate_env):
    """One small run of the reference, every example's trace kept: every requirement observed
    once (126 examples at seed 3; the CI profile's three times each took 143), each event the
    tests below count being one of them."""
    traces: list[list[str]] = []
    result = run_check(BranchResetCheck, knownstate_env, seed=3, profile=ONCE, traces=traces)
    return result, traces


def test_reference_passes_and_observes_work_and_faults(reference_run):
    r, _ = reference_run
    assert r.passed, "\n".join([r.failure or "", *r.vacuous, *r.counterexample])
    assert r.stats.invariants_checked > 0
    assert r.stats.events["poll of an operation in flight"] > 0 and r.stats.events["lost race"] > 0
    assert r.stats.faults["app-clock-skew"] > 0 and r.stats.events["worker died before commit"] > 0


def test_skew_past_the_bound_is_observed_and_labelled(reference_run):
    """Past L - M a reaper ahead of the last poller reaps a live run: allowed (the lease is in
    application time, the recorded deviation), counted, and labelled in the trace; within the
    bound a reaper ahead spares it. A live run reaped below the bound would fail the check."""
    r, traces = reference_run
    assert BOUND == skew_bound(LEASE, MARGIN) == LEASE - MARGIN
    assert r.stats.events["skew within bound"] > 0
    assert r.stats.events["skew past bound (known deviation)"] > 0
    assert r.stats.events[DEVIATION] > 0
    labelled = [
        line
        for t in traces
        for line in t
        if "known deviation of an application-clock lease" in line
    ]
    assert labelled and all(f">= L - M = {BOUND}s" in line for line in labelled)


@pytest.mark.parametrize(
    "name", ["one-in-flight-missing", "reaper-ignores-lease", "start-retry-fresh-key"]
)
def test_mutant_is_caught_with_a_short_counterexample(knownstate_env, name):
    r = run_check(
        MUTANT[name].machine(BranchResetCheck),
        knownstate_env,
        seed=2,
        require_all=False,
        shrinks=300,
    )
    assert r.failure is not None, f"mutant {name} was not caught"
    assert MUTANT_INVARIANT[name] in r.invariants, r.failure
    assert r.counterexample_steps <= 15, "\n".join(r.counterexample)


def test_a_seed_replays_the_same_run(knownstate_env):
    traces: list[list[list[str]]] = [[], []]
    for kept in traces:
        run_check(
            BranchResetCheck,
            knownstate_env,
            examples=6,
            steps=30,
            seed=11,
            require_all=False,
            traces=kept,
        )
    assert_same_traces(*traces)


def test_a_poll_refused_in_a_block_is_judged_by_the_stamp_it_met_not_the_one_before_the_block():
    """Seed 1 once failed correct code this way: w1 (clock +300 s) started b#1; in a block w0
    (clock on time) polled it first, re-stamping the lease 300 s earlier, then w1's poll found it
    lapsed. Against w0's stamp, the one w1 met, w1's clock is past the bound: the known deviation.
    Against w1's own stamp from before the block it looked like a refusal by an equal clock."""
    check = object.__new__(BranchResetCheck)  # the judgment alone: no database needed
    check.lease, check.margin = LEASE, MARGIN
    failures: list[str] = []
    check.fail = lambda problem, violations: failures.append(violations[0].invariant)
    check.log = lambda line: None
    check.model = BranchResetModel(LEASE)
    check.model.skew("w1", BOUND + 60)
    check.model.request("b", "k")
    run_id = next(iter(check.model.runs))
    check.model.start(run_id, "w1")
    check.stamps = {run_id: (check.model.runs[run_id].lease_until, 0, BOUND + 60)}
    met = check.model.copy()
    assert met.poll(run_id, "w0") == Won("running")  # w0 re-stamped it, in the block
    drawn = check._live(run_id)
    assert drawn == (0, BOUND + 60)
    check.met = {"w1": (met,)}
    assert check._live_met("w1", run_id, drawn) == [(0, 0)]
    check._judge_skew(run_id, "w1", check._live_met("w1", run_id, drawn), "poll refused")
    assert failures == []
    check.met = {}  # in a step of its own, the stamp from before is the one it met
    check._judge_skew(run_id, "w1", check._live_met("w1", run_id, drawn), "poll refused")
    assert failures == ["skew-bound"]
