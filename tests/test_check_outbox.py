"""The outbox's stateful check, as the suite runs it: the reference passes, seeded bugs are caught
with short counterexamples, and a seed replays the same run."""

from __future__ import annotations

import pytest

from knownstate.chaos.check import run_check
from knownstate.chaos.kinds.outbox import MUTANTS, OutboxCheck

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
    assert traces[0] and traces[0] == traces[1]
