"""The outbox implementation against a real PostgreSQL (the session's throwaway cluster).

The same operation sequences go to the model and to :class:`OutboxStore`; after every operation
the outcomes must be equal, the rows projected through ``impl.outbox.project`` must equal the
model's state, and the contract's invariants must hold. Time is the database clock: the test
moves it with libfaketime (``pg.clock.jump``) and advances the model by the same amount.

Then what only a real database shows: the fence after a real reclaim, ``SKIP LOCKED`` under an
open claim, the lease stamped with the database clock, the reaper leaving terminal rows alone, a
COMMIT whose answer is lost (through a real Toxiproxy link) in both directions, and the error
boundary on a dead connection and on a lock timeout.
"""

from __future__ import annotations

import re
import time
from datetime import datetime, timezone

import psycopg
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from knownstate.chaos.toxi import Toxic
from knownstate.impl import errors
from knownstate.impl import outbox as impl
from knownstate.impl.errors import CommitIndeterminate, ConnectionLost, TransactionAborted
from knownstate.impl.outbox import OutboxStore, project
from knownstate.model.contract import CREATED, LostRace, Write, Won, check_invariants
from knownstate.model.outbox import CONTRACT, TABLE, Claim, Config, OutboxModel, Status, views

P, R, S, F, D = (s.value for s in Status)

QUANTUM = 60
"""Model time is whole seconds. The database clock keeps ticking in real time while a test runs,
so every duration here (lease, backoff, clock jumps) is a multiple of a minute and a timestamp is
projected to the nearest minute: exact while a sequence lasts under half a minute of real time,
and a slower run fails with that message instead of a wrong comparison."""

CONFIG = Config(lease=300, backoff_base=60, backoff_cap=240, max_attempts=3)


@pytest.fixture
def dsn(fresh_db):
    return fresh_db(impl.SCHEMA)


@pytest.fixture
def clock(pg):
    if pg.clock is None:  # pragma: no cover - the session cluster always runs under libfaketime
        pytest.fail("the session cluster has no libfaketime clock")
    return pg.clock


@pytest.fixture
def connect(dsn):
    conns: list[psycopg.Connection] = []

    def make(autocommit: bool = False, dsn_: str | None = None) -> psycopg.Connection:
        c = psycopg.connect(dsn_ or dsn, autocommit=autocommit)
        conns.append(c)
        return c

    yield make
    for c in conns:
        c.close()


def rows(observer: psycopg.Connection) -> dict[int, tuple]:
    """Every column of every row, read on a direct autocommit connection."""
    return {r[0]: r for r in observer.execute(
        "select id, status, attempts, next_attempt_at, lease_until, last_error from outbox_delivery order by id")}


class Pair:
    """One model and one database, driven by the same operations and compared after each."""

    def __init__(self, conns: list[psycopg.Connection], observer: psycopg.Connection, clock, config: Config = CONFIG):
        self.model, self.store = OutboxModel(config), OutboxStore(config)
        self.conns, self.observer, self.clock = conns, observer, clock
        self.t0: datetime = observer.execute("select now()").fetchone()[0]
        self.started = time.monotonic()
        self.taken: set[tuple[str, str, str]] = set()

    def to_model_time(self, ts: datetime) -> int:
        seconds = (ts - self.t0).total_seconds()
        q = round(seconds / QUANTUM) * QUANTUM
        assert abs(seconds - q) < QUANTUM / 2 - 5, (
            f"a sequence ran {time.monotonic() - self.started:.0f}s of real time, longer than the clock "
            "tolerance: this machine is too slow for the test")
        return q

    def advance(self, seconds: int) -> None:
        assert seconds % QUANTUM == 0
        self.clock.jump(seconds)
        self.model.advance(seconds)

    def __call__(self, op: str, *args, conn: int = 0, token: Claim | None = None):
        before = self.model.views()
        owner_current = token is not None and self.model._owned(token) is not None
        n = len(self.model.transitions)
        expected = getattr(self.model, op)(*args)
        got = getattr(self.store, op)(self.conns[conn], *args)
        assert got == expected, f"{op}{args}: implementation {got}, model {expected}"
        state = project(self.observer, self.to_model_time)
        assert state == self.model.state(), f"after {op}{args}"
        writes = [] if token is None else [Write(str(token.id), token.attempt, isinstance(got, Won), owner_current)]
        # The sink is not in these sequences: count a completed row's send as received so the
        # at-least-once invariant reads the rows alone.
        received = {d.id: 1 for d in state if d.status == S}
        assert check_invariants(CONTRACT, before, views(state, received), writes) == []
        self.taken.update((s, e, t) for _, s, e, t in self.model.transitions[n:])
        return got


@pytest.fixture
def pair(connect, clock):
    return Pair([connect(), connect()], connect(autocommit=True), clock)


# ---------------------------------------------------------------------------
# Drift: one fact, two places.
# ---------------------------------------------------------------------------


def test_the_schemas_status_check_is_the_models_enum():
    m = re.search(r"CHECK \(status IN \(([^)]*)\)\)", impl.SCHEMA)
    assert m is not None, "outbox_schema.sql lost its status CHECK"
    assert [s.strip().strip("'") for s in m.group(1).split(",")] == [s.value for s in Status]


def test_the_database_refuses_a_status_the_model_does_not_have(dsn, connect):
    c = connect(autocommit=True)
    with pytest.raises(psycopg.errors.CheckViolation):
        c.execute("insert into outbox_delivery (id, status) values (1, 'delivered')")
    with pytest.raises(psycopg.errors.CheckViolation):  # processing without a lease
        c.execute("insert into outbox_delivery (id, status) values (2, 'processing')")


# ---------------------------------------------------------------------------
# Model == implementation along the same sequences.
# ---------------------------------------------------------------------------


def test_every_transition_of_the_table_agrees_with_the_model(pair):
    for i in (1, 2, 3, 4, 5):
        assert pair("enqueue", i) == Won(i)
    c1, c2, c3 = pair("claim", 3).value
    assert (c1, c2, c3) == (Claim(1, 1), Claim(2, 1), Claim(3, 1))
    pair("extend_lease", c1, token=c1)
    assert pair("complete", c1, token=c1) == Won(S)
    assert pair("fail", c2, True, token=c2) == Won(F)
    assert pair("fail", c3, False, token=c3) == Won(P)        # retry: backoff 60
    c4, c5 = pair("claim", 5, conn=1).value                    # 3 is not due yet
    assert (c4.id, c5.id) == (4, 5)
    pair.advance(300)                                          # both leases lapse
    assert pair("reclaim_stale") == Won((4, 5))
    c3, c4, c5 = pair("claim", 3).value
    assert (c3, c4) == (Claim(3, 2), Claim(4, 2))
    assert pair("fail", c3, False, token=c3) == Won(P)        # backoff 120
    pair.advance(120)
    c3 = pair("claim", 1).value[0]
    assert c3 == Claim(3, 3)
    assert pair("fail", c3, False, token=c3) == Won(D)        # give_up at max_attempts
    assert pair("fail", c4, False, token=c4) == Won(P)
    pair.advance(300)
    assert pair("reclaim_stale") == Won((5,))
    c4, c5 = pair("claim", 2, conn=1).value
    assert (c4, c5) == (Claim(4, 3), Claim(5, 3))
    pair.advance(300)
    assert pair("reclaim_stale") == Won((4, 5))                # reclaim_dead, both at the limit
    assert pair.taken == {(t.source, t.event, t.target) for t in TABLE.transitions}


def test_backoff_is_capped_in_sql_as_in_the_model(connect, clock):
    cfg = Config(lease=300, backoff_base=60, backoff_cap=120, max_attempts=5)
    pair = Pair([connect()], connect(autocommit=True), clock, cfg)
    pair("enqueue", 1)
    for waited in (60, 120, 120):  # 60, 120, then 240 capped at 120
        c = pair("claim", 1).value[0]
        pair("fail", c, False, token=c)
        pair.advance(waited - QUANTUM)
        assert pair("claim", 1) == Won(())  # a minute early: not due
        pair.advance(QUANTUM)
    assert pair("claim", 1).value == (Claim(1, 4),)


def test_random_sequences_agree_with_the_model(dsn, connect, clock):
    """A Hypothesis state machine over two worker connections, stale tokens and clock jumps."""
    admin = connect(autocommit=True)
    conns = [connect(), connect()]

    class Machine(RuleBasedStateMachine):
        @initialize(max_attempts=st.integers(1, 3))
        def start(self, max_attempts):
            admin.execute("truncate outbox_delivery")
            self.pair = Pair(conns, admin, clock, Config(300, 60, 240, max_attempts))
            self.tokens: list[Claim] = []

        @precondition(lambda self: sum(d.status == P for d in self.pair.model.deliveries.values()) < 4)
        @rule()
        def enqueue(self):
            self.pair("enqueue", self.pair.model.next_id())

        @rule(w=st.integers(0, 1), batch=st.integers(1, 3))
        def claim(self, w, batch):
            self.tokens.extend(self.pair("claim", batch, conn=w).value)

        @precondition(lambda self: self.tokens)
        @rule(data=st.data(), w=st.integers(0, 1), op=st.sampled_from(["complete", "retry", "permanent", "extend"]))
        def write(self, data, w, op):
            c = data.draw(st.sampled_from(self.tokens), label="token")
            if op == "complete":
                self.pair("complete", c, conn=w, token=c)
            elif op == "extend":
                self.pair("extend_lease", c, conn=w, token=c)
            else:
                self.pair("fail", c, op == "permanent", conn=w, token=c)

        @rule(minutes=st.sampled_from([1, 2, 5]))
        def advance(self, minutes):
            self.pair.advance(minutes * QUANTUM)

        @rule()
        def reap(self):
            self.pair("reclaim_stale")

        @invariant()
        def no_transaction_left_open(self):
            if hasattr(self, "pair"):
                assert all(c.info.transaction_status == psycopg.pq.TransactionStatus.IDLE for c in conns)

    run_state_machine_as_test(Machine, settings=settings(
        max_examples=25, stateful_step_count=20, deadline=None, database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]))


# ---------------------------------------------------------------------------
# The fence, the claim and the lease on the real database.
# ---------------------------------------------------------------------------


def test_a_stale_owner_is_fenced_after_a_reclaim(pair):
    pair("enqueue", 1)
    stale = pair("claim", 1).value[0]
    pair.advance(300)
    assert pair("reclaim_stale") == Won((1,))
    current = pair("claim", 1, conn=1).value[0]
    assert (stale.attempt, current.attempt) == (1, 2)
    before = rows(pair.observer)
    assert isinstance(pair("complete", stale, token=stale), LostRace)
    assert isinstance(pair("fail", stale, True, token=stale), LostRace)
    assert isinstance(pair("fail", stale, False, token=stale), LostRace)
    assert isinstance(pair("extend_lease", stale, token=stale), LostRace)
    assert rows(pair.observer) == before  # every column, last_error included
    assert pair("complete", current, conn=1, token=current) == Won(S)
    assert isinstance(pair("complete", stale, token=stale), LostRace)  # and behind the terminal status


def test_skip_locked_an_open_claim_neither_blocks_nor_overlaps_a_second(connect):
    store = OutboxStore(CONFIG)
    a, b, observer = connect(), connect(), connect(autocommit=True)
    for i in range(1, 7):
        store.enqueue(a, i)
    held = store.begin_claim(a, 3)  # open transaction: rows locked, not committed
    assert [c.id for c, _ in held] == [1, 2, 3]
    b.execute("set statement_timeout = '3s'")  # waiting on A's locks would fail here, not hang
    b.commit()
    started = time.monotonic()
    other = store.claim_batch(b, 6)
    assert time.monotonic() - started < 2.5
    assert [c.id for c, _ in other] == [4, 5, 6]
    errors.commit(a, "test")
    assert not {c.id for c, _ in held} & {c.id for c, _ in other}
    assert {r[1] for r in rows(observer).values()} == {R}
    assert all(r[2] == 1 for r in rows(observer).values())  # each row claimed exactly once


def test_concurrent_claims_partition_the_rows(dsn, connect):
    """Four connections claim at once (threads, real concurrency): every row goes to exactly one."""
    from concurrent.futures import ThreadPoolExecutor

    store = OutboxStore(CONFIG)
    c0 = connect()
    for i in range(1, 41):
        store.enqueue(c0, i)
    conns = [connect() for _ in range(4)]

    def drain(conn):
        got = []
        while batch := store.claim_batch(conn, 3):
            got += [c.id for c, _ in batch]
        return got

    with ThreadPoolExecutor(4) as pool:
        claimed = list(pool.map(drain, conns))
    flat = [i for ids in claimed for i in ids]
    assert sorted(flat) == list(range(1, 41)) and len(flat) == len(set(flat))


def test_the_lease_is_stamped_and_compared_with_the_database_clock(connect, clock):
    store = OutboxStore(CONFIG)
    conn, observer = connect(), connect(autocommit=True)
    store.enqueue(conn, 1)
    clock.jump(3600)  # the database is an hour ahead of this process
    (c, _), = store.claim_batch(conn, 1)
    lease_until, db_now = observer.execute(
        "select lease_until, now() from outbox_delivery").fetchone()
    app_now = datetime.now(timezone.utc)
    assert abs((lease_until - db_now).total_seconds() - 300) < 5
    assert abs((lease_until - app_now).total_seconds() - 3900) < 10  # an app-clock lease would say 300
    assert store.reclaim_stale(conn) == Won(())
    clock.jump(240)
    assert store.reclaim_stale(conn) == Won(())  # 4 of 5 minutes on the database clock
    clock.jump(61)
    assert store.reclaim_stale(conn) == Won((1,))
    assert rows(observer)[1][1:3] == (P, 1)
    assert isinstance(store.complete(conn, c), LostRace)


def test_the_reaper_never_touches_a_terminal_row(connect, clock):
    store = OutboxStore(Config(lease=300, max_attempts=1))
    conn, observer = connect(), connect(autocommit=True)
    for i in (1, 2, 3, 4):
        store.enqueue(conn, i)
    c1, c2, c3, c4 = store.claim(conn, 4).value
    assert store.complete(conn, c1) == Won(S)
    assert store.fail(conn, c2, permanent=True, error="422") == Won(F)
    assert store.fail(conn, c3, permanent=False, error="503") == Won(D)
    terminal = {i: r for i, r in rows(observer).items() if i != 4}
    clock.jump(10 ** 6)
    assert store.reclaim_stale(conn) == Won((4,))
    after = rows(observer)
    assert {i: r for i, r in after.items() if i != 4} == terminal
    assert after[4][1] == D and after[4][5] == "lease expired"


# ---------------------------------------------------------------------------
# Indeterminate COMMIT through a real Toxiproxy link.
# ---------------------------------------------------------------------------


@pytest.fixture
def db_link(pg, toxiproxy, request):
    return toxiproxy.link(f"outbox-impl-{request.node.name[:40]}", pg.host, pg.port)


def wait_backend_gone(observer: psycopg.Connection, pid: int, deadline_s: float = 10.0) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if not observer.execute("select 1 from pg_stat_activity where pid = %s", (pid,)).fetchone():
            return
        time.sleep(0.02)
    raise AssertionError(f"backend {pid} still alive after {deadline_s}s")


def test_a_commit_whose_answer_is_lost_is_indeterminate_and_did_commit(dsn, connect, db_link):
    observer = connect(autocommit=True)
    conn = connect(dsn_=psycopg.conninfo.make_conninfo(dsn, host=db_link.host, port=db_link.port))
    pid = conn.info.backend_pid
    conn.execute("insert into outbox_delivery (id) values (1)")
    db_link.add(Toxic("limit_data", "downstream", {"bytes": 0}))  # the next byte back closes the link
    with pytest.raises(CommitIndeterminate) as info:
        errors.commit(conn, "outbox.enqueue")
    assert "may or may not" in str(info.value) and "outbox.enqueue" in str(info.value)
    wait_backend_gone(observer, pid)
    assert list(rows(observer)) == [1]  # the COMMIT landed; only its answer was lost


def test_a_commit_that_never_arrived_is_indeterminate_and_did_not_commit(dsn, connect, db_link):
    observer = connect(autocommit=True)
    conn = connect(dsn_=psycopg.conninfo.make_conninfo(dsn, host=db_link.host, port=db_link.port))
    pid = conn.info.backend_pid
    conn.execute("insert into outbox_delivery (id) values (1)")
    db_link.add(Toxic("reset_peer", "upstream", {"timeout": 0}))  # the COMMIT resets the link
    with pytest.raises(CommitIndeterminate):
        errors.commit(conn, "outbox.enqueue")
    wait_backend_gone(observer, pid)  # the server saw the reset and rolled back
    assert rows(observer) == {}


# ---------------------------------------------------------------------------
# The error boundary.
# ---------------------------------------------------------------------------


def test_a_dead_connection_becomes_connection_lost(connect):
    store = OutboxStore(CONFIG)
    conn, admin = connect(), connect(autocommit=True)
    store.enqueue(conn, 1)
    admin.execute("select pg_terminate_backend(%s)", (conn.info.backend_pid,))
    with pytest.raises(ConnectionLost) as info:
        store.claim(conn, 1)
    assert "outbox.claim" in str(info.value) and "nothing of this transaction committed" in str(info.value)
    assert rows(admin)[1][1:3] == (P, 0)


def test_a_lock_timeout_becomes_transaction_aborted(connect):
    store = OutboxStore(CONFIG)
    holder, victim, observer = connect(), connect(), connect(autocommit=True)
    store.enqueue(holder, 1)
    (c, _), = store.claim_batch(holder, 1)
    holder.execute("select * from outbox_delivery where id = 1 for update")  # hold the row lock
    victim.execute("set lock_timeout = '100ms'")
    victim.commit()
    with pytest.raises(TransactionAborted) as info:
        store.complete(victim, c)
    assert "55P03" in str(info.value) and "outbox.complete" in str(info.value)
    victim.rollback()
    holder.rollback()
    assert rows(observer)[1][1] == R  # nothing of the refused write committed
    assert store.complete(victim, c) == Won(S)  # the owner's write goes through once the lock is free
