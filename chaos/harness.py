"""The harness: the real parts of one verify run, the workers, and what a run observed.

A run starts its real parts once (:meth:`Env.open`): a PostgreSQL server (a throwaway cluster
the harness owns, or an external one named by ``--dsn``), the Toxiproxy server, and the
stand-ins a kind asks for, each a process of its own (:mod:`.standin`). Every connection the
code under test makes goes through a :class:`Worker`'s own Toxiproxy link, so one worker can be
cut off alone; the check's observations use direct, unfaulted connections.

Any database, safely. Each kind's check works in a :class:`Workspace` of its own: a schema
``ks_<run id>_<kind>`` in the database the run uses (the one the DSN names), reached through
``search_path`` and nothing else. Everything server-wide the harness touches is scoped to the
run: its sessions' application names start ``ks-<run id>-``, and it only ever watches, waits
for or ends sessions of its own. :meth:`Env.close` ends them and drops exactly the schemas the
run created, also after Ctrl-C or SIGTERM (which wait until it is done). Two runs against one
server never meet.

Time. ``Env.clock`` moves the database's time for the leases: the server's ``now()`` itself on
the harness's cluster (libfaketime, capability ``db-clock``), else a time shift of the
workspace's stored timestamps (:mod:`.timeshift`). Either way leases can lapse (capability
``time-shift``). What a run cannot do on this database is reported as not covered, never as
vacuous (:meth:`Env.capabilities`).

The harness tells the environment apart from the code under test. A real part that dies and
was not killed by the harness (:meth:`Env.health`) ends the run as an :class:`EnvironmentFault`
(exit 3), whatever the check was doing at that moment; it is never reported as a
counterexample.
"""

from __future__ import annotations

import contextlib
import secrets
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import psycopg

from knownstate.impl.errors import first_line, is_connection_error

from .cluster import ClusterError, DbClock, PostgresCluster, Refused, Unavailable, open_database
from . import timings
from .timeshift import TimeShift
from .tools import deferred_signals
from .toxi import ToxiproxyError, ToxiproxyServer
from .envfaults import EnvironmentFault, SchemaRefused, WorkerDied
from .workers import HUNG_SECONDS, HookedConnection, Watch, Worker, cut_socket, watch
from .workspace import TRUNCATE_EVERY, Workspace

__all__ = [
    "CLOCK_BASE",
    "HUNG_SECONDS",
    "QUANTUM",
    "TRUNCATE_EVERY",
    "Env",
    "EnvironmentFault",
    "HookedConnection",
    "SchemaRefused",
    "Stats",
    "Watch",
    "Worker",
    "WorkerDied",
    "Workspace",
    "cut_socket",
    "watch",
]

CLOCK_BASE = -7 * 86_400
"""Every example starts with the fake database clock a week behind real time, and jumps from
there. Under libfaketime a server clock *ahead* of real time delays its lock-wait timers
(deadlock_timeout fires that much late): a concurrent block needs it at or behind."""

RECOVERY_GRACE_S = 30.0
"""How long the check's own connection waits for a server that refuses it while it starts or
recovers (SQLSTATE 57P03, not one shutting down): after a restart between two runs, or the
server's own restart after one of its processes died. Polled; past it, the server is not
answering (exit 3)."""


def _recovering(e: psycopg.Error) -> bool:
    """Whether PostgreSQL refused the connection because it is starting or in crash recovery,
    and will answer once that ends (libpq reports it at connect time by its message only)."""
    return any(
        f"the database system is {what}" in str(e)
        for what in ("starting up", "not yet accepting connections", "in recovery mode")
    )


QUANTUM = 60
"""Model time is whole seconds, and every duration a check uses is a multiple of this. The
database clock ticks in real time while a step runs and stands still between steps
(:class:`~.cluster.DbClock`); projecting its timestamps to the nearest quantum is exact while
the steps of one example together last less than QUANTUM / 2 seconds of real time (on a
database whose clock cannot stand still, the whole example)."""


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
        self.run_id = secrets.token_hex(4)
        self._admin: dict[str, psycopg.Connection] = {}
        self.stand_ins: dict[str, Any] = {}
        self.workspaces: list[Workspace] = []
        self.active: Workspace | None = None
        self.clock = db.clock if db.clock is not None else TimeShift(self)
        self.crashing = False
        self.leftovers: list[str] = []

    def app_name(self, role: str) -> str:
        """The application name of one of this run's sessions: ``ks-<run id>-<role>``. Every
        query the harness makes about sessions is scoped to this prefix, or to one pid."""
        return f"ks-{self.run_id}-{role}"

    @classmethod
    @contextlib.contextmanager
    def open(cls, dsn: str | None = None):
        """The real parts of one run, stopped (and the run's schemas dropped) when the block
        ends, however it ends. ``dsn``: an external PostgreSQL, else a throwaway cluster."""
        db = open_database(dsn)
        tp = ToxiproxyServer()
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(db)
                stack.enter_context(tp)
            except Refused as e:
                raise EnvironmentFault(str(e)) from None
            except (ClusterError, ToxiproxyError, Unavailable, psycopg.Error) as e:
                raise EnvironmentFault(f"could not start the real parts: {e}") from None
            env = cls(db, tp)
            stack.callback(env.close)
            yield env

    def close(self) -> None:
        """Stop the stand-ins, end this run's sessions and drop exactly the schemas it created
        (also when a part died); Ctrl-C and SIGTERM wait until that is done. A schema that
        cannot be dropped is named in ``leftovers`` and on stderr, with the statement that
        drops it."""
        with deferred_signals():
            self.stop_stand_ins()
            for ws in self.workspaces:
                ws.close()
            for conn in self._admin.values():
                with contextlib.suppress(Exception):
                    conn.close()
            self._admin.clear()
            self._drop_workspaces()

    def _drop_workspaces(self) -> None:
        names = [ws.name for ws in reversed(self.workspaces)]
        self.workspaces.clear()
        self.active = None
        if not names or (self.db.owns_server and not self.db.running):
            return  # nothing created, or a cluster the harness owns, dead and removed with it
        try:
            with psycopg.connect(
                self.db.dsn(),
                autocommit=True,
                connect_timeout=5,
                application_name=self.app_name("cleanup"),
            ) as conn:
                conn.execute("set lock_timeout = '2s'")
                deadline = time.monotonic() + 30
                while names:
                    self._end_own_sessions(conn)
                    try:
                        conn.execute(f'drop schema if exists "{names[0]}" cascade')
                        names.pop(0)
                    except psycopg.errors.LockNotAvailable:
                        if time.monotonic() > deadline:
                            raise
        except psycopg.Error as e:
            self.leftovers = names
            where = getattr(self.db, "dbname", "the database")
            why = first_line(e)
            for name in names:
                print(
                    f"knownstate: could not drop schema {name} in {where} ({why}): drop it "
                    f"with DROP SCHEMA {name} CASCADE",
                    file=sys.stderr,
                )

    def _end_own_sessions(self, conn: psycopg.Connection, deadline_s: float = 10.0) -> None:
        """End every other session of this run (its application names), and wait until the
        server has let them go."""
        mine = (
            "select pid from pg_stat_activity where application_name like %s "
            "and pid <> pg_backend_pid()"
        )
        pattern = self.app_name("%")
        conn.execute(f"select pg_terminate_backend(pid) from ({mine}) s", (pattern,))
        deadline = time.monotonic() + deadline_s
        while conn.execute(mine, (pattern,)).fetchone() and time.monotonic() < deadline:
            time.sleep(0.01)

    # -- capabilities ----------------------------------------------------------------------
    @property
    def can_crash(self) -> bool:
        return bool(getattr(self.db, "owns_server", False))

    def capabilities(self) -> frozenset[str]:
        """What this run can do to the world. ``time-shift``: leases, heartbeats and backoffs
        can lapse (always: the clock moves, or the stored timestamps do). ``db-clock``: the
        database's ``now()`` itself moves, apart from the application's clock (the harness's
        cluster, under libfaketime). ``db-crash``: the server can be killed and restarted.
        ``concurrency``: concurrent blocks can run (the scheduler sets deadlock_timeout and
        log_lock_waits, which takes a superuser). Requirements and mutants that need what is
        missing are reported as not covered on this database, never as a vacuous run."""
        out = {"time-shift"}
        if isinstance(self.clock, DbClock):
            out.add("db-clock")
        if self.can_crash:
            out.add("db-crash")
        if self.can_schedule():
            out.add("concurrency")
        return frozenset(out)

    def can_schedule(self) -> bool:
        if not hasattr(self, "_can_schedule"):
            try:
                # through query: a part killed meanwhile is named (exit 3), not a Traceback
                self.query("SET log_lock_waits = on")
                self.query("RESET log_lock_waits")
                self._can_schedule = True
            except psycopg.errors.InsufficientPrivilege:
                self._can_schedule = False
        return self._can_schedule

    def unavailable(self) -> list[str]:
        out = []
        if not isinstance(self.clock, DbClock):
            out.append(
                "db-clock (now() cannot move here: a clock jump shifts the workspace's "
                "stored timestamps instead, so leases still lapse, but an application "
                "clock that disagrees with the database's is not covered)"
            )
        if not self.can_crash:
            out.append("db-crash (the harness does not own the database server)")
        if not self.can_schedule():
            out.append(
                "concurrent blocks (setting deadlock_timeout and log_lock_waits takes a superuser)"
            )
        return out

    def stand_in(self, name: str, part: type | Callable[[], Any]):
        """The stand-in ``name``, started on first use and kept for the run. A class runs in a
        process of its own (:class:`~.standin.StandInProcess`): killable from outside and
        health-checked like PostgreSQL and Toxiproxy. Any other callable builds a part in this
        process (one that needs the run's objects)."""
        if name not in self.stand_ins:
            if isinstance(part, type):
                from .standin import StandInProcess

                self.stand_ins[name] = StandInProcess(name, part).start()
            else:
                self.stand_ins[name] = part().start()
        return self.stand_ins[name]

    def stop_stand_ins(self) -> None:
        """Stop every stand-in started so far; the next :meth:`stand_in` starts its own again.
        A run of several kinds calls it between two kinds, so one kind's parts (a browser) are
        not kept running while the next kind is checked."""
        for part in self.stand_ins.values():
            with contextlib.suppress(Exception):
                part.stop()
        self.stand_ins.clear()

    # -- workspaces and the check's own connections ------------------------------------------
    def workspace(self, kind: str, schema_sql: str) -> Workspace:
        """(Re)create the workspace of ``kind`` for this run; it becomes the active one (the
        one a time shift moves)."""
        name = f"ks_{self.run_id}_{kind.replace('-', '_')}"
        try:
            for old in [w for w in self.workspaces if w.name == name]:
                old.drop()  # closes every connection to it first
                self.workspaces.remove(old)
            ws = Workspace(self, name, schema_sql)
            with deferred_signals():
                ws.create()
                self.workspaces.append(ws)
            ws.apply_schema()
        except psycopg.Error as e:
            if not is_connection_error(e):
                raise
            raise self._not_answering(e) from None
        self.active = ws
        return ws

    def admin(self, ws: Workspace | None = None) -> psycopg.Connection:
        """The check's own autocommit connection (to a workspace, or to the database): direct,
        never through a proxy, since observations must not be faulted."""
        key = ws.name if ws is not None else ""
        conn = self._admin.get(key)
        if conn is not None and not conn.closed and not conn.broken:
            return conn
        self.ensure_alive()
        app = self.app_name("observer")
        deadline = time.monotonic() + RECOVERY_GRACE_S
        while True:
            try:
                with timings.span("connect"):
                    conn = (
                        ws.connect(application_name=app)
                        if ws is not None
                        else psycopg.connect(
                            self.db.dsn(), autocommit=True, connect_timeout=5, application_name=app
                        )
                    )
                break
            except psycopg.Error as e:
                if not (_recovering(e) and time.monotonic() < deadline):
                    raise self._not_answering(e) from None
                self.ensure_alive()  # a server that died while recovering is named as dead
                time.sleep(0.01)
        self._admin[key] = conn
        return conn

    def _not_answering(self, e: psycopg.Error) -> EnvironmentFault:
        """The fault for a connection PostgreSQL refused or lost: the part that died, if one did
        (a kill from outside between two statements), else what the server said."""
        problem = self.health()
        return EnvironmentFault(
            problem
            or f"PostgreSQL at {self.db.host}:{self.db.port} is not answering: {first_line(e)}"
        )

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
        the harness killing it, and what to do. A part counts as dead from the moment it
        starts to exit (:func:`~.cluster.process_alive`), so whoever saw one of its sockets
        close finds it dead here."""
        if isinstance(self.db, PostgresCluster) and not self.db.running and not self.crashing:
            return (
                f"PostgreSQL ({self.db.describe()}) died, and not by an injected crash: was "
                f"it killed from outside? Server log tail: {self.db.log_tail(300)!r}"
            )
        if not self.toxiproxy.running:
            return (
                f"toxiproxy-server ({self.toxiproxy.url}) died, and not by the harness: was "
                "it killed from outside?"
            )
        for name, part in self.stand_ins.items():
            if getattr(part, "running", True) is False:
                who = part.describe() if hasattr(part, "describe") else f"the {name} stand-in"
                return f"{who} died, and not by the harness: was it killed from outside?"
        return None

    def ensure_alive(self) -> None:
        problem = self.health()
        if problem:
            raise EnvironmentFault(problem)

    def crash_and_restart(self) -> None:
        self.crash()
        self.restart()

    def crash(self) -> None:
        """SIGKILL the database server, an injected crash (:meth:`health` does not count it as
        the environment's failure until :meth:`restart` ends it), and drop the check's own
        connections, which died with it."""
        self.crashing = True
        try:
            with timings.span("crash"):
                self.db.crash()
        except ClusterError as e:
            self.crashing = False
            raise self._around_crash(e) from None
        for key in list(self._admin):
            self._admin.pop(key).close()
        for ws in self.workspaces:
            if ws._scheduler is not None:
                ws._scheduler.close()  # its observer connection died with the server

    def restart(self) -> None:
        """Start the server again on the same data after :meth:`crash` (crash recovery)."""
        try:
            with timings.span("crash"):
                self.db.restart()
        except ClusterError as e:
            raise self._around_crash(e) from None
        finally:
            self.crashing = False

    def _around_crash(self, e: ClusterError) -> EnvironmentFault:
        return EnvironmentFault(
            f"PostgreSQL ({self.db.describe()}) failed around an injected crash: {e}"
        )

    def backends(self, application_name: str) -> list[int]:
        return [
            r[0]
            for r in self.query(
                "select pid from pg_stat_activity where application_name = %s", (application_name,)
            )
        ]

    def settle(self, application_name: str, grace_s: float = 2.0) -> None:
        """Wait until the server has let go of an abandoned connection's backend, so a transaction
        that lingers server-side cannot hold row locks into the next step. Polls with a deadline;
        past the grace period it terminates the backend (the end a dead client's backend meets
        anyway, once TCP notices). A COMMIT already under way is not interrupted by that."""
        with timings.span("wait"):
            self._settle(application_name, grace_s)

    def _settle(self, application_name: str, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        while self.backends(application_name):
            if time.monotonic() > deadline:
                self.query(
                    "select pg_terminate_backend(pid) from pg_stat_activity "
                    "where application_name = %s",
                    (application_name,),
                )
                deadline = time.monotonic() + 10
                while self.backends(application_name):
                    if time.monotonic() > deadline:
                        raise EnvironmentFault(
                            f"backend {application_name} did not go away after pg_terminate_backend"
                        )
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
            with timings.span("reset"):
                self.clock.reset(CLOCK_BASE)


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
    shortest: dict[str, tuple[str, list[str]]] = field(default_factory=dict)
    """Per invariant, the shortest failing example seen naming it (its failure and trace):
    a run shrinks the first bug it finds, and this keeps what else it met on the way."""

    def saw_failure(self, message: str, names: tuple[str, ...], trace: list[str]) -> None:
        """A failing example: for each invariant it names, kept when shorter than any before
        (in steps, a continuation line not counted; the first seen wins a tie)."""
        for name in names:
            kept = self.shortest.get(name)
            if kept is None or _steps(trace) < _steps(kept[1]):
                self.shortest[name] = (message, list(trace))

    def as_dict(self) -> dict:
        return {
            "examples": self.examples,
            "steps": self.steps,
            "invariants_checked": self.invariants_checked,
            "faults": dict(self.faults),
            "events": dict(self.events),
            "transitions": {f"{s} -{e}-> {t}": n for (s, e, t), n in self.transitions.items()},
            "shortest": {
                name: {"failure": m, "counterexample": t, "steps": _steps(t)}
                for name, (m, t) in sorted(self.shortest.items())
            },
        }


def _steps(trace: list[str]) -> int:
    return sum(1 for line in trace if not line.startswith("  "))
