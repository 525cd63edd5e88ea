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
import datetime as dt
import itertools
import os
import secrets
import socket
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import psycopg

from knownstate.impl.errors import KnownstateError, first_line, is_connection_error

from .cluster import ClusterError, DbClock, PostgresCluster, Refused, Unavailable, open_database
from . import timings
from .timeshift import TimeShift
from .interleave import ScheduledConnection, Scheduler
from .tools import deferred_signals
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
    A BaseException, so Hypothesis neither shrinks it nor mistakes it for a counterexample.
    ``partial``: what the interrupted kind's check had done so far (a ``CheckResult``, set by
    ``run_check``), for the reports."""

    partial: Any = None


class WorkerDied(KnownstateError):
    """The worker process died (injected): its connection closed without COMMIT."""


class SchemaRefused(Exception):
    """The server refused the kind's schema SQL: the implementation's failure (its schema), not
    the environment's, reported with the error and the line of the schema it is on."""


# ---------------------------------------------------------------------------------------
# Workspaces: one schema per kind and run.
# ---------------------------------------------------------------------------------------

TRUNCATE_EVERY = 50
"""Between examples a workspace's tables are emptied by DELETE, and by TRUNCATE once in this
many resets (a count, so a seed resets the same way on any machine)."""


class Workspace:
    """One kind's tables for one run: the schema ``name`` in the run's database. Connections
    reach it through ``search_path`` (this schema only), so implementations use unqualified
    table names and can touch nothing else. Sessions are pinned to the settings the reference
    implementations assume (read committed, no timeouts), whatever the database's defaults."""

    SETTINGS = (
        "default_transaction_isolation=read\\ committed",
        "statement_timeout=0",
        "lock_timeout=0",
        "idle_in_transaction_session_timeout=0",
    )

    def __init__(self, env: "Env", name: str, schema_sql: str):
        self.env, self.name, self.schema_sql = env, name, schema_sql
        self.tables: tuple[str, ...] = ()
        self.time_columns: dict[str, tuple[str, ...]] = {}
        self.triggered: frozenset[str] = frozenset()
        self.shifted = 0
        self.clear_sql: str | None = None  # the cheap reset, when the schema allows it
        self.resets = 0
        self.workers: list[Worker] = []  # kept from one example to the next (KindCheck)
        self._scheduler: Scheduler | None = None

    def scheduler(self) -> Scheduler:
        """The scheduler of this workspace's concurrent blocks (its observer is direct)."""
        if self._scheduler is None:
            self._scheduler = Scheduler(
                self.conninfo(), pause=self.env.can_crash, clock_guard=self.env.clock is not None
            )
            # a block's operations run on threads of their own: the main thread's wait for them
            # is the implementation's time (--timings)
            self._scheduler.run = timings.timed("impl")(self._scheduler.run)
        return self._scheduler

    def create(self) -> "Workspace":
        """Create the schema; never one that exists (that is not this run's)."""
        admin = self.env.admin()
        try:
            admin.execute(f'create schema "{self.name}"')
        except (psycopg.errors.DuplicateSchema, psycopg.errors.InsufficientPrivilege) as e:
            user, db = admin.execute("select current_user, current_database()").fetchone()
            if isinstance(e, psycopg.errors.DuplicateSchema):
                raise EnvironmentFault(
                    f"schema {self.name} already exists in database {db}: "
                    "another run with the same id? Run again (a new id is "
                    "drawn)"
                ) from None
            raise EnvironmentFault(
                f"user {user} may not create schemas in database {db}: grant "
                f"it with GRANT CREATE ON DATABASE {db} TO {user}"
            ) from None
        return self

    def apply_schema(self) -> None:
        """Run the kind's schema SQL inside the workspace; learn its tables, their timestamp
        columns (what a time shift moves) and which have user triggers."""
        conn = self.connect(application_name=self.env.app_name("setup"))
        try:
            try:
                conn.execute(self.schema_sql)
            except psycopg.Error as e:
                if is_connection_error(e):
                    raise
                pos = e.diag.statement_position
                line = self.schema_sql[: int(pos)].count("\n") + 1 if pos else None
                raise SchemaRefused(
                    f"the server refused the kind's schema SQL{f' at line {line}' if line else ''}"
                    f": {e.sqlstate} {first_line(e)}. Fix the schema (a kind "
                    "of your own: its adapter's `schema`): it must apply, as one script, to "
                    "an empty schema"
                ) from None
            self.tables = tuple(
                r[0]
                for r in conn.execute(
                    "select tablename from pg_tables where schemaname = %s order by tablename",
                    (self.name,),
                ).fetchall()
            )
            columns: dict[str, list[str]] = {}
            for table, column in conn.execute(
                "select c.relname, a.attname from pg_attribute a "
                "join pg_class c on c.oid = a.attrelid "
                "join pg_namespace n on n.oid = c.relnamespace "
                "where n.nspname = %s and c.relkind in ('r', 'p') and not c.relispartition "
                "and a.attnum > 0 and not a.attisdropped and a.attgenerated = '' "
                "and a.atttypid in ('timestamptz'::regtype, 'timestamp'::regtype) "
                "order by c.relname, a.attnum",
                (self.name,),
            ).fetchall():
                columns.setdefault(table, []).append(column)
            self.time_columns = {t: tuple(cs) for t, cs in columns.items()}
            self.triggered = frozenset(
                r[0]
                for r in conn.execute(
                    "select distinct c.relname from pg_trigger t "
                    "join pg_class c on c.oid = t.tgrelid "
                    "join pg_namespace n on n.oid = c.relnamespace "
                    "where n.nspname = %s and not t.tgisinternal",
                    (self.name,),
                ).fetchall()
            )
            self.clear_sql = self._clear_sql(conn)
        finally:
            conn.close()

    def _clear_sql(self, conn: psycopg.Connection) -> str | None:
        """What empties the tables as ``truncate ... restart identity`` does, by DELETE (a
        twentieth of TRUNCATE's cost: no new files, no catalog rows): each table after every
        table that references it, then each sequence its tables own back to its start. None
        (TRUNCATE it is) when DELETE could do more than empty them: a user trigger, a rule,
        or foreign keys in a cycle."""
        if self.triggered or not self.tables:
            return None
        rules = conn.execute(
            "select count(*) from pg_rules where schemaname = %s", (self.name,)
        ).fetchone()[0]
        if rules:
            return None
        refs: dict[str, set[str]] = {t: set() for t in self.tables}  # table -> its referrers
        for child, parent in conn.execute(
            "select ch.relname, pa.relname from pg_constraint k "
            "join pg_class ch on ch.oid = k.conrelid join pg_class pa on pa.oid = k.confrelid "
            "join pg_namespace n on n.oid = ch.relnamespace "
            "where n.nspname = %s and k.contype = 'f'",
            (self.name,),
        ).fetchall():
            if child != parent and parent in refs:
                refs[parent].add(child)
        order: list[str] = []
        while refs:
            free = sorted(t for t, by in refs.items() if not by - set(order))
            if not free:
                return None  # a cycle
            order += free
            for t in free:
                del refs[t]
        owned = conn.execute(
            "select s.relname, q.seqstart from pg_class s "
            "join pg_namespace n on n.oid = s.relnamespace "
            "join pg_sequence q on q.seqrelid = s.oid "
            "join pg_depend d on d.objid = s.oid and d.classid = 'pg_class'::regclass "
            "and d.refclassid = 'pg_class'::regclass and d.deptype in ('a', 'i') "
            "where n.nspname = %s and s.relkind = 'S' order by s.relname",
            (self.name,),
        ).fetchall()
        return "; ".join(
            [f'delete from "{self.name}"."{t}"' for t in order]
            + [f'select setval(\'"{self.name}"."{q}"\', {start}, false)' for q, start in owned]
        )

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

    def conninfo(
        self, *, host: str | None = None, port: int | None = None, options: str = ""
    ) -> str:
        """A DSN for this workspace, through ``host:port`` (a worker's link) when given."""
        pinned = " ".join(f"-c {s}" for s in (f"search_path={self.name}", *self.SETTINGS))
        return psycopg.conninfo.make_conninfo(
            self.env.db.dsn(host=host, port=port), options=f"{pinned} {options}".strip()
        )

    def connect(
        self, *, application_name: str, host: str | None = None, port: int | None = None, **kwargs
    ) -> psycopg.Connection:
        return psycopg.connect(
            self.conninfo(host=host, port=port),
            autocommit=True,
            application_name=application_name,
            connect_timeout=5,
            **kwargs,
        )

    def admin(self) -> psycopg.Connection:
        """The check's own connection to this workspace: direct, never through a proxy."""
        return self.env.admin(self)

    def query(self, sql: str, params: Any = None) -> list[tuple]:
        return self.env.query(sql, params, self)

    def truncate(self) -> None:
        """Empty every table and restart the sequences they own (between examples). By
        ``clear_sql`` when the schema allows, and by TRUNCATE every ``TRUNCATE_EVERY`` resets,
        which gives back the space the deleted rows held (autovacuum is off)."""
        if not self.tables:
            return
        self.resets += 1
        with timings.span("reset"):
            if self.clear_sql is not None and self.resets % TRUNCATE_EVERY:
                self.query(self.clear_sql)
            else:
                names = ", ".join(f'"{self.name}"."{t}"' for t in self.tables)
                self.query(f"truncate {names} restart identity cascade")

    def now(self) -> dt.datetime:
        return self.query("select now()")[0][0]

    def shift(self, seconds: int) -> None:
        """Move every stored timestamp of the workspace back by ``seconds`` (forward when
        negative), in one transaction, user triggers held off: the time shift
        (:mod:`.timeshift`)."""
        seconds = int(seconds)
        if not seconds:
            return
        statements = ["set local lock_timeout = '10s'"]
        for table, columns in self.time_columns.items():
            name = f'"{self.name}"."{table}"'
            sets = ", ".join(f'"{c}" = "{c}" - interval \'{seconds} seconds\'' for c in columns)
            held = table in self.triggered
            statements += [f"alter table {name} disable trigger user"] * held
            statements += [f"update {name} set {sets}"]
            statements += [f"alter table {name} enable trigger user"] * held
        try:
            # One message: the statements run as one transaction, in one round trip.
            self.admin().execute("; ".join(statements))
        except psycopg.errors.LockNotAvailable:
            raise RuntimeError(
                f"the time shift of {self.name} waited 10 s on a row lock: a "
                "session of this run left a transaction open between steps"
            ) from None
        except psycopg.Error as e:
            if is_connection_error(e):
                self.env.ensure_alive()
                raise EnvironmentFault(
                    f"PostgreSQL stopped answering during a time shift: {first_line(e)}"
                ) from None
            raise RuntimeError(
                f"the schema of {self.name} refuses a time shift of {seconds:+d}s "
                f"({e.sqlstate} {first_line(e)}): a constraint "
                "reading now(), or a unique timestamp"
            ) from None
        self.shifted += seconds


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
            for part in self.stand_ins.values():
                with contextlib.suppress(Exception):
                    part.stop()
            self.stand_ins.clear()
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
                self.admin().execute("SET log_lock_waits = on")
                self.admin().execute("RESET log_lock_waits")
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
        try:
            with timings.span("connect"):
                conn = (
                    ws.connect(application_name=app)
                    if ws is not None
                    else psycopg.connect(
                        self.db.dsn(), autocommit=True, connect_timeout=5, application_name=app
                    )
                )
        except psycopg.Error as e:
            raise self._not_answering(e) from None
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


def cut_socket(conn: psycopg.Connection | psycopg.AsyncConnection) -> None:
    """Close a connection the way a dying process does: the socket goes, no goodbye, no COMMIT.
    An async connection is finished without an event loop."""
    with contextlib.suppress(Exception):
        s = socket.socket(fileno=os.dup(conn.pgconn.socket))
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        s.close()
    with contextlib.suppress(Exception):
        if isinstance(conn, psycopg.AsyncConnection):
            conn.pgconn.finish()
        else:
            conn.close()


HUNG_SECONDS = 60.0
"""A worker's statement that neither finishes nor waits on a lock for this long is cut off and
reported as hung. Generous on purpose: it is a backstop, never what decides a verdict on a
machine under load. (The server's own statement_timeout cannot be used: it reads the faked
clock.)"""


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
            observer = psycopg.connect(
                env.db.dsn(),
                autocommit=True,
                connect_timeout=5,
                application_name=env.app_name("watch"),
            )
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
            self.app_name = self.env.app_name(f"{self.kind}-{self.name}-{next(self._serial)}")
            try:
                with timings.span("connect"):
                    self.conn = HookedConnection.connect(
                        self.ws.conninfo(host=self.link.host, port=self.link.port),
                        application_name=self.app_name,
                        connect_timeout=3,
                    )
            except psycopg.Error as e:
                self.conn = None
                raise ConnectionLost(f"{self.name} connect: {first_line(e)}") from None
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
                with timings.span("reset"):
                    conn.execute("select 1")
                    conn.rollback()  # never leave a transaction open: now() would stay at its start
            except psycopg.Error:
                self.abandon()
        try:
            self.connection()
        except ConnectionLost as e:
            raise EnvironmentFault(
                f"{self.name} could not connect through its clean link: {e}"
            ) from None

    def faulted(self) -> bool:
        """A toxic on one of its links, a link down, or a COMMIT fault armed."""
        return self.before_commit is not None or any(l.toxics or not l.enabled for l in self.links)

    def clean(self) -> bool:
        return not self.faulted()

    def arm(self, hook: Callable[[HookedConnection], None]) -> None:
        """Run ``hook`` just before this worker's next COMMIT, on whatever connection it has
        then."""
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
        return {
            "examples": self.examples,
            "steps": self.steps,
            "invariants_checked": self.invariants_checked,
            "faults": dict(self.faults),
            "events": dict(self.events),
            "transitions": {f"{s} -{e}-> {t}": n for (s, e, t), n in self.transitions.items()},
        }
