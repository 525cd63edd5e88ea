"""Statement-level interleaving (knownstate.chaos.interleave) on the real parts: the session's
PostgreSQL (under libfaketime) and every worker through its own Toxiproxy link.

Each test pins what a wrong scheduler would get wrong: statements running out of the drawn
order, a lock wait guessed instead of read from the server, a deadlock that crashes the
harness or picks its victim by timing, a replay that differs, a fault inside a block that
leaves a lock or a thread behind, a round trip that slips past the scheduler.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import re
import signal
import threading

import psycopg
import pytest

from knownstate.chaos import linearize
from knownstate.chaos.interleave import (
    AsyncScheduledConnection,
    BlockAborted,
    ClockAhead,
    Op,
    ScheduledConnection,
    Scheduler,
    WorkerStuck,
    history,
)
from knownstate.chaos.interleave.server import SchedulerEnvironmentError, check_backend
from knownstate.impl import errors
from knownstate.model.contract import Won
from polling import poll

SCHEMA = """
CREATE TABLE account (id int PRIMARY KEY, balance int NOT NULL);
CREATE TABLE event (seq int GENERATED ALWAYS AS IDENTITY PRIMARY KEY, worker text, n int);
INSERT INTO account VALUES (1, 100), (2, 100), (3, 100);
"""


@pytest.fixture
def db(knownstate_db, knownstate_cluster):
    dsn = knownstate_db(SCHEMA)
    return psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]


@pytest.fixture
def admin(knownstate_cluster, db):
    with psycopg.connect(knownstate_cluster.dsn(db), autocommit=True) as conn:
        yield conn


@pytest.fixture
def scheduler(knownstate_cluster, db):
    s = Scheduler(knownstate_cluster.dsn(db), pause=True)
    yield s
    s.close()


_serial = itertools.count()


@pytest.fixture
def links(toxiproxy, knownstate_cluster):
    """One Toxiproxy link per worker (new names per test: the server keeps its proxies)."""
    n = next(_serial)
    return {
        w: toxiproxy.link(f"interleave-{n}-{w}", knownstate_cluster.host, knownstate_cluster.port)
        for w in ("w0", "w1", "w2")
    }


@pytest.fixture
def connect(knownstate_cluster, db, links):
    """``connect(worker, **kw)``: a ScheduledConnection through the worker's own link."""
    made: list[psycopg.Connection] = []

    def make(worker: str, **kwargs) -> ScheduledConnection:
        link = links[worker]
        conn = ScheduledConnection.connect(
            knownstate_cluster.dsn(db, host=link.host, port=link.port),
            application_name=f"t-{worker}",
            **kwargs,
        )
        made.append(conn)
        return conn

    yield make
    for conn in made:
        conn.close()


def knownstate_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("knownstate-")]


def script(*choices: str):
    """A chooser that follows ``choices`` (then takes the first option)."""
    it = iter(choices)

    def choose(options: list[str]) -> str:
        want = next(it, None)
        assert want is None or want in options, f"{want} is not among {options}"
        return want or options[0]

    return choose


# ---------------------------------------------------------------------------------------
# Statements run as scheduled.
# ---------------------------------------------------------------------------------------


def log_events(worker: str, n: int):
    def run(conn):
        with errors.boundary("log"):
            for i in range(1, n + 1):
                conn.execute("INSERT INTO event (worker, n) VALUES (%s, %s)", (worker, i))
        errors.commit(conn, "log")
        return n

    return run


def test_two_workers_statements_run_in_the_scheduled_order(scheduler, connect, admin):
    ops = [
        Op("w0", "log 3", connect("w0"), log_events("w0", 3)),
        Op("w1", "log 2", connect("w1"), log_events("w1", 2)),
    ]
    choices = ("w1", "w0", "w0", "w1", "w1", "w0", "w0")
    result = scheduler.run(ops, script(*choices))
    assert result.schedule == choices
    # The server assigned the identity in the order the statements reached it.
    rows = admin.execute("SELECT worker, n FROM event ORDER BY seq").fetchall()
    assert rows == [("w1", 1), ("w0", 1), ("w0", 2), ("w1", 2), ("w0", 3)]
    assert [r.value for r in result.ops] == [3, 2]
    assert [r.statements for r in result.ops] == [4, 3]
    steps = [line for line in result.trace if line[3:4] == "."]
    assert steps[0] == "  1. w1 INSERT INTO event (worker, n) VALUES (%s, %s)"
    assert steps[4] == "  5. w1 COMMIT"
    assert result.by_worker()["w1"].returned_at == 5
    assert knownstate_threads() == []


def test_every_way_to_reach_the_server_is_a_step_and_nothing_runs_unscheduled(
    scheduler, connect, admin
):
    def run(conn):
        conn.cursor().execute("SELECT 1")
        conn.execute("UPDATE account SET balance = balance WHERE id = 1")
        conn.cursor().executemany("INSERT INTO event (worker, n) VALUES ('w0', %s)", [(1,), (2,)])
        with conn.cursor(name="named") as cur:
            cur.execute("SELECT id FROM account ORDER BY id")
            cur.fetchall()
        with conn.transaction():
            conn.execute("SELECT 2")
        errors.commit(conn, "all")
        with conn.transaction():
            conn.execute("SELECT 3")
            with conn.transaction():
                conn.execute("SELECT 4")
        conn.rollback()  # nothing open: psycopg sends nothing, and it is no step
        return "done"

    conn = connect("w0")
    pid = conn.info.backend_pid
    states = []
    with scheduler.block([Op("w0", "every path", conn, run)]) as block:
        while not block.finished:
            (state,) = admin.execute(
                "SELECT state FROM pg_stat_activity WHERE pid = %s", (pid,)
            ).fetchone()
            states.append(state)
            block.step("w0")
        result = block.result()
    labels = [m[1] for line in result.trace if (m := re.match(r" *\d+\. w0 (.*)", line))]
    assert labels == [
        "SELECT 1",
        "UPDATE account SET balance = balance WHERE id = 1",
        "INSERT INTO event (worker, n) VALUES ('w0', %s)",
        "SELECT id FROM account ORDER BY id",
        "round trip fetch_gen",
        "round trip close_gen",
        "SAVEPOINT (nested transaction block)",
        "SELECT 2",
        "RELEASE SAVEPOINT _pg3_1",
        "COMMIT",
        "BEGIN (transaction block)",
        "SELECT 3",
        "SAVEPOINT (nested transaction block)",
        "SELECT 4",
        "RELEASE SAVEPOINT _pg3_2",
        "COMMIT (end of transaction block)",
    ]
    assert result.ops[0].value == "done"
    # Parked between steps, the backend never ran anything on its own.
    assert set(states) <= {"idle", "idle in transaction"}
    assert admin.execute("SELECT count(*) FROM event").fetchone() == (2,)


# ---------------------------------------------------------------------------------------
# Lock waits, deadlocks.
# ---------------------------------------------------------------------------------------


def add(account: int, delta: int):
    def run(conn):
        try:
            with errors.boundary("add"):
                conn.execute(
                    "UPDATE account SET balance = balance + %s WHERE id = %s", (delta, account)
                )
            errors.commit(conn, "add")
        except errors.TransactionAborted:
            conn.rollback()
            raise
        return Won()

    return run


def test_a_lock_wait_is_read_from_the_server_and_ends_when_the_holder_commits(
    scheduler, connect, admin
):
    c0, c1 = connect("w0"), connect("w1")
    ops = [Op("w0", "add(1, +1)", c0, add(1, 1)), Op("w1", "add(1, +2)", c1, add(1, 2))]
    with scheduler.block(ops) as block:
        block.step("w0")
        block.step("w1")
        # The server, asked on its own connection, agrees: w1's backend waits for w0's.
        (blockers,) = admin.execute(
            "SELECT pg_blocking_pids(%s)", (c1.info.backend_pid,)
        ).fetchone()
        assert blockers == [c0.info.backend_pid]
        assert block.blocked_by("w1") == ("w0",)
        assert block.options() == ["w0"]
        assert block.in_transaction("w0")
        block.step("w0")  # COMMIT: the wait ends
        assert block.blocked_by("w1") == ()
        assert block.options() == ["w1"]
        block.step("w1")
        result = block.result()
    assert admin.execute("SELECT balance FROM account WHERE id = 1").fetchone() == (103,)
    text = "\n".join(result.trace)
    assert "w1 waits for w0 (ShareLock on its transaction)" in text
    assert "w1 resumed" in text


@pytest.fixture
def connect_async(knownstate_cluster, db, links):
    """``connect_async(worker)``: an AsyncScheduledConnection through the worker's own link, on
    an event loop of its own (as a worker of an asyncio implementation has), and the loop."""
    made = []

    def make(worker: str):
        link = links[worker]
        loop = asyncio.new_event_loop()
        dsn = knownstate_cluster.dsn(db, host=link.host, port=link.port)
        conn = loop.run_until_complete(
            AsyncScheduledConnection.connect(dsn, application_name=f"t-{worker}")
        )
        made.append((conn, loop))
        return conn, loop

    yield make
    for conn, loop in made:
        loop.run_until_complete(conn.close())
        loop.close()


def test_asyncio_workers_are_scheduled_statement_by_statement_and_their_lock_waits_seen(
    scheduler, connect_async, admin
):
    """An implementation on asyncio: each worker's coroutine runs on its own loop, on the block's
    thread of that worker; its statements and COMMIT wait at the gate, its transaction block
    (``async with conn.transaction()``) included, and a lock wait is read from the server."""

    def add_async(loop, account: int, delta: int):
        async def body(conn):
            async with conn.transaction():
                await conn.execute(
                    "UPDATE account SET balance = balance + %s WHERE id = %s", (delta, account)
                )
            return delta

        return lambda conn: loop.run_until_complete(body(conn))

    (c0, l0), (c1, l1) = connect_async("w0"), connect_async("w1")
    ops = [
        Op("w0", "add(1, +1)", c0, add_async(l0, 1, 1)),
        Op("w1", "add(1, +2)", c1, add_async(l1, 1, 2)),
    ]
    with scheduler.block(ops) as block:
        block.step("w0")  # BEGIN
        block.step("w0")  # its UPDATE: holds the row
        block.step("w1")  # BEGIN
        block.step("w1")  # its UPDATE waits on w0
        assert block.blocked_by("w1") == ("w0",)
        assert block.options() == ["w0"]
        assert admin.execute("SELECT balance FROM account WHERE id = 1").fetchone() == (100,)
        block.step("w0")  # COMMIT: the wait ends
        assert block.options() == ["w1"]
        block.step("w1")
        result = block.result()
    assert [r.value for r in result.ops] == [1, 2]
    assert admin.execute("SELECT balance FROM account WHERE id = 1").fetchone() == (103,)
    steps = [line.split(". ", 1)[1] for line in result.trace if line[3:4] == "."]
    assert steps[0] == "w0 BEGIN (transaction block)"
    assert steps[4] == "w0 COMMIT (end of transaction block)"
    assert "w1 waits for w0 (ShareLock on its transaction)" in "\n".join(result.trace)
    assert knownstate_threads() == []
    # at rest again: the connection is a plain one, its block settings undone
    got = l0.run_until_complete(c0.execute("SHOW deadlock_timeout"))
    assert l0.run_until_complete(got.fetchone()) == ("1s",)


class Accounts:
    """The transfer model: a transfer moves money, all or nothing."""

    def __init__(self, balances=None):
        self.balances = dict(balances or {1: 100, 2: 100, 3: 100})

    def copy(self) -> "Accounts":
        return Accounts(self.balances)

    def add(self, account: int, delta: int):
        self.balances[account] += delta
        return Won()

    def transfer(self, src: int, dst: int, amount: int):
        self.balances[src] -= amount
        self.balances[dst] += amount
        return Won()

    def rows(self):
        return tuple(sorted(self.balances.items()))


def transfer(src: int, dst: int, amount: int):
    def run(conn):
        try:
            with errors.boundary("transfer"):
                conn.execute(
                    "UPDATE account SET balance = balance - %s WHERE id = %s", (amount, src)
                )
                conn.execute(
                    "UPDATE account SET balance = balance + %s WHERE id = %s", (amount, dst)
                )
            errors.commit(conn, "transfer")
        except errors.TransactionAborted:
            conn.rollback()
            raise
        return Won()

    return run


def judge(result, calls, admin):
    ops = {w: (lambda s, d, a: lambda m: m.transfer(s, d, a))(*args) for w, args in calls.items()}
    observed = tuple(admin.execute("SELECT id, balance FROM account ORDER BY id").fetchall())
    return linearize.check(
        history(result, ops), Accounts(), final=linearize.FinalState(observed, Accounts.rows)
    )


def test_an_asyncio_connection_at_rest_runs_where_this_thread_runs_another_loop(connect_async):
    """Playwright's sync API keeps its loop running on the main thread while the browser kind's
    Chromium is kept for the run: an async adapter's next block ran its connections' session
    settings there and failed ("Cannot run the event loop while another loop is running"),
    reported as the implementation's failure. The connection's loop then runs on a thread of
    its own, and the caller waits for it."""
    conn, _ = connect_async("w0")

    async def another_loop():
        cur = conn.at_rest(conn.execute("SELECT 41 + 1"))
        return conn.at_rest(cur.fetchone())

    assert asyncio.run(another_loop()) == (42,)
    assert conn.at_rest(conn.at_rest(conn.execute("SELECT 1")).fetchone()) == (1,)


@pytest.mark.parametrize("closer", ["w1", "w0"])
def test_a_deadlock_is_an_outcome_the_model_expects_and_the_closer_is_its_victim(
    scheduler, connect, admin, closer
):
    """w0 moves 1 -> 2, w1 moves 2 -> 1; each takes its first row, then wants the other's.
    The statement that closes the cycle is the victim, every time: the server aborts it
    (40P01), nothing of it commits, and the other transfer completes. The model has no
    deadlock: a victim is an operation that did not happen, and the block is linearizable."""
    c0, c1 = connect("w0"), connect("w1")
    calls = {"w0": (1, 2, 10), "w1": (2, 1, 30)}
    first = "w0" if closer == "w1" else "w1"
    victims = []
    for _ in range(3):
        admin.execute("UPDATE account SET balance = 100")
        ops = [
            Op(w, f"transfer{args}", c, transfer(*args))
            for (w, args), c in zip(calls.items(), (c0, c1))
        ]
        result = scheduler.run(ops, script("w0", "w1", first, closer))
        victim = [r for r in result.ops if r.error is not None]
        assert len(victim) == 1, result.trace
        (v,) = victim
        assert isinstance(v.error, errors.TransactionAborted)  # the operation's own outcome
        assert v.sqlstate == "40P01" and v.transient
        victims.append(v.worker)
        verdict = judge(result, calls, admin)
        assert verdict.ok, "\n".join(verdict.explain())
        assert [o.client for o in verdict.order] == [first]
        assert (
            f"{closer} transfer{calls[closer]} raised TransactionAborted (40P01 deadlock "
            "detected)" in "\n".join(result.trace)
        )
    assert victims == [closer] * 3


def test_a_serialization_failure_is_the_callers_outcome_and_the_other_commits(
    scheduler, connect, admin
):
    """Write skew under SERIALIZABLE: each reads both balances and moves money out of one
    if the sum allows. Both reads before either write: the second COMMIT fails (40001), as an
    outcome of that operation; the block is linearizable without it."""

    def withdraw(account: int):
        def run(conn):
            try:
                with errors.boundary("withdraw"):
                    conn.execute("SET TRANSACTION ISOLATION LEVEL SERIALIZABLE")
                    (total,) = conn.execute(
                        "SELECT sum(balance) FROM account WHERE id IN (1, 2)"
                    ).fetchone()
                    if total >= 150:
                        conn.execute(
                            "UPDATE account SET balance = balance - 150 WHERE id = %s", (account,)
                        )
                errors.commit(conn, "withdraw")
            except errors.TransactionAborted:
                conn.rollback()
                raise
            return Won()

        return run

    ops = [
        Op("w0", "withdraw(1)", connect("w0"), withdraw(1)),
        Op("w1", "withdraw(2)", connect("w1"), withdraw(2)),
    ]
    result = scheduler.run(ops, script("w0", "w1", "w0", "w1", "w0", "w0", "w1", "w1"))
    r0, r1 = result.ops
    assert r0.value == Won()
    assert r1.sqlstate == "40001" and r1.transient
    assert isinstance(r1.error, errors.TransactionAborted)
    verdict = linearize.check(
        history(result, {"w0": lambda m: m.add(1, -150), "w1": lambda m: m.add(2, -150)}),
        Accounts(),
        final=linearize.FinalState(
            tuple(admin.execute("SELECT id, balance FROM account ORDER BY id").fetchall()),
            Accounts.rows,
        ),
    )
    assert verdict.ok and [o.client for o in verdict.order] == ["w0"]


def test_the_same_choices_replay_the_same_schedule_trace_outcomes_and_rows(
    scheduler, connect, admin
):
    """Three workers moving money among three accounts in random directions: lock waits,
    deadlocks and plain runs. Each seed's choices, replayed, give the same everything."""
    conns = {w: connect(w) for w in ("w0", "w1", "w2")}
    seen_blocked = seen_deadlock = 0
    for seed in range(6):
        directions = random.Random(seed).sample([(1, 2), (2, 3), (3, 1), (2, 1), (3, 2)], 3)
        runs = []
        for _ in range(2):
            admin.execute("UPDATE account SET balance = 100")
            rng = random.Random(seed)
            ops = [
                Op(w, f"transfer{d}", conns[w], transfer(*d, 5)) for w, d in zip(conns, directions)
            ]
            result = scheduler.run(ops, lambda options: options[rng.randrange(len(options))])
            rows = admin.execute("SELECT id, balance FROM account ORDER BY id").fetchall()
            outcomes = [r.describe() for r in result.ops]
            runs.append((result.schedule, result.trace, outcomes, rows))
        assert runs[0] == runs[1], "\n".join(
            ["replayed differently:", *runs[0][1], "--", *runs[1][1]]
        )
        text = "\n".join(runs[0][1])
        seen_blocked += " waits for " in text
        seen_deadlock += "40P01" in text
    assert seen_blocked and seen_deadlock  # the seeds did reach both


# ---------------------------------------------------------------------------------------
# Faults inside a block.
# ---------------------------------------------------------------------------------------


def test_the_lock_holders_link_cut_mid_transaction_lets_the_waiter_through(
    scheduler, connect, admin, links
):
    c0, c1 = connect("w0"), connect("w1")
    ops = [Op("w0", "add(1, +1)", c0, add(1, 1)), Op("w1", "add(1, +2)", c1, add(1, 2))]
    with scheduler.block(ops) as block:
        block.step("w0")
        block.step("w1")
        assert block.blocked_by("w1") == ("w0",)
        block.fault("link down w0", links["w0"].down, lost=["w0"])
        assert block.blocked_by("w1") == ()  # w0's backend is gone, its lock with it
        assert block.options() == ["w0", "w1"]
        block.step("w0")  # its COMMIT meets the dead link
        block.step("w1")
        result = block.result()
    r0, r1 = result.ops
    assert isinstance(r0.error, errors.CommitIndeterminate) and r1.value == Won()
    assert admin.execute("SELECT balance FROM account WHERE id = 1").fetchone() == (102,)
    text = "\n".join(result.trace)
    assert "FAULT link down w0" in text and "w0's backend is gone" in text
    verdict = linearize.check(
        history(result, {"w0": lambda m: m.add(1, 1), "w1": lambda m: m.add(1, 2)}),
        Accounts(),
        final=linearize.FinalState(((1, 102), (2, 100), (3, 100)), Accounts.rows),
    )
    assert verdict.ok  # w0 indeterminate, w1 explained; rows as observed, through the model
    assert knownstate_threads() == []


def test_a_waiters_link_cut_leaves_its_backend_waiting_until_the_holder_commits(
    scheduler, connect, admin, links
):
    c0, c1 = connect("w0"), connect("w1")
    pid1 = c1.info.backend_pid
    ops = [Op("w0", "add(1, +1)", c0, add(1, 1)), Op("w1", "add(1, +2)", c1, add(1, 2))]
    with scheduler.block(ops) as block:
        block.step("w0")
        block.step("w1")
        block.fault("link down w1", links["w1"].down, lost=["w1"])
        assert block.options() == ["w0"]  # w1's operation ended: its connection died
        # Its backend still waits on the server, holding its place: at rest, not gone.
        assert admin.execute("SELECT pg_blocking_pids(%s)", (pid1,)).fetchone()[0]
        block.step("w0")
        result = block.result()
    assert isinstance(result.ops[1].error, errors.ConnectionLost)
    assert admin.execute("SELECT balance FROM account WHERE id = 1").fetchone() == (101,)
    assert admin.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid1,)
    ).fetchone() == (0,)
    assert "w1's backend is gone" in "\n".join(result.trace)
    # its statement raised at the fault, before the next step, whatever the machine's load:
    # the same seed gives the same trace (it was noted during w0's step when w1 saw it late)
    after = result.trace[result.trace.index("     FAULT link down w1") + 1]
    assert after.strip() == "w1 add(1, +2) raised ConnectionLost (the connection was lost)"


def test_a_database_crash_while_a_lock_is_held(scheduler, connect, admin, knownstate_cluster, db):
    c0, c1 = connect("w0"), connect("w1")
    ops = [Op("w0", "add(1, +1)", c0, add(1, 1)), Op("w1", "add(1, +2)", c1, add(1, 2))]

    def crash():
        knownstate_cluster.crash()
        knownstate_cluster.restart()

    with scheduler.block(ops) as block:
        block.step("w0")
        block.step("w1")
        assert block.in_transaction("w0") and block.blocked_by("w1") == ("w0",)
        block.fault("database crash", crash, lost=["w0", "w1"])
        assert block.options() == ["w0"]
        block.step("w0")
        result = block.result()
    assert isinstance(result.ops[0].error, errors.CommitIndeterminate)
    assert isinstance(result.ops[1].error, errors.ConnectionLost)
    with psycopg.connect(knownstate_cluster.dsn(db)) as conn:
        assert conn.execute("SELECT balance FROM account WHERE id = 1").fetchone() == (100,)


# ---------------------------------------------------------------------------------------
# Nothing left behind; errors for people.
# ---------------------------------------------------------------------------------------


class Interrupted(BaseException):
    """What Hypothesis does mid-draw (StopTest): a BaseException out of ``choose``."""


def test_an_interrupted_block_leaves_no_thread_no_backend_and_no_lock(
    scheduler, connect, admin, knownstate_cluster, db
):
    c0, c1 = connect("w0"), connect("w1")
    pids = [c0.info.backend_pid, c1.info.backend_pid]
    ops = [Op("w0", "add(1, +1)", c0, add(1, 1)), Op("w1", "add(1, +2)", c1, add(1, 2))]
    calls = iter(["w0", "w1"])

    def choose(options):
        nxt = next(calls, None)
        if nxt is None:
            raise Interrupted()
        return nxt

    with pytest.raises(Interrupted):
        scheduler.run(ops, choose)
    assert knownstate_threads() == []
    assert c0.closed and c1.closed
    assert admin.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s)", (pids,)
    ).fetchone() == (0,)
    # No lock lingers: a new block on the same row runs through at once.
    again = scheduler.run([Op("w0", "add(1, +5)", connect("w0"), add(1, 5))], script())
    assert again.ops[0].value == Won()
    assert admin.execute("SELECT balance FROM account WHERE id = 1").fetchone() == (105,)


def test_a_parked_worker_unwinds_with_block_aborted():
    assert issubclass(BlockAborted, BaseException) and not issubclass(BlockAborted, Exception)


def test_a_worker_stuck_outside_any_lock_is_an_environment_error_naming_it(
    knownstate_cluster, db, connect
):
    scheduler = Scheduler(knownstate_cluster.dsn(db), deadline_s=0.5, pause=True)
    try:
        op = Op("w0", "sleep", connect("w0"), lambda conn: conn.execute("SELECT pg_sleep(30)"))
        with pytest.raises(WorkerStuck) as e:
            scheduler.run([op], script())
        message = str(e.value)
        assert "w0 (sleep) still in statement 1" in message
        assert "state=active wait=Timeout:PgSleep" in message
        assert "\n" not in message
        assert knownstate_threads() == []
    finally:
        scheduler.close()


def test_a_database_clock_ahead_of_real_time_is_refused_with_the_reason(
    scheduler, connect, knownstate_db_clock
):
    knownstate_db_clock.reset(300)  # 300 s ahead of true time
    with pytest.raises(ClockAhead, match="300 s ahead of real time.*a day back"):
        scheduler.run([Op("w0", "add", connect("w0"), add(1, 1))], script())
    knownstate_db_clock.reset(-86_400)  # behind real time: fine
    assert scheduler.run([Op("w0", "add", connect("w0"), add(1, 1))], script()).ops[0].value
    assert knownstate_threads() == []


def test_a_block_restores_the_connections_own_settings(scheduler, connect):
    conn = connect("w0", options="-c lock_timeout=2000 -c statement_timeout=10000")

    def show(c):
        value = c.execute("SHOW lock_timeout").fetchone()[0]
        c.commit()
        return value

    assert scheduler.run([Op("w0", "show", conn, show)], script()).ops[0].value == "0"
    assert conn.execute("SHOW lock_timeout").fetchone() == ("2s",)
    assert conn.execute("SHOW deadlock_timeout").fetchone() == ("1s",)
    assert conn.execute("SHOW statement_timeout").fetchone() == ("10s",)


def test_a_scheduler_that_keeps_settings_sets_them_once_per_connection(
    knownstate_cluster, db, connect
):
    """``keep_settings``: the block's settings stay on the connection after the block, and the
    next block on it does not set them again (what the check's own workers save)."""
    keeping = Scheduler(knownstate_cluster.dsn(db), pause=True, keep_settings=True)
    conn = connect("w0", options="-c lock_timeout=2000")
    sets: list[str] = []

    def show(c):
        value = c.execute("SHOW lock_timeout").fetchone()[0]
        c.commit()
        return value

    real_execute = conn.execute

    def execute(query, *args, **kwargs):
        if "set_config" in str(query):
            sets.append(query)
        return real_execute(query, *args, **kwargs)

    conn.execute = execute
    try:
        for _ in range(2):
            assert keeping.run([Op("w0", "show", conn, show)], script()).ops[0].value == "0"
            assert real_execute("SHOW deadlock_timeout").fetchone() == ("1ms",)
            assert real_execute("SHOW lock_timeout").fetchone() == ("0",)
            conn.rollback()
    finally:
        keeping.close()
    assert len(sets) == 1, sets


def test_a_block_needs_idle_scheduled_connections(scheduler, connect, knownstate_cluster, db):
    plain = psycopg.connect(knownstate_cluster.dsn(db))
    try:
        with pytest.raises(TypeError, match="ScheduledConnection"):
            scheduler.run([Op("w0", "x", plain, lambda c: None)], script())
    finally:
        plain.close()
    busy = connect("w0")
    busy.execute("SELECT 1")
    with pytest.raises(ValueError, match="transaction open"):
        scheduler.run([Op("w0", "x", busy, lambda c: None)], script())
    busy.rollback()
    with pytest.raises(ValueError, match="one operation per worker"):
        scheduler.run(
            [Op("w0", "x", busy, lambda c: None), Op("w0", "y", busy, lambda c: None)], script()
        )


def test_a_backend_that_is_exiting_is_not_paused_and_a_process_not_postgres_is_refused(
    knownstate_db,
):
    """Pausing a backend resting in a lock wait: one whose client is gone and which the server
    has not reaped yet (a zombie) has nothing left to pause, which is no environment fault;
    a live backend is paused; a process that is not PostgreSQL's is never signalled."""
    dsn = knownstate_db(None)
    conn = psycopg.connect(dsn, autocommit=True)
    pid = conn.info.backend_pid
    assert check_backend(pid) is True
    with pytest.raises(SchedulerEnvironmentError, match="not a PostgreSQL process"):
        check_backend(os.getpid())
    with open(f"/proc/{pid}/stat") as f:
        postmaster = int(f.read().rsplit(")", 1)[1].split()[1])
    os.kill(postmaster, signal.SIGSTOP)  # it cannot reap the backend that exits now
    try:
        conn.close()

        def state() -> str:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0]

        poll(f"backend {pid} exits and is left unreaped", lambda: state() == "Z", 30)
        assert check_backend(pid) is False
    finally:
        os.kill(postmaster, signal.SIGCONT)
