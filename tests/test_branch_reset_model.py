"""The branch-reset model on its own: fast and pure (no database, no network).

Every transition of the table, the guards as lost races, illegal transitions, the claim
(idempotency key, one in flight), create-once, the app-clock lease and its skew bound, and the
spec's diagram against the table.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from knownstate.model import branch_reset as br
from knownstate.model.branch_reset import (
    CONTRACT,
    LEASE_LAPSED,
    TABLE,
    BranchResetModel,
    Event,
    ExternalStatus,
    Status,
    not_in,
    skew_bound,
)
from knownstate.model.contract import (
    CREATED,
    ExternalEffect,
    IllegalTransition,
    LeaseClock,
    LostRace,
    Rejected,
    StepView,
    Won,
    check_invariants,
)

SPEC = Path(__file__).resolve().parent.parent / "specs" / "branch-reset.md"


def running(m: BranchResetModel, branch: str = "main", key: str = "k1", worker: str = "w1") -> str:
    run_id = m.request(branch, key).value
    assert isinstance(m.start(run_id, worker), Won)
    return run_id


def step(m: BranchResetModel, op, *args):
    """Apply one operation and check the six invariants over it."""
    before = m.views()
    outcome = op(*args)
    violations = check_invariants(CONTRACT, before, m.views())
    assert violations == [], violations
    return outcome


# -- the contract -------------------------------------------------------------------


def test_contract_is_the_seeds_branch_reset_column():
    assert CONTRACT.kind == "branch-reset"
    assert CONTRACT.statuses == ("queued", "running", "succeeded", "failed", "canceled")
    assert CONTRACT.terminal == {"succeeded", "failed", "canceled"}
    assert CONTRACT.lease_clock is LeaseClock.APPLICATION
    assert CONTRACT.external_effect is ExternalEffect.CREATE_ONCE_THEN_POLL
    assert any("application time" in d for d in CONTRACT.deviations)
    assert "never re-issued" in CONTRACT.retry_policy
    # The Python enum and the table name the same statuses.
    assert {s.value for s in Status} == set(CONTRACT.statuses)


def test_every_way_out_of_a_live_status_is_guarded_on_running_except_the_claim():
    # The seed: every transition guarded on status = 'running'. Only the claim leaves queued,
    # and nothing leaves a terminal status.
    for t in TABLE.transitions:
        if t.source == CREATED:
            assert t.target == "queued"
        elif t.source == "queued":
            assert (t.event, t.target) == ("start", "running")
        else:
            assert t.source == "running"
    assert not TABLE.allows("queued", "canceled")


# -- every transition, through the operations ------------------------------------------


def test_request_start_poll_succeeded():
    m = BranchResetModel()
    assert step(m, m.request, "main", "k1") == Won("main#1")
    assert m.runs["main#1"].status is Status.QUEUED
    m.advance(5)
    assert step(m, m.start, "main#1", "w1") == Won("op-1")
    run = m.runs["main#1"]
    assert (run.status, run.claimed_by, run.external_op_id) == (Status.RUNNING, "w1", "op-1")
    assert run.lease_until == 5 + 600
    assert run.op_statuses == ("in_progress",)
    m.advance(60)
    # any worker polls; the fence is the status
    assert step(m, m.poll, "main#1", "w2") == Won("running")
    assert m.runs["main#1"].lease_until == 65 + 600  # extended, in the poller's app time
    assert m.runs["main#1"].op_statuses == ("in_progress",)  # recorded on change only
    m.external_finish("op-1", ok=True)
    assert step(m, m.poll, "main#1", "w1") == Won("succeeded")
    run = m.runs["main#1"]
    assert (run.status, run.lease_until, run.error) == (Status.SUCCEEDED, None, None)
    assert run.op_statuses == ("in_progress", "succeeded")


def test_poll_failed():
    m = BranchResetModel()
    run_id = running(m)
    m.external_finish("op-1", ok=False)
    assert step(m, m.poll, run_id, "w1") == Won("failed")
    run = m.runs[run_id]
    assert (run.status, run.error, run.op_statuses) == (
        Status.FAILED,
        br.EXTERNAL_FAILED,
        ("in_progress", "failed"),
    )


def test_cancel_running_leaves_the_external_operation_alone():
    m = BranchResetModel()
    run_id = running(m)
    assert step(m, m.cancel, run_id) == Won("canceled")
    assert m.runs[run_id].status is Status.CANCELED and m.runs[run_id].lease_until is None
    assert m.ops["op-1"].status is ExternalStatus.IN_PROGRESS
    m.external_finish("op-1", ok=True)  # the operation still ends; the run no longer follows it
    assert step(m, m.poll, run_id, "w1") == LostRace(not_in("canceled"))
    assert m.runs[run_id].status is Status.CANCELED


def test_reap_fails_a_run_whose_lease_lapsed_and_only_that():
    m = BranchResetModel(lease=100)
    a = running(m, "a", "ka")
    m.advance(50)
    b = m.request("b", "kb").value
    m.start(b, "w1")
    assert step(m, m.reap, "r") == Won(())
    m.advance(50)  # a's lease (100) lapses exactly now; b's (150) does not
    assert step(m, m.reap, "r") == Won((a,))
    assert (m.runs[a].status, m.runs[a].error) == (Status.FAILED, LEASE_LAPSED)
    assert m.runs[b].status is Status.RUNNING
    m.advance(50)
    assert step(m, m.reap, "r") == Won((b,))


def test_every_edge_of_the_table_is_reached_by_an_operation():
    seen: set[tuple[str, str]] = set()
    for finish in (True, False, "cancel", "reap"):
        m = BranchResetModel(lease=100)
        run_id = m.request("main", "k").value
        seen.add((CREATED, m.runs[run_id].status.value))
        before = m.runs[run_id].status.value
        m.start(run_id, "w")
        seen.add((before, m.runs[run_id].status.value))
        m.poll(run_id, "w")
        seen.add(("running", m.runs[run_id].status.value))
        if finish == "cancel":
            m.cancel(run_id)
        elif finish == "reap":
            m.advance(100)
            m.reap("w")
        else:
            m.external_finish("op-1", finish)
            m.poll(run_id, "w")
        seen.add(("running", m.runs[run_id].status.value))
    assert seen == TABLE.edges()


# -- guards: a write that matches no row is a lost race --------------------------------------


@pytest.mark.parametrize("terminal", ["succeeded", "failed", "canceled"])
def test_terminal_runs_refuse_every_write_as_a_lost_race(terminal):
    m = BranchResetModel()
    run_id = running(m)
    if terminal == "canceled":
        m.cancel(run_id)
    else:
        m.external_finish("op-1", terminal == "succeeded")
        m.poll(run_id, "w1")
    frozen = m.copy()
    assert step(m, m.start, run_id, "w2") == LostRace(not_in(terminal))
    assert step(m, m.poll, run_id, "w2") == LostRace(not_in(terminal))
    assert step(m, m.cancel, run_id) == LostRace(not_in(terminal))
    m.advance(10_000)
    frozen.advance(10_000)
    assert step(m, m.reap, "w2") == Won(())
    assert m == frozen


def test_queued_run_refuses_poll_and_cancel():
    m = BranchResetModel()
    run_id = m.request("main", "k").value
    frozen = m.copy()
    assert m.poll(run_id, "w") == LostRace(not_in("queued"))
    assert m.cancel(run_id) == LostRace(not_in("queued"))
    assert m == frozen


def test_second_start_loses_and_creates_nothing():
    m = BranchResetModel()
    run_id = running(m)
    frozen = m.copy()
    assert m.start(run_id, "w2") == LostRace(not_in("running"))
    assert m == frozen
    assert m.external_state().creations(run_id) == 1


def test_unknown_run_is_rejected():
    m = BranchResetModel()
    for outcome in (m.start("nope#1", "w"), m.poll("nope#1", "w"), m.cancel("nope#1")):
        assert outcome == Rejected(br.NO_SUCH_RUN)
    assert m == BranchResetModel()


def test_poll_with_a_lapsed_lease_writes_nothing():
    m = BranchResetModel(lease=100)
    run_id = running(m)
    m.advance(100)  # lease_until == app now: lapsed
    frozen = m.copy()
    assert m.poll(run_id, "w1") == LostRace(LEASE_LAPSED)
    assert m == frozen  # not extended, nothing observed


def test_every_transition_is_logged_once_and_a_refused_one_not_at_all():
    """The stateful check counts which rows of TABLE it observed from this log."""
    m = BranchResetModel(lease=600)
    m.request("a", "k1")
    m.start("a#1", "w1")
    m.poll("a#1", "w1")
    m.external_finish("op-1", ok=True)
    m.poll("a#1", "w1")
    m.request("b", "k2")
    m.start("b#1", "w1")
    m.cancel("b#1")
    m.request("c", "k3")
    m.start("c#1", "w1")
    m.external_finish("op-3", ok=False)
    m.poll("c#1", "w1")
    m.request("d", "k4")
    m.start("d#1", "w1")
    m.advance(600)
    m.reap("r")
    assert {(s, e, t) for _, s, e, t in m.transitions} == {
        (t.source, t.event, t.target) for t in TABLE.transitions
    }
    assert len(m.transitions) == 13
    logged = list(m.transitions)
    assert m.cancel("a#1") == LostRace(not_in("succeeded")) and m.start("zz#1", "w1") == Rejected(
        br.NO_SUCH_RUN
    )
    with pytest.raises(IllegalTransition):
        m.fire("a#1", "cancel")
    assert m.transitions == logged
    assert m.copy().transitions == logged


# -- illegal transitions ---------------------------------------------------------------------


def test_illegal_transitions_raise_and_leave_the_state_unchanged():
    for status in Status:
        for event in Event:
            if (status.value, event.value) in {(t.source, t.event) for t in TABLE.transitions}:
                continue
            m = BranchResetModel()
            run_id = running(m)
            m.runs[run_id] = replace(m.runs[run_id], status=status)
            frozen = m.copy()
            with pytest.raises(IllegalTransition) as e:
                m.fire(run_id, event)
            assert (e.value.status, e.value.event) == (status.value, event.value)
            assert m == frozen


def test_fire_takes_a_legal_transition():
    m = BranchResetModel()
    run_id = running(m)
    assert m.fire(run_id, "cancel").status is Status.CANCELED


def test_an_operation_finishes_once():
    m = BranchResetModel()
    running(m)
    m.external_finish("op-1", ok=True)
    frozen = m.copy()
    with pytest.raises(IllegalTransition):
        m.external_finish("op-1", ok=False)
    assert m == frozen


# -- the claim: idempotency key and one in flight ----------------------------------------------


def test_same_key_returns_the_existing_run_in_flight_or_terminal():
    m = BranchResetModel()
    assert m.request("main", "k1") == Won("main#1")
    assert step(m, m.request, "main", "k1") == Won("main#1")
    m.start("main#1", "w")
    m.external_finish("op-1", ok=True)
    m.poll("main#1", "w")
    frozen = m.copy()
    assert step(m, m.request, "main", "k1") == Won("main#1")  # answered from the row, not re-run
    assert m == frozen


def test_same_key_for_another_branch_is_rejected():
    m = BranchResetModel()
    m.request("main", "k1")
    frozen = m.copy()
    assert m.request("dev", "k1") == Rejected(br.KEY_REUSED)
    assert m == frozen


def test_one_run_in_flight_per_branch():
    m = BranchResetModel()
    m.request("main", "k1")
    assert m.request("main", "k2") == Rejected(br.IN_FLIGHT_REASON)  # queued blocks
    assert m.request("dev", "k2") == Won("dev#1")  # another branch does not
    m.start("main#1", "w")
    assert m.request("main", "k3") == Rejected(br.IN_FLIGHT_REASON)  # running blocks
    m.cancel("main#1")
    assert m.request("main", "k3") == Won("main#2")  # terminal does not
    assert sorted(m.runs) == ["dev#1", "main#1", "main#2"]


# -- create once, then poll --------------------------------------------------------------------


def test_polls_never_re_issue_the_external_operation():
    m = BranchResetModel()
    run_id = running(m)
    for _ in range(20):
        m.advance(30)
        assert m.poll(run_id, "w1") == Won("running")
    ext = m.external_state()
    assert ext.creations(run_id) == 1 and ext.create_requests[run_id] == 1


def test_worker_dies_between_create_and_commit_then_restart_gets_the_same_operation():
    m = BranchResetModel()
    run_id = m.request("main", "k1").value
    m.external_create(run_id, "main")  # the API acted; the claim's transaction never committed
    assert m.runs[run_id].status is Status.QUEUED
    assert step(m, m.start, run_id, "w2") == Won("op-1")
    ext = m.external_state()
    assert ext.creations(run_id) == 1 and ext.create_requests[run_id] == 2
    assert m.views()[run_id].steps[br.EXTERNAL_STEP].external_calls == 2


def test_a_second_creation_is_what_the_invariant_flags():
    m = BranchResetModel()
    run_id = running(m)
    before = m.views()
    m.external_create(run_id, "main", idempotency_key="another key")  # what a re-issuing bug does
    violations = check_invariants(CONTRACT, before, m.views())
    assert [v.invariant for v in violations] == ["external-effect-semantics"]


# -- clocks: the lease is in application time --------------------------------------------------


def test_skew_moves_one_workers_clock_and_advance_moves_all():
    m = BranchResetModel()
    m.skew("w1", 30)
    m.skew("w1", -10)
    m.advance(5)
    assert (m.app_now("w1"), m.app_now("w2"), m.now) == (25, 5, 5)


def test_a_stamp_uses_the_stampers_app_clock():
    m = BranchResetModel(lease=100)
    m.skew("w1", -40)
    run_id = running(m, worker="w1")
    assert m.runs[run_id].lease_until == -40 + 100


def test_the_skew_bound_is_lease_minus_poll_margin():
    assert skew_bound() == 540
    assert skew_bound(lease=120, poll_interval=30) == 90


def poll_then_reap(lease: int, margin: int, reaper_skew: int, gaps: list[int]) -> BranchResetModel:
    """A live run: polled after each gap (every gap <= margin); the reaper (skewed) runs right
    before each poll, the worst moment."""
    m = BranchResetModel(lease=lease)
    m.skew("reaper", reaper_skew)
    run_id = running(m, worker="poller")
    for gap in gaps:
        m.advance(gap)
        m.reap("reaper")
        if m.runs[run_id].status is not Status.RUNNING:
            break
        m.poll(run_id, "poller")
    return m


@settings(max_examples=200, deadline=None)
@given(data=st.data(), lease=st.integers(2, 1000))
def test_skew_below_the_bound_never_reaps_a_live_run(data, lease):
    margin = data.draw(st.integers(1, lease - 1), label="margin")
    skew = data.draw(st.integers(-2 * lease, lease - margin - 1), label="reaper skew")
    gaps = data.draw(st.lists(st.integers(1, margin), min_size=1, max_size=30), label="gaps")
    m = poll_then_reap(lease, margin, skew, gaps)
    assert m.runs["main#1"].status is Status.RUNNING


@settings(max_examples=200, deadline=None)
@given(data=st.data(), lease=st.integers(2, 1000))
def test_skew_at_the_bound_reaps_a_live_run_the_known_deviation(data, lease):
    margin = data.draw(st.integers(1, lease - 1), label="margin")
    skew = data.draw(st.integers(lease - margin, 2 * lease), label="reaper skew")
    m = poll_then_reap(lease, margin, skew, [margin])  # one poll due, reaped just before it
    run = m.runs["main#1"]
    assert (run.status, run.error) == (Status.FAILED, LEASE_LAPSED)


def test_skew_bound_with_the_defaults():
    below = poll_then_reap(600, 60, skew_bound() - 1, [60] * 50)
    assert below.runs["main#1"].status is Status.RUNNING
    at = poll_then_reap(600, 60, skew_bound(), [60] * 50)
    assert at.runs["main#1"].status is Status.FAILED
    # The fence still holds past the bound: the live poller's next write is a lost race.
    assert at.poll("main#1", "poller") == LostRace(not_in("failed"))


def test_a_poller_behind_shortens_the_lease_another_poller_may_find_lapsed():
    m = BranchResetModel(lease=100)
    run_id = running(m, worker="a")
    m.skew("b", -50)
    m.advance(10)
    m.poll(run_id, "b")  # stamps 10 - 50 + 100 = 60
    assert m.runs[run_id].lease_until == 60
    m.advance(50)  # real time 60: a's clock says the lease lapsed
    assert m.poll(run_id, "a") == LostRace(LEASE_LAPSED)


def test_a_database_clock_is_not_what_the_lease_reads():
    # Only app clocks judge the lease: moving every worker's clock back undoes the passing of time.
    m = BranchResetModel(lease=100)
    run_id = running(m, worker="w")
    m.advance(150)
    m.skew("w", -150)
    assert m.reap("w") == Won(())
    assert m.poll(run_id, "w") == Won("running")


# -- copies and state ----------------------------------------------------------------------------


def test_copy_is_equal_and_independent():
    m = BranchResetModel()
    running(m)
    c = m.copy()
    assert c == m
    c.external_finish("op-1", ok=True)
    c.poll("main#1", "w1")
    c.skew("w1", 3)
    assert c != m
    assert (
        m.runs["main#1"].status is Status.RUNNING
        and m.ops["op-1"].status is ExternalStatus.IN_PROGRESS
    )


def test_zero_skew_equals_no_skew():
    a, b = BranchResetModel(), BranchResetModel()
    a.skew("w", 5)
    a.skew("w", -5)
    assert a == b


def test_views_count_creations_and_receipts():
    m = BranchResetModel()
    m.request("main", "k")
    v = m.views()["main#1"]
    assert (v.status, v.fence_token, v.external_creations) == ("queued", 0, 0)
    assert v.steps[br.EXTERNAL_STEP] == StepView(0, 0, 0)
    m.start("main#1", "w")
    v = m.views()["main#1"]
    assert (v.status, v.fence_token, v.external_creations) == ("running", 1, 1)
    assert v.steps[br.EXTERNAL_STEP] == StepView(1, 1, 1)


# -- the spec --------------------------------------------------------------------------------------


def test_spec_diagram_is_the_models_table():
    text = SPEC.read_text()
    m = re.search(
        r"<!-- generated:diagram -->\n```mermaid\n(.*?)\n```\n"
        r"<!-- /generated:diagram -->",
        text,
        re.S,
    )
    assert m, "specs/branch-reset.md has no generated diagram block"
    assert m.group(1) == TABLE.mermaid()


def test_spec_states_the_skew_bound_and_the_deviation():
    text = SPEC.read_text()
    assert f"{skew_bound()} s" in text
    assert "deviation" in text.lower()
