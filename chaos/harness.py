"""The harness: the real parts of one verify run, the workers, and what a run observed.

A run starts its real parts once (:meth:`Env.open`): a PostgreSQL server (a throwaway cluster
the harness owns, or an external one named by ``--dsn``), the Toxiproxy server, and the
stand-ins a kind asks for. Each kind's check works in a :class:`Workspace` of its own: a schema
with a name unique to this run, in the database the run uses, created at the start and dropped
at the end. Every connection the code under test makes goes through a :class:`Worker`'s own
Toxiproxy link, so one worker can be cut off alone; the check's observations use direct,
unfaulted connections.

The harness tells the environment apart from the code under test. A real part that dies and
was not killed by the harness (:meth:`Env.health`) ends the run as an :class:`EnvironmentFault`
(exit 3), whatever the check was doing at that moment; it is never reported as a
counterexample.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import itertools
import os
import secrets
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import psycopg

from knownstate.impl.errors import KnownstateError, is_connection_error

from .cluster import ClusterError, PostgresCluster, Unavailable, open_database
from .interleave import ScheduledConnection, Scheduler
from .toxi import Link, ToxiproxyError, ToxiproxyServer

CLOCK_BASE = -7 * 86_400
"""Every example starts with the fake database clock a week behind real time, and jumps from
there. Under libfaketime a server clock *ahead* of real time delays its lock-wait timers
(deadlock_timeout fires that much late): a concurrent block needs it at or behind."""

QUANTUM = 60
"""Model time is whole seconds, and every duration a check uses is a multiple of this. The
database clock keeps ticking in real time during an example; projecting its timestamps to the
nearest quantum is exact while an example lasts less than QUANTUM / 2 seconds of real time."""


class EnvironmentFault(BaseException):
    """The environment broke, not the code under test: a real part died or misbehaved.
    A BaseException, so Hypothesis neither shrinks it nor mistakes it for a counterexample."""


class WorkerDied(KnownstateError):
    """The worker process died (injected): its connection closed without COMMIT."""


# ---------------------------------------------------------------------------------------
# Workspaces: one schema per kind and run.
# ---------------------------------------------------------------------------------------


class Workspace:
    """One kind's tables for one run: the schema ``name`` in the run's database. Connections
    reach it through ``search_path``, so implementations use unqualified table names."""

    def __init__(self, env: "Env", name: str, schema_sql: str):
        self.env, self.name, self.schema_sql = env, name, schema_sql
        self.tables: tuple[str, ...] = ()
        self.workers: list[Worker] = []  # kept from one example to the next (KindCheck)
        self._scheduler: Scheduler | None = None

    def scheduler(self) -> Scheduler:
        """The scheduler of this workspace's concurrent blocks (its observer is direct)."""
        if self._scheduler is None:
            self._scheduler = Scheduler(self.conninfo(), pause=self.env.can_crash,
                                        clock_guard=self.env.clock is not None)
        return self._scheduler

    def create(self) -> "Workspace":
        admin = self.env.admin()
        try:
            admin.execute(f'drop schema if exists "{self.name}" cascade')
            admin.execute(f'create schema "{self.name}"')
        except psycopg.errors.InsufficientPrivilege:
            raise EnvironmentFault(
                f"no privilege to create a schema in database {self.env.db.dbname!r}: grant it "
                f"with GRANT CREATE ON DATABASE {self.env.db.dbname} TO <the DSN's user>") from None
        conn = self.connect(application_name=f"knownstate-{self.env.run_id}-setup")
        try:
            conn.execute(self.schema_sql)
            self.tables = tuple(r[0] for r in conn.execute(
                "select tablename from pg_tables where schemaname = %s order by tablename",
                (self.name,)).fetchall())
        finally:
            conn.close()
        return self

    def close(self) -> None:
        """Close every connection to the workspace (a worker may have been left in a transaction
        by a failure that ended its run)."""
        for w in self.workers:
            w.close()
        self.workers.clear()
        if self._scheduler is not None:
            self._scheduler.close()
            self._scheduler = None
        conn = self.env._admin.pop(self.name, None)
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def drop(self) -> None:
        self.close()
        self.env.admin().execute(f'drop schema if exists "{self.name}" cascade')

    def conninfo(self, *, host: str | None = None, port: int | None = None,
                 options: str = "") -> str:
        """A DSN for this workspace, through ``host:port`` (a worker's link) when given."""
        search = f"-c search_path={self.name},public"
        return psycopg.conninfo.make_conninfo(
            self.env.db.dsn(host=host, port=port), options=f"{search} {options}".strip())

    def connect(self, *, application_name: str, host: str | None = None,
                port: int | None = None, **kwargs) -> psycopg.Connection:
        return psycopg.connect(self.conninfo(host=host, port=port), autocommit=True,
                               application_name=application_name, connect_timeout=5, **kwargs)

    def admin(self) -> psycopg.Connection:
        """The check's own connection to this workspace: direct, never through a proxy."""
        return self.env.admin(self)

    def query(self, sql: str, params: Any = None) -> list[tuple]:
        return self.env.query(sql, params, self)

    def truncate(self) -> None:
        if self.tables:
            names = ", ".join(f'"{self.name}"."{t}"' for t in self.tables)
            self.query(f"truncate {names} restart identity cascade")

    def now(self) -> dt.datetime:
        return self.query("select now()")[0][0]


# ---------------------------------------------------------------------------------------
# The real parts of one verify run.
# ---------------------------------------------------------------------------------------


class Env:
    """Everything a run uses: the database, the Toxiproxy server, the stand-ins, the links.
    Started once per run; each example resets it (tables truncated, toxics removed, clock back)."""

    def __init__(self, db, toxiproxy: ToxiproxyServer):
        self.db = db
        self.toxiproxy = toxiproxy
        self.api = toxiproxy.client()
        self.run_id = secrets.token_hex(3)
        self._admin: dict[str, psycopg.Connection] = {}
        self.stand_ins: dict[str, Any] = {}
        self.workspaces: list[Workspace] = []
        self.crashing = False

    @classmethod
    @contextlib.contextmanager
    def open(cls, dsn: str | None = None):
        db = open_database(dsn)
        tp = ToxiproxyServer()
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(db)
                stack.enter_context(tp)
            except (ClusterError, ToxiproxyError, Unavailable, psycopg.Error) as e:
                raise EnvironmentFault(f"could not start the real parts: {e}") from None
            env = cls(db, tp)
            stack.callback(env.close)
            yield env

    def close(self) -> None:
        for ws in reversed(self.workspaces):
            with contextlib.suppress(Exception, EnvironmentFault):
                ws.drop()
        self.workspaces.clear()
        for conn in self._admin.values():
            with contextlib.suppress(Exception):
                conn.close()
        self._admin.clear()
        for s in self.stand_ins.values():
            with contextlib.suppress(Exception):
                s.stop()
        self.stand_ins.clear()

    # -- capabilities ----------------------------------------------------------------------
    @property
    def clock(self):
        return getattr(self.db, "clock", None)

    @property
    def can_crash(self) -> bool:
        return bool(getattr(self.db, "owns_server", False))

    def capabilities(self) -> frozenset[str]:
        """What this run can do to the world: ``db-clock`` (move the database's now()),
        ``db-crash`` (kill and restart the server), ``concurrency`` (run concurrent blocks: the
        scheduler sets deadlock_timeout and log_lock_waits, which takes a superuser).
        Requirements that need what is missing are reported as not covered on this database,
        never as a vacuous run."""
        out = set()
        if self.clock is not None:
            out.add("db-clock")
        if self.can_crash:
            out.add("db-crash")
        if self.can_schedule():
            out.add("concurrency")
        return frozenset(out)

    def can_schedule(self) -> bool:
        if not hasattr(self, "_can_schedule"):
            try:
                self.admin().execute("SET log_lock_waits = on")
                self.admin().execute("RESET log_lock_waits")
                self._can_schedule = True
            except psycopg.errors.InsufficientPrivilege:
                self._can_schedule = False
        return self._can_schedule

    def unavailable(self) -> list[str]:
        out = []
        if self.clock is None:
            out.append("db-clock-jump (the database is not one the harness owns, "
                       "or libfaketime is missing)")
        if not self.can_crash:
            out.append("db-crash (the harness does not own the database server)")
        if not self.can_schedule():
            out.append("concurrent blocks (setting deadlock_timeout and log_lock_waits takes a "
                       "superuser)")
        return out

    def stand_in(self, name: str, factory: Callable[[], Any]):
        if name not in self.stand_ins:
            self.stand_ins[name] = factory().start()
        return self.stand_ins[name]

    # -- workspaces and the check's own connections ------------------------------------------
    def workspace(self, kind: str, schema_sql: str) -> Workspace:
        """(Re)create the workspace of ``kind`` for this run."""
        name = f"ks_{self.run_id}_{kind.replace('-', '_')}"
        for ws in [w for w in self.workspaces if w.name == name]:
            self.workspaces.remove(ws)
            ws.close()
        ws = Workspace(self, name, schema_sql)
        self.workspaces.append(ws)
        return ws.create()

    def admin(self, ws: Workspace | None = None) -> psycopg.Connection:
        """The check's own autocommit connection (to a workspace, or to the database): direct,
        never through a proxy, since observations must not be faulted."""
        key = ws.name if ws is not None else ""
        conn = self._admin.get(key)
        if conn is not None and not conn.closed and not conn.broken:
            return conn
        self.ensure_alive()
        app = f"knownstate-{self.run_id}-observer"
        try:
            conn = (ws.connect(application_name=app) if ws is not None else
                    psycopg.connect(self.db.dsn(), autocommit=True, connect_timeout=5,
                                    application_name=app))
        except psycopg.Error as e:
            self.ensure_alive()
            raise EnvironmentFault(f"PostgreSQL at {self.db.host}:{self.db.port} is not answering: "
                                   f"{str(e).strip().splitlines()[0]}") from None
        self._admin[key] = conn
        return conn

    def query(self, sql: str, params: Any = None, ws: Workspace | None = None) -> list[tuple]:
        for attempt in (1, 2):
            try:
                cur = self.admin(ws).execute(sql, params)
                return cur.fetchall() if cur.description else []
            except psycopg.Error as e:
                if not is_connection_error(e) or attempt == 2:
                    self.ensure_alive()
                    raise
                self._admin.pop(ws.name if ws is not None else "", None)
        raise AssertionError("unreachable")

    # -- health --------------------------------------------------------------------------------
    def health(self) -> str | None:
        """None while every real part lives; else one line naming the part that died without
        the harness killing it, and what to do."""
        if isinstance(self.db, PostgresCluster) and not self.db.running and not self.crashing:
            return (f"PostgreSQL ({self.db.describe()}) died, and not by an injected crash: was "
                    f"it killed from outside? Server log tail: {self.db.log_tail(300)!r}")
        if not self.toxiproxy.running:
            return "toxiproxy-server died, and not by the harness: was it killed from outside?"
        for name, part in self.stand_ins.items():
            if getattr(part, "running", True) is False:
                return f"the {name} stand-in died, and not by the harness: was it killed from outside?"
        return None

    def ensure_alive(self) -> None:
        problem = self.health()
        if problem:
            raise EnvironmentFault(problem)

    def crash_and_restart(self) -> None:
        self.crashing = True
        try:
            self.db.crash()
            for key in list(self._admin):
                self._admin.pop(key).close()
            for ws in self.workspaces:
                if ws._scheduler is not None:
                    ws._scheduler.close()  # its observer connection died with the server
            self.db.restart()
        except ClusterError as e:
            raise EnvironmentFault(f"PostgreSQL did not come back after an injected crash: {e}") from None
        finally:
            self.crashing = False

    def backends(self, application_name: str) -> list[int]:
        return [r[0] for r in self.query(
            "select pid from pg_stat_activity where application_name = %s", (application_name,))]

    def settle(self, application_name: str, grace_s: float = 2.0) -> None:
        """Wait until the server has let go of an abandoned connection's backend, so a transaction
        that lingers server-side cannot hold row locks into the next step. Polls with a deadline;
        past the grace period it terminates the backend (the end a dead client's backend meets
        anyway, once TCP notices). A COMMIT already under way is not interrupted by that."""
        deadline = time.monotonic() + grace_s
        while self.backends(application_name):
            if time.monotonic() > deadline:
                self.query("select pg_terminate_backend(pid) from pg_stat_activity "
                           "where application_name = %s", (application_name,))
                deadline = time.monotonic() + 10
                while self.backends(application_name):
                    if time.monotonic() > deadline:
                        raise EnvironmentFault(f"backend {application_name} did not go away after "
                                               "pg_terminate_backend")
                    time.sleep(0.005)
                return
            time.sleep(0.002)

    def reset_faults(self) -> None:
        try:
            self.api.reset()
        except ToxiproxyError as e:
            self.ensure_alive()
            raise EnvironmentFault(str(e)) from None
        if self.clock is not None:
            self.clock.reset(CLOCK_BASE)


# ---------------------------------------------------------------------------------------
# A worker: its own connection through its own link, a hook around COMMIT, and a watch on
# every statement it runs for a wait on another worker's lock.
# ---------------------------------------------------------------------------------------


class HookedConnection(ScheduledConnection):
    """A worker's connection: its ``commit()`` first runs a one-shot hook (faults act at the most
    interesting instant, just before COMMIT leaves the client), and inside a concurrent block
    every statement and COMMIT waits for the scheduler (:mod:`.interleave`); the hook runs when
    the COMMIT is scheduled."""

    owner: "Worker | None" = None

    def commit(self) -> None:
        owner = self.owner
        with self.step("COMMIT"):
            if owner is not None and owner.before_commit is not None:
                hook, owner.before_commit = owner.before_commit, None
                hook(self)
            super().commit()


def cut_socket(conn: psycopg.Connection) -> None:
    """Close a connection the way a dying process does: the socket goes, no goodbye, no COMMIT."""
    with contextlib.suppress(Exception):
        s = socket.socket(fileno=os.dup(conn.pgconn.socket))
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        s.close()
    with contextlib.suppress(Exception):
        conn.close()


HUNG_SECONDS = 60.0
"""A worker's statement that neither finishes nor waits on a lock for this long is cut off and
reported as hung. Generous on purpose: it is a backstop, never what decides a verdict on a
machine under load. (The server's own statement_timeout cannot be used: it reads the faked clock.)"""


@dataclass
class Watch:
    """What the watch over one operation saw: the other workers' backends it waited on."""

    blocked_by: list[str] = field(default_factory=list)
    hung: bool = False


@contextlib.contextmanager
def watch(env: Env, worker: "Worker", others: list["Worker"]):
    """Watch ``worker``'s operation from the server while it runs: when its backend waits on a
    lock held by another worker's backend (``pg_blocking_pids``), cancel the statement and
    record who held the lock. The wait is seen by the server, never guessed from a timeout."""
    seen = Watch()
    conn = worker.conn
    holders = [w for w in others if w.in_transaction()]
    if conn is None or conn.closed or conn.broken or not holders:
        # Nobody else holds a transaction open: there is no lock to wait on.
        yield seen
        return
    pid = conn.info.backend_pid
    stop = threading.Event()

    def run() -> None:
        start, delay = time.monotonic(), 0.002
        try:
            observer = psycopg.connect(env.db.dsn(), autocommit=True, connect_timeout=5,
                                       application_name=f"knownstate-{env.run_id}-watch")
        except psycopg.Error:
            return
        with observer:
            while not stop.wait(delay):
                delay = min(0.02, delay * 2)
                try:
                    row = observer.execute("select pg_blocking_pids(%s)", (pid,)).fetchone()
                except psycopg.Error:
                    return
                holders = {w.backend_pid: w.name for w in others if w.backend_pid}
                names = sorted(holders[p] for p in (row[0] or []) if p in holders)
                if names or time.monotonic() - start > HUNG_SECONDS:
                    seen.blocked_by, seen.hung = names, not names
                    with contextlib.suppress(Exception):
                        conn.cancel_safe(timeout=2)
                    return

    thread = threading.Thread(target=run, name=f"watch-{worker.name}", daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        stop.set()
        thread.join(timeout=5)


class Worker:
    """One worker of the check. Its database connection goes through its own Toxiproxy link."""

    def __init__(self, env: Env, ws: Workspace, kind: str, index: int):
        self.env, self.ws, self.kind, self.index = env, ws, kind, index
        self.name = f"w{index}"
        self.link = env.api.link(f"{kind}-{self.name}-pg", env.db.host, env.db.port)
        self.conn: HookedConnection | None = None
        self._serial = itertools.count(1)
        self.app_name = ""
        self.links: list[Link] = [self.link]
        self.before_commit: Callable[[HookedConnection], None] | None = None

    def in_transaction(self) -> bool:
        """Whether this worker's connection holds a transaction open (so it may hold locks)."""
        conn = self.conn
        if conn is None or conn.closed or conn.broken:
            return False
        return conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE

    @property
    def backend_pid(self) -> int | None:
        conn = self.conn
        if conn is None or conn.closed or conn.broken:
            return None
        return conn.info.backend_pid

    def connection(self) -> HookedConnection:
        from knownstate.impl.errors import ConnectionLost

        if self.conn is None or self.conn.closed or self.conn.broken:
            self.app_name = f"ks-{self.env.run_id}-{self.kind}-{self.name}-{next(self._serial)}"
            try:
                self.conn = HookedConnection.connect(
                    self.ws.conninfo(host=self.link.host, port=self.link.port),
                    application_name=self.app_name, connect_timeout=3)
            except psycopg.Error as e:
                self.conn = None
                raise ConnectionLost(f"{self.name} connect: {str(e).strip().splitlines()[0]}") from None
            self.conn.owner = self
        return self.conn

    def abandon(self) -> None:
        """Drop the connection after an error and wait until the server has let go of it."""
        if self.conn is not None:
            cut_socket(self.conn)
            self.conn = None
        if self.app_name:
            self.env.settle(self.app_name)

    def close(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(Exception):
                self.conn.close()
            self.conn = None

    def ready(self) -> None:
        """At the start of an example: a healthy, idle connection on a clean link, kept from the
        example before when it still answers (a new one costs a backend fork). Every example thus
        starts with every worker connected, so what a fault does to a connection depends on the
        example alone, never on the examples before it."""
        from knownstate.impl.errors import ConnectionLost

        self.before_commit = None
        conn = self.conn
        if conn is not None:
            try:
                if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                    raise psycopg.OperationalError("not idle")
                conn.execute("select 1")
                conn.rollback()  # never leave a transaction open: now() would stay at its start
            except psycopg.Error:
                self.abandon()
        try:
            self.connection()
        except ConnectionLost as e:
            raise EnvironmentFault(f"{self.name} could not connect through its clean link: {e}") from None

    def faulted(self) -> bool:
        """A toxic on one of its links, a link down, or a COMMIT fault armed."""
        return self.before_commit is not None or any(l.toxics or not l.enabled for l in self.links)

    def clean(self) -> bool:
        return not self.faulted()

    def arm(self, hook: Callable[[HookedConnection], None]) -> None:
        """Run ``hook`` just before this worker's next COMMIT, on whatever connection it has then."""
        self.before_commit = hook


# ---------------------------------------------------------------------------------------
# What a run observed.
# ---------------------------------------------------------------------------------------


@dataclass
class Stats:
    examples: int = 0
    steps: int = 0
    invariants_checked: int = 0
    faults: Counter = field(default_factory=Counter)
    events: Counter = field(default_factory=Counter)
    transitions: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict:
        return {"examples": self.examples, "steps": self.steps,
                "invariants_checked": self.invariants_checked,
                "faults": dict(self.faults), "events": dict(self.events),
                "transitions": {f"{s} -{e}-> {t}": n for (s, e, t), n in self.transitions.items()}}
