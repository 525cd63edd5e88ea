"""The outbox's stateful check, as the suite runs it: the reference passes, seeded bugs are caught
with short counterexamples, and a seed replays the same run."""

from __future__ import annotations

import pytest

from knownstate.chaos.check import Env, run_check
from knownstate.chaos.kinds.outbox import MUTANTS, OutboxCheck

pytestmark = pytest.mark.slow

MUTANT = {m.name: m for m in MUTANTS}


@pytest.fixture(scope="module")
def outbox_env():
    with Env.open() as env:
        yield env


def test_reference_passes_and_observes_faults(outbox_env):
    r = run_check(OutboxCheck, outbox_env, examples=20, steps=40, seed=4, require_all=False)
    assert r.failure is None, "\n".join([r.failure or "", *r.counterexample])
    assert r.stats.invariants_checked > 0
    assert r.stats.faults and r.stats.events["indeterminate commit"] > 0


@pytest.mark.parametrize("name", ["claim-without-bump", "reaper-app-clock", "no-backoff"])
def test_mutant_is_caught_with_a_short_counterexample(outbox_env, name):
    r = run_check(MUTANT[name].machine(OutboxCheck), outbox_env, examples=40, steps=40, seed=4,
                  require_all=False, shrink_seconds=30)
    assert r.failure is not None, f"mutant {name} was not caught"
    assert r.counterexample_steps <= 15, "\n".join(r.counterexample)


def test_a_seed_replays_the_same_run(outbox_env):
    traces = []
    for _ in range(2):
        OutboxCheck.all_traces = []
        run_check(OutboxCheck, outbox_env, examples=8, steps=30, seed=21, require_all=False)
        traces.append(OutboxCheck.all_traces)
    del OutboxCheck.all_traces
    assert traces[0] == traces[1]
