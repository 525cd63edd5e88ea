"""The real parts the checks are built from, each tested on its own against the real thing.

- ``PostgresCluster``: start, ``crash()`` (the postmaster and every backend die, nothing of its
  process group is left), ``restart()`` on the same data (committed rows survive, uncommitted do
  not), ``stop()`` (data directory removed, no process left), also when the block raised.
- ``DbClock``: a jump moves ``now()`` of a connection that is already open, both ways.
- ``ExternalDatabase`` over the session cluster's DSN; ``ContainerDatabase`` where a Docker
  engine is.
- Toxiproxy: the real server, a link, each toxic kind observed on a psycopg connection or a raw
  socket, ``down``/``up``, ``reset``, and a killed server reported as such.
- ``NotificationSink``: records (delivery, attempt), answers as planned, counts duplicates.
- ``StandInProcess``: a stand-in in a process of its own answers like the class in-process, raises
  its exceptions here, and when killed from outside is dead at once and named when called.
- ``process_alive``: a child SIGKILLed from outside is dead from the moment the signal is sent;
  a postmaster killed from outside leaves no backend behind once the cluster is stopped.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import socketserver
import subprocess
import threading
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

import psycopg
import pytest

from knownstate.chaos import cluster as cluster_mod
from knownstate.chaos.cluster import (
    ClusterError,
    ContainerDatabase,
    ExternalDatabase,
    PostgresCluster,
    Unavailable,
    docker_available,
    process_alive,
)
from knownstate.chaos.opsapi import OpsApi
from knownstate.chaos.sink import NotificationSink
from knownstate.chaos.standin import StandInDied, StandInProcess
from knownstate.chaos.toxi import Toxic, ToxiproxyError, ToxiproxyServer
from knownstate.impl.errors import ExternalCallFailed
from knownstate.impl.outbox import OK, PERMANENT, RETRYABLE, send_to_sink
from knownstate.model.outbox import Claim
from polling import poll


def pgrep(*args: str) -> list[int]:
    out = subprocess.run(["pgrep", *args], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def children_of(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        try:
            if (
                entry.name.isdigit()
                and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid
            ):
                out.append(int(entry.name))
        except (OSError, ValueError):
            pass
    return out


def _swallow(fn) -> None:
    try:
        fn()
    except psycopg.Error:
        pass


# ---------------------------------------------------------------------------
# PostgresCluster
# ---------------------------------------------------------------------------


def test_cluster_crash_restart_and_stop_leave_a_known_state():
    with pytest.raises(RuntimeError, match="the block failed"):
        with PostgresCluster(faketime=False) as c:
            data_dir = c._dir
            assert data_dir.is_dir() and c.running and c.port
            postmaster = c._proc.pid
            # no other server on its port; a child it has just forked carries the postmaster's
            # command line until it sets its own title (a loaded machine widens that instant)
            on_port = pgrep("-f", f"port={c.port}")
            assert postmaster in on_port
            others = {p for p in on_port if p != postmaster and alive(p)}
            assert others <= set(children_of(postmaster)), on_port

            with psycopg.connect(c.dsn(), autocommit=True) as conn:
                conn.execute("create table t (v int)")
                conn.execute("insert into t values (1)")
            open_tx = psycopg.connect(c.dsn())
            open_tx.execute("insert into t values (2)")  # never committed
            # a backend in the middle of a long statement
            busy = psycopg.connect(c.dsn(), autocommit=True)
            threading.Thread(
                target=lambda: _swallow(
                    lambda: busy.execute("select count(*) from generate_series(1, 2000000000)")
                ),
                daemon=True,
            ).start()
            with psycopg.connect(c.dsn(), autocommit=True) as watch:
                poll(
                    "the long statement runs",
                    lambda: watch.execute(
                        "select 1 from pg_stat_activity where pid = %s and state = 'active'",
                        (busy.info.backend_pid,),
                    ).fetchone(),
                )
            backends = [open_tx.info.backend_pid, busy.info.backend_pid]
            children = children_of(postmaster)  # backends call setsid(): found by parentage
            # + checkpointer, walwriter, ...
            assert set(backends) <= set(children) and len(children) >= 5

            c.crash()
            assert not c.running and c.crashes == 1
            assert pgrep("-g", str(postmaster)) == [] and pgrep("-f", f"port={c.port}") == []
            # every one, the busy one too
            assert [p for p in [postmaster, *children] if alive(p)] == []
            with pytest.raises(psycopg.OperationalError):
                open_tx.execute("select 1")
            open_tx.close()
            busy.close()
            with pytest.raises(psycopg.OperationalError):
                psycopg.connect(c.dsn(), connect_timeout=2)

            c.restart()  # crash recovery on the same data
            assert c.running and c._proc.pid != postmaster
            with psycopg.connect(c.dsn(), autocommit=True) as conn:
                assert conn.execute("select v from t order by v").fetchall() == [(1,)]
            second = c._proc.pid
            second_children = children_of(second)
            assert second_children
            raise RuntimeError("the block failed")

    # __exit__ stopped it although the block raised: no process, no data directory.
    assert not c.running
    assert not data_dir.exists()
    assert pgrep("-f", f"port={c.port}") == [] and pgrep("-g", str(second)) == []
    assert [p for p in [second, *second_children] if alive(p)] == []


def test_cluster_stop_is_idempotent_and_reports_describe(knownstate_cluster):
    assert (
        "throwaway PostgreSQL" in knownstate_cluster.describe()
        and "libfaketime" in knownstate_cluster.describe()
    )
    c = PostgresCluster(faketime=False)
    c.stop()  # never started: nothing to do, no error
    c.stop()


# ---------------------------------------------------------------------------
# DbClock
# ---------------------------------------------------------------------------


def db_ahead(conn: psycopg.Connection) -> float:
    """Seconds the server's now() is ahead of this process's clock."""
    (now,) = conn.execute("select now()").fetchone()
    return (now - datetime.now(timezone.utc)).total_seconds()


def test_db_clock_jumps_move_now_of_an_open_connection(knownstate_cluster):
    clock = knownstate_cluster.clock
    assert clock is not None
    try:
        with psycopg.connect(knownstate_cluster.dsn(), autocommit=True) as conn:
            clock.reset()
            assert abs(db_ahead(conn)) < 2
            clock.jump(3600)
            assert clock.offset == 3600
            assert abs(db_ahead(conn) - 3600) < 2
            clock.jump(-7200)
            assert clock.offset == -3600
            assert abs(db_ahead(conn) + 3600) < 2
            assert float(clock.path.read_text()) == -3600
            clock.reset()
            assert clock.offset == 0 and abs(db_ahead(conn)) < 2
    finally:
        clock.reset()


def db_clock(conn: psycopg.Connection) -> float:
    (t,) = conn.execute("select extract(epoch from clock_timestamp())::float8").fetchone()
    return t


def test_db_clock_stands_still_between_hold_and_release(knownstate_cluster):
    """The real time between a hold and its release does not reach the server's clock, and the
    clock never goes back past what a step saw before the hold. Bounds from the monotonic clock
    around each read, so the assertions hold however slow the machine is."""
    clock = knownstate_cluster.clock
    assert clock is not None
    try:
        with psycopg.connect(knownstate_cluster.dsn(), autocommit=True) as conn:
            clock.reset(-86_400)
            start = time.monotonic()
            seen = db_clock(conn)  # the last time a step saw
            clock.hold()
            held = time.monotonic()
            while time.monotonic() - held < 2.0:  # real time passes while the clock is held
                db_clock(conn)
            released = time.monotonic()
            clock.release()
            after = db_clock(conn)
            end = time.monotonic()
            assert clock.held_total >= released - held >= 2.0
            assert seen <= after  # never back past what was seen
            # it moved at most by the real time outside the hold
            assert after - seen <= (end - start) - (released - held) + 0.05
            assert clock.app_offset == -86_400 - clock.held_total
            clock.reset(-86_400)
            assert clock.held_total == 0 and clock.app_offset == -86_400
    finally:
        clock.reset()


def test_db_clock_never_goes_back_past_a_read_over_holds_short_and_long(knownstate_cluster):
    """Steps between holds of every length, shorter than HOLD_GRAIN (which the clock runs
    through) and longer (which it takes back): every read the server answers is at or after the
    one before it. A clock that took back a short hold later, with a long one, went back past the
    steps in between (by up to the holds it had let add up)."""
    clock = knownstate_cluster.clock
    assert clock is not None
    holds = [0.6, 0.8, 1.5, 0.3, 1.2, 0.9, 2.0] * 2  # in HOLD_GRAIN
    try:
        with psycopg.connect(knownstate_cluster.dsn(), autocommit=True) as conn:
            clock.reset(-86_400)
            seen = [db_clock(conn)]
            for n in holds:
                clock.hold()
                held = time.monotonic()
                while time.monotonic() - held < n * cluster_mod.HOLD_GRAIN:
                    pass  # real time passes while the clock is held
                clock.release()
                seen.append(db_clock(conn))
            assert seen == sorted(seen), [b - a for a, b in zip(seen, seen[1:])]
            assert clock.held_total >= sum(n for n in holds if n >= 1) * cluster_mod.HOLD_GRAIN
    finally:
        clock.reset()


# ---------------------------------------------------------------------------
# ExternalDatabase, ContainerDatabase, open_database
# ---------------------------------------------------------------------------


def test_external_database_works_and_refuses_server_faults_with_a_message(knownstate_cluster):
    with ExternalDatabase(knownstate_cluster.dsn()) as ext:
        assert not ext.owns_server and ext.clock is None and ext.running
        assert (ext.host, ext.port) == (knownstate_cluster.host, knownstate_cluster.port)
        with psycopg.connect(ext.dsn(), autocommit=True) as conn:
            assert conn.execute("select 1").fetchone() == (1,)
        with psycopg.connect(ext.dsn("template1"), autocommit=True) as conn:
            assert conn.execute("select current_database()").fetchone() == ("template1",)
        assert "port=4242" in ext.dsn(port=4242)
        for fault in (ext.crash, ext.restart):
            with pytest.raises(Unavailable, match="unavailable on an external DSN"):
                fault()
        assert "clock and crash faults unavailable" in ext.describe()
        # the server it does not own still runs
        with psycopg.connect(knownstate_cluster.dsn(), autocommit=True) as conn:
            assert conn.execute("select 1").fetchone() == (1,)


def test_open_database_picks_the_dsn_else_a_cluster_never_database_url(
    knownstate_cluster, monkeypatch
):
    monkeypatch.delenv("DATABASE_URL", raising=False)
    assert isinstance(cluster_mod.open_database(knownstate_cluster.dsn()), ExternalDatabase)
    assert type(cluster_mod.open_database()) is PostgresCluster
    monkeypatch.setenv("DATABASE_URL", knownstate_cluster.dsn())
    assert type(cluster_mod.open_database()) is PostgresCluster  # only when named: env:NAME
    db = cluster_mod.open_database("env:DATABASE_URL")
    assert isinstance(db, ExternalDatabase) and db.port == knownstate_cluster.port


def test_container_database_needs_a_docker_engine():
    reason = docker_available()
    if reason is not None:
        with pytest.raises(Unavailable) as info:
            ContainerDatabase().start()
        assert str(info.value) == reason
        assert "docker" in reason.lower()
        pytest.skip(f"needs a Docker engine, which this machine cannot provide: {reason}")
    with ContainerDatabase() as db:  # pragma: no cover - only where a Docker engine answers
        with psycopg.connect(db.dsn(), autocommit=True) as conn:
            assert conn.execute("show server_version").fetchone()[0].startswith("15")
        with pytest.raises(Unavailable):
            db.crash()


# ---------------------------------------------------------------------------
# Toxiproxy
# ---------------------------------------------------------------------------


class _Echo(socketserver.BaseRequestHandler):
    def handle(self):
        try:
            while data := self.request.recv(65536):
                self.request.sendall(data)
        except OSError:
            pass  # a client cut off by a toxic is the point, not an error


@pytest.fixture(scope="module")
def echo():
    """A real TCP echo server on loopback, for the toxics a raw socket shows best."""
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address
    server.shutdown()
    server.server_close()


@pytest.fixture
def pg_link(knownstate_cluster, toxiproxy, request):
    return toxiproxy.link(
        f"parts-pg-{request.node.name[:40]}", knownstate_cluster.host, knownstate_cluster.port
    )


@pytest.fixture
def echo_link(echo, toxiproxy, request):
    return toxiproxy.link(f"parts-echo-{request.node.name[:40]}", *echo)


def via(link, knownstate_cluster, **kw) -> psycopg.Connection:
    return psycopg.connect(
        knownstate_cluster.dsn(host=link.host, port=link.port), autocommit=True, **kw
    )


def roundtrip(conn: psycopg.Connection) -> float:
    started = time.monotonic()
    assert conn.execute("select 1").fetchone() == (1,)
    return time.monotonic() - started


def echo_roundtrip(link, payload: bytes, timeout: float = 10.0) -> tuple[bytes, list[int], float]:
    """Send ``payload`` through ``link`` to the echo server; read until EOF or all of it came
    back."""
    chunks: list[int] = []
    got = b""
    with socket.create_connection((link.host, link.port), timeout=timeout) as s:
        started = time.monotonic()
        s.sendall(payload)
        while len(got) < len(payload):
            part = s.recv(65536)
            if not part:
                break
            chunks.append(len(part))
            got += part
        return got, chunks, time.monotonic() - started


def test_the_real_server_answers_and_a_link_forwards(
    toxiproxy, knownstate_toxiproxy, knownstate_cluster, pg_link, echo_link
):
    assert toxiproxy.version()  # the real server's /version
    with urllib.request.urlopen(f"{knownstate_toxiproxy.url}/proxies/{pg_link.name}") as r:
        proxy = json.load(r)
    assert proxy["listen"] == f"127.0.0.1:{pg_link.port}" and proxy["enabled"] is True
    assert (
        toxiproxy.link(pg_link.name, knownstate_cluster.host, knownstate_cluster.port) is pg_link
    )  # one proxy per link name
    with via(pg_link, knownstate_cluster) as conn:
        assert conn.execute("select inet_server_port()").fetchone() == (knownstate_cluster.port,)
    payload = os.urandom(4000)
    assert echo_roundtrip(echo_link, payload)[0] == payload


def test_latency_delays_every_answer(knownstate_cluster, pg_link):
    with via(pg_link, knownstate_cluster) as conn:
        assert roundtrip(conn) < 0.3
        toxic = Toxic("latency", "downstream", {"latency": 400, "jitter": 0})
        pg_link.add(toxic)
        assert roundtrip(conn) >= 0.38
        pg_link.remove(toxic)
        assert roundtrip(conn) < 0.3 and pg_link.toxics == []


def test_timeout_swallows_the_answer_then_closes(knownstate_cluster, pg_link):
    with via(pg_link, knownstate_cluster) as conn:
        pg_link.add(Toxic("timeout", "downstream", {"timeout": 500}))
        started = time.monotonic()
        with pytest.raises(psycopg.OperationalError):
            conn.execute("select 1")
        assert time.monotonic() - started >= 0.45


def test_reset_peer_resets_the_connection(knownstate_cluster, pg_link, echo_link):
    with via(pg_link, knownstate_cluster) as conn:
        pg_link.add(Toxic("reset_peer", "upstream", {"timeout": 0}))
        with pytest.raises(psycopg.OperationalError):
            conn.execute("select 1")
    echo_link.add(Toxic("reset_peer", "upstream", {"timeout": 0}))
    with pytest.raises(ConnectionResetError):  # an RST, not an orderly close (that would read b"")
        echo_roundtrip(echo_link, b"x" * 100)


def test_slicer_cuts_the_stream_into_small_delayed_pieces(echo_link):
    payload = bytes(range(256)) * 1
    echo_link.add(
        Toxic("slicer", "downstream", {"average_size": 10, "size_variation": 0, "delay": 20000})
    )
    got, chunks, elapsed = echo_roundtrip(echo_link, payload)
    assert got == payload  # intact and in order
    assert len(chunks) >= 8 and elapsed >= 0.4  # 256 bytes in ~8-byte slices, 20 ms apart


def test_limit_data_closes_after_so_many_bytes(echo_link):
    echo_link.add(Toxic("limit_data", "downstream", {"bytes": 100}))
    got, _, _ = echo_roundtrip(echo_link, os.urandom(1000))
    assert len(got) == 100


def test_bandwidth_limits_the_rate(echo_link):
    payload = os.urandom(4000)
    fast = echo_roundtrip(echo_link, payload)[2]
    echo_link.add(Toxic("bandwidth", "downstream", {"rate": 10}))  # 10 KB/s: 4000 bytes take 0.4 s
    got, _, slow = echo_roundtrip(echo_link, payload)
    assert got == payload and slow >= 0.35 and fast < 0.35


def test_down_cuts_open_and_new_connections_and_up_restores(knownstate_cluster, pg_link):
    conn = via(pg_link, knownstate_cluster)
    try:
        pg_link.down()
        assert not pg_link.enabled
        with pytest.raises(psycopg.OperationalError):
            conn.execute("select 1")
        with pytest.raises(psycopg.OperationalError):
            via(pg_link, knownstate_cluster, connect_timeout=2)
        pg_link.up()
        with via(pg_link, knownstate_cluster) as again:
            assert roundtrip(again) < 1
    finally:
        conn.close()


def test_reset_clears_every_toxic_and_reenables(
    toxiproxy, knownstate_toxiproxy, knownstate_cluster, pg_link
):
    pg_link.add(Toxic("latency", "downstream", {"latency": 1000}))
    pg_link.add(Toxic("bandwidth", "upstream", {"rate": 1}))
    pg_link.down()
    toxiproxy.reset()
    assert pg_link.toxics == [] and pg_link.enabled
    with urllib.request.urlopen(f"{knownstate_toxiproxy.url}/proxies/{pg_link.name}/toxics") as r:
        assert json.load(r) == []
    with via(pg_link, knownstate_cluster) as conn:
        assert roundtrip(conn) < 0.5
    pg_link.clear()  # nothing left to clear: no error


def test_a_killed_toxiproxy_server_is_reported_as_such(knownstate_cluster):
    server = ToxiproxyServer().start()
    try:
        port = server.port
        (pid,) = pgrep("-f", f"toxiproxy-server -host 127.0.0.1 -port {port}$")
        api = server.client()
        link = api.link("doomed", knownstate_cluster.host, knownstate_cluster.port)
        os.kill(pid, signal.SIGKILL)
        poll("the server is dead", lambda: not alive(pid))
        calls = {
            "version": api.version,
            "link": lambda: api.link("new", knownstate_cluster.host, knownstate_cluster.port),
            "add": lambda: link.add(Toxic("latency", "downstream", {"latency": 10})),
            "down": link.down,
            "reset": api.reset,
        }
        for name, call in calls.items():
            with pytest.raises(ToxiproxyError, match="was it killed") as info:
                call()
            assert f"127.0.0.1:{port}" in str(info.value), name
        assert not server.running
    finally:
        server.stop()
    assert pgrep("-f", f"toxiproxy-server -host 127.0.0.1 -port {port}$") == []


def test_a_private_toxiproxy_server_stops_clean():
    with ToxiproxyServer() as server:
        port = server.port
        (pid,) = pgrep("-f", f"toxiproxy-server -host 127.0.0.1 -port {port}$")
        assert server.client().version()
    assert not alive(pid) and pgrep("-f", f"toxiproxy-server -host 127.0.0.1 -port {port}$") == []


# ---------------------------------------------------------------------------
# NotificationSink
# ---------------------------------------------------------------------------


def test_the_sink_records_answers_as_planned_and_counts_duplicates():
    with NotificationSink() as sink:
        assert send_to_sink(sink.url, Claim(1, 1)) == OK
        sink.plan(503, 422)
        assert send_to_sink(sink.url, Claim(2, 1)) == RETRYABLE
        assert send_to_sink(sink.url, Claim(3, 1)) == PERMANENT
        assert send_to_sink(sink.url, Claim(2, 2)) == OK  # the plan is used up: 200 again
        assert send_to_sink(sink.url, Claim(1, 1)) == OK  # the same delivery again: a duplicate
        assert sink.log == [(1, 1), (2, 1), (3, 1), (2, 2), (1, 1)]
        assert sink.received() == {1: 2, 2: 2, 3: 1}
        assert sink.duplicates() == 2

        req = urllib.request.Request(f"{sink.url}/deliveries", data=b'{"nope": 1}', method="POST")
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=5)
        assert info.value.code == 400 and len(sink.log) == 5  # a bad body is not a delivery

        sink.plan(503)
        sink.reset_plan()
        assert send_to_sink(sink.url, Claim(4, 1)) == OK
        sink.plan(503)
        sink.reset()
        assert sink.log == [] and sink.duplicates() == 0
        assert send_to_sink(sink.url, Claim(5, 1)) == OK
        url = sink.url
    with pytest.raises(ExternalCallFailed, match="may still have arrived|sink at"):
        send_to_sink(url, Claim(6, 1), timeout=2)  # stopped: nothing listens any more
    assert not [t for t in threading.enumerate() if t.name == "notification-sink"]


def test_the_receiver_answers_what_each_calls_url_asks_whatever_the_order():
    from knownstate.chaos.receiver import Receiver

    with Receiver() as receiver:
        # two calls of one block, their answers in their URLs, arriving in either order; an
        # adapter's own path after the code (the outbox adds /deliveries) changes nothing
        assert send_to_sink(f"{receiver.url}/runs/1/422", Claim(1, 1)) == PERMANENT
        assert send_to_sink(f"{receiver.url}/runs/2/503", Claim(2, 1)) == RETRYABLE
        assert send_to_sink(f"{receiver.url}/runs/2/200", Claim(2, 2)) == OK
        receiver.plan(503)  # no code in the URL: what the check planned, then 200
        assert send_to_sink(f"{receiver.url}/runs/3", Claim(3, 1)) == RETRYABLE
        assert send_to_sink(f"{receiver.url}/runs/3", Claim(3, 1)) == OK
        assert send_to_sink(f"{receiver.url}/runs/3/404", Claim(3, 1)) == OK  # not a code it plans
        assert receiver.received() == {"1": 1, "2": 2, "3": 3}


def test_the_sink_records_a_delivery_whose_answer_was_lost(toxiproxy):
    with NotificationSink() as sink:
        link = toxiproxy.link("parts-sink-reply-lost", sink.host, sink.port)
        link.add(Toxic("limit_data", "downstream", {"bytes": 0}))
        with pytest.raises(ExternalCallFailed):
            send_to_sink(f"http://{link.host}:{link.port}", Claim(7, 3), timeout=5)
        # it arrived; only the answer was lost
        poll("the sink recorded it", lambda: sink.log == [(7, 3)])


# ---------------------------------------------------------------------------
# Stand-ins in processes of their own; processes killed from outside
# ---------------------------------------------------------------------------


def test_a_stand_in_process_answers_like_the_class_and_raises_its_errors():
    with StandInProcess("sink", NotificationSink) as sink:
        assert sink.running and alive(sink.pid) and sink.pid != os.getpid()
        sink.plan(503)
        assert send_to_sink(sink.url, Claim(1, 1)) == RETRYABLE  # the plan reached the child
        assert send_to_sink(sink.url, Claim(1, 2)) == OK
        assert sink.log == [(1, 1), (1, 2)] and sink.received() == {1: 2}
        assert sink.duplicates() == 1
        sink.reset()
        assert sink.log == []
        pid = sink.pid
    assert not alive(pid)
    with StandInProcess("ops", OpsApi) as ops:
        ops.fail_next(2)
        assert ops.pending_failures == 2 and ops.refused == 0  # properties and attributes
        with pytest.raises(KeyError):
            ops.finish("op-404", ok=True)  # raised in the child, raised again here
        assert ops.snapshot().ops == {}
        with pytest.raises(AttributeError):
            ops._clear()  # the stand-in's own business


def test_a_run_of_several_kinds_stops_one_kinds_stand_ins_before_the_next_kind():
    """A kind's stand-ins are kept for all its runs, and stopped before the next kind's first
    run (the browser kind's Chromium ran on beside every kind after it)."""
    from types import SimpleNamespace

    from knownstate.chaos.cli import kind_by_kind
    from knownstate.chaos.harness import Env

    units = [SimpleNamespace(kind=k) for k in ("a", "a", "b")]
    seen = []
    with Env.open() as env:
        for unit in kind_by_kind(env, units):
            part = env.stand_in(f"sink-{unit.kind}", NotificationSink)
            seen.append((part.pid, sorted(env.stand_ins)))
    (a1, first), (a2, second), (b, third) = seen
    assert a1 == a2 and first == second == ["sink-a"]  # kept for the kind's runs
    assert third == ["sink-b"] and b != a1 and not alive(a1)  # stopped before the next kind
    assert not alive(b)  # and the last when the run ends


def test_a_stand_in_killed_from_outside_is_dead_at_once_and_named_when_called():
    with StandInProcess("sink", NotificationSink) as sink:
        pid = sink.pid
        os.kill(pid, signal.SIGKILL)
        assert not sink.running  # at once: the signal is pending or the process exiting
        with pytest.raises(
            StandInDied,
            match=rf"the sink stand-in \(NotificationSink, pid "
            rf"{pid}\) died \(killed by SIGKILL\)",
        ):
            sink.received()
    assert not alive(pid)


def test_a_child_killed_from_outside_is_dead_once_a_peer_sees_its_files_close():
    """What the harness relies on: whoever saw a socket of the child close finds it dead, before
    it is reaped. (Not at the instant the signal is sent: on another core the child can take
    the SIGKILL off its pending set before it marks itself exiting.)"""
    proc = subprocess.Popen(["sleep", "600"], stdout=subprocess.PIPE)
    try:
        assert process_alive(proc)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.stdout.read() == b""  # its end of the pipe closed: it is exiting
        assert not process_alive(proc)  # no wait, no poll: PF_EXITING, or already a zombie
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    assert not process_alive(None)


def test_a_postmaster_killed_from_outside_leaves_nothing_once_stopped():
    with PostgresCluster(faketime=False) as c:
        busy = psycopg.connect(c.dsn(), autocommit=True)  # a backend that never looks up
        threading.Thread(
            target=lambda: _swallow(
                lambda: busy.execute("select count(*) from generate_series(1, 2000000000)")
            ),
            daemon=True,
        ).start()
        with psycopg.connect(c.dsn(), autocommit=True) as watch:
            poll(
                "the long statement runs",
                lambda: watch.execute(
                    "select 1 from pg_stat_activity where pid = %s and state = 'active'",
                    (busy.info.backend_pid,),
                ).fetchone(),
            )
        servers = [c._proc.pid, *children_of(c._proc.pid)]
        os.kill(c._proc.pid, signal.SIGKILL)
        assert not c.running
        with pytest.raises(ClusterError, match="killed from outside"):
            c.crash()  # an injected crash never absorbs a death it did not cause
        assert alive(busy.info.backend_pid)  # orphaned, still counting
    busy.close()
    assert [p for p in servers if alive(p)] == []  # stop() found it by its data directory
