"""The outbox's stateful check, as the suite runs it: the reference passes, seeded bugs are caught
with short counterexamples, and a seed replays the same run."""

from __future__ import annotations

import time

import pytest

from knownstate.chaos.check import QUANTUM, run_check
from knownstate.chaos.kinds.outbox import MUTANTS, OutboxCheck
from replays import assert_same_traces

pytestmark = pytest.mark.slow

MUTANT_INVARIANT = {m.name: m.invariant for m in MUTANTS}

MUTANT = {m.name: m for m in MUTANTS}


def test_reference_passes_and_observes_faults(knownstate_env):
    r = run_check(OutboxCheck, knownstate_env, examples=20, steps=40, seed=4, require_all=False)
    assert r.failure is None, "\n".join([r.failure or "", *r.counterexample])
    assert r.stats.invariants_checked > 0
    assert r.stats.faults and r.stats.events["indeterminate commit"] > 0


@pytest.mark.parametrize("name", ["claim-without-bump", "reaper-app-clock", "no-backoff"])
def test_mutant_is_caught_with_a_short_counterexample(knownstate_env, name):
    r = run_check(
        MUTANT[name].machine(OutboxCheck), knownstate_env, seed=4, require_all=False, shrinks=300
    )
    assert r.failure is not None, f"mutant {name} was not caught"
    assert MUTANT_INVARIANT[name] in r.invariants, r.failure
    assert r.counterexample_steps <= 15, "\n".join(r.counterexample)


def test_a_reaper_that_takes_back_a_terminal_run_breaks_the_terminal_state_too(knownstate_env):
    """The reaper's answer is its lease guarantee; a terminal run in it is the terminal state's
    as well, even when taking it back left its row as it was (a dead run that stays dead). At
    seed 5 that is the first failure of reaper-touches-terminal, which named lease alone."""
    r = run_check(
        MUTANT["reaper-touches-terminal"].machine(OutboxCheck),
        knownstate_env,
        seed=5,
        require_all=False,
        shrinks=0,
    )
    assert r.failure is not None and "reclaim_stale" in r.failure, r.failure
    assert {"lease", "terminal-answers-from-receipts"} <= set(r.invariants), r.failure


def test_a_seed_replays_the_same_run(knownstate_env):
    traces: list[list[list[str]]] = [[], []]
    for kept in traces:
        run_check(
            OutboxCheck,
            knownstate_env,
            examples=8,
            steps=30,
            seed=21,
            require_all=False,
            traces=kept,
        )
    assert_same_traces(*traces)


class _SlowBetweenSteps(OutboxCheck):
    """The outbox's check on a machine so loaded that, once, the time between two steps is
    longer than the clock tolerance (the checker and Hypothesis are what was slow: no step)."""

    def model_agrees(self) -> None:
        super().model_agrees()
        self.observed_steps = getattr(self, "observed_steps", 0) + 1
        if self.observed_steps == 1:
            time.sleep(QUANTUM / 2)  # load simulated between steps: not a wait for any state


def test_time_between_steps_never_ages_a_lease_nor_decides_a_verdict(knownstate_env):
    """The database's clock stands still between steps, so the same seed gives the same run
    however long the machine takes between them (before, this raised the clock tolerance's
    EnvironmentFault, or read a lease as lapsed that the model still held)."""
    traces: list[list[list[str]]] = [[], []]
    for machine, kept in zip((OutboxCheck, _SlowBetweenSteps), traces):
        r = run_check(
            machine, knownstate_env, examples=1, steps=12, seed=4, require_all=False, traces=kept
        )
        assert r.failure is None, "\n".join([r.failure or "", *r.counterexample])
    assert_same_traces(*traces)
    first, *after = traces[0][0]
    assert first.startswith("enqueue") and any("Job(" in line for line in after), traces[0][0]
