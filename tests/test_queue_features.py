"""What the description language says about real queues (issue 20): fast, pure.

Each feature with its model semantics: a claim that re-picks lapsed work itself (no reaper), a
reaper that does not know the retry policy, attempts counted as retries, a give-up decided on
the worker's count, a guard by id only ("unless terminal"), writes that answer nothing, a
heartbeat per worker (the adapter's claim is told its worker), a claim of one job at a time, a
reaper that re-queues without a retry policy, a re-queue or a new run's schedule stamped by
the application's clock, and a library in autocommit (the COMMIT faults meet its statements).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from knownstate.chaos.genericbuild import required_events
from knownstate.model import generic
from knownstate.model.contract import LostRace, Won, Write, check_invariants
from knownstate.model.describe import Claim, Fence, Lease, Retry, RunKind
from knownstate.model.outbox import DESCRIPTION as OUTBOX
from knownstate.model.generic import GenericModel

QUEUE = dict(
    name="repick",
    owned=("picked",),
    transitions=(
        "(new) -enqueue-> queued",
        "queued -claim-> picked",
        "picked -claim-> picked",
        "picked -extend_lease-> picked",
        "picked -complete-> successful",
        "picked -retry-> queued",
        "picked -give_up-> exception",
    ),
    claim=Claim(how="queued or stale picked jobs", reclaims=True),
    lease=Lease(seconds=60, heartbeat=30),
    fence=Fence(kind="unless-terminal", answers=False),
    receipts="the job row",
    retry=Retry(max_attempts=2, base=60, counts="retries", decided_by="worker"),
    commits="autocommit",
)


def described(**changes) -> RunKind:
    return RunKind(**{**QUEUE, **changes})


def lapsed_and_repicked(d: RunKind):
    """A job claimed by a first worker, its lease lapsed, re-picked by a second claim."""
    m = GenericModel(d)
    m.enqueue("1")
    first = m.claim(1).value[0]
    m.advance(60)
    second = m.claim(1).value[0]
    return m, first, second


# -- a claim that re-picks -------------------------------------------------------------------


def test_a_claim_re_picks_a_lapsed_job_as_it_is_with_no_reaper():
    m, first, second = lapsed_and_repicked(described())
    assert m.transitions[-1] == ("1", "picked", "claim", "picked")
    assert (first.attempt, second.attempt) == (0, 0)  # counting retries, a claim adds none
    assert not m.owns(first) and m.owns(second)  # yet each claim is a new owner
    assert m.reclaim_stale() == Won(())  # nothing else takes it back


def test_a_live_lease_is_not_re_picked():
    m = GenericModel(described())
    m.enqueue("1")
    m.claim(1)
    m.advance(59)
    assert m.claim(1) == Won(())


def test_re_picking_needs_its_transition_and_a_lease_needs_a_way_back():
    moves = tuple(t for t in QUEUE["transitions"] if t != "picked -claim-> picked")
    with pytest.raises(ValueError, match="add 'picked -claim-> picked'"):
        described(transitions=moves)
    with pytest.raises(ValueError, match="Claim\\(reclaims=True\\)"):
        described(claim=Claim(how="queued jobs only"))


# -- a reaper independent of the retry policy ------------------------------------------------


def test_a_reaper_that_does_not_know_the_retry_policy_never_ends_a_run():
    d = OUTBOX.model_copy(
        update={
            "transitions": tuple(t for t in OUTBOX.transitions if t[1] != "reclaim_dead"),
            "lease": Lease(seconds=300, taken_back_by=("reclaim",)),
        }
    )
    assert not generic.fit_problems(d)
    m = GenericModel(d)
    m.enqueue("1")
    for _ in range(m.timing.max_attempts + 1):  # past the limit: taken back, never dead
        job = m.claim(1).value[0]
        m.advance(300)
        assert m.reclaim_stale() == Won(("1",))
    assert m.runs["1"].status == "pending" and job.attempt > m.timing.max_attempts


# -- several waiting statuses -----------------------------------------------------------------

RETRYING = dict(
    QUEUE,
    transitions=(
        "(new) -enqueue-> pending",
        "pending -claim-> running",
        "retrying -claim-> running",
        "running -extend_lease-> running",
        "running -complete-> succeeded",
        "running -retry-> retrying",
        "running -give_up-> failed",
        "running -reclaim-> pending",
    ),
    owned=("running",),
    claim=Claim(how="pending or retrying jobs"),
    lease=Lease(seconds=60, heartbeat=30, taken_back_by=("reclaim",)),
    fence=Fence(kind="claim"),
    retry=Retry(max_attempts=3, base=60),
    commits="transaction",
)


def test_a_run_waits_in_any_status_a_claim_takes_runs_from():
    """A failed run waits in ``retrying`` (not where new runs wait), is due after its backoff
    like any waiting run, is claimed from there, and is shown with its schedule."""
    d = RunKind(**RETRYING)
    assert d.waiting == ("pending", "retrying") and not generic.fit_problems(d)
    m = GenericModel(d)
    m.enqueue("1")
    m.enqueue("2")
    first = m.claim(1).value[0]
    m.fail(first, permanent=False)
    assert m.runs["1"].status == "retrying"
    assert [r.key for r in m.due()] == ["2"]  # backing off: not due yet
    assert m.observe(m.runs["1"]).due_in == 60
    m.advance(60)
    assert [r.key for r in m.due()] == ["1", "2"]  # due again, in creation order
    again = m.claim(1).value[0]
    assert again.key == "1" and m.transitions[-1] == ("1", "retrying", "claim", "running")
    view = generic.views(d, m.timing, m.state(), {}, owing=frozenset())["1"]
    assert view.status == "running" and view.retry.attempts == 2
    m.fail(again, permanent=False)
    assert generic.views(d, m.timing, m.state(), {})["1"].retry.waiting  # owes its backoff


def test_every_waiting_status_needs_its_claim_and_a_retry_goes_to_one():
    with pytest.raises(ValueError, match="'running -retry-> pending'"):  # retried to nowhere
        RunKind(
            **{
                **RETRYING,
                "transitions": tuple(
                    t.replace("running -retry-> retrying", "running -retry-> parked")
                    for t in RETRYING["transitions"]
                )
                + ("parked -give_up-> failed",),
            }
        )
    picked = tuple(  # into the owned status by another event than the claim
        t.replace("retrying -claim->", "retrying -reclaim->") for t in RETRYING["transitions"]
    )
    problems = generic.fit_problems(RunKind(**{**RETRYING, "transitions": picked}))
    assert "the generic queue needs 'retrying -claim-> running'" in problems, problems


# -- chancy's count: executions, no backoff, a take-back that adds to the limit ---------------

CHANCY_RETRY = dict(
    RETRYING,
    retry=Retry(
        max_attempts=2,
        backoff="none",
        counts="executions",
        decided_by="worker",
        taken_back="one-more",
    ),
)


def test_attempts_counted_as_executions_count_finished_runs_not_claims():
    """A claim adds nothing; each run of the work that finishes adds one, succeeded or failed;
    with no backoff a failed run keeps its schedule (due again at once); the run of the work
    that makes ``max_attempts`` of them ends it."""
    d = RunKind(**CHANCY_RETRY)
    m = GenericModel(d)
    m.enqueue("1")
    job = m.claim(1).value[0]
    assert job.attempt == 0 and m.runs["1"].attempts == 0
    m.fail(job, permanent=False)
    assert (m.runs["1"].status, m.runs["1"].attempts, m.runs["1"].due) == ("retrying", 1, 0)
    job = m.claim(1).value[0]
    assert job.attempt == 1
    m.fail(job, permanent=False)
    assert (m.runs["1"].status, m.runs["1"].attempts) == ("failed", 2)
    m.enqueue("2")
    m.complete(m.claim(1).value[0])
    assert (m.runs["2"].status, m.runs["2"].attempts) == ("succeeded", 1)
    assert "backoff" not in required_events(d, "async")  # there is none to see
    assert Retry(max_attempts=2).backoff == "none"  # no base: no wait
    with pytest.raises(ValueError, match="backoff='none'"):
        Retry(max_attempts=2, backoff="fixed")  # a wait needs its base


def test_a_take_back_that_adds_to_the_limit_allows_one_more_run_and_shows_it():
    """chancy's Recovery adds one to the job's max_attempts: a job recovered once fails twice
    and is still retried; its row shows the limit, which the contract judges it by."""
    d = RunKind(**CHANCY_RETRY)
    m = GenericModel(d)
    m.enqueue("1")
    m.claim(1)
    m.advance(60)
    assert m.reclaim_stale() == Won(("1",))
    assert m.observe(m.runs["1"]).max_attempts == 3
    for _ in range(2):
        m.fail(m.claim(1).value[0], permanent=False)
    assert (m.runs["1"].status, m.runs["1"].attempts) == ("retrying", 2)
    view = generic.views(d, m.timing, m.state(), {})["1"].retry
    assert view.max_attempts == 3 and view.waiting
    views = m.views()
    assert not check_invariants(d.contract(), views, views)  # waiting within its own limit
    stale = {"1": replace(views["1"], retry=replace(view, max_attempts=2))}
    assert any(v.invariant == "retry-policy" for v in check_invariants(d.contract(), stale, stale))
    m.fail(m.claim(1).value[0], permanent=False)
    assert m.runs["1"].status == "failed"
    unchanged = RunKind(
        **{
            **CHANCY_RETRY,
            "retry": CHANCY_RETRY["retry"].model_copy(update={"taken_back": "unchanged"}),
        }
    )
    assert GenericModel(unchanged).observe(m.runs["1"]).max_attempts is None  # none kept


# -- attempts as the library counts them -----------------------------------------------------


def test_attempts_counted_as_retries_give_up_after_max_retries():
    m = GenericModel(described(retry=Retry(max_attempts=2, base=60, counts="retries")))
    m.enqueue("1")
    waits = []
    for retries in range(3):
        job = m.claim(1).value[0]
        assert job.attempt == retries
        m.fail(job, permanent=False)
        waits.append(m.runs["1"].due - m.now)
        m.advance(max(0, waits[-1]))
    assert m.runs["1"].status == "exception" and m.runs["1"].attempts == 2
    assert waits[:2] == [60, 120]  # the backoff of the 1st and 2nd run of the work
    view = generic.views(m.d, m.timing, m.state(), {})["1"].retry
    assert view.max_attempts == 3  # the last run allowed is the one after 2 retries


def test_the_give_up_is_decided_on_the_count_the_worker_read():
    row = described(retry=Retry(max_attempts=1, base=60, counts="retries", decided_by="row"))
    worker = described(retry=Retry(max_attempts=1, base=60, counts="retries", decided_by="worker"))
    for d, status in ((row, "exception"), (worker, "queued")):
        m, first, second = lapsed_and_repicked(d)
        m.fail(second, permanent=False)  # the second owner retries: 1 retry on the row
        assert m.runs["1"].attempts == 1
        m.advance(60)
        third = m.claim(1).value[0]
        stale = generic.Job("1", 0, third.claim)  # a worker that read attempts = 0
        m.fail(stale, permanent=False)
        assert m.runs["1"].status == status


# -- guards per write: id only, unless terminal; writes that answer nothing ------------------


def test_an_id_only_write_lands_on_a_re_picked_job_and_the_invariant_names_it():
    m, first, second = lapsed_and_repicked(described(fence=Fence(kind="unless-terminal")))
    before = m.views()
    assert m.complete(first) == Won() and m.runs["1"].status == "successful"
    broken = check_invariants(
        m.d.contract(),
        before,
        m.views(),
        [Write("1", first.token, accepted=True, owner_current=False)],
    )
    assert {v.invariant for v in broken} == {"lease-fence"}


def test_an_id_only_write_does_not_land_on_an_ended_job():
    m, first, second = lapsed_and_repicked(described(fence=Fence(kind="unless-terminal")))
    m.complete(second)
    assert m.fail(first, permanent=False) == LostRace("fenced")
    assert m.runs["1"].status == "successful"


def test_a_heartbeat_by_id_only_stamps_the_lease_and_nothing_else():
    m = GenericModel(described())
    m.enqueue("1")
    job = m.claim(1).value[0]
    m.fail(job, permanent=False)
    assert m.extend_lease(job) == Won() and m.runs["1"].status == "queued"


def test_writes_that_answer_nothing_are_refused_without_a_lost_race():
    m, first, second = lapsed_and_repicked(described())
    m.complete(second)
    assert m.complete(first) == Won() and m.runs["1"].status == "successful"


# -- a heartbeat per worker -------------------------------------------------------------------


def test_a_workers_beat_extends_every_job_it_holds_and_a_claim_stamps_nothing():
    d = described(lease=Lease(seconds=60, heartbeat=30, per="worker"))
    m = GenericModel(d)
    for key in ("1", "2", "3"):
        m.enqueue(key)
    [a1] = m.claim(1, holder="w0").value  # w0 registers: its lease runs from now
    m.advance(40)
    [a2] = m.claim(1, holder="w0").value  # stamps nothing: w0's last beat is 40 s old
    [b1] = m.claim(1, holder="w1").value
    assert [m.runs[k].lease_until for k in ("1", "2", "3")] == [60, 60, 100]
    m.advance(10)
    assert m.extend_lease(a1) == Won()  # w0 beats: both its jobs, not w1's
    assert [m.runs[k].lease_until for k in ("1", "2", "3")] == [110, 110, 100]
    m.advance(50)
    assert [j.key for j in m.due()] == ["3"]  # only w1's job lapsed


def test_a_workers_beat_is_a_transition_of_each_job_it_holds_and_grants_no_fresh_lease():
    d = described(lease=Lease(seconds=60, heartbeat=30, per="worker"))
    m = GenericModel(d)
    m.enqueue("1")
    [a1] = m.claim(1, holder="w0").value
    m.transitions.clear()
    m.extend_lease(a1)
    assert m.transitions == [("1", "picked", "extend_lease", "picked")]  # observed, counted
    m.advance(70)  # w0's beat lapsed: a new claim of w0's is born lapsed, as predicted
    [again] = m.claim(1, holder="w0").value
    view = m.views()[again.key]
    assert view.lease_left == 0 and view.lease_granted is None  # a claim stamps nothing


def test_the_check_tells_a_per_worker_adapter_its_worker_and_refuses_one_that_cannot_hear():
    from knownstate.chaos.adapter import Adapter
    from knownstate.chaos.genericbuild import adapter_problems

    d = described(lease=Lease(seconds=60, heartbeat=30, per="worker"))

    class Deaf(Adapter):
        def claim(self, conn, batch):
            return []

    class Told(Adapter):
        def claim(self, conn, batch, worker):
            return []

    assert any("(conn, batch, worker)" in p for p in adapter_problems(d, Deaf))
    assert not any("claim" in p for p in adapter_problems(d, Told))
    assert not any("claim" in p for p in adapter_problems(described(), Deaf))


def test_a_worker_starts_before_its_first_claim_and_again_until_a_claim_returns():
    """``Adapter.start``: a library's worker registers as it starts (procrastinate, chancy).
    The model registers a worker with its first claim, so a start whose claim raised counts
    for nothing: the next claim starts the worker again; once a claim returned, never again."""
    from types import SimpleNamespace

    from knownstate.chaos.adapter import Adapter
    from knownstate.chaos.generic import GenericCheck
    from knownstate.impl.errors import ConnectionLost

    d = described(lease=Lease(seconds=60, heartbeat=30, per="worker"))
    calls = []

    class Registering(Adapter):
        def start(self, conn, worker):
            calls.append(("start", worker))
            return f"id-{len(calls)}"

        def claim(self, conn, batch, worker):
            calls.append(("claim", self.started[worker]))
            if len(calls) == 2:
                raise ConnectionLost("the link went down")
            return []

    adapter = Registering(generic.Timing.of(d))

    def call(worker, op, conn, *args, closes=True, named=None):
        return getattr(adapter, op)(conn, *args, **(named or {})), False

    check = SimpleNamespace(adapter=adapter, _call=call, _holder=lambda w: "w0", handles=[{}])
    w0 = SimpleNamespace(name="w0", index=0)
    with pytest.raises(ConnectionLost):
        GenericCheck._claimed(check, w0, None, 1)
    GenericCheck._claimed(check, w0, None, 1)
    GenericCheck._claimed(check, w0, None, 1)
    assert calls == [
        ("start", "w0"),
        ("claim", "id-1"),
        ("start", "w0"),
        ("claim", "id-3"),
        ("claim", "id-3"),
    ]
    assert not Adapter.implements("start") and Registering.implements("start")


# -- a claim of one job, a reaper that re-queues, a re-queue in application time ---------------

REAPED = dict(
    QUEUE,
    transitions=(
        "(new) -enqueue-> todo",
        "todo -claim-> doing",
        "doing -complete-> succeeded",
        "doing -fail_permanent-> failed",
        "doing -reclaim-> todo",
    ),
    owned=("doing",),
    claim=Claim(how="one todo job", most=1),
    lease=Lease(seconds=60, taken_back_by=("reclaim",)),
    retry=None,
    fence=Fence(kind="unless-terminal"),
)


def test_one_reaper_at_a_time_is_the_reaper_process_alone():
    """``Lease(reapers="one")``: only w2, the reaper process, reaps, so no block races two
    reapers; by default the loop's workers reap too; without a reaper nobody does."""
    from knownstate.chaos.genericbuild import reaping

    one = described(
        **{**REAPED, "lease": Lease(seconds=60, taken_back_by=("reclaim",), reapers="one")}
    )
    assert [reaping(one, w) for w in range(3)] == [False, False, True]
    assert [reaping(described(**REAPED), w) for w in range(3)] == [True, True, True]
    assert not any(reaping(described(), w) for w in range(3))


def test_a_claim_of_one_job_at_a_time_asks_for_one():
    from knownstate.chaos.adapter import Adapter
    from knownstate.chaos.generic import kind

    class Jobs(Adapter):
        schema, read_query = "CREATE TABLE jobs (key text)", "SELECT key FROM jobs"

        def enqueue(self, conn, key): ...
        def claim(self, conn, batch): ...
        def complete(self, conn, job): ...
        def fail(self, conn, job, permanent): ...
        def reclaim_stale(self, conn): ...

    assert kind(RunKind(**REAPED), Jobs)._batches() == [1]
    wide = RunKind(**{**REAPED, "claim": Claim(how="jobs")})
    assert kind(wide, Jobs)._batches() == [1, 2, 3]


def test_without_a_retry_policy_a_reaper_may_re_queue():
    d = RunKind(**REAPED)
    assert generic.fit_problems(d) == []
    m = GenericModel(d)
    m.enqueue("1")
    m.claim(1)
    m.advance(60)
    assert m.reclaim_stale() == Won(("1",)) and m.runs["1"].status == "todo"
    assert [r.key for r in m.due()] == ["1"]  # by the database's clock: due at once


def test_a_re_queue_stamped_by_the_application_is_due_when_the_database_reaches_it():
    lease = Lease(seconds=60, taken_back_by=("reclaim",), requeue_clock="application")
    m = GenericModel(RunKind(**{**REAPED, "lease": lease}))
    m.enqueue("1")
    m.claim(1)
    m.advance(60)  # the database's clock moved; the application's did not
    m.reclaim_stale()
    assert m.runs["1"].due == m.now + generic.APP_AHEAD - 60 and m.due() == []
    m.advance(generic.APP_AHEAD - 60)
    assert [r.key for r in m.due()] == ["1"]


def test_the_gate_keeps_the_application_clock_as_far_ahead_as_the_model_says():
    from knownstate.chaos.harness import CLOCK_BASE

    assert -CLOCK_BASE == generic.APP_AHEAD


def test_an_under_lease_control_requires_no_stale_write():
    d = RunKind(**REAPED)
    assert "stale complete on a re-claimed run" in required_events(d, "async")
    assert not any(str(e).startswith("stale ") for e in required_events(d, "async", "under-lease"))
    # behind an id-only fence a write is refused only on an ended run: a stale holder's write
    assert "fence rejection" in required_events(d, "async")
    for control in (True, "under-lease"):
        assert "fence rejection" not in required_events(d, "async", control)
        assert "lost race" in required_events(d, "async", control)


# -- autocommit: nothing a COMMIT fault causes is required -----------------------------------


def test_a_library_in_autocommit_meets_the_commit_faults_at_its_statements():
    """No COMMIT is sent: the COMMIT faults meet statements (their events are required), and
    no claim holds a COMMIT open for another to skip past."""
    auto = required_events(described(), "async")
    txn = required_events(described(commits="transaction"), "async")
    assert "skip locked" in txn and "skip locked" not in auto
    for event in ("worker died before commit", "indeterminate commit"):
        assert event in auto and event in txn
    assert "fence rejection" not in auto  # writes that answer nothing show no refusal
    assert "stale complete on a re-claimed run" not in required_events(
        described(), "async", owners_only=True
    )


def test_a_run_with_no_schedule_is_due_whatever_the_clock():
    m = GenericModel(RunKind(**{**REAPED, "claim": Claim(how="one", unscheduled="always")}))
    m.enqueue("1")
    m.advance(-60)  # the database's clock moved back: a NULL schedule is still due
    assert [r.key for r in m.due()] == ["1"]
    at_enqueue = GenericModel(RunKind(**REAPED))
    at_enqueue.enqueue("1")
    at_enqueue.advance(-60)
    assert at_enqueue.due() == []


def test_a_schedule_the_application_stamps_is_due_when_the_database_reaches_it():
    app = GenericModel(RunKind(**{**REAPED, "claim": Claim(how="one", unscheduled="application")}))
    app.advance(-60)  # the database's clock moved back; the application's did not
    app.enqueue("1")
    assert app.due() == []  # stamped a minute in the database's future
    app.advance(60)
    assert [r.key for r in app.due()] == ["1"]
    app.advance(60)  # now the database's clock is ahead: a new run is due at once
    app.enqueue("2")
    assert [r.key for r in app.due()] == ["1", "2"]
    at_enqueue = GenericModel(RunKind(**REAPED))
    at_enqueue.advance(-60)
    at_enqueue.enqueue("1")
    assert [r.key for r in at_enqueue.due()] == ["1"]  # the database's now: due at once


def test_a_skew_of_the_application_clock_moves_its_schedules_and_nothing_the_database_stamps():
    """``app-clock-skew``: the application's clock runs ahead; a run it schedules then is due
    that much later, while a lease (the database's) and a run added before are unmoved."""
    d = RunKind(**{**REAPED, "claim": Claim(how="one", unscheduled="application")})
    m = GenericModel(d)
    m.enqueue("1")
    [job] = m.claim(1).value
    m.skew_app(120)
    m.enqueue("2")
    m.enqueue("3")
    assert m.due() == [] and m.runs["1"].lease_until == 60  # "2", "3": two minutes off
    m.skew_app(-180)  # now a minute behind the database's
    m.enqueue("4")
    assert [r.key for r in m.due()] == ["4"]
    m.advance(120)
    assert [r.key for r in m.due()] == ["2", "3", "4"] and m.lapsed(m.runs["1"])


def test_only_a_kind_scheduled_by_the_application_gets_its_clock_skewed():
    from knownstate.chaos.adapter import Adapter
    from knownstate.chaos.generic import kind
    from knownstate.chaos.genericrules import SkewsAppClock

    class Queue(Adapter):
        schema = "CREATE TABLE jobs (key text)"
        read_query = "SELECT key, 'todo' AS status FROM jobs"

        def enqueue(self, conn, key): ...

        def claim(self, conn, batch): ...

        def complete(self, conn, job): ...

        def fail(self, conn, job, permanent): ...

        def reclaim_stale(self, conn): ...

    app = RunKind(**{**REAPED, "claim": Claim(how="one", unscheduled="application")})
    assert issubclass(kind(app, Queue), SkewsAppClock)
    assert not issubclass(kind(RunKind(**REAPED), Queue), SkewsAppClock)
    timing = generic.Timing.of(app)
    adapter = Adapter(timing)
    before = adapter.now()
    adapter.app_skew = 3600
    assert 3599 < (adapter.now() - before).total_seconds() < 3605


def test_the_application_clock_the_gate_hands_an_adapter_starts_where_the_databases_does(tmp_path):
    from datetime import UTC, datetime, timedelta

    from knownstate.chaos.adapter import Adapter
    from knownstate.chaos.cluster import DbClock
    from knownstate.chaos.harness import CLOCK_BASE

    timing = generic.Timing.of(RunKind(**REAPED))
    clock = DbClock(tmp_path / "faketime")
    clock.reset(CLOCK_BASE)
    clock.jump(3600)  # the database's clock moves; the application's does not
    week_back = datetime.now(UTC) + timedelta(seconds=CLOCK_BASE)
    assert abs(Adapter(timing, clock).now() - week_back) < timedelta(seconds=5)
    assert abs(Adapter(timing).now() - datetime.now(UTC)) < timedelta(seconds=5)
    assert GenericModel(RunKind(**REAPED)).app_now() == 0  # model time: the database's start


# -- chancy: a fence on a claim id, keys of the producers', a schedule the reaper leaves ------

CHANCY_LIKE = dict(
    REAPED,
    transitions=(
        "(new) -enqueue-> pending",
        "pending -claim-> running",
        "running -extend_lease-> running",
        "running -complete-> succeeded",
        "running -reclaim-> pending",
    ),
    owned=("running",),
    claim=Claim(how="pending jobs", unscheduled="always"),
    lease=Lease(seconds=60, heartbeat=30, per="worker", taken_back_by=("reclaim",)),
    fence=Fence(kind="claim", answers=False),
    keys="producers",
)


def reaped_and_reclaimed(d: RunKind):
    """w0's job, its worker's lease lapsed, re-queued by the reaper and claimed by w1."""
    m = GenericModel(d)
    m.enqueue("1")
    [first] = m.claim(1, holder="w0").value
    m.advance(60)
    assert m.reclaim_stale() == Won(("1",))
    [second] = m.claim(1, holder="w1").value
    return m, first, second


def test_a_claim_id_fence_refuses_a_stale_holder_and_keeps_no_count():
    m, first, second = reaped_and_reclaimed(RunKind(**CHANCY_LIKE))
    assert not m.tracks_attempts()  # the rows show no count: the check compares none
    assert (first.token, second.token) == (1, 2)  # each claim's id is new
    assert not m.lands(first, "complete") and m.lands(second, "complete")
    assert m.complete(first) == Won()  # silent: None either way
    assert m.runs["1"].status == "running"  # and refused: the rows show it
    assert m.complete(second) == Won() and m.runs["1"].status == "succeeded"


def test_a_silent_fence_shows_no_refusal_and_its_stale_writes_are_required():
    events = required_events(RunKind(**CHANCY_LIKE), "async")
    assert "stale complete on a re-claimed run" in events
    assert not any(str(e).startswith("fence refusal") for e in events)
    answering = RunKind(**{**CHANCY_LIKE, "fence": Fence(kind="claim")})
    assert "fence refusal: complete (no longer claimed)" in required_events(answering, "async")


def test_a_stale_write_a_silent_fence_refused_is_not_judged_accepted():
    from types import SimpleNamespace

    from knownstate.chaos.adapter import Claimed
    from knownstate.chaos.generic import GenericCheck, Held

    d = RunKind(**CHANCY_LIKE)
    m, first, second = reaped_and_reclaimed(d)
    check = SimpleNamespace(description=d, model=m)
    key, token, current = GenericCheck._fence(check, Held(first, Claimed("1")), "complete")()
    # answered None, refused by the fence: no stale write was accepted
    assert check_invariants(d.contract(), {}, {}, [Write(key, token, True, current)]) == []
    weak = RunKind(**{**CHANCY_LIKE, "fence": Fence(kind="unless-terminal", answers=False)})
    m, first, _ = reaped_and_reclaimed(weak)
    check = SimpleNamespace(description=weak, model=m)
    key, token, current = GenericCheck._fence(check, Held(first, Claimed("1")), "complete")()
    [found] = check_invariants(weak.contract(), {}, {}, [Write(key, token, True, current)])
    assert found.invariant == "lease-fence"  # an id-only write lands: still named


def test_a_reaper_that_leaves_the_schedule_leaves_a_run_due_whatever_the_clock():
    lease = Lease(seconds=60, heartbeat=30, per="worker", taken_back_by=("reclaim",))
    for clock, due_after_moving_back in (("unchanged", ["1"]), ("database", [])):
        d = RunKind(**{**CHANCY_LIKE, "lease": lease.model_copy(update={"requeue_clock": clock})})
        m = GenericModel(d)
        m.enqueue("1")
        m.claim(1, holder="w0")
        m.advance(60)
        m.reclaim_stale()
        m.advance(-60)
        assert [r.key for r in m.due()] == due_after_moving_back


def test_a_soak_refuses_a_fence_its_judge_cannot_read():
    from knownstate.chaos.adapter import Adapter
    from knownstate.chaos.generic import kind
    from knownstate.chaos.kinds import KindNotFound
    from knownstate.chaos.soakgeneric import described as soak_of

    class Jobs(Adapter):
        schema = "CREATE TABLE jobs (key text)"
        read_query = "SELECT key, 'todo' AS status FROM jobs"

        async def enqueue(self, conn, key): ...

        async def claim(self, conn, batch): ...

        async def extend_lease(self, conn, job): ...

        async def complete(self, conn, job): ...

        async def reclaim_stale(self, conn): ...

    per_run = Lease(seconds=60, heartbeat=30, taken_back_by=("reclaim",))
    d = RunKind(**{**CHANCY_LIKE, "lease": per_run})
    with pytest.raises(KindNotFound, match="a claim id the rows do not show"):
        soak_of(kind(d, Jobs))
    soak_of(
        kind(RunKind(**{**CHANCY_LIKE, "lease": per_run, "fence": Fence(kind="attempt")}), Jobs)
    )


def test_producers_keys_never_meet_and_are_never_raced():
    from types import SimpleNamespace

    from knownstate.chaos.generic import GenericCheck

    for keys, expected in (("producers", ["1", "2"]), ("deduplicated", ["1", "1"])):
        d = RunKind(**{**CHANCY_LIKE, "keys": keys})
        check = SimpleNamespace(description=d, model=GenericModel(d))
        assert [GenericCheck._new_key(check, w) for w in (0, 1)] == expected


def test_every_pair_that_can_meet_on_one_row_is_required_raced_and_no_other():
    from knownstate.chaos.blocks import pair_event

    def raced(d, owners_only=False, commits="transaction"):
        events = required_events(RunKind(**{**d, "commits": commits}), "async", owners_only)
        return {str(e.label) for e in events if "raced on one row" in str(e)}

    def pairs(*ps):
        return {pair_event(a, b) for a, b in ps}

    core = pairs(("claim", "claim"), ("claim", "reclaim_stale"), ("reclaim_stale", "reclaim_stale"))
    # chancy-like: producers keep their own keys (never raced), a beat behind a claim fence
    holder = pairs(("reclaim_stale", "record"), ("reclaim_stale", "extend_lease"))
    assert raced(CHANCY_LIKE) == core | holder | pairs(("claim", "record"))
    # a control that never writes once its lease lapsed meets the reaper with no write
    assert raced(CHANCY_LIKE, "under-lease") == core
    # behind an id-only fence the heartbeat is named renew_lease; keys the system dedupes meet
    unless_terminal = {
        **CHANCY_LIKE,
        "fence": Fence(kind="unless-terminal"),
        "keys": "deduplicated",
    }
    assert pairs(("reclaim_stale", "renew_lease"), ("enqueue", "enqueue")) <= raced(unless_terminal)
    # one reaper at a time races no other reaper; no reaper, nothing to race it
    one = {**CHANCY_LIKE, "lease": CHANCY_LIKE["lease"].model_copy(update={"reapers": "one"})}
    assert pair_event("reclaim_stale", "reclaim_stale") not in raced(one)
    assert raced({**QUEUE, "keys": "producers"}) == pairs(("claim", "claim"))
    # in autocommit a one-statement operation is one step: no pair is required to overlap
    assert raced(CHANCY_LIKE, commits="autocommit") == set()


def test_a_lease_or_a_backoff_the_database_shows_shorter_is_named():
    """A lease shorter in the rows than every possible state has it is ``lease``; a run due
    again sooner after the same attempts is ``retry-policy`` (a block's rows that no order
    explains are named so too)."""
    from knownstate.model.generic import Observed, cut_short

    m = GenericModel(RunKind(**CHANCY_LIKE))
    m.enqueue("1")
    m.claim(1, holder="w0")
    kept = (Observed("1", "running", lease_left=60),)
    lost = (Observed("1", "running", lease_left=0),)  # a crash emptied the workers' beats
    assert cut_short(kept, [m.state()]) == []
    [found] = cut_short(lost, [m.state()])
    assert found.invariant == "lease" and "0s left in the database, 60s" in found.message

    m = GenericModel(RunKind(**QUEUE))
    m.enqueue("1")
    [job] = m.claim(1).value
    m.fail(job, False)
    waited = (Observed("1", "queued", attempts=1, due_in=60),)
    at_once = (Observed("1", "queued", attempts=1, due_in=0),)
    assert cut_short(waited, [m.state()]) == []
    [found] = cut_short(at_once, [m.state()])
    assert found.invariant == "retry-policy"
    assert "every possible state has it wait 60s" in found.message
    # another attempt's wait, or a state where it is held, says nothing of this backoff
    held = (Observed("1", "picked", attempts=1, lease_left=60),)
    assert cut_short(at_once, [m.state(), held]) == []


def test_a_python_migration_is_recorded_as_the_sql_it_runs_on_an_empty_database():
    from psycopg import sql

    from knownstate.chaos.adapter import recorded_migration

    async def migrate(conn):
        async with conn.cursor() as cur, conn.transaction():
            await cur.execute("SELECT version FROM versions WHERE app = %s", ["app"])
            if await cur.fetchone() is None:  # an empty database: every migration runs
                table = sql.Identifier("app_jobs")
                await cur.execute(sql.SQL("CREATE UNLOGGED TABLE {} (id int)").format(table))
                await cur.execute("INSERT INTO versions VALUES (%(app)s, 1);", {"app": "it's"})

    assert recorded_migration(migrate) == (
        "SELECT version FROM versions WHERE app = 'app';\n"
        'CREATE UNLOGGED TABLE "app_jobs" (id int);\n'
        "INSERT INTO versions VALUES ('it''s', 1);\n"
    )


def test_a_beat_that_forgets_lapsed_workers_keeps_their_runs_lapsed_whatever_the_clock():
    for lapsed, left_after_moving_back in (("forgotten", 0), ("kept", 30)):
        lease = CHANCY_LIKE["lease"].model_copy(update={"lapsed_workers": lapsed})
        m = GenericModel(RunKind(**{**CHANCY_LIKE, "lease": lease}))
        m.enqueue("1")
        m.enqueue("2")
        [first] = m.claim(1, holder="w0").value
        m.advance(60)  # w0's lease lapsed
        [other] = m.claim(1, holder="w1").value  # w1 starts: chancy deletes w0's row
        m.advance(-30)  # the clock moves back
        assert m.views()["1"].lease_left == left_after_moving_back
        m.extend_lease(first)  # w0 beats again: its row is back
        assert m.views()["1"].lease_left == 60


def test_a_block_whose_orders_differ_only_in_the_holder_is_judged_by_the_holder_the_rows_show():
    """w0's and w1's claims of one run, the reaper between them, in one block: both orders
    leave the run held, its lease lapsed (both workers' beats are old); only who holds it
    differs, and so whose next beat keeps it. The search keeps the first order it finds:
    the rows must tell the holder, or a later beat is judged against the other order."""
    from knownstate.chaos.linearize import FinalState, Operation, check

    m = GenericModel(RunKind(**CHANCY_LIKE))
    m.enqueue("0")
    [done] = m.claim(1, holder="w0").value
    m.claim(1, holder="w1")  # w1 started too
    m.complete(done)
    m.advance(60)  # both workers' leases lapsed
    m.enqueue("1")
    took = Won((generic.Job("1", None),))

    def claim(holder):
        return lambda s: Won(tuple(generic.Job(j.key, None) for j in s.claim(1, holder).value))

    history = [
        Operation("w0", "claim", claim("w0"), 0, 3, took),
        Operation("w1", "claim", claim("w1"), 0, 3, took),
        Operation("w2", "reap", lambda s: s.reclaim_stale(), 0, 3, Won(("1",))),
    ]
    for holder in ("w0", "w1"):  # the claim the rows show last
        rows = (
            m.observe(m.runs["0"]),
            generic.Observed("1", "running", lease_left=0, holder=holder),
        )
        verdict = check(history, m, final=FinalState(rows, lambda s: s.state(holders=True)))
        assert verdict.ok and {s.runs["1"].holder for s in verdict.final_states} == {holder}


def test_copies_of_one_state_are_one_state_and_a_hidden_difference_is_two():
    """The check keeps every state the rows leave possible, once each (by fingerprint): a copy
    of a state is the same state (its kind's table is shared, not copied), and a worker's beat
    while it holds no run is another state, which no row shows."""
    from knownstate.chaos.linearize import default_fingerprint as fp

    m = generic.GenericModel(RunKind(**CHANCY_LIKE))
    m.enqueue("1")
    [job] = m.claim(1, holder="w0").value
    m.complete(job)
    assert fp(m.copy()) == fp(m) and m.copy().table is m.table
    beat = m.copy()
    m.advance(30)
    beat.advance(30)
    beat.extend_lease(job)  # its answer lost: the beat may have landed
    assert beat.state(holders=True) == m.state(holders=True) and fp(beat) != fp(m)


# -- a stale write whose answer was lost: judged by the rows read back ------------------------


def judged_after_a_lost_answer(status: str) -> list[str]:
    """A stale holder's complete behind an id-only fence, its answer lost: the world is either
    state (the write committed or not); the rows read back show ``status``."""
    from types import SimpleNamespace

    from knownstate.chaos.generic import GenericCheck

    m = GenericModel(RunKind(**REAPED))  # fence: unless terminal (a write by id only)
    m.enqueue("1")
    [first] = m.claim(1).value
    m.advance(60)
    m.reclaim_stale()  # the run is waiting again; the first holder does not know
    before = frozenset({m.runs["1"].status})
    wrote = m.copy()
    assert wrote.complete(first) == Won() and wrote.runs["1"].status == "succeeded"
    check = SimpleNamespace(
        _unsure=("1", first.token, before),
        candidates=[SimpleNamespace(model=m), SimpleNamespace(model=wrote)],
        receiver=None,
        description=m.d,
    )
    rows = (generic.Observed("1", status, None, None, None),)
    return [v.invariant for v in GenericCheck.kind_violations(check, (rows, ()))]


def test_a_stale_write_that_landed_with_its_answer_lost_names_the_fence():
    """The model's candidates explain both rows (id only lets the write land), so only what
    the write found tells them apart: the run moved to what the stale write makes of it."""
    assert judged_after_a_lost_answer("succeeded") == ["lease-fence"]
    assert judged_after_a_lost_answer("todo") == []  # it did not land: nothing to name


def test_a_library_that_names_no_sql_gets_mutants_of_its_claims_lock():
    """Its claim's SKIP LOCKED, or its whole row lock, taken out of what the claim sends and of
    the schema (a claim may be a function there), each to be caught naming claim; not in
    autocommit, where a claim of one statement meets no other inside a block."""
    from knownstate.chaos.adapter import Adapter
    from knownstate.chaos.genericbuild import derived_mutants

    class Library(Adapter):
        schema = "CREATE FUNCTION f() ... FOR UPDATE OF jobs SKIP LOCKED ...;"

    wire = {"claim-waits-on-locks", "claim-takes-no-lock"}
    mutants = {m.name: m for m in derived_mutants(RunKind(**RETRYING), Library)}
    assert wire <= set(mutants) and {mutants[n].invariant for n in wire} == {"claim"}
    edited = mutants["claim-takes-no-lock"].machine(type("C", (), {}))
    assert edited.schema == "CREATE FUNCTION f() ... ...;" and set(edited.sql_edits) == {"claim"}
    assert not wire & {m.name for m in derived_mutants(described(), Library)}  # autocommit


def test_a_wire_mutant_applies_where_its_edit_changed_a_statement_or_the_schema():
    """Not applicable (it ran as the reference) only where it changed neither: a claim that is
    a function in the schema applies whatever the statements; a driver of its own, whose
    statements the gate never edits, is named in the reason."""
    from knownstate.chaos.adapter import Adapter
    from knownstate.chaos.adaptercall import EDITED, AdapterCalls
    from knownstate.chaos.genericbuild import derived_mutants

    class InSchema(Adapter):
        schema = "CREATE FUNCTION f() ... FOR UPDATE OF jobs SKIP LOCKED ...;"

    class InStatements(Adapter):
        schema = "CREATE TABLE jobs (id bigint);"

    class OwnDriver(InStatements):
        def connect(self, dsn):
            raise NotImplementedError

    def waits(adapter: type[Adapter]):
        check = type("C", (AdapterCalls,), {"schema": adapter.schema, "adapter_class": adapter})
        [m] = [m for m in derived_mutants(RunKind(**RETRYING), adapter) if m.name.endswith("locks")]
        return m.machine(check)

    why = (
        r"its edit (pattern '\s+SKIP\s+LOCKED') matched no statement the library sent for claim "
        "and nothing in its schema"
    )
    assert waits(InSchema).not_applied({}) == ""
    assert waits(InStatements).not_applied({}) == why
    assert waits(InStatements).not_applied({EDITED: 1}) == ""
    assert waits(OwnDriver).not_applied({}) == why + (
        " (the gate edits what psycopg sends; the adapter's driver is its own)"
    )
    assert AdapterCalls.not_applied({}) == ""  # no edits: the reference, or any other mutant
