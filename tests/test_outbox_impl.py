"""The outbox implementation against a real PostgreSQL (the session's throwaway cluster).

The same operation sequences go to the model and to :class:`OutboxStore`; after every operation
the outcomes must be equal, the rows projected through ``impl.outbox.project`` must equal the
model's state, and the contract's invariants must hold. Time is the database clock: the test
moves it with libfaketime (``knownstate_db_clock.jump``) and advances the model by the same amount.

Then what only a real database shows: the fence after a real reclaim, ``SKIP LOCKED`` under an
open claim, the lease stamped with the database clock, the reaper leaving terminal rows alone, a
COMMIT whose answer is lost (through a real Toxiproxy link) in both directions, and the error
boundary on a dead connection and on a lock timeout. The batched completion: a mixed batch, a
stale row in a batch, a batch whose COMMIT is lost (both candidate states kept, the observation
picks one), and every fenced write planned through the primary key after an ANALYZE taken with
nothing in flight.
"""

from __future__ import annotations

import itertools
import re
import time
from datetime import datetime, timezone

import psycopg
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from knownstate.chaos.toxi import Toxic
from knownstate.impl import errors
from knownstate.impl import outbox as impl
from knownstate.impl.errors import CommitIndeterminate, ConnectionLost, TransactionAborted
from knownstate.impl.outbox import OutboxStore, project
from knownstate.model.contract import LostRace, Rejected, Write, Won, check_invariants
from knownstate.model import outbox as outbox_model
from knownstate.model.outbox import (
    CONTRACT,
    OK,
    PERMANENT,
    RETRYABLE,
    TABLE,
    TWICE_IN_BATCH,
    Claim,
    Config,
    OutboxModel,
    Report,
    Status,
    views,
)

P, R, S, F, D = (s.value for s in Status)

QUANTUM = 60
"""Model time is whole seconds. The database clock keeps ticking in real time while a test runs,
so every duration here (lease, backoff, clock jumps) is a multiple of a minute and a timestamp is
projected to the nearest minute: exact while a sequence lasts under half a minute of real time,
and a slower run fails with that message instead of a wrong comparison."""

CONFIG = Config(lease=300, backoff_base=60, backoff_cap=240, max_attempts=3)


@pytest.fixture
def dsn(knownstate_db):
    return knownstate_db(impl.SCHEMA)


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
    return {
        r[0]: r
        for r in observer.execute(
            "select id, status, attempts, next_attempt_at, lease_until, last_error from "
            "outbox_delivery order by id"
        )
    }


class Pair:
    """One model and one database, driven by the same operations and compared after each."""

    def __init__(
        self,
        conns: list[psycopg.Connection],
        observer: psycopg.Connection,
        clock,
        config: Config = CONFIG,
    ):
        self.model, self.store = OutboxModel(config), OutboxStore(config)
        self.conns, self.observer, self.clock = conns, observer, clock
        self.t0: datetime = observer.execute("select now()").fetchone()[0]
        self.started = time.monotonic()
        self.taken: set[tuple[str, str, str]] = set()

    def to_model_time(self, ts: datetime) -> int:
        seconds = (ts - self.t0).total_seconds()
        q = round(seconds / QUANTUM) * QUANTUM
        assert abs(seconds - q) < QUANTUM / 2 - 5, (
            f"a sequence ran {time.monotonic() - self.started:.0f}s of real time, longer than the "
            "clock tolerance: this machine is too slow for the test"
        )
        return q

    def advance(self, seconds: int) -> None:
        assert seconds % QUANTUM == 0
        self.clock.jump(seconds)
        self.model.advance(seconds)

    def __call__(self, op: str, *args, conn: int = 0, token: Claim | None = None):
        before = self.model.views()
        batch = op == "record_batch"
        tokens = [token] if token is not None else [r.claim for r in args[0]] if batch else []
        owner_current = [self.model._owned(t) is not None for t in tokens]
        n = len(self.model.transitions)
        expected = getattr(self.model, op)(*args)
        got = getattr(self.store, op)(self.conns[conn], *args)
        assert got == expected, f"{op}{args}: implementation {got}, model {expected}"
        state = project(self.observer, self.to_model_time)
        assert state == self.model.state(), f"after {op}{args}"
        accepted = (
            [isinstance(o, Won) for o in got.value]
            if batch and isinstance(got, Won)
            else [isinstance(got, Won)] * len(tokens)
        )
        writes = (
            []
            if isinstance(got, Rejected)
            else [  # a refused batch attempted no write
                Write(str(t.id), t.attempt, a, o)
                for t, a, o in zip(tokens, accepted, owner_current)
            ]
        )
        # The sink is not in these sequences: count a completed row's send as received so the
        # at-least-once invariant reads the rows alone.
        received = {d.id: 1 for d in state if d.status == S}
        assert check_invariants(CONTRACT, before, views(state, received), writes) == []
        self.taken.update((s, e, t) for _, s, e, t in self.model.transitions[n:])
        return got


@pytest.fixture
def pair(connect, knownstate_db_clock):
    return Pair([connect(), connect()], connect(autocommit=True), knownstate_db_clock)


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
    assert pair("fail", c3, False, token=c3) == Won(P)  # retry: backoff 60
    c4, c5 = pair("claim", 5, conn=1).value  # 3 is not due yet
    assert (c4.id, c5.id) == (4, 5)
    pair.advance(300)  # both leases lapse
    assert pair("reclaim_stale") == Won((4, 5))
    c3, c4, c5 = pair("claim", 3).value
    assert (c3, c4) == (Claim(3, 2), Claim(4, 2))
    assert pair("fail", c3, False, token=c3) == Won(P)  # backoff 120
    pair.advance(120)
    c3 = pair("claim", 1).value[0]
    assert c3 == Claim(3, 3)
    assert pair("fail", c3, False, token=c3) == Won(D)  # give_up at max_attempts
    assert pair("fail", c4, False, token=c4) == Won(P)
    pair.advance(300)
    assert pair("reclaim_stale") == Won((5,))
    c4, c5 = pair("claim", 2, conn=1).value
    assert (c4, c5) == (Claim(4, 3), Claim(5, 3))
    pair.advance(300)
    assert pair("reclaim_stale") == Won((4, 5))  # reclaim_dead, both at the limit
    assert pair.taken == {(t.source, t.event, t.target) for t in TABLE.transitions}


def test_backoff_is_capped_in_sql_as_in_the_model(connect, knownstate_db_clock):
    cfg = Config(lease=300, backoff_base=60, backoff_cap=120, max_attempts=5)
    pair = Pair([connect()], connect(autocommit=True), knownstate_db_clock, cfg)
    pair("enqueue", 1)
    for waited in (60, 120, 120):  # 60, 120, then 240 capped at 120
        c = pair("claim", 1).value[0]
        pair("fail", c, False, token=c)
        pair.advance(waited - QUANTUM)
        assert pair("claim", 1) == Won(())  # a minute early: not due
        pair.advance(QUANTUM)
    assert pair("claim", 1).value == (Claim(1, 4),)


def test_random_sequences_agree_with_the_model(dsn, connect, knownstate_db_clock):
    """A Hypothesis state machine over two worker connections, stale tokens and clock jumps."""
    admin = connect(autocommit=True)
    conns = [connect(), connect()]

    class Machine(RuleBasedStateMachine):
        @initialize(max_attempts=st.integers(1, 3))
        def start(self, max_attempts):
            admin.execute("truncate outbox_delivery")
            self.pair = Pair(conns, admin, knownstate_db_clock, Config(300, 60, 240, max_attempts))
            self.tokens: list[Claim] = []

        @precondition(
            lambda self: sum(d.status == P for d in self.pair.model.deliveries.values()) < 4
        )
        @rule()
        def enqueue(self):
            self.pair("enqueue", self.pair.model.next_id())

        @rule(w=st.integers(0, 1), batch=st.integers(1, 3))
        def claim(self, w, batch):
            self.tokens.extend(self.pair("claim", batch, conn=w).value)

        @precondition(lambda self: self.tokens)
        @rule(
            data=st.data(),
            w=st.integers(0, 1),
            op=st.sampled_from(["complete", "retry", "permanent", "extend"]),
        )
        def write(self, data, w, op):
            c = data.draw(st.sampled_from(self.tokens), label="token")
            if op == "complete":
                self.pair("complete", c, conn=w, token=c)
            elif op == "extend":
                self.pair("extend_lease", c, conn=w, token=c)
            else:
                self.pair("fail", c, op == "permanent", conn=w, token=c)

        @precondition(lambda self: self.tokens)
        @rule(data=st.data(), w=st.integers(0, 1))
        def write_batch(self, data, w):
            by_id = {c.id: c for c in data.draw(st.permutations(self.tokens), label="tokens")}
            ids = data.draw(
                st.lists(st.sampled_from(sorted(by_id)), min_size=1, max_size=4, unique=True),
                label="ids",
            )
            results = data.draw(
                st.lists(
                    st.sampled_from([OK, RETRYABLE, PERMANENT]),
                    min_size=len(ids),
                    max_size=len(ids),
                ),
                label="results",
            )
            self.pair("record_batch", [Report(by_id[i], r) for i, r in zip(ids, results)], conn=w)

        @rule(minutes=st.sampled_from([1, 2, 5]))
        def advance(self, minutes):
            self.pair.advance(minutes * QUANTUM)

        @rule()
        def reap(self):
            self.pair("reclaim_stale")

        @invariant()
        def no_transaction_left_open(self):
            if hasattr(self, "pair"):
                assert all(
                    c.info.transaction_status == psycopg.pq.TransactionStatus.IDLE for c in conns
                )

    run_state_machine_as_test(
        Machine,
        settings=settings(
            max_examples=25,
            stateful_step_count=20,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        ),
    )


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
    # and behind the terminal status
    assert isinstance(pair("complete", stale, token=stale), LostRace)


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


def test_the_lease_is_stamped_and_compared_with_the_database_clock(connect, knownstate_db_clock):
    store = OutboxStore(CONFIG)
    conn, observer = connect(), connect(autocommit=True)
    store.enqueue(conn, 1)
    knownstate_db_clock.jump(3600)  # the database is an hour ahead of this process
    ((c, _),) = store.claim_batch(conn, 1)
    lease_until, db_now = observer.execute(
        "select lease_until, now() from outbox_delivery"
    ).fetchone()
    app_now = datetime.now(timezone.utc)
    assert abs((lease_until - db_now).total_seconds() - 300) < 5
    # an app-clock lease would say 300
    assert abs((lease_until - app_now).total_seconds() - 3900) < 10
    assert store.reclaim_stale(conn) == Won(())
    knownstate_db_clock.jump(240)
    assert store.reclaim_stale(conn) == Won(())  # 4 of 5 minutes on the database clock
    knownstate_db_clock.jump(61)
    assert store.reclaim_stale(conn) == Won((1,))
    assert rows(observer)[1][1:3] == (P, 1)
    assert isinstance(store.complete(conn, c), LostRace)


def test_the_reaper_never_touches_a_terminal_row(connect, knownstate_db_clock):
    store = OutboxStore(Config(lease=300, max_attempts=1))
    conn, observer = connect(), connect(autocommit=True)
    for i in (1, 2, 3, 4):
        store.enqueue(conn, i)
    c1, c2, c3, c4 = store.claim(conn, 4).value
    assert store.complete(conn, c1) == Won(S)
    assert store.fail(conn, c2, permanent=True, error="422") == Won(F)
    assert store.fail(conn, c3, permanent=False, error="503") == Won(D)
    terminal = {i: r for i, r in rows(observer).items() if i != 4}
    knownstate_db_clock.jump(10**6)
    assert store.reclaim_stale(conn) == Won((4,))
    after = rows(observer)
    assert {i: r for i, r in after.items() if i != 4} == terminal
    assert after[4][1] == D and after[4][5] == "lease expired"


# ---------------------------------------------------------------------------
# Enqueue refuses a taken id; the batched completion.
# ---------------------------------------------------------------------------


def test_enqueue_with_a_taken_id_is_refused_by_the_key_and_changes_nothing(pair):
    assert pair("enqueue", 1) == Won(1)
    c = pair("claim", 1).value[0]
    before = rows(pair.observer)
    assert pair("enqueue", 1) == Rejected(outbox_model.DUPLICATE_ID)
    assert rows(pair.observer) == before
    assert pair("complete", c, token=c) == Won(S)
    assert pair("enqueue", 1) == Rejected(outbox_model.DUPLICATE_ID)
    assert pair.conns[0].info.transaction_status == psycopg.pq.TransactionStatus.IDLE


def test_a_mixed_batch_agrees_with_the_model_in_one_commit(pair):
    """complete, permanent failure, retry with backoff: one statement, reported out of id order."""
    for i in (1, 2, 3, 4):
        pair("enqueue", i)
    c1, c2, c3, c4 = pair("claim", 4).value
    pair.advance(QUANTUM)
    got = pair(
        "record_batch",
        [Report(c3, RETRYABLE), Report(c1, OK), Report(c4, PERMANENT), Report(c2, RETRYABLE)],
    )
    assert got == Won((Won(P), Won(S), Won(F), Won(P)))
    r = rows(pair.observer)
    assert r[1][5] is None and r[2][5] == r[3][5] == r[4][5] == ""  # as complete/fail write it
    assert pair.taken >= {(R, "complete", S), (R, "retry", P), (R, "fail_permanent", F)}
    pair.advance(QUANTUM)  # the backoff (60 s) passed: both retries are due, second attempt
    assert pair("claim", 4).value == (Claim(2, 2), Claim(3, 2))


def test_a_batch_reaches_dead_at_the_attempt_limit(connect, knownstate_db_clock):
    pair = Pair(
        [connect()],
        connect(autocommit=True),
        knownstate_db_clock,
        Config(300, 60, 240, max_attempts=1),
    )
    pair("enqueue", 1)
    pair("enqueue", 2)
    c1, c2 = pair("claim", 2).value
    assert pair("record_batch", [Report(c1, RETRYABLE), Report(c2, OK)]) == Won((Won(D), Won(S)))


def test_a_stale_row_in_a_batch_loses_alone_and_the_others_commit(pair):
    pair("enqueue", 1)
    stale = pair("claim", 1).value[0]
    pair.advance(300)
    assert pair("reclaim_stale") == Won((1,))
    current = pair("claim", 1, conn=1).value[0]
    pair("enqueue", 2)
    pair("enqueue", 3)
    c2, c3 = pair("claim", 2).value
    before = rows(pair.observer)[1]
    got = pair("record_batch", [Report(c3, RETRYABLE), Report(stale, OK), Report(c2, OK)])
    assert got == Won((Won(P), LostRace("fenced"), Won(S)))
    assert rows(pair.observer)[1] == before  # every column of the current owner's row
    assert pair("record_batch", [Report(current, OK)], conn=1) == Won((Won(S),))
    assert pair("record_batch", [Report(stale, PERMANENT)]) == Won((LostRace("fenced"),))


def test_a_batch_naming_a_row_twice_is_refused_before_any_statement(pair):
    pair("enqueue", 1)
    (c,) = pair("claim", 1).value
    assert pair("record_batch", [Report(c, OK), Report(c, OK)]) == Rejected(TWICE_IN_BATCH)
    assert pair("record_batch", []) == Won(())
    assert rows(pair.observer)[1][1] == R


def test_every_fenced_write_is_planned_through_the_primary_key(dsn, connect):
    """After an ANALYZE taken with nothing in flight the statistics say no row holds a lease; an
    index whose predicate the fenced writes imply would then look cheapest, and each write would
    scan every row in flight. Generic and custom plans of each fenced write use the key."""
    from knownstate.chaos.bench import fenced_write_plans

    conn = connect(autocommit=True)
    conn.execute("insert into outbox_delivery (id) select g from generate_series(1, 20000) g")
    conn.execute("update outbox_delivery set status = 'sent' where id <= 10000")
    conn.execute("analyze outbox_delivery")  # nothing in flight
    OutboxStore(CONFIG).claim(conn, 2000)
    plans = fenced_write_plans(conn)
    assert set(plans) == {"complete", "fail", "extend_lease", "record_batch"}
    for query, modes in plans.items():
        for mode, scan in modes.items():
            assert scan.startswith("Index Scan using outbox_delivery_pkey"), (query, mode, scan)


# ---------------------------------------------------------------------------
# Indeterminate COMMIT through a real Toxiproxy link.
# ---------------------------------------------------------------------------


_links = itertools.count()


@pytest.fixture
def db_link(knownstate_cluster, toxiproxy):
    return toxiproxy.link(
        f"outbox-impl-{next(_links)}", knownstate_cluster.host, knownstate_cluster.port
    )


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
    # the next byte back closes the link
    db_link.add(Toxic("limit_data", "downstream", {"bytes": 0}))
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


class ToxicCommit(psycopg.Connection):
    """A connection that runs a one-shot hook just before its next COMMIT leaves the client."""

    before_commit = None

    def commit(self) -> None:
        hook, self.before_commit = self.before_commit, None
        if hook is not None:
            hook()
        super().commit()


@pytest.mark.parametrize(
    "toxic, landed",
    [
        (
            Toxic("limit_data", "downstream", {"bytes": 0}),
            True,
        ),  # the COMMIT arrived, its answer not
        (Toxic("reset_peer", "upstream", {"timeout": 0}), False),  # the COMMIT never arrived
    ],
    ids=["reply-lost", "request-lost"],
)
def test_a_batch_whose_commit_is_lost_keeps_both_states_until_observed(
    dsn, connect, knownstate_db_clock, db_link, toxic, landed
):
    observer = connect(autocommit=True)
    pair = Pair([connect()], observer, knownstate_db_clock)
    for i in (1, 2, 3, 4):
        pair("enqueue", i)
    stale = pair("claim", 1).value[0]
    pair.advance(300)
    pair("reclaim_stale")
    c1, c2, c3, c4 = pair("claim", 4).value
    reports = [Report(stale, OK), Report(c2, OK), Report(c3, RETRYABLE), Report(c4, PERMANENT)]
    committed = pair.model.copy()
    assert committed.record_batch(reports) == Won((LostRace("fenced"), Won(S), Won(P), Won(F)))
    candidates = {"not committed": pair.model, "committed": committed}
    assert candidates["not committed"].state() != candidates["committed"].state()

    via_link = psycopg.conninfo.make_conninfo(dsn, host=db_link.host, port=db_link.port)
    proxied = ToxicCommit.connect(via_link)
    try:
        pid = proxied.info.backend_pid
        proxied.before_commit = lambda: db_link.add(toxic)
        with pytest.raises(CommitIndeterminate) as info:
            pair.store.record_batch(proxied, reports)
        assert "outbox.record_batch" in str(info.value) and "may or may not" in str(info.value)
    finally:
        proxied.close()
    wait_backend_gone(observer, pid)
    state = project(observer, pair.to_model_time)
    assert [k for k, m in candidates.items() if m.state() == state] == [
        "committed" if landed else "not committed"
    ]  # all rows of the batch, or none


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
    assert "outbox.claim" in str(info.value)
    assert "nothing of this transaction committed" in str(info.value)
    assert rows(admin)[1][1:3] == (P, 0)


def test_a_lock_timeout_becomes_transaction_aborted(connect):
    store = OutboxStore(CONFIG)
    holder, victim, observer = connect(), connect(), connect(autocommit=True)
    store.enqueue(holder, 1)
    ((c, _),) = store.claim_batch(holder, 1)
    holder.execute("select * from outbox_delivery where id = 1 for update")  # hold the row lock
    victim.execute("set lock_timeout = '100ms'")
    victim.commit()
    with pytest.raises(TransactionAborted) as info:
        store.complete(victim, c)
    assert "55P03" in str(info.value) and "outbox.complete" in str(info.value)
    victim.rollback()
    holder.rollback()
    assert rows(observer)[1][1] == R  # nothing of the refused write committed
    # the owner's write goes through once the lock is free
    assert store.complete(victim, c) == Won(S)
