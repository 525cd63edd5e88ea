"""Workspaces: one schema per kind and run (see :mod:`.harness`, "Any database, safely").

A kind's check works in a :class:`Workspace` of its own: a schema ``ks_<run id>_<kind>`` in the
database the run uses, reached through ``search_path`` and nothing else; its tables are emptied
between examples, and its stored timestamps shifted when the run cannot move the server's clock
(:mod:`.timeshift`)."""

from __future__ import annotations

import contextlib
import datetime as dt
from typing import TYPE_CHECKING, Any

import psycopg

from knownstate.impl.errors import first_line, is_connection_error

from . import timings
from .interleave import Scheduler
from .envfaults import EnvironmentFault, SchemaRefused

if TYPE_CHECKING:
    from .harness import Env
    from .workers import Worker

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
                self.conninfo(),
                pause=self.env.can_crash,
                clock_guard=self.env.clock is not None,
                gone=lambda: self.env.health() is not None,  # a part died: no waiting it out
                keep_settings=True,  # the workers' connections are the check's own
            )
            # a block's operations run on threads of their own: the main thread's wait for them
            # is the implementation's time (--timings)
            self._scheduler.run = timings.timed("impl")(self._scheduler.run)
        return self._scheduler

    def create(self) -> "Workspace":
        """Create the schema; never one that exists (that is not this run's). Through
        ``Env.query``, whose retry replaces a connection kept from a run before a restart."""
        try:
            self.env.query(f'create schema "{self.name}"')
        except (psycopg.errors.DuplicateSchema, psycopg.errors.InsufficientPrivilege) as e:
            ((user, db),) = self.env.query("select current_user, current_database()")
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
        self.env.query(f'drop schema if exists "{self.name}" cascade')

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
