"""The generic queue model (``knownstate.model.generic``): fast, pure.

Run from the outbox's description, it must be the hand-written outbox model: the same outcome
for every operation and the same rows after it, on random operation sequences (a Hypothesis
state machine drives both). Then what the generic model adds: the fence kinds predict what a
described system does (a weak fence lets a stale owner's write land, and ``owns`` still says it
lost the run, which the lease-fence invariant judges), a description it cannot run is refused
with a hint, and the durations a check runs with are whole quanta.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from knownstate.model import generic, outbox
from knownstate.model.contract import LostRace, Won, Write, check_invariants
from knownstate.model.describe import Fence, Lease, Retry
from knownstate.model.approved_plan import DESCRIPTION as APPROVED_PLAN
from knownstate.model.outbox import DESCRIPTION as OUTBOX
from knownstate.model.generic import GenericModel, Job, Timing


def normal(outcome):
    """Outcomes of the two models in one shape: claims as (key, attempt), writes as Won/Lost."""
    if isinstance(outcome, LostRace):
        return "lost"
    value = outcome.value
    if isinstance(value, tuple):
        return tuple(
            (str(c.id), c.attempt)
            if isinstance(c, outbox.Claim)
            else (c.key, c.attempt)
            if isinstance(c, Job)
            else str(c)
            for c in value
        )
    return "won"


class SameAsOutbox(RuleBasedStateMachine):
    """The generic model, run from the outbox's description, against the outbox model."""

    def __init__(self):
        super().__init__()
        self.hand = outbox.OutboxModel(outbox.Config())
        self.generic = GenericModel(OUTBOX)
        self.claims: list[outbox.Claim] = []

    def both(self, hand_op, generic_op):
        a, b = hand_op(self.hand), generic_op(self.generic)
        assert normal(a) == normal(b), (a, b)
        return a

    @rule()
    def enqueue(self):
        key = self.hand.next_id()
        self.both(lambda m: m.enqueue(key), lambda m: m.enqueue(str(key)))

    @rule(batch=st.integers(1, 3))
    def claim(self, batch):
        got = self.both(lambda m: m.claim(batch), lambda m: m.claim(batch))
        self.claims += list(got.value)

    @precondition(lambda self: self.claims)
    @rule(data=st.data(), op=st.sampled_from(["extend", "complete", "retry", "permanent"]))
    def write(self, data, op):
        c = data.draw(st.sampled_from(self.claims))
        job = Job(str(c.id), c.attempt)
        if op == "extend":
            self.both(lambda m: m.extend_lease(c), lambda m: m.extend_lease(job))
        elif op == "complete":
            self.both(lambda m: m.complete(c), lambda m: m.complete(job))
        else:
            permanent = op == "permanent"
            self.both(lambda m: m.fail(c, permanent), lambda m: m.fail(job, permanent))

    @rule()
    def reclaim_stale(self):
        self.both(lambda m: m.reclaim_stale(), lambda m: m.reclaim_stale())

    @rule(seconds=st.sampled_from([60, 120, 300, 360, 3600]))
    def advance(self, seconds):
        self.hand.advance(seconds)
        self.generic.advance(seconds)

    @invariant()
    def same_rows_and_transitions(self):
        hand = [
            (str(d.id), d.status, d.attempts, d.next_attempt_at, d.lease_until)
            for d in self.hand.state()
        ]
        mine = [
            (r.key, r.status, r.attempts, r.due, r.lease_until)
            for r in sorted(self.generic.runs.values(), key=lambda r: r.seq)
        ]
        assert hand == mine
        assert [(str(i), *rest) for i, *rest in self.hand.transitions] == self.generic.transitions


TestSameAsOutbox = SameAsOutbox.TestCase
TestSameAsOutbox.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def stale_after_reclaim(fence: str):
    """A run claimed (attempt 1), its lease lapsed, taken back and claimed again (attempt 2);
    the first owner then writes. Returns the model and the outcome of that write."""
    d = OUTBOX.model_copy(update={"fence": Fence(kind=fence)})
    m = GenericModel(d)
    m.enqueue("1")
    first = m.claim(1).value[0]
    m.advance(300)
    m.reclaim_stale()
    m.claim(1)
    return m, first


def test_the_attempt_fence_refuses_the_stale_owner():
    m, first = stale_after_reclaim("attempt")
    assert m.complete(first) == LostRace("fenced") and m.runs["1"].status == "processing"


@pytest.mark.parametrize("fence", ["status", "none"])
def test_a_weak_fence_lets_the_stale_owner_write_and_the_invariant_names_it(fence):
    m, first = stale_after_reclaim(fence)
    m.sent("1")  # the stale owner's call went out (at-least-once)
    before = m.views()
    assert not m.owns(first)
    assert m.complete(first) == Won() and m.runs["1"].status == "sent"
    broken = check_invariants(
        OUTBOX.contract(),
        before,
        m.views(),
        [Write("1", first.attempt, accepted=True, owner_current=False)],
    )
    assert {v.invariant for v in broken} == {"lease-fence"}


def test_no_fence_at_all_writes_even_on_a_run_taken_back():
    d = OUTBOX.model_copy(update={"fence": Fence(kind="none")})
    m = GenericModel(d)
    m.enqueue("1")
    first = m.claim(1).value[0]
    m.advance(300)
    m.reclaim_stale()
    assert m.runs["1"].status == "pending"
    assert m.complete(first) == Won() and m.transitions[-1] == ("1", "pending", "complete", "sent")


def test_a_repeated_key_is_the_same_run_with_an_idempotency_key():
    m = GenericModel(OUTBOX.model_copy(update={"idempotency_key": "key, unique"}))
    assert m.enqueue("1") == m.enqueue("1") == Won("1") and len(m.runs) == 1


def test_a_failed_run_owes_its_backoff_in_the_retry_view():
    m = GenericModel(OUTBOX)
    m.enqueue("1")
    job = m.claim(1).value[0]
    m.fail(job, permanent=False)
    owed = generic.views(OUTBOX, m.timing, m.state(), {}, owing=frozenset({"1"}))["1"].retry
    assert owed.waiting and owed.owed == 60 and owed.due_in == 60
    assert generic.views(OUTBOX, m.timing, m.state(), {})["1"].retry.owed == 0


@pytest.mark.parametrize(
    "changes, hint",
    [
        (
            {
                "transitions": tuple(t for t in OUTBOX.transitions if t[1] != "extend_lease"),
                "lease": OUTBOX.lease.model_copy(update={"heartbeat": 60}),
            },
            "a heartbeat is the 'extend_lease' event",
        )
    ],
)
def test_a_description_the_generic_queue_cannot_run_is_refused_with_a_hint(changes, hint):
    with pytest.raises(ValueError, match=hint):
        GenericModel(OUTBOX.model_copy(update=changes))


def test_a_lease_in_the_applications_clock_is_stamped_and_judged_by_it():
    """``Lease(clock="application")`` (checked on the real parts in test_app_clock_lease): the
    database's clock jumps leave the lease as it was, the application's skew moves it."""
    lease = OUTBOX.lease.model_copy(update={"clock": "application"})
    m = GenericModel(OUTBOX.model_copy(update={"lease": lease}))
    m.enqueue("1")
    m.claim(1)
    m.advance(600)  # the database's clock: past the lease by it, not by the application's
    assert not m.lapsed(m.runs["1"]) and m.observe(m.runs["1"]).lease_left == 300
    m.skew_app(300)
    assert m.lapsed(m.runs["1"]) and m.reclaim_stale() == Won(("1",))


def test_events_outside_the_vocabulary_are_named():
    problems = generic.fit_problems(APPROVED_PLAN)
    assert len(problems) == 1 and "'mark_executing'" in problems[0]
    assert "write a model by hand" in problems[0]


@pytest.mark.parametrize(
    "lease, base, cap, scale",
    [
        ("5m", "1m", "1h", 1),
        ("30s", "10s", "10m", 6),
        ("45s", "20s", None, 12),
        ("2m", "90s", None, 2),
    ],
)
def test_durations_are_scaled_to_whole_quanta(lease, base, cap, scale):
    d = OUTBOX.model_copy(
        update={
            "lease": Lease(seconds=lease, taken_back_by=("reclaim", "reclaim_dead")),
            "retry": Retry(max_attempts=3, base=base, cap=cap),
        }
    )
    t = Timing.of(d, quantum=60)
    assert t.scale == scale
    assert all(v % 60 == 0 for v in (t.lease, t.backoff_base, t.backoff_cap or 60))
    assert t.lease * d.retry.base == t.backoff_base * d.lease.seconds  # ratios kept


def test_a_lapsed_run_is_claimable_once_reaped_only_while_it_has_attempts_left():
    """A run whose lease lapsed can be claimed again once the reaper took it back, unless the
    reaper ends it, its attempts spent: a block that freezes its holder's write while the run
    is 'taken back and claimed' must not aim at one the claim can never take (it was counted
    so, and a completion that reads its attempt first passed outbox seed 3)."""
    d = OUTBOX.model_copy(update={"retry": OUTBOX.retry.model_copy(update={"max_attempts": 2})})
    m = GenericModel(d)
    m.enqueue("1")
    m.enqueue("2")
    m.claim(1)  # run 1, attempt 1
    m.advance(300)
    assert [m.claimable_once_reaped(r) for r in m.runs.values()] == [True, False]  # 2 waits
    m.reclaim_stale()
    m.claim(2)  # run 1 at attempt 2, its last; run 2 at attempt 1
    m.advance(300)
    assert {k: m.claimable_once_reaped(r) for k, r in m.runs.items()} == {"1": False, "2": True}
    assert m.reclaim_stale() == Won(("1", "2"))
    assert m.runs["1"].status == "dead" and m.claim(2) == Won((Job("2", 2),))


def test_a_copy_is_a_state_of_its_own_sharing_only_what_never_changes():
    m = GenericModel(OUTBOX)
    m.enqueue("1")
    m.claim(1)
    c = m.copy()
    assert (c.d, c.timing, c.table) == (m.d, m.timing, m.table)
    assert c.d is m.d and c.table is m.table  # immutable: shared, not copied at every step
    assert c.runs == m.runs and c.runs["1"] is not m.runs["1"]
    c.advance(3600)
    c.reclaim_stale()
    c.enqueue("2")
    assert m.runs["1"].status == OUTBOX.owned[0] and "2" not in m.runs and m.now == 0
