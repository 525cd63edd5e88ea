"""Any database, safely: ``--dsn`` on a PostgreSQL the harness does not own.

The server here is started with ``pg_ctl`` (as the ``postgres`` user when running as root), not
by the harness: it is a server someone else runs. Its users are ordinary roles:

- ``runner``: CONNECT and CREATE on database ``app`` (owned by someone else) — all the gate needs;
- ``reader``: CONNECT only; database ``locked``: no CONNECT for anyone but its owner;
- database ``hardened``: EXECUTE on ``pg_terminate_backend`` revoked from PUBLIC.

What is checked:

- a missing privilege ends the run with exit 3 before anything starts, naming the GRANT;
- ``DATABASE_URL`` is read only when ``--dsn env:DATABASE_URL`` names it;
- the time shift moves every stored timestamp of the active workspace, nothing else, with
  triggers held off, and moves it back on reset;
- closing a run ends only its own sessions and drops only its own schemas;
- (slow) SIGTERM and Ctrl-C drop the run's schemas; two runs of every kind at once both pass
  and leave the databases, schemas and the user's own tables exactly as they were.
"""

from __future__ import annotations

import json
import os
import pwd
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

from knownstate.chaos import kinds, leftovers, tools
from knownstate.chaos.check import run_check
from knownstate.chaos.cli import build_parser
from knownstate.chaos.cluster import ExternalDatabase, PostgresCluster, open_database, resolve_dsn
from knownstate.chaos.harness import Env
from knownstate.chaos.kinds.outbox import OutboxCheck
from knownstate.chaos.timeshift import TimeShift
from knownstate.impl.ports import free_port
from polling import poll

KNOWNSTATE = [sys.executable, "-m", "knownstate.chaos.cli"]
KINDS = kinds.names()


@dataclass
class Server:
    port: int
    data: Path

    def dsn(self, user: str = "runner", db: str = "app") -> str:
        return f"host=127.0.0.1 port={self.port} user={user} dbname={db}"

    def sql(self, query: str, db: str = "app", user: str = "postgres") -> list[tuple]:
        with psycopg.connect(self.dsn(user, db), autocommit=True) as conn:
            cur = conn.execute(query)
            return cur.fetchall() if cur.description else []

    def state(self) -> dict:
        """What a run must leave as it found it: databases, every database's schemas, the user's
        own table, the sessions of runs."""
        dbs = [r[0] for r in self.sql("select datname from pg_database order by 1", "postgres")]
        return {
            "databases": dbs,
            "schemas": {
                db: self.sql("select nspname from pg_namespace order by 1", db)
                for db in dbs
                if db != "template0"
            },
            "user table": self.sql("select * from public.outbox_delivery order by 1"),
            "run sessions": self.sql(
                "select application_name from pg_stat_activity where application_name like 'ks-%'"
            ),
        }


def _as_postgres() -> dict:
    return {"user": "postgres"} if tools.running_as_root() else {}


@pytest.fixture(scope="module")
def server():
    """A PostgreSQL started with pg_ctl, on a free port in a temp directory; stopped at the end
    (its folder made by ``leftovers``: a test run killed outright leaves a server that the next
    run's sweep stops, not one that runs on)."""
    base = leftovers.make("knownstate-own-pg-")
    if tools.running_as_root():
        pw = pwd.getpwnam("postgres")
        os.chown(base, pw.pw_uid, pw.pw_gid)
    data, port = base / "data", free_port()
    pg_ctl = tools.pg_binary("pg_ctl")
    subprocess.run(
        [
            tools.pg_binary("initdb"),
            "-D",
            str(data),
            "-U",
            "postgres",
            "-A",
            "trust",
            "--no-sync",
            "-E",
            "UTF8",
            "--locale=C",
        ],
        check=True,
        capture_output=True,
        cwd=base,
        **_as_postgres(),
    )
    options = (
        f"-c listen_addresses=127.0.0.1 -c port={port} -c unix_socket_directories={base} "
        "-c fsync=off -c max_connections=200"
    )
    subprocess.run(
        [
            pg_ctl,
            "-D",
            str(data),
            "-l",
            str(base / "log"),
            "-w",
            "-t",
            "120",
            "-o",
            options,
            "start",
        ],
        check=True,
        capture_output=True,
        cwd=base,
        **_as_postgres(),
    )
    try:
        s = Server(port, data)
        for statement in (
            "create role owner_role",
            "create database app owner owner_role",
            "create role runner login",
            "grant create on database app to runner",
            "create role reader login",
            "create database locked owner owner_role",
            "revoke connect on database locked from public",
            "create database hardened owner owner_role",
            "grant create on database hardened to runner",
        ):
            s.sql(statement, "postgres")
        s.sql(
            "revoke execute on function pg_terminate_backend(integer, bigint) from public",
            "hardened",
        )
        s.sql("create table public.outbox_delivery (id int primary key, note text)")
        s.sql("insert into public.outbox_delivery values (1, 'the application''s own row')")
        s.sql("grant select, update on public.outbox_delivery to runner")
        yield s
    finally:
        subprocess.run(
            [pg_ctl, "-D", str(data), "-m", "fast", "-w", "stop"],
            capture_output=True,
            cwd=base,
            **_as_postgres(),
        )
        leftovers.remove(base)


def knownstate(
    *args: str, env: dict | None = None, timeout: float = 1800
) -> subprocess.CompletedProcess:
    environ = {**os.environ, "CI": "true", **(env or {})}
    return subprocess.run(
        [*KNOWNSTATE, *args], capture_output=True, text=True, timeout=timeout, env=environ
    )


# ---------------------------------------------------------------------------------------
# Found up front: privileges, and no implicit DATABASE_URL.
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "user, db, grant",
    [
        ("reader", "app", "GRANT CREATE ON DATABASE app TO reader"),
        ("reader", "locked", "GRANT CONNECT ON DATABASE locked TO reader"),
        (
            "runner",
            "hardened",
            "GRANT EXECUTE ON FUNCTION pg_terminate_backend(integer,bigint) TO runner",
        ),
    ],
)
def test_a_missing_privilege_ends_the_run_up_front_with_exit_3_naming_the_grant(
    server, user, db, grant
):
    before = server.state()
    r = knownstate("verify", "outbox", "--examples", "1", "--dsn", server.dsn(user, db))
    assert r.returncode == 3, r.stdout + r.stderr
    (line,) = [l for l in r.stderr.splitlines() if "GRANT" in l]
    assert line.endswith(grant) and f"{user}" in line and db in line, line
    assert "on external PostgreSQL" not in r.stdout  # found before the run started
    assert "Traceback" not in r.stderr
    assert server.state() == before


def test_database_url_is_read_only_when_the_dsn_names_it(server, monkeypatch):
    monkeypatch.setenv("DATABASE_URL", server.dsn())
    assert type(open_database()) is PostgresCluster  # never read implicitly
    assert build_parser().parse_args(["verify"]).dsn is None
    named = open_database("env:DATABASE_URL")
    assert isinstance(named, ExternalDatabase) and named.port == server.port
    assert build_parser().parse_args(["verify", "--dsn", "env:DATABASE_URL"]).dsn == server.dsn()
    assert resolve_dsn(server.dsn("reader")) == server.dsn("reader")
    monkeypatch.delenv("DATABASE_URL")
    with pytest.raises(ValueError, match="DATABASE_URL is not set"):
        resolve_dsn("env:DATABASE_URL")
    r = knownstate("verify", "--dsn", "env:DATABASE_URL")
    assert r.returncode == 2 and "environment variable DATABASE_URL is not set" in r.stderr


# ---------------------------------------------------------------------------------------
# The time shift.
# ---------------------------------------------------------------------------------------

SHIFTED_SCHEMA = """
create table lease (
    id          int primary key,
    lease_until timestamptz,
    stamped     timestamp,
    day         date,
    note        text,
    writes      int not null default 0,
    until_plus  timestamp generated always as (stamped + interval '1 hour') stored
);
create function count_write() returns trigger language plpgsql as
    $$ begin new.writes := old.writes + 1; return new; end $$;
create trigger count_write before update on lease for each row execute function count_write();
create table stamp (id int primary key, at timestamptz not null default now());
"""


def test_the_time_shift_moves_every_stored_timestamp_back_and_nothing_else(server):
    with Env.open(server.dsn()) as env:
        assert isinstance(env.clock, TimeShift) and env.db.clock is None
        assert env.capabilities() == frozenset({"time-shift"})
        assert any("db-crash" in u for u in env.unavailable())
        other = env.workspace("bystander", SHIFTED_SCHEMA)
        other.query("insert into stamp values (1, '2030-01-01T00:00:00Z')")
        ws = env.workspace("shifted", SHIFTED_SCHEMA)
        assert env.active is ws and ws.time_columns == {
            "lease": ("lease_until", "stamped"),
            "stamp": ("at",),
        }
        ws.query(
            "insert into lease (id, lease_until, stamped, day, note) values "
            "(1, now() + interval '300 seconds', '2030-01-01 12:00', '2030-01-01', 'n'), "
            "(2, null, null, null, null)"
        )
        ws.query("insert into stamp values (1, '2030-01-01T00:00:00Z')")
        rows = (
            "select id, lease_until, stamped, day, note, writes, until_plus from lease order by id"
        )
        before, stamp_before = ws.query(rows), ws.query("select at from stamp")
        assert ws.query("select lease_until <= now() from lease where id = 1") == [(False,)]

        env.clock.jump(360)
        assert env.clock.shifted == 360
        after = ws.query(rows)
        assert (after[0][1] - before[0][1]).total_seconds() == -360
        assert (after[0][2] - before[0][2]).total_seconds() == -360
        assert after[0][3:6] == before[0][3:6]  # a date, text, and no trigger fired (writes 0)
        assert (after[0][6] - before[0][6]).total_seconds() == -360  # generated: follows
        assert after[1] == before[1]  # nulls stay null
        assert (ws.query("select at from stamp")[0][0] - stamp_before[0][0]).total_seconds() == -360
        assert ws.query("select lease_until <= now() from lease where id = 1") == [(True,)]
        assert other.query("select at from stamp") == stamp_before  # not the active workspace

        env.clock.jump(-60)
        assert env.clock.shifted == 300
        env.clock.reset()
        assert env.clock.shifted == 0 and ws.query(rows) == before
        ws.query("update lease set note = 'x' where id = 1")  # the trigger is back on
        assert ws.query("select writes from lease where id = 1") == [(1,)]


def test_leases_lapse_under_the_time_shift_and_the_reference_passes(server):
    """The outbox's check on a database the harness does not own: clock jumps and stalls are
    time shifts, the reaper reclaims lapsed leases, stale owners are fenced, and the reference
    passes (a shift that moved the wrong rows, or the model's time the wrong way, would fail)."""
    with Env.open(server.dsn()) as env:
        r = run_check(OutboxCheck, env, examples=15, steps=30, seed=3, require_all=False)
    assert r.failure is None, "\n".join([r.failure or "", *r.counterexample])
    shifts = r.stats.faults["db-clock-jump"] + r.stats.faults["worker-stall"]
    assert shifts > 0 and r.stats.events["reclaim"] > 0 and r.stats.events["fence rejection"] > 0
    # what a database that allows no blocks cannot cover: the requirements that need them
    blocks = {q.key for q in OutboxCheck.requirements() if "concurrency" in q.needs}
    assert set(r.not_covered) <= blocks


def test_closing_a_run_ends_only_its_sessions_and_drops_only_its_schemas(server):
    server.sql("create schema if not exists ks_users_own")
    server.sql("create table if not exists ks_users_own.t (v int)")
    before = server.state()
    stranger = psycopg.connect(server.dsn(), application_name="someone-else")  # same role
    stranger.execute("select * from public.outbox_delivery for update")  # a transaction, open
    try:
        with Env.open(server.dsn()) as env:
            names = {env.workspace(k, "create table t (v int)").name for k in ("one", "two")}
            ws = env.active
            assert ws.query("show search_path") == [(ws.name,)]
            with pytest.raises(psycopg.errors.UndefinedTable):
                ws.query("select * from outbox_delivery")  # the user's table is out of reach
            mine = ws.connect(application_name=env.app_name("w0-1"))
            mine.execute("begin")
            mine.execute("lock table t in access exclusive mode")  # would block a plain drop
            schemas = {r[0] for r in server.sql("select nspname from pg_namespace")}
            assert names <= schemas
        assert mine.closed or mine.broken or _dead(mine)
        assert server.state() == before
        assert stranger.execute("select 1").fetchone() == (1,)  # a stranger's session lives
    finally:
        stranger.close()
        server.sql("drop schema ks_users_own cascade")


def _dead(conn: psycopg.Connection) -> bool:
    try:
        conn.execute("select 1")
    except psycopg.OperationalError:
        return True
    return False


# ---------------------------------------------------------------------------------------
# Slow: a real verify run, interrupted, and two at once.
# ---------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_and_ctrl_c_drop_the_runs_schemas(server, sig):
    before = server.state()
    proc = subprocess.Popen(
        [
            *KNOWNSTATE,
            "verify",
            "outbox",
            "--examples",
            "100000",
            "--seed",
            "3",
            "--dsn",
            server.dsn(),
            "--no-example-db",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "CI": "true"},
    )
    try:
        poll(
            "the run's schema exists and a worker is connected",
            lambda: server.sql(
                "select 1 from pg_stat_activity where application_name like 'ks-%-outbox-w%'"
            ),
            120,
        )
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=600)  # a backstop for a loaded machine, not a verdict
    finally:
        proc.kill()
    assert proc.returncode == {signal.SIGTERM: 143, signal.SIGINT: 130}[sig], out + err
    assert f"interrupted by {sig.name}" in err
    assert server.state() == before


@pytest.mark.slow
def test_two_runs_at_once_pass_and_leave_the_database_as_found(server, tmp_path):
    """Two runs of every kind against one database at once: neither fails, and the server is
    left as found. What this checks is that they never meet, so each runs a fixed count of
    examples (``--examples``), and a kind whose coverage that count does not reach is VACUOUS,
    not failed: coverage is every other test's business (the CI profile's took 212 s here)."""
    before = server.state()
    reports = [tmp_path / f"run{seed}.json" for seed in (1, 2)]
    procs = [
        subprocess.Popen(
            [
                *KNOWNSTATE,
                "verify",
                "--seed",
                str(seed),
                "--dsn",
                server.dsn(),
                "--json",
                str(report),
                "--no-example-db",
                "--examples",
                "10",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "CI": "true"},
        )
        for seed, report in zip((1, 2), reports)
    ]
    try:
        results = [p.communicate(timeout=3600) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, report, (out, err) in zip(procs, reports, results):
        assert p.returncode in (0, 1), out + err
        runs = json.loads(report.read_text())["runs"]
        assert sorted(r["kind"] for r in runs) == sorted(KINDS), out
        for r in runs:
            assert r["status"] in ("passed", "vacuous") and not r["failure"], out + err
            # the runner is no superuser: concurrent blocks (which set deadlock_timeout per
            # session) are what it cannot reach — the kind's blocks, the pairs they race, the
            # server's blocks — each said so, never a vacuous run
            needs_blocks = {
                q.key for q in kinds.check(r["kind"]).requirements() if "concurrency" in q.needs
            }
            assert set(r["not_covered"]) == needs_blocks, out + err
            if r["kind"] not in ("document-session", "document-session-browser"):
                assert {"concurrent block", "lock wait in a block"} <= needs_blocks
            assert any("shifts the workspace's stored timestamps" in u for u in r["unavailable"]), r
    assert server.state() == before
