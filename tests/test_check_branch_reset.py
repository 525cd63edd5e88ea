"""The branch reset's stateful check, as the suite runs it: the reference passes, seeded bugs are
caught with short counterexamples, the application-clock skew is shown on both sides of its
bound (past it, labelled as the known deviation), and a seed replays the same run."""

from __future__ import annotations

import pytest

from knownstate.chaos.check import run_check
from knownstate.chaos.kinds.branch_reset import BOUND, LEASE, MARGIN, MUTANTS, BranchResetCheck
from knownstate.model.branch_reset import skew_bound

pytestmark = pytest.mark.slow

MUTANT_INVARIANT = {m.name: m.invariant for m in MUTANTS}

MUTANT = {m.name: m for m in MUTANTS}
DEVIATION = "reaped live run under skew past bound (known deviation)"


@pytest.fixture(scope="session")
def reference_run(knownstate_env):
    """One small run of the reference, every example's trace kept."""
    traces: list[list[str]] = []
    result = run_check(
        BranchResetCheck, knownstate_env, seed=3, traces=traces
    )  # the gate's CI profile
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
    assert traces[0] and traces[0] == traces[1]
