"""Race mutants (knownstate.chaos.race_mutants): bugs that only overlapping transactions show.

For each mutant, on the real parts (the session's PostgreSQL, workers through Toxiproxy):
every sequential order of its block passes (what the sequential mode can do, and why it misses
the bug is in the mutant's ``sequential_misses``); schedules drawn by Hypothesis and judged by
the linearizability checker against the pure model catch it, with a short counterexample; and
the reference implementation is linearizable under *every* schedule of the same block.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from knownstate.chaos import race_mutants as rm
from knownstate.chaos import kinds
from knownstate.chaos.mutants import Mutant
from knownstate.model.contract import INVARIANTS
from fixed_draws import FixedDraws

MUTANTS = {m.name: m for m in rm.RACE_MUTANTS}


@pytest.fixture(scope="module")
def rig(knownstate_cluster, knownstate_toxiproxy):
    r = rm.Rig(knownstate_cluster, knownstate_toxiproxy.client(), prefix="ksrace_t")
    yield r
    r.close()
    if knownstate_cluster.clock is not None:
        knownstate_cluster.clock.reset()


@pytest.mark.parametrize("name", MUTANTS)
def test_every_sequential_order_misses_the_mutant(rig, name):
    mutant = MUTANTS[name]
    scenario = mutant.scenario
    examples = rm.sequential_schedules(rig, scenario, mutant.variant)
    orders = list(itertools.permutations(c.worker for c in scenario.block))
    assert len(examples) == len(orders)
    for example, order in zip(examples, orders):
        assert example.verdict.ok, "\n".join(example.counterexample())
        # Each operation ran to its end before the next started.
        runs = [w for w, _ in itertools.groupby(example.result.schedule)]
        assert runs == [w for w in order if w in runs]
    assert mutant.sequential_misses


@pytest.mark.parametrize("name", MUTANTS)
def test_drawn_schedules_judged_by_linearizability_catch_the_mutant(rig, name):
    mutant = MUTANTS[name]
    scenario = mutant.scenario
    hunt = rm.hunt(rig, scenario, mutant.variant, seed=0, max_examples=200)
    assert hunt.caught, hunt.report()
    assert hunt.steps is not None and hunt.steps <= 15
    text = "\n".join(hunt.counterexample)
    assert text.startswith("block: ")
    assert "not linearizable" in text
    for call in scenario.block:
        assert f"{call.worker} {call.label}" in text
    # A counterexample interleaves: some worker runs between two statements of another.
    runs = [w for w, _ in itertools.groupby(_schedule(hunt.counterexample))]
    assert len(runs) > len(set(runs))


def _schedule(lines: list[str]) -> list[str]:
    return [line.split()[1] for line in lines if line[:5].strip().rstrip(".").isdigit()]


@pytest.mark.parametrize("name", [n for n in MUTANTS if len(MUTANTS[n].scenario.block) == 2])
def test_the_reference_is_linearizable_under_every_schedule_of_the_block(rig, name):
    scenario = MUTANTS[name].scenario
    examples = rm.every_schedule(rig, scenario, rm.REFERENCE)
    assert len({e.result.schedule for e in examples}) == len(examples) > 2
    refused = [e for e in examples if not e.verdict.ok]
    assert not refused, "\n".join(refused[0].counterexample())


@pytest.mark.slow
def test_the_reference_passes_every_schedule_of_the_three_worker_block(rig):
    scenario = MUTANTS["complete-reads-attempt-first"].scenario
    examples = rm.every_schedule(rig, scenario, rm.REFERENCE)
    assert len(examples) > 6
    assert all(e.verdict.ok for e in examples)
    mutant = rm.every_schedule(rig, scenario, MUTANTS["complete-reads-attempt-first"].variant)
    assert 0 < sum(not e.verdict.ok for e in mutant) < len(mutant)


@pytest.mark.slow
@pytest.mark.parametrize("name", MUTANTS)
def test_each_mutant_is_caught_on_five_seeds(rig, name):
    mutant = MUTANTS[name]
    scenario = mutant.scenario
    for seed in range(5):
        hunt = rm.hunt(rig, scenario, mutant.variant, seed=seed, max_examples=300)
        assert hunt.caught and hunt.steps <= 15, hunt.report()


def test_the_3a43514_schedule_applies_the_step_again_and_the_reference_answers_from_its_receipt(
    rig,
):
    """The race the gate once missed: w1 locks the run, w0 waits for the lock; after w1
    commits, the mutant's count (read before the wait) misses w1's receipt and runs step 0
    again (refused by the receipt's key); the reference counts after the wait and answers
    from the receipt."""
    scenario = MUTANTS["count-before-lock-wait"].scenario

    def w1_then_w0(options):
        return "w1" if "w1" in options else options[0]

    first = ["w0", "w1"]  # w0 is the one that waits

    def choose(options):
        return first.pop() if first else w1_then_w0(options)

    bad = rm.run_example(rig, scenario, MUTANTS["count-before-lock-wait"].variant, choose)
    assert "w0 waits for w1" in "\n".join(bad.result.trace)
    w0 = bad.result.by_worker()["w0"]
    assert w0.sqlstate == "23505" and "agent_proposal_step_pkey" in str(w0.error)
    assert bad.verdict.ok is False
    first[:] = ["w0", "w1"]
    good = rm.run_example(rig, scenario, rm.REFERENCE, choose)
    assert "w0 waits for w1" in "\n".join(good.result.trace)
    assert good.verdict.ok, "\n".join(good.counterexample())
    assert good.result.by_worker()["w0"].value == good.result.by_worker()["w1"].value


def test_the_race_mutants_are_in_each_kinds_catalogue():
    assert {r.kind for r in rm.RACE_MUTANTS} == {"outbox", "approved-plan", "branch-reset"}
    for r in rm.RACE_MUTANTS:
        catalogue = kinds.mutants(r.kind)
        (m,) = [m for m in catalogue if m.name == r.name]  # in its kind's catalogue, once
        assert isinstance(m, Mutant) and m.kind == r.kind and m.invariant == r.invariant
        assert m.invariant in INVARIANTS
    reset = next(
        m for m in kinds.mutants("branch-reset") if m.name == "idempotency-select-then-insert"
    )

    class Check:
        store_class = object
        schema = "the reference schema"

    applied = reset.machine(Check)
    assert applied.store_class is MUTANTS["idempotency-select-then-insert"].variant.store_class
    assert applied.store_class.__name__ == "RequestSelectThenInsert"
    assert "CREATE INDEX branch_reset_idempotency_key" in applied.schema
    assert "UNIQUE INDEX branch_reset_idempotency_key" not in applied.schema


def test_an_operation_raising_outside_the_database_leaves_no_transaction_open(rig):
    """A worker's operation that raises a non-database error with its transaction open (holding
    row locks) is rolled back after the block: the next example's TRUNCATE would wait on it."""
    scenario = MUTANTS["claim-read-then-write"].scenario

    def broken(store, conn):
        conn.execute("SELECT id FROM outbox_delivery FOR UPDATE").fetchall()
        raise RuntimeError("the worker's own bug")

    bad = dataclasses.replace(scenario, block=(rm.Call("w0", "broken()", lambda m: None, broken),))
    example = rm.run_example(rig, bad, rm.REFERENCE, lambda options: options[0])
    assert example.result.by_worker()["w0"].left_open
    admin = rig.admin(rig.database(scenario.schema))
    (open_,) = admin.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE state LIKE 'idle in transaction%%' "
        "AND application_name LIKE 'ksrace_t-%%'"
    ).fetchone()
    assert open_ == 0
    again = rm.run_example(rig, scenario, rm.REFERENCE, lambda options: options[0])
    assert again.verdict.ok, "\n".join(again.counterexample())


def test_a_call_to_an_external_service_is_a_step_of_the_schedule(rig):
    """The operations API's create is gated like a statement: one step of its own, in the trace,
    taken when the schedule says (the stand-in sees the calls in schedule order)."""
    scenario = MUTANTS["start-reads-status-first"].scenario
    example = rm.run_example(rig, scenario, rm.REFERENCE, lambda options: options[0])
    assert example.verdict.ok, "\n".join(example.counterexample())
    calls = [line for line in example.result.trace if "operations API.create(a#1)" in line]
    assert len(calls) == 1 and calls[0].split()[1] == "w0", example.result.trace


def test_every_pair_that_can_race_on_one_row_is_a_required_event():
    from knownstate.chaos.blocks import pair_event
    from knownstate.chaos.kinds.approved_plan import ApprovedPlanCheck
    from knownstate.chaos.kinds.branch_reset import BranchResetCheck

    assert pair_event("start", "cancel") == pair_event("cancel", "start")
    assert pair_event("start", "cancel") == "raced on one row: cancel × start"
    for check, pairs in ((BranchResetCheck, 7), (ApprovedPlanCheck, 23)):
        raced = [r for r in check.requirements() if r.label.startswith("raced on one row: ")]
        assert len(raced) == len({r.label for r in raced}) == pairs
        # reachable only where blocks are: elsewhere reported as not covered, never vacuous
        assert all(r.needs == {"concurrency"} for r in raced)
    assert pair_event("compensate", "compensate") in {
        r.label for r in ApprovedPlanCheck.requirements()
    }
    assert pair_event("start", "start") in {r.label for r in BranchResetCheck.requirements()}


def _pair_schedule(drawn: FixedDraws, pair: bool) -> list[str]:
    """The steps a block of w0 (three statements, then COMMIT) and w1 (two, then COMMIT) takes
    under the pair-aimed schedule (``pair``) or the general one."""
    from knownstate.chaos import schedules

    labels = {"w0": ["s1", "s2", "s3", "COMMIT"], "w1": ["t1", "t2", "COMMIT"]}
    done = {"w0": 0, "w1": 0}

    def pending(w):
        return labels[w][done[w]] if done[w] < len(labels[w]) else None

    choose = schedules.pct(drawn, ["w0", "w1"], pending=pending if pair else None)
    taken = []
    while options := [w for w in labels if pending(w) is not None]:
        w = choose(options)
        taken.append(f"{w} {pending(w)}")
        done[w] += 1
    return taken


def test_a_pair_aimed_schedule_preempts_the_first_worker_at_latest_before_its_commit():
    """A change point drawn past the first operation's last statement falls before its COMMIT
    (the pair races, with everything read and written but nothing committed); the general
    schedule runs them one after the other. A change point inside the operation is kept."""
    late = ["w0 s1", "w0 s2", "w0 s3", "w1 t1", "w1 t2", "w1 COMMIT", "w0 COMMIT"]
    assert _pair_schedule(FixedDraws(["w0", "w1"], 5), pair=True) == late
    sequential = ["w0 s1", "w0 s2", "w0 s3", "w0 COMMIT", "w1 t1", "w1 t2", "w1 COMMIT"]
    assert _pair_schedule(FixedDraws(["w0", "w1"], [6]), pair=False) == sequential
    early = ["w0 s1", "w1 t1", "w1 t2", "w1 COMMIT", "w0 s2", "w0 s3", "w0 COMMIT"]
    assert _pair_schedule(FixedDraws(["w0", "w1"], 0), pair=True) == early


def test_two_operations_raced_only_when_one_stepped_between_the_others_first_and_last():
    from knownstate.chaos.interleave import BlockResult

    def overlapped(*schedule):
        return BlockResult((), schedule, ()).overlapped("w0", "w1")

    assert not overlapped("w0", "w0", "w1", "w1")  # one after the other: no race
    assert not overlapped("w1", "w0")
    assert not overlapped("w0", "w0")  # w1 never reached the database
    assert overlapped("w0", "w1", "w1", "w0")  # w1 inside w0's transaction
    assert overlapped("w0", "w1", "w0", "w1")


def test_only_a_block_aimed_at_a_pair_counts_it_raced_and_only_when_they_overlapped():
    """A pair's requirement is met by races drawn for it: a block not aimed at a pair (its
    change points anywhere, or none, maybe a fault) counts no pair, however its operations
    overlapped; an aimed one counts its pair when the two overlapped, on a row both touch."""
    from knownstate.chaos.blocks import Blocks, pair_event
    from knownstate.chaos.interleave import BlockResult
    from knownstate.chaos.steps import Action

    def offer(op, run):
        return Action(op, f"{op}({run})", lambda m: None, lambda c: None, runs=frozenset({run}))

    same = {"w0": offer("compensate", 1), "w1": offer("compensate", 1)}
    other_rows = {"w0": offer("compensate", 1), "w1": offer("repeat", 2)}
    raced = BlockResult((), ("w0", "w1", "w1", "w0"), ())
    one_then_other = BlockResult((), ("w0", "w0", "w1", "w1"), ())
    names = ["w0", "w1"]
    assert Blocks._pairs_raced(names, same, raced, aimed=True) == {
        pair_event("compensate", "compensate")
    }
    assert Blocks._pairs_raced(names, same, raced, aimed=False) == set()
    assert Blocks._pairs_raced(names, same, one_then_other, aimed=True) == set()
    assert Blocks._pairs_raced(names, other_rows, raced, aimed=True) == set()


def test_no_check_shadows_a_helper_of_the_blocks():
    """The blocks' own helpers are the ones every check runs: a mixin's method of the same name
    (ClaimRace's ``_raced``, once) would take the block's place in the generic kinds only."""
    import inspect

    from knownstate.chaos.blocks import Blocks
    from knownstate.chaos.generic import GenericCheck
    from knownstate.chaos.kinds.approved_plan import ApprovedPlanCheck
    from knownstate.chaos.kinds.branch_reset import BranchResetCheck
    from knownstate.chaos.kinds.document_session import DocumentSessionCheck

    helpers = {n: v for n, v in vars(Blocks).items() if n.startswith("_") and n[1] != "_"}
    assert "_pairs_raced" in helpers and "_block" in helpers
    for check in (GenericCheck, ApprovedPlanCheck, BranchResetCheck, DocumentSessionCheck):
        shadowed = [n for n, v in helpers.items() if inspect.getattr_static(check, n) is not v]
        assert not shadowed, (check.__name__, shadowed)


def test_a_drawn_pair_means_the_same_two_operations_whatever_else_can_race_now():
    """The pair a block races is drawn by its place in the kind's fixed list of pairs, not in
    the list of pairs available now: replayed after the steps before it were shrunk away (other
    pairs available, or fewer), the same draw races the same two operations."""
    from hypothesis.internal.conjecture.data import ConjectureData

    from knownstate.chaos.blocks import Blocks, pair_event
    from knownstate.chaos.kinds.approved_plan import ApprovedPlanCheck

    class Kind:
        requirements = ApprovedPlanCheck.requirements

    class Replayed:  # Hypothesis's ``data`` replaying fixed choices
        def __init__(self, choices):
            self.data = ConjectureData.for_choices(choices)

        def draw(self, strategy, label=None):
            return self.data.draw(strategy)

    fixed = sorted(
        r.label for r in ApprovedPlanCheck.requirements() if r.label.startswith("raced on one")
    )
    place = fixed.index(pair_event("compensate", "compensate"))
    wanted = ("compensate", "compensate")
    for others in ([], [("read", "read")], [("approve", "approve"), ("repeat", "repeat")]):
        pairs = {key: [] for key in [*others, wanted]}
        assert Blocks._draw_pair(Kind(), Replayed([place]), pairs) == wanted, others
