"""The outbox model on its own: fast, pure, no database.

Every row of the transition table is taken by the operation that owns it; an illegal step raises
and leaves the state unchanged; a stale owner is fenced (a lost race, nothing changes); the reaper
takes back only lapsed leases and never a terminal row; the backoff and its cap; dead at the
attempt limit; the claim's order and batch; an id enqueued twice is refused; the batched
completion moves each row as complete/fail would and fences each row on its own. Then a
Hypothesis state machine: any sequence of operations (batches included), stale tokens and clock
moves keeps the contract's invariants, terminal rows never change and attempts never decrease.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from knownstate.model import outbox
from knownstate.model.contract import (
    CREATED,
    IllegalTransition,
    LostRace,
    Rejected,
    Write,
    Won,
    check_invariants,
)
from knownstate.model.outbox import (
    CONTRACT,
    OK,
    PERMANENT,
    RETRYABLE,
    TABLE,
    Claim,
    Config,
    Delivery,
    OutboxModel,
    Report,
    Status,
)

P, R, S, F, D = (s.value for s in Status)


def claimed(m: OutboxModel, id: int = 1) -> Claim:
    """Enqueue ``id`` and claim it; the only due row, so the claim is exactly it."""
    m.enqueue(id)
    out = m.claim(1)
    assert isinstance(out, Won) and len(out.value) == 1
    return out.value[0]


def at_last_attempt(m: OutboxModel) -> Claim:
    """Delivery 1 claimed for the ``max_attempts``-th time (each earlier attempt retried)."""
    c = claimed(m)
    while c.attempt < m.config.max_attempts:
        assert m.fail(c, permanent=False) == Won(P)
        m.advance(m.config.backoff_cap)
        c = m.claim(1).value[0]
    return c


def drive(event: str) -> OutboxModel:
    """A model that has just taken ``event`` through the operation that owns it."""
    m = OutboxModel()
    if event == "enqueue":
        m.enqueue(1)
    elif event == "claim":
        claimed(m)
    elif event == "extend_lease":
        m.extend_lease(claimed(m))
    elif event == "complete":
        m.complete(claimed(m))
    elif event == "fail_permanent":
        m.fail(claimed(m), permanent=True)
    elif event == "retry":
        m.fail(claimed(m), permanent=False)
    elif event == "give_up":
        m.fail(at_last_attempt(m), permanent=False)
    elif event == "reclaim":
        claimed(m)
        m.advance(m.config.lease)
        m.reclaim_stale()
    elif event == "reclaim_dead":
        at_last_attempt(m)
        m.advance(m.config.lease)
        m.reclaim_stale()
    else:  # pragma: no cover - a new table row needs a driver here
        raise AssertionError(f"no driver for {event}")
    return m


# ---------------------------------------------------------------------------
# The table, row by row.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "t", TABLE.transitions, ids=[f"{t.source}-{t.event}-{t.target}" for t in TABLE.transitions]
)
def test_every_row_of_the_table_is_taken_by_its_operation(t):
    m = drive(t.event)
    assert m.transitions[-1] == (1, t.source, t.event, t.target)
    assert m.deliveries[1].status == t.target


def test_the_table_is_the_seeds_outbox_column():
    assert set(TABLE.statuses()) == {s.value for s in Status}
    assert CONTRACT.terminal == {S, F, D}
    assert TABLE.edges() == {(CREATED, P), (P, R), (R, R), (R, S), (R, F), (R, P), (R, D)}
    for terminal in CONTRACT.terminal:  # nothing leaves a terminal status
        assert not any(t.source == terminal for t in TABLE.transitions)


TERMINAL_EVENTS = ["complete", "fail_permanent", "give_up", "reclaim_dead"]


@pytest.mark.parametrize(
    "status, event",
    [
        (P, "complete"),
        (P, "retry"),
        (P, "reclaim"),
        (P, "enqueue"),
        (S, "claim"),
        (S, "reclaim"),
        (F, "retry"),
        (D, "claim"),
        (R, "claim"),
        (R, "enqueue"),
    ],
)
def test_an_illegal_step_raises_and_leaves_the_state_unchanged(status, event):
    m = OutboxModel()
    m.deliveries[1] = Delivery(1, status, 1, 0, 300 if status == R else None)
    snapshot = m.copy()
    with pytest.raises(IllegalTransition) as info:
        m._move(m.deliveries[1], event)
    assert (info.value.kind, info.value.status, info.value.event) == ("outbox", status, event)
    assert m == snapshot and m.transitions == snapshot.transitions


# ---------------------------------------------------------------------------
# Fence, reaper, retry policy, claim.
# ---------------------------------------------------------------------------


def reclaimed_and_reclaimed_again() -> tuple[OutboxModel, Claim, Claim]:
    """Owner A's lease lapsed, the reaper took the row back, owner B claimed it again."""
    m = OutboxModel()
    a = claimed(m)
    m.advance(m.config.lease)
    assert m.reclaim_stale() == Won((1,))
    b = m.claim(1).value[0]
    assert (a.attempt, b.attempt) == (1, 2)
    return m, a, b


@pytest.mark.parametrize("write", ["complete", "fail_retry", "fail_permanent", "extend_lease"])
def test_a_stale_owner_is_fenced_and_changes_nothing(write):
    m, stale, current = reclaimed_and_reclaimed_again()
    snapshot = m.copy()
    out = {
        "complete": lambda c: m.complete(c),
        "fail_retry": lambda c: m.fail(c, permanent=False),
        "fail_permanent": lambda c: m.fail(c, permanent=True),
        "extend_lease": lambda c: m.extend_lease(c),
    }[write](stale)
    assert isinstance(out, LostRace)
    assert m == snapshot and m.transitions == snapshot.transitions
    assert m.complete(current) == Won(S)  # the current owner still can


def test_a_claim_on_a_terminal_row_is_fenced_too():
    m = OutboxModel()
    c = claimed(m)
    assert m.complete(c) == Won(S)
    snapshot = m.copy()
    # a repeated terminal write: a lost race, not an error
    assert isinstance(m.complete(c), LostRace)
    assert isinstance(m.fail(c, permanent=False), LostRace)
    assert m == snapshot


def test_extend_lease_moves_the_lease_from_now():
    m = OutboxModel(Config(lease=300))
    c = claimed(m)
    m.advance(200)
    assert m.extend_lease(c) == Won()
    assert m.deliveries[1].lease_until == 500
    m.advance(299)
    assert m.reclaim_stale() == Won(())  # the extension kept it
    m.advance(1)
    assert m.reclaim_stale() == Won((1,))


def test_the_reaper_takes_only_lapsed_leases_at_the_boundary():
    m = OutboxModel(Config(lease=300))
    claimed(m)
    m.advance(299)
    assert m.reclaim_stale() == Won(())
    assert m.deliveries[1].status == R
    m.advance(1)  # lease_until <= now: lapsed (the SQL's `lease_until <= now()`)
    assert m.reclaim_stale() == Won((1,))
    assert m.deliveries[1] == Delivery(1, P, 1, next_attempt_at=300, lease_until=None)


def test_the_reaper_never_touches_a_terminal_row():
    m = OutboxModel(Config(max_attempts=1))
    for i in (1, 2, 3, 4):
        m.enqueue(i)
    c1, c2, c3, c4 = m.claim(4).value
    m.complete(c1)
    m.fail(c2, permanent=True)
    m.fail(c3, permanent=False)  # attempt 1 of 1: dead
    terminal = {i: m.deliveries[i] for i in (1, 2, 3)}
    assert [d.status for d in terminal.values()] == [S, F, D]
    m.advance(10**6)
    assert m.reclaim_stale() == Won((4,))
    assert {i: m.deliveries[i] for i in (1, 2, 3)} == terminal
    assert m.deliveries[4].status == D  # reclaimed at the limit: reclaim_dead


def test_backoff_doubles_from_the_base_up_to_the_cap():
    cfg = Config(backoff_base=60, backoff_cap=600)
    assert [cfg.backoff(a) for a in range(0, 7)] == [60, 60, 120, 240, 480, 600, 600]
    assert Config().backoff(1) == 60 and Config().backoff(7) == 3600


def test_a_retry_is_pending_again_after_the_backoff():
    cfg = Config(backoff_base=60, backoff_cap=100, max_attempts=5)
    m = OutboxModel(cfg)
    c = claimed(m)
    m.advance(7)
    assert m.fail(c, permanent=False) == Won(P)
    assert m.deliveries[1] == Delivery(1, P, attempts=1, next_attempt_at=67, lease_until=None)
    m.advance(59)
    assert m.claim(1) == Won(())  # not due yet
    m.advance(1)
    c = m.claim(1).value[0]
    assert c == Claim(1, 2)
    m.fail(c, permanent=False)
    assert m.deliveries[1].next_attempt_at == 67 + 100  # 120, capped at 100


def test_dead_at_max_attempts_and_not_before():
    m = OutboxModel(Config(max_attempts=3))
    c = claimed(m)
    for attempt in (1, 2):
        assert c.attempt == attempt
        assert m.fail(c, permanent=False) == Won(P)
        m.advance(m.config.backoff_cap)
        c = m.claim(1).value[0]
    assert c.attempt == 3
    assert m.fail(c, permanent=False) == Won(D)
    m.advance(10**6)
    assert m.claim(5) == Won(())  # dead is never claimed again


def test_the_claim_takes_due_pending_rows_in_id_order_at_most_batch_and_bumps_attempts():
    m = OutboxModel(Config(lease=300))
    for i in (5, 2, 9, 7):
        m.enqueue(i)
    assert m.claim(2) == Won((Claim(2, 1), Claim(5, 1)))
    assert m.deliveries[2].lease_until == 300 and m.deliveries[5].status == R
    assert m.claim(10) == Won((Claim(7, 1), Claim(9, 1)))
    assert m.claim(10) == Won(())  # nothing pending: an empty claim, not an error
    assert m.next_id() == 10


def test_a_reclaimed_row_is_claimed_again_with_a_new_token():
    m, stale, current = reclaimed_and_reclaimed_again()
    assert m.deliveries[1].attempts == 2 and current != stale


def test_views_project_a_sent_row_as_its_own_receipt():
    m = OutboxModel()
    c = claimed(m)
    m.sink_received(1)
    m.sink_received(1)
    m.complete(c)
    v = m.views()["1"]
    assert (v.status, v.fence_token) == (S, 1)
    assert v.steps[outbox.STEP].receipts == v.steps[outbox.STEP].effects == 1
    assert v.steps[outbox.STEP].external_calls == 2  # a duplicate delivery is visible, and allowed


# ---------------------------------------------------------------------------
# Enqueue refuses a taken id.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("status", [P, R, S])
def test_enqueue_with_a_taken_id_is_refused_and_changes_nothing(status):
    m = OutboxModel()
    c = claimed(m)
    if status == S:
        m.complete(c)
    elif status == P:
        m.fail(c, permanent=False)
    snapshot = m.copy()
    assert m.enqueue(1) == Rejected(outbox.DUPLICATE_ID)
    assert m == snapshot and m.transitions == snapshot.transitions
    assert m.deliveries[1].status == status and m.deliveries[1].attempts == 1
    assert m.enqueue(2) == Won(2)  # the next id is still free


# ---------------------------------------------------------------------------
# The batched completion.
# ---------------------------------------------------------------------------


def test_a_batch_moves_each_row_by_its_own_result():
    """complete, permanent failure, retry with backoff and dead at the limit, in one batch."""
    m = OutboxModel(Config(lease=300, backoff_base=60, backoff_cap=600, max_attempts=2))
    m.enqueue(4)
    (c4,) = m.claim(1).value
    assert m.fail(c4, permanent=False) == Won(P)  # row 4 goes on to its second, last attempt
    m.advance(60)
    for i in (1, 2, 3):
        m.enqueue(i)
    c1, c2, c3, c4 = m.claim(4).value
    assert (c1.attempt, c4.attempt) == (1, 2)
    m.advance(7)
    n = len(m.transitions)
    out = m.record_batch(
        [Report(c3, RETRYABLE), Report(c1, OK), Report(c4, RETRYABLE), Report(c2, PERMANENT)]
    )
    assert out == Won((Won(P), Won(S), Won(D), Won(F)))  # in the order of the reports
    assert m.deliveries[1] == Delivery(1, S, 1, 60, None)
    assert m.deliveries[2] == Delivery(2, F, 1, 60, None)
    assert m.deliveries[3] == Delivery(3, P, 1, 67 + 60, None)  # backoff from now
    assert m.deliveries[4] == Delivery(4, D, 2, 60, None)
    assert [t[2] for t in m.transitions[n:]] == ["retry", "complete", "give_up", "fail_permanent"]


def test_a_stale_row_in_a_batch_is_a_lost_race_for_that_row_alone():
    m, stale, current = reclaimed_and_reclaimed_again()
    m.enqueue(2)
    (c2,) = m.claim(1).value
    before = m.deliveries[1]
    out = m.record_batch([Report(stale, OK), Report(c2, OK)])
    assert out == Won((LostRace("fenced"), Won(S)))
    assert m.deliveries[1] == before  # the current owner's row is untouched
    assert m.deliveries[2].status == S
    assert m.record_batch([Report(current, PERMANENT)]) == Won((Won(F),))


def test_a_batch_of_only_stale_rows_changes_nothing():
    m, stale, _ = reclaimed_and_reclaimed_again()
    snapshot = m.copy()
    assert m.record_batch([Report(stale, RETRYABLE)]) == Won((LostRace("fenced"),))
    assert m == snapshot and m.transitions == snapshot.transitions


def test_a_batch_naming_a_row_twice_is_refused_whole():
    m = OutboxModel()
    m.enqueue(1)
    m.enqueue(2)
    c1, c2 = m.claim(2).value
    snapshot = m.copy()
    assert m.record_batch([Report(c1, OK), Report(c2, OK), Report(c1, RETRYABLE)]) == Rejected(
        outbox.TWICE_IN_BATCH
    )
    assert m == snapshot and m.transitions == snapshot.transitions
    assert m.record_batch([]) == Won(())


def test_a_report_with_an_unknown_result_is_refused_at_once():
    with pytest.raises(ValueError, match="'delivered'.*'ok'"):
        Report(Claim(1, 1), "delivered")


# ---------------------------------------------------------------------------
# Property: any sequence of operations keeps the invariants.
# ---------------------------------------------------------------------------


class OutboxModelMachine(RuleBasedStateMachine):
    """Random operations, stale tokens included. Writes are judged against ownership computed
    here, so a model that lost its fence (or refused its owner) fails the contract check."""

    @initialize(max_attempts=st.integers(1, 4))
    def start(self, max_attempts):
        self.m = OutboxModel(
            Config(lease=300, backoff_base=60, backoff_cap=240, max_attempts=max_attempts)
        )
        self.tokens: list[Claim] = []  # every claim ever handed out, stale ones included
        self.prev: dict[int, Delivery] = {}

    def step(self, fn, writes_for: Claim | None = None):
        before = self.m.views()
        self.prev = dict(self.m.deliveries)
        owner_current = writes_for is not None and (
            (d := self.m.deliveries.get(writes_for.id)) is not None
            and d.status == R
            and d.attempts == writes_for.attempt
        )
        n = len(self.m.transitions)
        out = fn()
        writes = (
            []
            if writes_for is None
            else [
                Write(
                    str(writes_for.id),
                    writes_for.attempt,
                    accepted=isinstance(out, Won),
                    owner_current=owner_current,
                )
            ]
        )
        assert check_invariants(CONTRACT, before, self.m.views(), writes) == []
        for _, src, event, dst in self.m.transitions[n:]:
            assert TABLE.next(src, event) == dst
        return out

    @rule()
    def enqueue(self):
        self.step(lambda: self.m.enqueue(self.m.next_id()))

    @rule(batch=st.integers(1, 3))
    def claim(self, batch):
        out = self.step(lambda: self.m.claim(batch))
        self.tokens.extend(out.value)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), op=st.sampled_from(["complete", "retry", "permanent", "extend"]))
    def write(self, data, op):
        c = data.draw(st.sampled_from(self.tokens), label="token")
        if op != "extend":
            self.m.sink_received(c.id)  # the worker sends first, then records the sink's answer
        fn = {
            "complete": lambda: self.m.complete(c),
            "retry": lambda: self.m.fail(c, permanent=False),
            "permanent": lambda: self.m.fail(c, permanent=True),
            "extend": lambda: self.m.extend_lease(c),
        }[op]
        self.step(fn, writes_for=c)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def write_batch(self, data):
        """A batch of outcomes over distinct rows, stale tokens included: judged row by row."""
        by_id = {c.id: c for c in data.draw(st.permutations(self.tokens), label="tokens")}
        chosen = data.draw(
            st.lists(st.sampled_from(sorted(by_id)), min_size=1, unique=True), label="ids"
        )
        results = st.sampled_from([OK, RETRYABLE, PERMANENT])
        reports = [Report(by_id[i], data.draw(results, label="result")) for i in chosen]
        for r in reports:
            self.m.sink_received(r.claim.id)
        before = self.m.views()
        owners = {r.claim.id: self.m._owned(r.claim) is not None for r in reports}
        self.prev = dict(self.m.deliveries)
        out = self.m.record_batch(reports)
        assert isinstance(out, Won) and len(out.value) == len(reports)
        writes = [
            Write(
                str(r.claim.id),
                r.claim.attempt,
                accepted=isinstance(o, Won),
                owner_current=owners[r.claim.id],
            )
            for r, o in zip(reports, out.value)
        ]
        assert check_invariants(CONTRACT, before, self.m.views(), writes) == []

    @rule(seconds=st.sampled_from([1, 60, 299, 300, 1000]))
    def advance(self, seconds):
        self.step(lambda: self.m.advance(seconds))

    @rule()
    def reap(self):
        self.step(self.m.reclaim_stale)

    @invariant()
    def terminal_rows_never_change_and_attempts_never_decrease(self):
        if not hasattr(self, "m"):
            return
        for i, old in self.prev.items():
            new = self.m.deliveries[i]
            if old.status in CONTRACT.terminal:
                assert new == old
            assert new.attempts >= old.attempts
            assert new.attempts <= self.m.config.max_attempts

    @invariant()
    def a_lease_exactly_while_processing(self):
        if hasattr(self, "m"):
            for d in self.m.deliveries.values():
                assert (d.status == R) == (d.lease_until is not None)
                assert d.status != P or d.attempts < self.m.config.max_attempts


TestOutboxModelMachine = OutboxModelMachine.TestCase
TestOutboxModelMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
