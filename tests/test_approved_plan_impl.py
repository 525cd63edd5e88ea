"""The approved-plan implementation against a real PostgreSQL (the session's throwaway cluster).

The same operation sequences go to the model and to the implementation; after every operation
the outcomes must be equal, the projected rows must equal the model's state, and the six
invariants must hold on the projection. Then what only a real database can show: the claim and
a step under real concurrency, the fence refusing a stale executor after a lazy heal with the
database clock moved by libfaketime, and a step's effect vanishing with its receipt.
"""

from __future__ import annotations

import math
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

import psycopg
import pytest

from knownstate.chaos import cluster
from knownstate.impl import approved_plan as impl
from knownstate.impl.approved_plan import ApprovedPlanStore, project
from knownstate.impl.errors import TransactionAborted
from knownstate.model import approved_plan as ap
from knownstate.model.approved_plan import (
    CONTRACT,
    INTERRUPTED,
    TABLE,
    ApprovedPlanModel,
    Receipt,
    Status,
)
from knownstate.model.contract import CREATED, LostRace, Rejected, Won, check_invariants

CREDIT_A5 = {"op": "credit", "account": "a", "amount": 5}
CREDIT_B3 = {"op": "credit", "account": "b", "amount": 3}
FAIL = {"op": "fail"}


@pytest.fixture
def dsn(knownstate_db):
    return knownstate_db(impl.schema())


@pytest.fixture
def connect(dsn):
    conns: list[psycopg.Connection] = []

    def make() -> psycopg.Connection:
        c = psycopg.connect(dsn)
        conns.append(c)
        return c

    yield make
    for c in conns:
        c.close()


class Pair:
    """One model and one database, driven by the same operations and compared after each.
    The database's clock stands still between operations (held, as the engine holds it between
    steps): a stamp is read in whole model seconds from ``base``, so the real time the model,
    the projection's comparison and a loaded machine take between operations must not count."""

    def __init__(self, conn: psycopg.Connection, clock):
        self.model, self.store = ApprovedPlanModel(), ApprovedPlanStore()
        self.conn, self.clock = conn, clock
        self.base: datetime = conn.execute("select now()").fetchone()[0]
        conn.rollback()
        clock.hold()
        self.edges: set[tuple[str, str]] = set()

    def to_model_time(self, ts: datetime) -> int:
        return math.floor((ts - self.base).total_seconds())

    def advance(self, seconds: int) -> None:
        self.clock.jump(seconds)
        self.model.advance(seconds)

    def __call__(self, op: str, *args):
        before = self.model.views()
        expected = getattr(self.model, op)(*args)
        self.clock.release()
        got = getattr(self.store, op)(self.conn, *args)
        self.clock.hold()
        assert got == expected, f"{op}{args}: implementation {got}, model {expected}"
        state = project(self.conn, self.to_model_time)
        assert state == self.model.state(), f"after {op}{args}"
        after = ap.views(state)
        assert check_invariants(CONTRACT, before, after) == []
        for run_id, v in after.items():
            src = before[run_id].status if run_id in before else CREATED
            if src != v.status or (
                isinstance(got, Won)
                and op in ("revise", "heartbeat", "run_step")
                and str(args[0]) == run_id
                and v.status == src
            ):
                self.edges.add((src, v.status))
        return got


@pytest.fixture
def pair(connect, knownstate_db_clock, monkeypatch):
    monkeypatch.setattr(cluster, "HOLD_GRAIN", 0.0)  # every hold taken back, however short
    return Pair(connect(), knownstate_db_clock)


def ledger_rows(conn: psycopg.Connection, pid: int, step_index: int) -> int:
    (n,) = conn.execute(
        "select count(*) from demo_ledger where proposal_id = %s and step_index = %s",
        (pid, step_index),
    ).fetchone()
    conn.rollback()
    return n


# ---------------------------------------------------------------------------
# Drift: one fact, two places.
# ---------------------------------------------------------------------------


def test_the_schemas_status_check_is_the_models_enum():
    m = re.search(r"CHECK \(status IN \(([^)]*)\)\)", impl.schema())
    assert m is not None
    assert [s.strip().strip("'") for s in m.group(1).split(",")] == [s.value for s in Status]


def test_every_named_query_says_what_it_does():
    for name, sql in impl.QUERIES.items():
        assert sql.startswith("-- "), f"query {name} has no comment"


# ---------------------------------------------------------------------------
# Model and implementation agree.
# ---------------------------------------------------------------------------


def test_model_and_implementation_agree_along_a_story_that_takes_every_transition(pair):
    pair("propose", [CREDIT_A5, CREDIT_B3, FAIL])
    pair("revise", 1, [CREDIT_A5, {"op": "debit", "account": "a", "amount": 2}, CREDIT_B3, FAIL])
    pair("approve", 1)
    pair("revise", 1, [CREDIT_A5])  # frozen: lost race
    pair("approve", 1)
    pair.advance(7)
    pair("mark_executing", 1)
    pair("mark_executing", 1)
    pair("run_step", 1, 1, 1)  # out of order
    pair("run_step", 1, 0, 2)  # wrong token
    pair("run_step", 1, 0, 1)
    pair("run_step", 1, 0, 1)  # answered from its receipt
    pair.advance(60)
    pair("heartbeat", 1, 1)
    pair("run_step", 1, 1, 1)
    pair("run_step", 1, 2, 1)
    pair("run_step", 1, 3, 1)  # fail: the run stops here
    pair("run_step", 1, 4, 1)
    pair("repeat", 1)
    pair("repeat", 1)
    pair("compensate", 1)
    pair("compensate", 1)
    pair("revise", 2, [CREDIT_A5])
    pair("approve", 2)
    pair("mark_executing", 2)
    pair("run_step", 2, 0, 1)
    pair("run_step", 2, 1, 1)
    pair("run_step", 2, 2, 1)  # last: executed
    pair("repeat", 2)
    pair("compensate", 2)  # a compensation can itself be compensated
    pair("propose", [CREDIT_A5])
    pair("reject", 4)
    pair("expire", 4)
    pair("propose", [CREDIT_A5])
    pair("expire", 5)
    pair("propose", [CREDIT_A5])
    pair("approve", 6)
    pair("expire", 6)
    pair("mark_executing", 6)
    pair("propose", [CREDIT_A5, CREDIT_B3])
    pair("approve", 7)
    pair("mark_executing", 7)
    pair("run_step", 7, 0, 1)
    pair.advance(121)
    pair("repeat", 7)  # a repeat reads, so it heals first
    pair("run_step", 7, 1, 1)  # the stale executor is fenced off
    pair("read", 7)
    pair("propose", [])
    pair("read", 99)
    assert pair.edges == TABLE.edges()


@pytest.mark.parametrize(
    "op",
    [
        "approve",
        "reject",
        "expire",
        "mark_executing",
        "revise",
        "heartbeat",
        "run_step",
        "read",
        "repeat",
        "compensate",
    ],
)
def test_every_operation_agrees_on_a_run_in_every_status(pair, op):
    """One run per status, built through the operations; then ``op`` on each, on both sides."""
    pids = {}
    for status in Status:
        steps = [CREDIT_A5, FAIL] if status is Status.FAILED else [CREDIT_A5]
        pid = pair("propose", steps).value
        pids[status] = pid
        if status in (Status.REJECTED, Status.EXPIRED):
            pair("reject" if status is Status.REJECTED else "expire", pid)
        elif status is not Status.PENDING:
            pair("approve", pid)
            if status is not Status.APPROVED:
                pair("mark_executing", pid)
                if status is Status.EXECUTED:
                    pair("run_step", pid, 0, 1)
                if status is Status.FAILED:
                    pair("run_step", pid, 0, 1)
                    pair("run_step", pid, 1, 1)
    args = {"revise": ([CREDIT_B3],), "heartbeat": (1,), "run_step": (0, 1)}.get(op, ())
    for status, pid in pids.items():
        pair(op, pid, *args)


# ---------------------------------------------------------------------------
# Lease on the database clock, lazy heal, fence.
# ---------------------------------------------------------------------------


def test_model_and_database_agree_exactly_at_the_heal_boundary(pair):
    pair("propose", [CREDIT_A5])
    pair("approve", 1)
    pair("mark_executing", 1)
    pair.advance(119)
    assert pair("read", 1).value.status is Status.EXECUTING
    pair.advance(1)  # the model's 120 is the database's 120 s and a little more
    assert pair("read", 1).value.status is Status.FAILED


def test_the_heal_reads_the_database_clock_not_the_applications(connect, knownstate_db_clock):
    store, worker, reader = ApprovedPlanStore(), connect(), connect()
    pid = store.propose(worker, [CREDIT_A5, CREDIT_B3]).value
    store.approve(worker, pid)
    assert store.mark_executing(worker, pid) == Won(1)
    knownstate_db_clock.jump(110)  # only the database's clock moves; this process's clock did not
    assert store.read(reader, pid).value.status is Status.EXECUTING
    knownstate_db_clock.jump(20)
    seen = store.read(reader, pid).value
    assert (seen.status, seen.failure) == (Status.FAILED, INTERRUPTED)


def test_the_fence_refuses_a_stale_executor_after_a_lazy_heal(connect, knownstate_db_clock):
    store, worker, reader = ApprovedPlanStore(), connect(), connect()
    pid = store.propose(worker, [CREDIT_A5, CREDIT_B3]).value
    store.approve(worker, pid)
    token = store.mark_executing(worker, pid).value
    assert store.run_step(worker, pid, 0, token) == Won(Receipt(0, True, "credited 5 to a"))
    knownstate_db_clock.jump(130)  # the worker stalls past its heartbeat
    assert store.read(reader, pid).value.status is Status.FAILED  # somebody looks: healed
    # the worker resumes, with its old token
    assert store.run_step(worker, pid, 1, token) == LostRace("run_step: not executing")
    assert store.heartbeat(worker, pid, token) == LostRace("heartbeat: not executing")
    assert ledger_rows(reader, pid, 1) == 0
    assert store.repeat(reader, pid).value.receipts == (Receipt(0, True, "credited 5 to a"),)


def test_a_late_owner_nobody_read_keeps_its_run(connect, knownstate_db_clock):
    store, worker = ApprovedPlanStore(), connect()
    pid = store.propose(worker, [CREDIT_A5, CREDIT_B3]).value
    store.approve(worker, pid)
    store.mark_executing(worker, pid)
    knownstate_db_clock.jump(600)
    assert store.run_step(worker, pid, 0, 1) == Won(Receipt(0, True, "credited 5 to a"))
    assert store.read(worker, pid).value.status is Status.EXECUTING  # the step renewed the lease


# ---------------------------------------------------------------------------
# Real concurrency: one claim, one effect per step.
# ---------------------------------------------------------------------------


def _together(connect, n: int, work):
    conns = [connect() for _ in range(n)]
    barrier = threading.Barrier(n)

    def run(i):
        barrier.wait()
        return work(conns[i], i)

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(run, range(n)))


def test_concurrent_claims_have_exactly_one_winner(connect):
    store, setup = ApprovedPlanStore(), connect()
    pid = store.propose(setup, [CREDIT_A5]).value
    store.approve(setup, pid)
    outs = _together(connect, 6, lambda c, i: store.mark_executing(c, pid))
    assert sorted(outs, key=repr) == [LostRace("mark_executing: not approved")] * 5 + [Won(1)]


def test_expiry_racing_the_claim_has_exactly_one_winner(connect):
    store, setup = ApprovedPlanStore(), connect()
    pid = store.propose(setup, [CREDIT_A5]).value
    store.approve(setup, pid)
    outs = _together(
        connect, 6, lambda c, i: (store.expire if i % 2 else store.mark_executing)(c, pid)
    )
    assert sum(isinstance(o, Won) for o in outs) == 1
    assert all(isinstance(o, (Won, LostRace)) for o in outs)


def test_the_same_step_run_concurrently_has_one_effect(connect):
    store, setup = ApprovedPlanStore(), connect()
    pid = store.propose(setup, [CREDIT_A5, CREDIT_B3]).value
    store.approve(setup, pid)
    token = store.mark_executing(setup, pid).value
    outs = _together(connect, 6, lambda c, i: store.run_step(c, pid, 0, token))
    assert outs == [Won(Receipt(0, True, "credited 5 to a"))] * 6  # one ran it, five were answered
    assert ledger_rows(setup, pid, 0) == 1
    assert setup.execute("select balance from demo_account where account = 'a'").fetchone() == (5,)


def test_concurrent_compensate_requests_propose_one_compensation(connect):
    store, setup = ApprovedPlanStore(), connect()
    pid = store.propose(setup, [CREDIT_A5, FAIL]).value
    store.approve(setup, pid)
    store.mark_executing(setup, pid)
    store.run_step(setup, pid, 0, 1)
    store.run_step(setup, pid, 1, 1)
    assert _together(connect, 4, lambda c, i: store.compensate(c, pid)) == [Won(2)] * 4


# ---------------------------------------------------------------------------
# Receipts commit with their effect.
# ---------------------------------------------------------------------------


def test_a_steps_effect_does_not_survive_without_its_receipt(connect):
    store, worker, squatter, observer = ApprovedPlanStore(), connect(), connect(), connect()
    pid = store.propose(worker, [CREDIT_A5]).value
    store.approve(worker, pid)
    store.mark_executing(worker, pid)
    # Another transaction holds the receipt's key (uncommitted): the worker applies the effect,
    # then blocks on the receipt insert until its lock_timeout gives up and the transaction dies.
    squatter.execute(
        "insert into agent_proposal_step (proposal_id, step_index, ok, detail) "
        "values (%s, 0, true, 'squatter')",
        (pid,),
    )
    worker.execute("set lock_timeout = '200ms'")
    worker.commit()
    with pytest.raises(TransactionAborted):
        store.run_step(worker, pid, 0, 1)
    assert ledger_rows(observer, pid, 0) == 0
    assert observer.execute("select count(*) from demo_account").fetchone() == (0,)
    observer.rollback()
    squatter.rollback()
    assert store.run_step(worker, pid, 0, 1) == Won(Receipt(0, True, "credited 5 to a"))
    assert ledger_rows(observer, pid, 0) == 1
    receipt = observer.execute(
        "select ok from agent_proposal_step where proposal_id = %s", (pid,)
    ).fetchall()
    assert receipt == [(True,)]


def test_truncating_the_tables_restarts_the_numbering(connect):
    store, conn = ApprovedPlanStore(), connect()
    assert [store.propose(conn, [CREDIT_A5]) for _ in range(2)] == [Won(1), Won(2)]
    conn.execute(f"truncate {', '.join(impl.TABLES)} restart identity")
    conn.commit()
    assert store.propose(conn, [CREDIT_A5]) == Won(1)
    assert project(conn, lambda ts: 0).proposals[0].proposal_id == 1


def test_a_refused_plan_touches_no_row(connect):
    store, conn = ApprovedPlanStore(), connect()
    assert isinstance(
        store.propose(conn, [{"op": "credit", "account": "a", "amount": -1}]), Rejected
    )
    assert store.propose(conn, [CREDIT_A5]) == Won(1)
