"""The approved-plan model on its own: fast, pure, no database.

Every row of the transition table is taken by an operation; every other (status, event) pair is
illegal for the raw table step and a lost race for the guarded operation, and leaves the state
unchanged. Then the behaviour the seed asks for: the claim, the fence, the lazy heal at its
boundary, stable step identity, repeat requests answered from receipts, compensation.
"""

from __future__ import annotations

import pytest

from knownstate.model import approved_plan as ap
from knownstate.model.approved_plan import (
    CONTRACT,
    INTERRUPTED,
    TABLE,
    ApprovedPlanModel,
    LedgerEntry,
    PlanState,
    Receipt,
    Status,
    Step,
)
from knownstate.model.contract import (
    CREATED,
    IllegalTransition,
    LostRace,
    Rejected,
    Won,
    check_invariants,
)

CREDIT_A5 = {"op": "credit", "account": "a", "amount": 5}
CREDIT_B3 = {"op": "credit", "account": "b", "amount": 3}
FAIL = {"op": "fail"}


def model_at(status: Status, steps=(CREDIT_A5, CREDIT_B3)) -> tuple[ApprovedPlanModel, int]:
    """A model whose proposal 1 has reached ``status`` through the operations."""
    m = ApprovedPlanModel()
    pid = m.propose(list(steps)).value
    if status is Status.PENDING:
        return m, pid
    if status is Status.REJECTED:
        assert m.reject(pid) == Won()
        return m, pid
    if status is Status.EXPIRED:
        assert m.expire(pid) == Won()
        return m, pid
    assert m.approve(pid) == Won()
    if status is Status.APPROVED:
        return m, pid
    assert m.mark_executing(pid) == Won(1)
    if status is Status.EXECUTING:
        return m, pid
    if status is Status.FAILED:
        m.advance(121)
        assert m.read(pid).value.status is Status.FAILED
        return m, pid
    for i in range(len(steps)):
        assert isinstance(m.run_step(pid, i, 1), Won)
    assert m.proposal(pid).status is Status.EXECUTED
    return m, pid


def failed_after_credits() -> tuple[ApprovedPlanModel, int]:
    m, pid = model_at(Status.EXECUTING, (CREDIT_A5, CREDIT_B3, FAIL))
    for i in range(3):
        m.run_step(pid, i, 1)
    return m, pid


# ---------------------------------------------------------------------------
# The table, row by row.
# ---------------------------------------------------------------------------


def _drive(source: str, event: str) -> tuple[object, ApprovedPlanModel, int]:
    """Take the transition (source, event) through the operation that owns it."""
    if event == "propose":
        m = ApprovedPlanModel()
        out = m.propose([CREDIT_A5])
        return out, m, out.value
    if event == "compensate":
        m, pid = failed_after_credits()
        out = m.compensate(pid)
        return out, m, out.value
    if event == "mark_interrupted_if_stale":
        m, pid = model_at(Status.EXECUTING)
        m.advance(121)
        return m.read(pid), m, pid
    m, pid = model_at(
        Status(source), (CREDIT_A5, FAIL) if event == "step_failed" else (CREDIT_A5, CREDIT_B3)
    )
    if event == "step_ok":
        return m.run_step(pid, 0, 1), m, pid
    if event == "last_step_ok":
        m.run_step(pid, 0, 1)
        return m.run_step(pid, 1, 1), m, pid
    if event == "step_failed":
        m.run_step(pid, 0, 1)
        return m.run_step(pid, 1, 1), m, pid
    if event == "heartbeat":
        return m.heartbeat(pid, 1), m, pid
    if event == "revise":
        return m.revise(pid, [CREDIT_B3]), m, pid
    return getattr(m, event)(pid), m, pid


@pytest.mark.parametrize("t", TABLE.transitions, ids=lambda t: f"{t.source}-{t.event}-{t.target}")
def test_every_transition_is_taken_by_its_operation(t):
    out, m, pid = _drive(t.source, t.event)
    assert isinstance(out, Won), out
    assert m.proposal(pid).status == t.target


def test_the_table_is_the_seeds_status_machine():
    assert set(TABLE.statuses()) == {s.value for s in Status}
    assert TABLE.edges() == {
        (CREATED, "pending"),
        ("pending", "pending"),
        ("pending", "approved"),
        ("pending", "rejected"),
        ("pending", "expired"),
        ("approved", "expired"),
        ("approved", "executing"),
        ("executing", "executing"),
        ("executing", "executed"),
        ("executing", "failed"),
    }
    for t in TABLE.transitions:  # terminal means no way out
        assert not CONTRACT.is_terminal(t.source)
    assert CONTRACT.terminal == {"executed", "failed", "expired", "rejected"}
    assert CONTRACT.kind == "approved-plan" and CONTRACT.lease_clock.name == "DATABASE"
    assert CONTRACT.external_effect.name == "NONE"


EVENTS = sorted({t.event for t in TABLE.transitions} - {"propose", "compensate"})
ILLEGAL = [
    (s, e)
    for s in Status
    for e in EVENTS
    if (s.value, e) not in {(t.source, t.event) for t in TABLE.transitions}
]


@pytest.mark.parametrize("status,event", ILLEGAL, ids=lambda x: str(x))
def test_an_illegal_transition_raises_and_leaves_the_state_unchanged(status, event):
    m, pid = model_at(status)
    before = m.copy()
    with pytest.raises(IllegalTransition) as e:
        m.transition(pid, event)
    assert (e.value.kind, e.value.status, e.value.event) == ("approved-plan", status.value, event)
    assert m == before


GUARDED = {
    "approve": lambda m, pid: m.approve(pid),
    "reject": lambda m, pid: m.reject(pid),
    "expire": lambda m, pid: m.expire(pid),
    "mark_executing": lambda m, pid: m.mark_executing(pid),
    "revise": lambda m, pid: m.revise(pid, [CREDIT_B3]),
    "heartbeat": lambda m, pid: m.heartbeat(pid, 1),
    "run_step": lambda m, pid: m.run_step(pid, 0, 1),
}
GUARD_EVENT = {"heartbeat": "heartbeat", "run_step": "step_ok"}


@pytest.mark.parametrize("status", list(Status), ids=str)
@pytest.mark.parametrize("op", sorted(GUARDED))
def test_an_operation_whose_guard_does_not_match_is_a_lost_race(status, op):
    m, pid = model_at(status)
    before = m.copy()
    out = GUARDED[op](m, pid)
    event = GUARD_EVENT.get(op, op)
    legal = (status.value, event) in {(t.source, t.event) for t in TABLE.transitions}
    if legal:
        assert isinstance(out, Won)
    else:
        assert isinstance(out, LostRace), out
        assert m == before


def test_unknown_proposal_is_rejected_not_raised():
    m = ApprovedPlanModel()
    for out in (
        m.approve(7),
        m.reject(7),
        m.expire(7),
        m.mark_executing(7),
        m.run_step(7, 0, 1),
        m.heartbeat(7, 1),
        m.read(7),
        m.repeat(7),
        m.compensate(7),
        m.revise(7, [CREDIT_A5]),
    ):
        assert out == Rejected("no proposal 7")
    assert m == ApprovedPlanModel()


# ---------------------------------------------------------------------------
# Proposals, approval, the claim.
# ---------------------------------------------------------------------------


def test_ids_are_assigned_in_order_and_a_refused_proposal_uses_none():
    m = ApprovedPlanModel()
    assert [m.propose([CREDIT_A5]) for _ in range(3)] == [Won(1), Won(2), Won(3)]
    assert isinstance(m.propose([]), Rejected)
    assert m.propose([CREDIT_A5]) == Won(4)


@pytest.mark.parametrize(
    "steps",
    [
        [],
        None,
        [{"op": "transfer", "account": "a", "amount": 1}],
        [{"op": "credit", "account": "a"}],
        [{"op": "credit", "account": "", "amount": 1}],
        [{"op": "credit", "account": "a", "amount": 0}],
        [{"op": "credit", "account": "a", "amount": True}],
        [{"op": "credit", "account": "a", "amount": 1.5}],
        [{"op": "fail", "account": "a"}],
        [CREDIT_A5, "credit"],
    ],
)
def test_a_malformed_plan_is_rejected_and_changes_nothing(steps):
    m = ApprovedPlanModel()
    assert isinstance(m.propose(steps), Rejected)
    assert m == ApprovedPlanModel()


def test_approval_freezes_the_payload():
    m, pid = model_at(Status.PENDING)
    assert m.revise(pid, [CREDIT_B3]) == Won()
    assert m.proposal(pid).steps == (Step("credit", "b", 3),)
    assert m.approve(pid) == Won()
    assert m.revise(pid, [CREDIT_A5]) == LostRace("revise: not pending")
    assert m.proposal(pid).steps == (Step("credit", "b", 3),)


def test_the_claim_has_exactly_one_winner_and_starts_the_lease_on_the_db_clock():
    m, pid = model_at(Status.APPROVED)
    m.advance(42)
    assert m.mark_executing(pid) == Won(1)
    assert m.mark_executing(pid) == LostRace("mark_executing: not approved")
    p = m.proposal(pid)
    assert (p.status, p.generation, p.heartbeat_at) == (Status.EXECUTING, 1, 42)


@pytest.mark.parametrize("first", ["expire", "mark_executing"])
def test_expiry_and_the_claim_race_and_exactly_one_wins(first):
    m, pid = model_at(Status.APPROVED)
    second = {"expire": "mark_executing", "mark_executing": "expire"}[first]
    assert isinstance(getattr(m, first)(pid), Won)
    assert getattr(m, second)(pid) == ap.lost(second)


# ---------------------------------------------------------------------------
# Steps: order, identity, the first step that is not ok.
# ---------------------------------------------------------------------------


def test_the_run_stops_at_the_first_step_that_is_not_ok_and_keeps_the_ones_before():
    m, pid = model_at(
        Status.EXECUTING, (CREDIT_A5, {"op": "debit", "account": "b", "amount": 1}, CREDIT_B3)
    )
    assert m.run_step(pid, 0, 1) == Won(Receipt(0, True, "credited 5 to a"))
    assert m.run_step(pid, 1, 1) == Won(Receipt(1, False, "b holds less than 1"))
    p = m.proposal(pid)
    assert (p.status, p.failure) == (Status.FAILED, "step 1: b holds less than 1")
    assert m.run_step(pid, 2, 1) == LostRace("run_step: not executing")
    s = m.state()
    assert s.balances == (("a", 5),)
    assert s.ledger == (LedgerEntry(pid, 0, "a", 5),)


def test_a_debit_moves_money_only_when_the_account_holds_it():
    m, pid = model_at(Status.EXECUTING, (CREDIT_A5, {"op": "debit", "account": "a", "amount": 5}))
    m.run_step(pid, 0, 1)
    assert m.run_step(pid, 1, 1) == Won(Receipt(1, True, "debited 5 from a"))
    assert m.state().balances == (("a", 0),)
    assert m.proposal(pid).status is Status.EXECUTED


def test_step_identity_is_the_position_in_the_frozen_payload():
    m, pid = model_at(Status.EXECUTING, (CREDIT_A5, CREDIT_B3, CREDIT_A5))
    first = m.run_step(pid, 0, 1)
    before = m.copy()
    m.advance(5)
    assert m.run_step(pid, 0, 1) == first  # asked again: answered from the receipt, not re-applied
    assert m.state() == before.state()
    assert m.run_step(pid, 2, 1) == Rejected("run_step: step 2 out of order, step 1 is next")
    assert m.run_step(pid, 3, 1) == Rejected("run_step: no step 3 in a plan of 3")
    assert m.run_step(pid, -1, 1) == Rejected("run_step: no step -1 in a plan of 3")
    assert m.state() == before.state()
    assert [e.step_index for e in m.state().ledger] == [0]


def test_the_fence_wants_the_claims_token():
    m, pid = model_at(Status.EXECUTING)
    before = m.copy()
    assert m.run_step(pid, 0, 2) == LostRace("run_step: token 2 does not hold the claim")
    assert m.heartbeat(pid, 0) == LostRace("heartbeat: token 0 does not hold the claim")
    assert m == before


# ---------------------------------------------------------------------------
# Lease, lazy heal, fence.
# ---------------------------------------------------------------------------


def test_the_lazy_heal_fires_once_the_heartbeat_interval_has_passed():
    """Model instant t is a database instant just after t: at stamp + 120 the database has seen
    strictly more than 120 s, which its ``heartbeat_at < now() - 120 s`` calls stale."""
    m, pid = model_at(Status.EXECUTING)  # claimed at 0
    m.advance(100)
    m.run_step(pid, 0, 1)  # stamps 100
    m.advance(119)  # 219: within the lease
    assert m.read(pid).value.status is Status.EXECUTING
    m.advance(1)  # 220: the interval has passed
    seen = m.read(pid).value
    assert (seen.status, seen.failure) == (Status.FAILED, INTERRUPTED)
    assert seen.receipts == (Receipt(0, True, "credited 5 to a"),)


def test_a_heartbeat_renews_the_lease_and_the_interval_is_configurable():
    m = ApprovedPlanModel(heartbeat_s=10)
    pid = m.propose([CREDIT_A5]).value
    m.approve(pid)
    m.mark_executing(pid)
    m.advance(9)
    assert m.heartbeat(pid, 1) == Won()
    m.advance(9)
    assert m.read(pid).value.status is Status.EXECUTING
    m.advance(1)
    assert m.read(pid).value.status is Status.FAILED


def test_no_reaper_runs_in_the_background_healing_waits_for_a_read():
    m, pid = model_at(Status.EXECUTING)
    m.advance(10_000)
    assert m.proposal(pid).status is Status.EXECUTING
    # nobody looked, so the late owner still holds the run and its step lands
    assert m.run_step(pid, 0, 1) == Won(Receipt(0, True, "credited 5 to a"))
    assert m.read(pid).value.status is Status.EXECUTING


def test_the_fence_refuses_a_stale_executor_after_the_heal():
    m, pid = model_at(Status.EXECUTING)
    m.run_step(pid, 0, 1)
    m.advance(121)
    assert m.read(pid).value.status is Status.FAILED
    after_heal = m.copy()
    assert m.run_step(pid, 1, 1) == LostRace("run_step: not executing")
    assert m.heartbeat(pid, 1) == LostRace("heartbeat: not executing")
    assert m == after_heal
    assert [e.step_index for e in m.state().ledger] == [0]


# ---------------------------------------------------------------------------
# Repeat requests and compensation.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "status", [Status.EXECUTED, Status.FAILED, Status.EXPIRED, Status.REJECTED], ids=str
)
def test_a_terminal_run_answers_repeats_from_its_receipts_and_never_reexecutes(status):
    m, pid = model_at(status)
    before = m.copy()
    answers = [m.repeat(pid) for _ in range(3)]
    assert answers[0] == answers[1] == answers[2]
    assert answers[0].value.receipts == m.proposal(pid).receipts
    assert answers[0].value.status is status
    assert m == before


@pytest.mark.parametrize("status", [Status.PENDING, Status.APPROVED, Status.EXECUTING], ids=str)
def test_a_repeat_on_a_live_run_is_refused(status):
    m, pid = model_at(status)
    assert m.repeat(pid) == Rejected(f"repeat: run is {status.value}, not terminal")


def test_a_repeat_reads_so_it_heals_a_stale_run_first():
    m, pid = model_at(Status.EXECUTING)
    m.advance(121)
    assert m.repeat(pid).value.failure == INTERRUPTED


def test_compensation_is_a_separate_linked_run_with_its_own_receipts():
    m, pid = failed_after_credits()
    original = m.proposal(pid)
    assert m.state().balances == (("a", 5), ("b", 3))
    out = m.compensate(pid)
    assert out == Won(2)
    comp = m.proposal(2)
    assert (comp.status, comp.compensates) == (Status.PENDING, pid)
    assert comp.steps == (Step("debit", "b", 3), Step("debit", "a", 5))  # reverse order
    assert m.compensate(pid) == Won(2)  # asked again: the same compensation, not a second one
    assert m.revise(2, [CREDIT_A5]) == ap.COMPENSATION_IS_FROZEN
    m.approve(2)
    token = m.mark_executing(2).value
    assert [m.run_step(2, i, token).value.ok for i in range(2)] == [True, True]
    assert m.proposal(2).status is Status.EXECUTED
    assert m.state().balances == (("a", 0), ("b", 0))
    assert m.proposal(pid) == original  # the original's receipts are untouched
    assert {(e.proposal_id, e.step_index) for e in m.state().ledger} == {
        (1, 0),
        (1, 1),
        (2, 0),
        (2, 1),
    }


def test_compensation_is_not_atomicity_its_own_steps_can_fail():
    m, pid = model_at(Status.EXECUTED, (CREDIT_A5,))
    spender = m.propose([{"op": "debit", "account": "a", "amount": 4}]).value
    m.approve(spender)
    m.mark_executing(spender)
    m.run_step(spender, 0, 1)
    comp = m.compensate(pid).value
    m.approve(comp)
    m.mark_executing(comp)
    assert m.run_step(comp, 0, 1) == Won(Receipt(0, False, "a holds less than 5"))
    assert m.proposal(comp).status is Status.FAILED
    assert m.state().balances == (("a", 1),)


@pytest.mark.parametrize(
    "status",
    [Status.PENDING, Status.APPROVED, Status.EXECUTING, Status.EXPIRED, Status.REJECTED],
    ids=str,
)
def test_only_a_run_that_committed_steps_can_be_compensated(status):
    m, pid = model_at(status)
    before = m.copy()
    assert m.compensate(pid) == ap.compensation_refusal(status)
    assert m == before


def test_a_run_with_no_ok_step_has_nothing_to_compensate():
    m, pid = model_at(Status.EXECUTING, (FAIL,))
    m.run_step(pid, 0, 1)
    assert m.compensate(pid) == ap.NOTHING_TO_COMPENSATE


def test_compensating_a_stale_run_heals_it_first():
    m, pid = model_at(Status.EXECUTING)
    m.run_step(pid, 0, 1)
    m.advance(121)
    assert m.compensate(pid) == Won(2)
    assert m.proposal(pid).status is Status.FAILED
    assert m.proposal(2).steps == (Step("debit", "a", 5),)


# ---------------------------------------------------------------------------
# Views, invariants, copies.
# ---------------------------------------------------------------------------


def test_the_invariants_hold_along_a_whole_story():
    m = ApprovedPlanModel()
    story = [
        lambda: m.propose([CREDIT_A5, CREDIT_B3, FAIL]),
        lambda: m.approve(1),
        lambda: m.mark_executing(1),
        lambda: m.run_step(1, 0, 1),
        lambda: m.run_step(1, 0, 1),
        lambda: m.run_step(1, 1, 1),
        lambda: m.run_step(1, 2, 1),
        lambda: m.repeat(1),
        lambda: m.compensate(1),
        lambda: m.approve(2),
        lambda: m.mark_executing(2),
        lambda: m.run_step(2, 0, 1),
        lambda: m.advance(121),
        lambda: m.read(2),
        lambda: m.run_step(2, 1, 1),
        lambda: m.repeat(2),
        lambda: m.propose([CREDIT_A5]),
        lambda: m.expire(3),
    ]
    for op in story:
        before = m.views()
        op()
        assert check_invariants(CONTRACT, before, m.views()) == []
    v = m.views()
    assert v["1"].status == "failed" and v["1"].fence_token == 1
    assert v["1"].valid_step_ids == {"0", "1", "2"}
    assert {k: (s.receipts, s.effects, s.failed) for k, s in v["1"].steps.items()} == {
        "0": (1, 1, 0),
        "1": (1, 1, 0),
        "2": (0, 0, 1),
    }  # the failed step: a receipt, no effect
    assert {k: (s.receipts, s.effects) for k, s in v["2"].steps.items()} == {"0": (1, 1)}


def test_views_count_effects_from_the_data_not_from_receipts():
    m, pid = failed_after_credits()
    s = m.state()
    twice = PlanState(s.proposals, s.balances, s.ledger + (LedgerEntry(pid, 0, "a", 5),))
    stray = PlanState(s.proposals, s.balances, s.ledger + (LedgerEntry(pid, 7, "a", 5),))
    kinds = {v.invariant for v in check_invariants(CONTRACT, ap.views(s), ap.views(twice))}
    assert {
        "receipt-with-effect",
        "stable-step-identity",
        "terminal-answers-from-receipts",
    } == kinds
    kinds = {v.invariant for v in check_invariants(CONTRACT, ap.views(s), ap.views(stray))}
    assert "stable-step-identity" in kinds


def test_copy_is_independent_and_equality_is_the_observable_state():
    m, pid = model_at(Status.EXECUTING)
    c = m.copy()
    assert c == m
    c.run_step(pid, 0, 1)
    assert c != m and m.state().ledger == ()
    d = m.copy()
    d.advance(1)
    assert d != m  # the clock is part of what the model will do next
    other, _ = model_at(Status.EXECUTING)
    assert other == m


def test_every_transition_is_logged_for_the_check_to_count():
    m = ApprovedPlanModel()
    pid = m.propose([CREDIT_A5, FAIL]).value
    m.approve(pid)
    m.mark_executing(pid)
    m.heartbeat(pid, 1)
    m.run_step(pid, 0, 1)
    m.run_step(pid, 1, 1)
    assert m.approve(pid) == ap.lost("approve")  # a lost race takes no transition
    assert m.transitions == [
        (pid, CREATED, "propose", "pending"),
        (pid, "pending", "approve", "approved"),
        (pid, "approved", "mark_executing", "executing"),
        (pid, "executing", "heartbeat", "executing"),
        (pid, "executing", "step_ok", "executing"),
        (pid, "executing", "step_failed", "failed"),
    ]
    comp = m.compensate(pid).value
    assert m.transitions[-1] == (comp, CREATED, "compensate", "pending")
    c = m.copy()
    c.transitions.clear()
    assert len(m.transitions) == 7  # a copy logs on its own
