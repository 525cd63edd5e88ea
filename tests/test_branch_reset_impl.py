"""Branch reset on real PostgreSQL, with the operations-API stand-in over real HTTP.

Every scenario runs on the model and on the implementation side by side (:class:`Pair`). The
outcomes must be equal, the projection must equal the model's rows, the stand-in's state must
equal the model's external state, and the six invariants must hold after every step. Faults are
real: Toxiproxy links to the stand-in, 503s from the stand-in, a backend terminated between the
HTTP create and the COMMIT, racing workers on their own connections. Nothing is mocked.
"""

from __future__ import annotations

import re
import threading
import time
from datetime import datetime, timedelta, timezone
from itertools import count

import psycopg
import pytest

from knownstate.chaos.opsapi import OpsApi
from knownstate.chaos.toxi import Toxic
from knownstate.impl import branch_reset as impl
from knownstate.impl.branch_reset import BranchResetStore, OpsApiClient, project
from knownstate.impl.errors import ConnectionLost, ExternalCallFailed
from knownstate.model.branch_reset import (
    CONTRACT,
    IN_FLIGHT_REASON,
    KEY_REUSED,
    LEASE_LAPSED,
    NO_SUCH_RUN,
    BranchResetModel,
    ExternalStatus,
    Status,
    not_in,
    skew_bound,
    views,
)
from knownstate.model.contract import IllegalTransition, LostRace, Rejected, Won, check_invariants

EPOCH = datetime(2030, 1, 1, tzinfo=timezone.utc)
_links = count()


def to_model_time(ts: datetime):
    s = (ts - EPOCH).total_seconds()
    return int(s) if s.is_integer() else s


def wait_for(predicate, what: str, deadline_s: float = 5.0) -> None:
    deadline = time.monotonic() + deadline_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


@pytest.fixture(scope="module")
def opsapi_server():
    with OpsApi() as api:
        yield api


@pytest.fixture
def api(opsapi_server):
    opsapi_server.reset()
    yield opsapi_server
    opsapi_server.reset()


class Pair:
    """The model and the implementation side by side. Workers are named; each has its own
    connection, its own app clock (the model's ``app_now(worker)``) and its own ops-API URL."""

    def __init__(
        self,
        dsn: str,
        api: OpsApi,
        *,
        lease: int = 600,
        urls: dict[str, str] | None = None,
        http_timeout: float = 2.0,
    ):
        self.dsn, self.api, self.lease = dsn, api, lease
        self.model = BranchResetModel(lease)
        self.urls = urls or {}
        self.http_timeout = http_timeout
        self.conns: dict[str, psycopg.Connection] = {}
        self.stores: dict[str, BranchResetStore] = {}
        self.admin = psycopg.connect(dsn, autocommit=True)
        self.reader = psycopg.connect(dsn)

    def clock(self, worker: str):
        return lambda: EPOCH + timedelta(seconds=self.model.app_now(worker))

    def worker(self, w: str) -> tuple[BranchResetStore, psycopg.Connection]:
        if w not in self.stores:
            self.conns[w] = psycopg.connect(self.dsn, connect_timeout=5)
            self.stores[w] = BranchResetStore(
                w,
                self.urls.get(w, self.api.url),
                self.clock(w),
                lease_seconds=self.lease,
                http_timeout=self.http_timeout,
            )
        return self.stores[w], self.conns[w]

    def reconnect(self, w: str) -> None:
        self.conns.pop(w).close()
        del self.stores[w]
        self.worker(w)

    def close(self) -> None:
        for c in (*self.conns.values(), self.admin, self.reader):
            c.close()

    # -- comparison ---------------------------------------------------------------------
    def impl_state(self):
        return project(self.reader, to_model_time), self.api.snapshot()

    def assert_equal(self, before=None) -> None:
        rows, ext = self.impl_state()
        assert rows == self.model.rows()
        assert ext == self.model.external_state()
        if before is not None:
            assert check_invariants(CONTRACT, before, views(rows, ext)) == []

    def both(self, model_call, impl_call):
        before = views(*self.impl_state())
        expected = model_call()
        got = impl_call()
        assert got == expected, f"implementation answered {got}, model {expected}"
        self.assert_equal(before)
        return got

    # -- the vocabulary, on both sides -------------------------------------------------------
    def request(self, branch: str, key: str, worker: str = "w1"):
        store, conn = self.worker(worker)
        return self.both(
            lambda: self.model.request(branch, key), lambda: store.request(conn, branch, key)
        )

    def start(self, run_id: str, worker: str = "w1"):
        store, conn = self.worker(worker)
        return self.both(
            lambda: self.model.start(run_id, worker), lambda: store.start(conn, run_id)
        )

    def poll(self, run_id: str, worker: str = "w1"):
        store, conn = self.worker(worker)
        return self.both(lambda: self.model.poll(run_id, worker), lambda: store.poll(conn, run_id))

    def cancel(self, run_id: str, worker: str = "w1"):
        store, conn = self.worker(worker)
        return self.both(lambda: self.model.cancel(run_id), lambda: store.cancel(conn, run_id))

    def reap(self, worker: str = "reaper"):
        store, conn = self.worker(worker)
        return self.both(lambda: self.model.reap(worker), lambda: store.reap(conn))

    def finish(self, op_id: str, ok: bool) -> None:
        self.model.external_finish(op_id, ok)
        self.api.finish(op_id, ok)

    def advance(self, seconds: int) -> None:
        self.model.advance(seconds)

    def skew(self, worker: str, seconds: int) -> None:
        self.model.skew(worker, seconds)


@pytest.fixture
def pair(knownstate_db, api):
    p = Pair(knownstate_db(impl.SCHEMA), api)
    yield p
    p.close()


# -- drift: one fact in SQL and in Python --------------------------------------------------------


def test_schema_statuses_are_the_models(knownstate_db):
    with psycopg.connect(knownstate_db(impl.SCHEMA)) as conn:
        (definition,) = conn.execute(
            "select pg_get_constraintdef(oid) from pg_constraint "
            "where conrelid = 'branch_reset'::regclass and contype = 'c' "
            "and conname like '%status%'"
        ).fetchone()
        indexes = {
            r[0]: r[1]
            for r in conn.execute(
                "select indexname, indexdef from pg_indexes where tablename = 'branch_reset'"
            )
        }
    assert set(re.findall(r"'(\w+)'::text", definition)) == {s.value for s in Status}
    assert "UNIQUE" in indexes["branch_reset_idempotency_key"]
    assert "UNIQUE" in indexes["branch_reset_one_in_flight"]
    assert (
        "'queued'" in indexes["branch_reset_one_in_flight"]
        and "'running'" in indexes["branch_reset_one_in_flight"]
    )
    assert impl.TABLES == ("branch_reset",)


# -- the same scenarios on model and implementation ------------------------------------------------


def test_life_of_a_reset_that_succeeds(pair):
    assert pair.request("main", "k1") == Won("main#1")
    assert pair.request("main", "k1", worker="w2") == Won("main#1")  # same key: the same run
    assert pair.request("main", "k2") == Rejected(IN_FLIGHT_REASON)
    assert pair.request("dev", "k1") == Rejected(KEY_REUSED)
    assert pair.poll("main#1") == LostRace(not_in("queued"))
    assert pair.cancel("main#1") == LostRace(not_in("queued"))
    pair.advance(3)
    assert pair.start("main#1") == Won("op-1")
    assert pair.start("main#1", worker="w2") == LostRace(not_in("running"))
    for _ in range(3):
        pair.advance(60)
        assert pair.poll("main#1", worker="w2") == Won("running")
    pair.finish("op-1", ok=True)
    assert pair.poll("main#1") == Won("succeeded")
    assert pair.poll("main#1") == LostRace(not_in("succeeded"))
    assert pair.cancel("main#1") == LostRace(not_in("succeeded"))
    assert pair.request("main", "k1") == Won("main#1")  # a terminal run answers from its row
    run = pair.model.runs["main#1"]
    assert run.op_statuses == ("in_progress", "succeeded") and run.claimed_by == "w1"
    assert pair.api.creations("main#1") == 1


def test_failed_canceled_and_reaped_runs(pair):
    pair.request("a", "ka")
    pair.start("a#1")
    pair.finish("op-1", ok=False)
    assert pair.poll("a#1") == Won("failed")
    assert pair.request("a", "ka2") == Won("a#2")  # terminal: the branch is free again
    pair.start("a#2")
    assert pair.cancel("a#2") == Won("canceled")
    pair.finish("op-2", ok=True)  # the operation ends; the canceled run does not follow it
    assert pair.poll("a#2") == LostRace(not_in("canceled"))
    pair.request("b", "kb")
    pair.start("b#1")
    assert pair.reap() == Won(())
    pair.advance(600)  # the lease lapses exactly now
    assert pair.poll("b#1") == LostRace(LEASE_LAPSED)  # checked on the poll: writes nothing
    assert pair.reap() == Won(("b#1",))
    assert pair.poll("b#1") == LostRace(not_in("failed"))  # the fence: a stale poller loses
    assert pair.start("nope#1") == Rejected(NO_SUCH_RUN)
    assert pair.poll("nope#1") == Rejected(NO_SUCH_RUN)
    assert pair.cancel("nope#1") == Rejected(NO_SUCH_RUN)
    statuses = {r: v.status for r, v in pair.model.rows().items()}
    assert statuses == {"a#1": Status.FAILED, "a#2": Status.CANCELED, "b#1": Status.FAILED}


def test_polls_never_re_issue_the_operation(pair):
    pair.request("main", "k")
    pair.start("main#1")
    for i in range(10):
        pair.advance(30)
        pair.poll("main#1", worker=f"w{i % 3}")
    assert (
        pair.api.creations("main#1"),
        pair.api.create_requests("main#1"),
        pair.api.polls("op-1"),
    ) == (1, 1, 10)


# -- through Toxiproxy: the stand-in on each worker's own link -------------------------------------


def links_for(toxiproxy, api, workers):
    n = next(_links)
    return {w: toxiproxy.link(f"opsapi-{w}-{n}-{api.port}", api.host, api.port) for w in workers}


def test_through_toxiproxy_a_lost_create_answer_is_retried_without_a_second_creation(
    knownstate_db, api, toxiproxy
):
    links = links_for(toxiproxy, api, ("w1", "w2"))
    p = Pair(
        knownstate_db(impl.SCHEMA),
        api,
        urls={w: f"http://127.0.0.1:{lk.port}" for w, lk in links.items()},
        http_timeout=0.5,
    )
    try:
        p.request("main", "k")
        # the API acts; its answer never comes
        links["w1"].add(Toxic("timeout", "downstream", {"timeout": 0}))
        store, conn = p.worker("w1")
        with pytest.raises(ExternalCallFailed):
            store.start(conn, "main#1")
        wait_for(lambda: api.create_requests("main#1") == 1, "the stand-in to act on the create")
        p.model.external_create("main#1", "main")  # what the stand-in did, mirrored
        p.assert_equal()
        assert p.model.runs["main#1"].status is Status.QUEUED  # the claim rolled back
        assert p.start("main#1", worker="w2") == Won("op-1")  # the same operation
        assert (api.creations("main#1"), api.create_requests("main#1")) == (1, 2)
        links["w1"].clear()
        assert p.poll("main#1") == Won("running")
    finally:
        p.close()


def test_through_toxiproxy_an_unreachable_api_fails_the_poll_and_changes_nothing(
    knownstate_db, api, toxiproxy
):
    links = links_for(toxiproxy, api, ("w1", "w2"))
    p = Pair(
        knownstate_db(impl.SCHEMA),
        api,
        urls={w: f"http://127.0.0.1:{lk.port}" for w, lk in links.items()},
        http_timeout=0.5,
    )
    try:
        p.request("main", "k")
        p.start("main#1")
        p.advance(60)
        links["w1"].down()
        store, conn = p.worker("w1")
        with pytest.raises(ExternalCallFailed):
            store.poll(conn, "main#1")
        p.assert_equal()  # lease not extended, nothing observed
        assert p.poll("main#1", worker="w2") == Won("running")  # the other worker's link is fine
        links["w1"].up()
        links["w1"].add(Toxic("reset_peer", "downstream", {"timeout": 0}))
        with pytest.raises(ExternalCallFailed):
            store.poll(conn, "main#1")
        p.assert_equal()
    finally:
        p.close()


def test_worker_dies_between_the_create_and_its_commit(knownstate_db, api, toxiproxy):
    links = links_for(toxiproxy, api, ("w1",))
    p = Pair(knownstate_db(impl.SCHEMA), api, urls={"w1": f"http://127.0.0.1:{links['w1'].port}"})
    try:
        p.request("main", "k")
        links["w1"].add(Toxic("latency", "downstream", {"latency": 1000, "jitter": 0}))
        store, conn = p.worker("w1")
        pid = conn.info.backend_pid
        died: list[BaseException] = []

        def run():
            try:
                store.start(conn, "main#1")
            except BaseException as e:  # noqa: BLE001 - recorded for the assertion below
                died.append(e)

        t = threading.Thread(target=run)
        t.start()
        wait_for(lambda: api.create_requests("main#1") == 1, "the create to reach the stand-in")
        # the worker's backend dies mid-transaction
        p.admin.execute("select pg_terminate_backend(%s)", (pid,))
        t.join(timeout=10)
        assert not t.is_alive()
        assert len(died) == 1 and isinstance(died[0], ConnectionLost), died
        p.model.external_create("main#1", "main")
        p.assert_equal()  # queued, no op id on the row, the operation exists at the API
        p.reconnect("w1")
        links["w1"].clear()
        assert p.start("main#1", worker="w2") == Won("op-1")
        assert p.start("main#1", worker="w1") == LostRace(not_in("running"))
        assert (api.creations("main#1"), api.create_requests("main#1")) == (1, 2)
    finally:
        p.close()


# -- stand-in failures -----------------------------------------------------------------------------


def test_a_503_is_an_external_failure_and_the_row_is_unchanged(pair):
    pair.request("main", "k")
    pair.api.fail_next(1)
    store, conn = pair.worker("w1")
    with pytest.raises(ExternalCallFailed, match="503"):
        store.start(conn, "main#1")
    pair.assert_equal()  # the API did not act; the claim rolled back
    assert pair.api.create_requests("main#1") == 0
    assert pair.start("main#1") == Won("op-1")
    pair.advance(100)
    pair.api.fail_next(1)
    with pytest.raises(ExternalCallFailed):
        store.poll(conn, "main#1")
    pair.assert_equal()  # lease not extended
    assert pair.poll("main#1") == Won("running")


def test_client_translates_every_network_failure(api):
    dead = OpsApi().start()
    url = dead.url
    dead.stop()
    with pytest.raises(ExternalCallFailed):
        OpsApiClient(url, timeout=0.5).status("op-1")
    with pytest.raises(ExternalCallFailed, match="404"):
        OpsApiClient(api.url).status("op-404")


# -- races between real workers --------------------------------------------------------------------


def race(*calls):
    barrier = threading.Barrier(len(calls))
    results: list = [None] * len(calls)

    def run(i, call):
        barrier.wait()
        results[i] = call()

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    return results


def test_two_workers_start_the_same_run_one_wins(pair):
    pair.request("main", "k")
    (s1, c1), (s2, c2) = pair.worker("w1"), pair.worker("w2")
    r1, r2 = race(lambda: s1.start(c1, "main#1"), lambda: s2.start(c2, "main#1"))
    assert sorted([r1, r2], key=repr) == [LostRace(not_in("running")), Won("op-1")]
    winner = "w1" if r1 == Won("op-1") else "w2"
    pair.model.start("main#1", winner)
    pair.assert_equal()
    assert (pair.api.creations("main#1"), pair.api.create_requests("main#1")) == (1, 1)


def test_two_requests_for_one_branch_one_run(pair):
    (s1, c1), (s2, c2) = pair.worker("w1"), pair.worker("w2")
    outcomes = race(lambda: s1.request(c1, "main", "k1"), lambda: s2.request(c2, "main", "k2"))
    assert sorted(outcomes, key=repr) == [Rejected(IN_FLIGHT_REASON), Won("main#1")]
    same = race(lambda: s1.request(c1, "dev", "kd"), lambda: s2.request(c2, "dev", "kd"))
    assert same == [Won("dev#1"), Won("dev#1")]
    assert sorted(project(pair.reader, to_model_time)) == ["dev#1", "main#1"]


# -- the app clock: skew below the bound and past it -----------------------------------------------


@pytest.mark.parametrize("reaper_skew, reaped", [(skew_bound() - 1, False), (skew_bound(), True)])
def test_reaper_skew_against_the_bound(pair, reaper_skew, reaped):
    """A live run polled every 60 s; the reaper's app clock runs ``reaper_skew`` ahead and reaps
    just before each poll. Below L - M = 540 s it never ends the live run; at 540 s it does,
    which is the known deviation of an app-clock lease."""
    pair.skew("reaper", reaper_skew)
    pair.request("main", "k")
    pair.start("main#1", worker="poller")
    for _ in range(5):
        pair.advance(60)
        outcome = pair.reap()
        if outcome != Won(()):
            break
        assert pair.poll("main#1", worker="poller") == Won("running")
    if reaped:
        assert outcome == Won(("main#1",))
        # the reset goes on at the API
        assert pair.model.ops["op-1"].status is ExternalStatus.IN_PROGRESS
        assert pair.poll("main#1", worker="poller") == LostRace(not_in("failed"))  # fenced
        assert pair.api.creations("main#1") == 1
    else:
        assert pair.model.runs["main#1"].status is Status.RUNNING


def test_a_skewed_worker_stamps_its_own_time(pair):
    pair.skew("w2", -45)
    pair.request("main", "k")
    pair.start("main#1", worker="w2")
    assert pair.model.runs["main#1"].lease_until == -45 + 600  # projected from the row: equal
    pair.advance(600 - 45)  # w1's clock: lapsed; w2's clock: 45 s to go
    assert pair.poll("main#1", worker="w1") == LostRace(LEASE_LAPSED)
    assert pair.poll("main#1", worker="w2") == Won("running")


def test_the_invariants_flag_a_second_creation(pair):
    pair.request("main", "k")
    pair.start("main#1")
    before = views(*pair.impl_state())
    OpsApiClient(pair.api.url).create("main#1", "main", idempotency_key="a fresh key")  # a re-issue
    after = views(*pair.impl_state())
    found = [v.invariant for v in check_invariants(CONTRACT, before, after)]
    assert found == ["external-effect-semantics"]


# -- the stand-in itself ---------------------------------------------------------------------------


def test_stand_in_creates_once_per_key_and_reports_status(api):
    import json
    import urllib.request

    def post(body):
        req = urllib.request.Request(
            api.url + "/operations",
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=2) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, None

    body = {"run_id": "r#1", "branch": "r", "idempotency_key": "r#1"}
    assert post(body) == (
        201,
        {"id": "op-1", "run_id": "r#1", "branch": "r", "status": "in_progress"},
    )
    assert post(body)[0] == 200
    assert post({"run_id": "r#1"})[0] == 400
    assert (api.creations("r#1"), api.create_requests("r#1")) == (1, 2)
    api.finish("op-1", ok=False)
    assert OpsApiClient(api.url).status("op-1") is ExternalStatus.FAILED
    with pytest.raises(IllegalTransition):
        api.finish("op-1", ok=True)
    api.reset()
    assert api.snapshot() == BranchResetModel().external_state()
