"""The check engine itself (``knownstate.chaos.check``), on the outbox kind and the real parts:
runs directed by coverage, vacuity that names what is missing, the door that names the broken
invariant, a client-side driver error reported as the implementation's, and a shrink bounded by
a count of replays (never by time), so the same seed gives the same counterexample."""

from __future__ import annotations

import dataclasses

import pytest

from knownstate.chaos.check import PROFILES, KindCheck, Profile, broken_by, run_check
from knownstate.model.contract import LostRace, Won
from knownstate.chaos.kinds.outbox import MUTANTS, OutboxCheck
from knownstate.impl import outbox as impl
from knownstate.impl.errors import boundary

pytestmark = pytest.mark.slow

MUTANT = {m.name: m for m in MUTANTS}


def profile(**kw) -> Profile:
    """The CI profile, quick: one example at least, each requirement seen once."""
    quick = dict(name="test", min_examples=1, max_examples=400, steps=30, times_each=1)
    return dataclasses.replace(PROFILES["ci"], **{**quick, "too_slow_s": 1e9, **kw})


def test_a_run_stops_once_every_requirement_was_observed(knownstate_env):
    r = run_check(OutboxCheck, knownstate_env, seed=5, profile=profile())
    assert r.passed, r.failure or r.vacuous
    assert r.stopped.startswith("every requirement observed 1+ times")
    assert all(n >= 1 for n in r.coverage.values()) and r.coverage
    assert r.examples < 400


def test_a_run_stops_at_the_example_that_meets_its_goal_not_at_the_end_of_its_batch(knownstate_env):
    """Seven examples meet this goal; a batch is twenty. The next example is never made."""
    goal = profile(min_examples=7, times_each=0, steps=5)
    r = run_check(OutboxCheck, knownstate_env, seed=5, profile=goal, require_all=False)
    assert r.passed and r.examples == 7, (r.examples, r.stopped)
    assert r.stopped == "every requirement observed 0+ times after 7 examples"


def test_a_run_whose_budget_ends_first_is_vacuous_and_names_what_is_missing(knownstate_env):
    r = run_check(
        OutboxCheck, knownstate_env, seed=5, profile=profile(max_examples=1, times_each=10**6)
    )
    assert not r.passed and r.failure is None
    assert r.stopped.startswith("the profile's 1 examples ran")
    # which requirements a one-batch run misses depends on the seed: each is named as such
    assert r.vacuous and all(v.startswith(("event '", "transition ")) for v in r.vacuous)


class _MissingParameter(impl.OutboxStore):
    """A client-side bug: the reaper's query is sent without the parameter it names."""

    def reclaim_stale(self, conn):
        with boundary("outbox.reclaim_stale"):
            conn.execute(self.q["reclaim_stale"], {}).fetchall()  # max_attempts missing
        raise AssertionError("unreachable: the driver refuses the call")


def test_a_client_side_driver_error_is_a_failure_naming_it_not_a_lost_connection(knownstate_env):
    check = type("MissingParameterCheck", (OutboxCheck,), {"store_class": _MissingParameter})
    r = run_check(check, knownstate_env, seed=5, examples=5, require_all=False, shrinks=50)
    assert r.failure is not None
    assert "reclaim_stale" in r.failure and "the driver refused" in r.failure, r.failure
    assert "placeholder" in r.failure or "parameter" in r.failure, r.failure
    assert "connection" not in r.failure.lower() and r.counterexample_steps <= 3, r.counterexample


def test_a_caught_mutant_names_its_invariant_and_replays_to_the_same_counterexample(knownstate_env):
    """A shrink of 25 replays is enough to replay: how short the gate's shrink gets is the
    mutant tests' of test_check_outbox.py, and a seed alone replaying the same counterexample
    after the gate's whole budget is test_cli.py's caught-mutant test."""
    mutant = MUTANT["unfenced-complete"]
    runs = [
        run_check(
            mutant.machine(OutboxCheck), knownstate_env, seed=5, require_all=False, shrinks=25
        )
        for _ in range(2)
    ]
    assert all(r.failure is not None and mutant.invariant in r.invariants for r in runs)
    assert runs[0].counterexample == runs[1].counterexample
    assert runs[0].failure == runs[1].failure


def test_every_kind_declares_only_invariants_its_check_can_name():
    assert set(KindCheck.named_invariants()) == set()  # no contract, no own invariants
    assert {"claim", "lease", "lease-fence", "retry-policy"} <= set(OutboxCheck.named_invariants())


def test_an_outcome_that_differs_from_the_model_names_what_it_breaks():
    """A refused write that went through (or the reverse) breaks the fence when an owner made
    it, the conditional transition otherwise, and in both cases the operation's own guarantee;
    any other difference names the guarantee alone, or nothing."""
    assert set(broken_by(LostRace("fenced"), Won("sent"), True, "lease-fence")) == {"lease-fence"}
    assert set(broken_by(Won(None), LostRace("fenced"), True, None)) == {"lease-fence"}
    assert set(broken_by(LostRace("approved"), Won(None), False, "stable-step-identity")) == {
        "conditional-transition",
        "stable-step-identity",
    }
    assert broken_by(Won((1,)), Won((2,)), False, "claim") == ("claim",)
    assert broken_by(Won((1,)), Won((2,)), False, None) == ()


def _bare_outbox_check(m) -> OutboxCheck:
    """An outbox check with no real parts: only what judging observations needs."""
    chk = OutboxCheck.__new__(OutboxCheck)
    chk.model, chk.owing = m, frozenset()
    return chk


def _claimed_done_retried() -> tuple:
    """One outbox run as the model sees it: claimed; then completed; and, from the claim,
    retried instead (a record that changed after the run ended, seen from ``done``)."""
    from knownstate.model.generic import GenericModel

    m = GenericModel(OutboxCheck.description, OutboxCheck.timing)
    m.enqueue("1")
    (job,) = m.claim(1).value
    claimed = m.copy()
    m.complete(job)
    retried = claimed.copy()
    retried.fail(job, permanent=False)
    return claimed, m, retried


def test_a_block_is_judged_from_the_states_where_its_orders_stopped():
    """Across a block only what no legal moves can explain is named: a run that had ended in a
    state where an order stopped and then changed (terminal answers), a run nobody owns (a stale
    write with no status guard). A run that ended only after the block, or a changed run that
    had not ended, names nothing."""
    claimed, done, retried = _claimed_done_retried()
    chk = _bare_outbox_check(done)
    seen = chk.observe_model
    assert chk._ended_then_changed((done,), seen(retried)) == ("terminal-answers-from-receipts",)
    assert chk._ended_then_changed((claimed, done), seen(retried)) == (
        "terminal-answers-from-receipts",
    )
    assert chk._ended_then_changed((done,), seen(done)) == ()
    assert chk._ended_then_changed((claimed,), seen(retried)) == ()  # not ended where it stopped
    assert chk._ended_then_changed((), seen(retried)) == ()
    assert chk._unowned(retried, frozenset({"1"})) and chk._unowned(done, frozenset({"1"}))
    assert not chk._unowned(claimed, frozenset({"1"}))


def test_a_block_with_nothing_refused_names_a_run_that_had_ended_before_it_and_changed():
    """Every outcome explained, yet no order ends in the rows read after the block: a run that
    had ended in a state the block started from, and changed, names terminal answers (a repeat
    that ran a finished plan's steps again, in a block racing it with a compensation, was
    named only by the default, conditional-transition: approved-plan's repeat-reexecutes was
    missed at seeds 2 and 3). A run that had not ended, or did not change, names nothing."""
    from knownstate.chaos import linearize

    claimed, done, retried = _claimed_done_retried()
    chk = _bare_outbox_check(done)
    explained = linearize.Verdict(False, ())
    changed = chk.observe_model(retried)
    assert chk._named(explained, {}, changed, [done]) == ("terminal-answers-from-receipts",)
    assert chk._named(explained, {}, changed, [claimed]) == ()
    assert chk._named(explained, {}, chk.observe_model(done), [done]) == ()


def test_a_block_names_what_the_operations_refused_after_its_longest_prefix_break_first():
    """The stale owner's write refused after the longest prefix names lease-fence; the claim
    refused only in some other order is named only when the prefix's refusals name nothing."""
    from knownstate.chaos import linearize
    from knownstate.chaos.steps import Action
    from knownstate.model.contract import LostRace, Won

    def op(client: str) -> linearize.Operation:
        return linearize.Operation(client, "x", lambda m: None, 0, 1, Won(None))

    write, claim = op("w0"), op("w1")
    offers = {
        "w0": Action("complete", "complete(1)", None, None, fence=lambda: ("1", 1, False)),
        "w1": Action("claim", "claim(batch=1)", None, None, guarantee="claim"),
    }
    verdict = linearize.Verdict(
        False,
        (write, claim),
        next_refused=((write, "the model refuses it"),),
        next_answers=((LostRace("fenced"),),),
        refused_anywhere=((write, (LostRace("fenced"),), ()), (claim, (Won(()),), ())),
    )
    chk = _bare_outbox_check(None)
    assert chk._named(verdict, offers, None) == ("lease-fence",)
    nothing_at_prefix = linearize.Verdict(
        False,
        (write, claim),
        next_refused=((write, "the model refuses it"),),
        next_answers=((Won(None),),),
        refused_anywhere=verdict.refused_anywhere,
    )
    assert chk._named(nothing_at_prefix, offers, None) == ("lease-fence", "claim")


def test_a_block_names_also_what_the_operation_that_ended_last_breaks():
    """Of two longest prefixes the search may find the one that reads a stale owner's write
    (ended last, after the heal committed) before the heal: the heal refused after it names
    lease, and the write, refused in the other order, names lease-fence too."""
    from knownstate.chaos import linearize
    from knownstate.chaos.steps import Action
    from knownstate.model.contract import LostRace, Won

    heal = linearize.Operation("w1", "read(1)", lambda m: None, 0, 4, Won("failed"))
    write = linearize.Operation("w0", "heartbeat(1)", lambda m: None, 0, 6, Won(None))
    offers = {
        "w0": Action("heartbeat", "heartbeat(1)", None, None, fence=lambda: ("1", 1, False)),
        "w1": Action("read", "read(1)", None, None, guarantee="lease"),
    }
    verdict = linearize.Verdict(
        False,
        (write, heal),
        order=(write,),
        next_refused=((heal, "the model answers executing"),),
        next_answers=((Won("executing"),),),
        refused_anywhere=((heal, (Won("executing"),), ()), (write, (LostRace("fenced"),), ())),
    )
    assert _bare_outbox_check(None)._named(verdict, offers, None) == ("lease", "lease-fence")
    ended_first = dataclasses.replace(
        verdict,
        history=(dataclasses.replace(write, ret=2), heal),
        refused_anywhere=(
            (heal, (Won("executing"),), ()),
            (dataclasses.replace(write, ret=2), (LostRace("fenced"),), ()),
        ),
    )
    assert _bare_outbox_check(None)._named(ended_first, offers, None) == ("lease",)


def test_a_seed_runs_the_same_examples_whatever_else_the_process_imported(
    knownstate_env, tmp_path, monkeypatch
):
    """Hypothesis draws some values from the constants of every local module imported so far;
    a run must not: the same seed under ``verify outbox`` and under ``verify`` of every kind (or
    a replay command) runs the same examples. A module full of constants, imported between two
    runs, changes nothing."""
    (tmp_path / "many_constants.py").write_text(
        "VALUES = ("  # under Hypothesis's 1,024 a module; ints from -99 to 99 it ignores
        + ", ".join(f"{99 + n}, {n * 4099}, {n * 1048573}" for n in range(1, 300))
        + ")\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))

    def trace() -> list[list[str]]:
        traces: list[list[str]] = []
        run_check(
            OutboxCheck, knownstate_env, seed=1, examples=20, require_all=False, traces=traces
        )
        return traces

    before = trace()
    __import__("many_constants")
    assert trace() == before
