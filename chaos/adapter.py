"""Binding a real system to the gate: the adapter, and what every adapter meets.

An adapter is the user's side of a check built from a description
(:mod:`knownstate.chaos.generic`): one method per operation of the queue, each calling the
user's own code on the connection the gate gives it, and one query that reads the state back.
The gate does the rest — the model, every fault, the invariants, the report.

Operations may be plain functions or coroutines. A plain one gets a psycopg
:class:`~psycopg.Connection`; a coroutine gets a psycopg :class:`~psycopg.AsyncConnection`,
run on the worker's own event loop. Either way the connection goes through the worker's own
Toxiproxy link, and every COMMIT on it — ``conn.commit()`` or the end of a
``conn.transaction()`` block — meets the faults armed for it. A driver that brings its own
connections (asyncpg, a pool) overrides :meth:`Adapter.connect` and :meth:`Adapter.close`;
it still gets the worker's link, but since the gate cannot see its COMMIT, every connection it
loses counts as *indeterminate* (the check keeps both outcomes).

What every adapter meets, handled here once:

- **lost races**: a library says "nobody matched" in its own way — a ``None`` or ``False``, a
  status like ``UPDATE 0`` or ``INSERT 0 0``, a plpgsql ``RAISE`` (SQLSTATE ``P0001``), an
  exception of its own. :class:`LostRaceSignals` lists them; the gate turns them into
  :class:`~knownstate.model.contract.LostRace`.
- **wrapped driver errors**: libraries wrap psycopg's errors in their own; :func:`unwrap`
  follows ``__cause__``/``__context__`` to the driver's error, which decides: a lost
  connection, a statement the server refused, a call the driver refused.
- **rows deleted when finished**: :func:`merge_log` reads finished runs back from a log table,
  so a queue that deletes its finished rows does not read as "run disappeared".
- **a library that takes a pool**: :class:`LentPool` lends it the worker's connection, so
  its queries go through the worker's link and meet its faults.
- **tables** are found in the schema (the workspace lists them after running ``schema``).
- **time**: the description's durations are in the user's units; :class:`Timing` gives them
  as the check runs them — scaled, when needed, to whole minutes, the gate's quantum — and
  the adapter configures its system with those.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import inspect
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Iterable, Mapping

import psycopg
from psycopg import pq, sql
from psycopg._cursor_base import BaseCursor

from knownstate.impl import queries as named_queries
from knownstate.impl.errors import ConnectionLost, ExternalCallFailed, first_line
from knownstate.model.contract import LostRace, Won
from knownstate.model.generic import Timing

from . import timings
from .harness import Worker, cut_socket
from .interleave import AsyncScheduledConnection, ScheduledConnection, round_trip_label, run_on

OK, RETRY, PERMANENT = "ok", "retry", "permanent"
"""What an external call answered: done, failed for now, failed for good."""

# ---------------------------------------------------------------------------------------
# Values the adapter hands back.
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Claimed:
    """One run a claim took: its key, the attempt it claimed (None when the system keeps no
    attempt count), and ``handle``: whatever the adapter needs later to write for it."""

    key: str
    attempt: int | None = None
    handle: Any = field(default=None, compare=False)


@dataclass(frozen=True)
class Row:
    """One run as the system keeps it: ``due`` (when a waiting run may be claimed) and
    ``lease_until`` (when its lease lapses: compute it in the query when the table keeps the
    heartbeat's time instead) are database timestamps, or None; ``holder``, with
    ``Adapter.holders``, the worker whose claim holds it; ``max_attempts``, the run's own limit
    where take-backs add to it (``Retry(taken_back="one-more")``)."""

    key: str
    status: str
    attempts: int | None = None
    due: dt.datetime | None = None
    lease_until: dt.datetime | None = None
    holder: str | None = None
    max_attempts: int | None = None


def merge_log(live: Iterable[Row | Mapping], finished: Iterable[Row | Mapping]) -> list[Row]:
    """The runs of a queue that deletes finished rows: the live rows, and for every key no
    longer among them its last entry in the log table (``finished``, oldest first)."""
    out = {r.key: r for r in map(as_row, finished)}
    out.update({r.key: r for r in map(as_row, live)})
    return list(out.values())


def as_row(r: Row | Mapping) -> Row:
    if isinstance(r, Row):
        return r
    fields = ("attempts", "due", "lease_until", "holder", "max_attempts")
    known = {k: r[k] for k in fields if k in r}
    return Row(str(r["key"]), str(r["status"]), **known)


@dataclass(frozen=True)
class LostRaceSignals:
    """How a library says "your conditional write matched nothing"."""

    values: tuple[Any, ...] = (None, False)
    """Return values that mean a lost race (compared by identity or ``==``)."""
    empty: bool = True
    """An empty sequence, or a row count of 0, means a lost race."""
    statuses: tuple[str, ...] = ("UPDATE 0", "INSERT 0 0", "DELETE 0", "SELECT 0")
    """Command statuses (a cursor's ``statusmessage``, or the cursor itself) for a lost race."""
    sqlstates: tuple[str, ...] = ()
    """SQLSTATEs a refused statement raises for a lost race, e.g. ``P0001`` (plpgsql RAISE)."""
    messages: tuple[str, ...] = ()
    """Substrings of an error's message that mean a lost race."""
    errors: tuple[type[BaseException], ...] = ()
    """The library's own exceptions that mean a lost race."""

    def returned(self, value: Any) -> bool:
        if isinstance(value, (LostRace, Won)):  # an adapter that speaks in outcomes
            return isinstance(value, LostRace)
        if isinstance(value, psycopg.Cursor | psycopg.AsyncCursor):
            value = value.statusmessage
        if isinstance(value, str):
            return value in self.statuses or value in self.values
        if any(value is v for v in self.values):
            return True
        if self.empty and isinstance(value, (tuple, list)) and not value:
            return True
        return self.empty and isinstance(value, int) and not isinstance(value, bool) and value == 0

    def raised(self, e: BaseException) -> bool:
        if self.errors and isinstance(e, self.errors):
            return True
        pg = unwrap(e)
        if pg is not None and pg.sqlstate and pg.sqlstate in self.sqlstates:
            return True
        text = str(pg or e)
        return any(m in text for m in self.messages)


def unwrap(e: BaseException) -> psycopg.Error | None:
    """The driver's error behind a library's own (following ``__cause__``/``__context__``)."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, psycopg.Error):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def load_queries(path: str | Path) -> dict[str, str]:
    """Named queries from a ``.sql`` file in knownstate's format (``-- name --`` headers):
    expose them as ``Adapter.queries`` and the gate derives mutants from your guards."""
    path = Path(path)
    return named_queries.parse(path.read_text(), path.name)


def recorded_migration(migrate) -> str:
    """The SQL a library's migration written in Python runs on an empty database, as one
    script for ``Adapter.schema``: ``migrate(conn)``, a coroutine function taking a psycopg
    ``AsyncConnection``, is given one that records every statement its cursors execute
    (parameters inlined) and answers every read with nothing, as an empty database does (no
    version recorded yet, nothing to rename). A migration that branches on what a read
    returns is recorded down the empty database's branch."""
    recorder = _Recorder()
    asyncio.run(migrate(recorder))
    return "".join(f"{statement};\n" for statement in recorder.statements)


class _Recorder:
    """An async connection, its transactions and its cursors, recording what they execute."""

    def __init__(self):
        self.statements: list[str] = []

    def cursor(self, *args, **kwargs) -> "_Recorder":
        return self

    def transaction(self, *args, **kwargs) -> "_Recorder":
        return self

    async def __aenter__(self) -> "_Recorder":
        return self

    async def __aexit__(self, *exc) -> None:
        return None

    async def execute(self, query, params=None) -> "_Recorder":
        text = query if isinstance(query, str) else query.as_string(None)
        if isinstance(params, Mapping):
            text = text % {k: sql.Literal(v).as_string(None) for k, v in params.items()}
        elif params:
            text = text % tuple(sql.Literal(v).as_string(None) for v in params)
        self.statements.append(text.strip().rstrip(";").strip())
        return self

    async def fetchone(self) -> None:
        return None

    async def fetchall(self) -> list:
        return []


class LentPool:
    """A psycopg_pool pool, as a library taking one uses it, that lends the worker's
    connection: each ``connection()`` block is one transaction on it, committed at the block's
    end and rolled back on an error, as a pool's own connection is. Give it where the library
    wants its pool (``LentPool(conn)``); ``open`` and ``close`` do nothing, the gate owns the
    connection."""

    def __init__(self, conn: psycopg.AsyncConnection):
        self.conn = conn

    async def open(self, *args, **kwargs) -> None:
        return None

    async def close(self, *args, **kwargs) -> None:
        return None

    @contextlib.asynccontextmanager
    async def connection(self, *args, **kwargs):
        async with self.conn.transaction():
            yield self.conn


# ---------------------------------------------------------------------------------------
# The adapter.
# ---------------------------------------------------------------------------------------


class Adapter:
    """Subclass it: set ``schema`` (and ``queries``/``guards`` to get mutants), implement the
    operations your description has, sync or ``async``. Each gets the worker's connection;
    keep no connection of your own across calls (the gate owns them)."""

    schema: ClassVar[str] = ""
    """SQL that creates the tables (run once per run in a schema of its own; every table it
    creates is emptied between examples, none listed by hand)."""
    read_query: ClassVar[str] = ""
    """One query reading every run back, with columns ``key, status`` and, as the system has
    them, ``attempts, due, lease_until``. Or override :meth:`read`."""
    holders: ClassVar[bool] = False
    """Whether ``read`` gives each held run's ``holder``: the ``worker`` name the gate passed
    the claim that took it. With a lease per worker, who holds a run decides whose beat keeps
    it, and two claims of one run in a block (a reaper between them) leave rows that only the
    holder tells apart: set it when the rows show it, so the block's order is judged by it
    (without it, the check goes on from both orders' states until a later step tells them
    apart)."""
    queries: ClassVar[dict[str, str]] = {}
    """Named SQL the operations run (``self.queries[name]``); mutants edit copies of it."""
    guards: ClassVar[dict[str, str]] = {}
    """The SQL text of each guard, for the mutants the gate derives: ``fence`` (the attempt
    match), ``status`` (the owned-status match), ``lease`` (the reaper's lapse test),
    ``skip_locked`` (``SKIP LOCKED``), ``lock`` (the claim's whole row lock, e.g. ``FOR UPDATE
    SKIP LOCKED``: without it the claim reads, then writes). Each query containing one gets a
    mutant without it."""
    lost_race: ClassVar[LostRaceSignals] = LostRaceSignals()
    no_answer: ClassVar[tuple[type[BaseException], ...]] = (OSError, ExternalCallFailed)
    """Exceptions of :meth:`send` that mean the external side never answered (it may still
    have acted). httpx's transport errors are added when httpx is installed."""
    connection_errors: ClassVar[tuple[type[BaseException], ...]] = ()
    """A driver of your own: its exceptions for a lost connection (psycopg's are known)."""

    def __init__(self, timing: Timing, clock: Any = None):
        self.timing = timing
        self.clock = clock  # the run's database clock (``Env.clock``); None: real time
        self.started: dict[str, Any] = {}  # worker name -> what its ``start`` returned
        self.app_skew = 0.0  # seconds the gate moved the application's clock (``now()``)

    def now(self) -> dt.datetime:
        """The application's clock, as the gate runs it: where the database's clock starts each
        example (a week behind real time under the fake clock), moved by none of its jumps and
        standing still between steps as the database's does, and skewed by the gate apart from
        the database's (the ``app-clock-skew`` fault). Pass it where the library stamps its own
        now (``Claim(unscheduled="application")``, ``Lease(clock="application")``)."""
        offset = self.clock.app_offset if self.clock is not None else 0.0
        return dt.datetime.now(dt.UTC) + dt.timedelta(seconds=offset + self.app_skew)

    # -- the operations (implement those your description has) --------------------------------
    def enqueue(self, conn, key: str) -> Any:
        """Add a run under ``key`` (keep the key: ``read`` returns it)."""
        raise NotImplementedError

    def start(self, conn, worker: str) -> Any:
        """A worker's start, before its first claim: where a library that keeps heartbeats
        per worker registers it. Run on the claim's connection in the claim's step (its faults
        are the claim's); what it returns is in ``self.started[worker]`` for the claim. The
        model registers a worker with its first claim that returns: until one does, each claim
        starts the worker again."""
        raise NotImplementedError

    def claim(self, conn, batch: int) -> Iterable[Claimed]:
        """Claim up to ``batch`` due runs; return what was claimed."""
        raise NotImplementedError

    def extend_lease(self, conn, job: Claimed) -> Any:
        """The owner's heartbeat."""
        raise NotImplementedError

    def complete(self, conn, job: Claimed) -> Any:
        raise NotImplementedError

    def fail(self, conn, job: Claimed, permanent: bool) -> Any:
        """A failed attempt: for good (``permanent``), or to be retried per the policy."""
        raise NotImplementedError

    def reclaim_stale(self, conn) -> Iterable[str] | int | None:
        """The reaper; return the keys it took back (or how many)."""
        raise NotImplementedError

    def send(self, job: Claimed, url: str) -> str:
        """The external call for ``job``, to ``url``; return OK, RETRY or PERMANENT."""
        raise NotImplementedError

    def read(self, conn: psycopg.Connection) -> Iterable[Row | Mapping]:
        """Every run, on the check's own connection (sync, autocommit, never faulted)."""
        if not self.read_query:
            raise NotImplementedError(f"{type(self).__name__}: set read_query or override read")
        with conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
            return cur.execute(self.read_query).fetchall()

    # -- a driver of your own -------------------------------------------------------------------
    def connect(self, dsn: str) -> Any:
        """Override to open your driver's connection to ``dsn`` (the worker's link)."""
        raise NotImplementedError

    def close(self, conn: Any) -> Any:
        """Override with :meth:`connect`: close what it opened."""

    @classmethod
    def mode(cls) -> str:
        """``sync`` (psycopg), ``async`` (psycopg's AsyncConnection) or ``own`` (a driver of
        its own, through :meth:`connect`)."""
        if cls.connect is not Adapter.connect:
            return "own"
        ops = [getattr(cls, n) for n in OPERATIONS if getattr(cls, n) is not getattr(Adapter, n)]
        kinds = {inspect.iscoroutinefunction(f) for f in ops}
        if len(kinds) > 1:
            raise TypeError(
                f"{cls.__name__}: make every operation async, or none (a worker has "
                "one connection, sync or async)"
            )
        return "async" if kinds == {True} else "sync"

    @classmethod
    def implements(cls, name: str) -> bool:
        return getattr(cls, name) is not getattr(Adapter, name)


OPERATIONS = (
    "enqueue",
    "start",
    "claim",
    "extend_lease",
    "complete",
    "fail",
    "reclaim_stale",
    "send",
)


def no_answer_errors(adapter: type[Adapter]) -> tuple[type[BaseException], ...]:
    extra: tuple[type[BaseException], ...] = ()
    with contextlib.suppress(ImportError):
        import httpx

        extra = (httpx.TransportError,)
    return tuple(adapter.no_answer) + extra


# ---------------------------------------------------------------------------------------
# A mutant's edits of the SQL a library sends (it keeps its SQL to itself).
# ---------------------------------------------------------------------------------------

SqlEdit = tuple[str, str]
"""A regular expression over a statement's text, and what replaces it (case-insensitive)."""


def edit_sql(text: str, edits: Iterable[SqlEdit]) -> str:
    for pattern, replacement in edits:
        text = re.sub(pattern, replacement, text, flags=re.IGNORECASE)
    return text


def _converting(convert):
    """psycopg's conversion of a query to what it sends, then the edits of the mutant the
    connection's worker runs, for the operation it is in (``AdapterWorker.sql_edits``; none
    outside a mutant): the one place every statement a library sends passes, whatever cursor
    it made (pgqueuer makes its own). A statement the edits changed is counted on the worker
    (``AdapterWorker.edited``)."""

    def converted(self, query, params=None):
        pgq = convert(self, query, params)
        worker = getattr(self._conn, "owner", None)
        edits = getattr(worker, "sql_edits", {}).get(getattr(worker, "op", None), ())
        if edits:
            sent = pgq.query.decode()
            edited = edit_sql(sent, edits)
            if edited != sent:
                pgq.query = edited.encode()
                worker.edited += 1
        return pgq

    return converted


BaseCursor._convert_query = _converting(BaseCursor._convert_query)  # type: ignore[method-assign]


# ---------------------------------------------------------------------------------------
# Connections whose every COMMIT meets the faults, sync and async; in autocommit, every
# statement (each commits on its own).
# ---------------------------------------------------------------------------------------

COMMIT = b"COMMIT"


def _autocommitted(conn, gen) -> bool:
    """Whether ``gen``, a round trip about to leave, is a statement that commits on its own (in
    autocommit, outside a transaction block) while a fault is armed on the connection's
    worker: the fault meets it as it would a COMMIT."""
    owner = conn.owner
    return (
        owner is not None
        and owner.before_commit is not None
        and conn.autocommit
        and conn.pgconn.transaction_status == pq.TransactionStatus.IDLE
        and (round_trip_label(gen, conn) or "").startswith("round trip")
    )


def _fire(conn, target) -> None:
    """The armed fault acts, once, on ``target`` (the connection or its socket)."""
    hook, conn.owner.before_commit = conn.owner.before_commit, None
    hook(target)


def _exec_command(cls):
    def hooked(self, command, result_format=pq.Format.TEXT):
        gen = super(cls, self)._exec_command(command, result_format)
        if command != COMMIT:
            return gen
        return _committing(self, gen)

    return hooked


def _committing(conn, gen):
    """COMMIT as it leaves: the armed fault acts first; ``in_commit`` stays True if the answer
    never comes, so the gate knows the outcome is indeterminate."""
    conn.in_commit = True
    if conn.owner is not None and conn.owner.before_commit is not None:
        _fire(conn, _Socket(conn) if isinstance(conn, psycopg.AsyncConnection) else conn)
    result = yield from gen
    conn.in_commit = False
    return result


class _Socket:
    """An async connection as a fault's hook sees it: its socket, and a close that needs no
    event loop (a dying worker does not await anything)."""

    def __init__(self, conn: psycopg.AsyncConnection):
        self.pgconn = conn.pgconn

    def close(self) -> None:
        self.pgconn.finish()


class TxConnection(ScheduledConnection):
    """A psycopg connection whose every COMMIT (``commit()``, or the end of a
    ``transaction()`` block) meets the fault armed on its worker; inside a concurrent block
    every statement and COMMIT waits for the scheduler (:mod:`.interleave`)."""

    owner: "AdapterWorker | None" = None
    in_commit = False

    def wait(self, gen: Any, *args: Any, **kwargs: Any) -> Any:
        if _autocommitted(self, gen):
            _fire(self, self)
        return super().wait(gen, *args, **kwargs)


class AsyncTxConnection(AsyncScheduledConnection):
    """The same, for asyncio."""

    owner: "AdapterWorker | None" = None
    in_commit = False

    async def wait(self, gen: Any, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        if _autocommitted(self, gen):
            _fire(self, _Socket(self))
        return await super().wait(gen, *args, **kwargs)


TxConnection._exec_command = _exec_command(TxConnection)  # type: ignore[method-assign]
AsyncTxConnection._exec_command = _exec_command(AsyncTxConnection)  # type: ignore[method-assign]


class AdapterWorker(Worker):
    """A worker whose connection is the one the adapter wants: sync or async psycopg through
    the worker's link, with its COMMIT hooked, or a driver's own (``Adapter.connect``)."""

    mode: ClassVar[str] = "sync"
    adapter: ClassVar[type[Adapter]] = Adapter
    sql_edits: Mapping[str, tuple[SqlEdit, ...]] = {}
    """A mutant's edits of the statements this worker sends, per operation of the adapter."""
    edited: int = 0
    """Statements those edits changed since the check last counted them into the run's events
    (:meth:`~.adaptercall.AdapterCalls._call`)."""
    op: str | None = None  # the adapter's operation it is in

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loop = asyncio.new_event_loop() if self.mode != "sync" else None
        self.own: Any = None
        self.binding: Adapter | None = None  # the adapter instance of the current example

    def run(self, value: Any) -> Any:
        """A coroutine's result, run on this worker's own event loop; any other value as is
        (:func:`.interleave.run_on`: on a thread of its own where this thread runs a loop)."""
        return run_on(self.loop, value)

    def dsn(self) -> str:
        return self.ws.conninfo(host=self.link.host, port=self.link.port)

    def connection(self) -> Any:
        if self.mode == "own":
            if self.own is None:
                self.own = self._connect(lambda: self.binding.connect(self.dsn()))
            return self.own
        conn = self.conn
        if conn is not None and not conn.closed and not conn.broken:
            return conn
        self.app_name = self.env.app_name(f"{self.kind}-{self.name}-{next(self._serial)}")
        # never prepared on its own (psycopg prepares a query on its fifth run, in a round trip
        # of its own before it, where a fault meant for the statement would meet the PREPARE):
        # a statement is one round trip whatever the connection ran before
        kwargs = dict(application_name=self.app_name, connect_timeout=3, prepare_threshold=None)
        if self.mode == "async":
            conn = self._connect(lambda: AsyncTxConnection.connect(self.dsn(), **kwargs))
        else:
            conn = self._connect(lambda: TxConnection.connect(self.dsn(), **kwargs))
        conn.owner = self
        self.conn = conn
        return conn

    def _connect(self, opener) -> Any:
        try:
            with timings.span("connect"):
                return self.run(opener())
        except (psycopg.Error, OSError, *self.adapter.connection_errors) as e:
            text = first_line(e)
            raise ConnectionLost(f"{self.name} connect: {text}") from None

    def abandon(self) -> None:
        if self.mode == "own":
            own, self.own = self.own, None
            if own is not None:
                with contextlib.suppress(Exception):
                    self.run(self.binding.close(own))
            return
        if self.mode == "async" and self.conn is not None:
            cut_socket(self.conn)
            self.conn = None
        super().abandon()

    def close(self) -> None:
        if self.mode == "sync":
            super().close()
        else:
            self.abandon()
            if self.loop is not None and not self.loop.is_closed():
                self.loop.close()

    def ready(self) -> None:
        if self.mode != "own":
            return super().ready()
        self.before_commit = None
        self.abandon()  # a driver's own connection is opened afresh for every example

    def still_answers(self, conn) -> None:
        self.run(conn.execute("select 1"))
        self.run(conn.rollback())

    def settle_after_error(self) -> None:
        """After an operation the adapter ended on an error it mapped to a lost race: leave no
        transaction open (a refused statement aborts it)."""
        conn = self.conn
        if self.mode == "own" or conn is None or conn.closed:
            return
        if conn.info.transaction_status != pq.TransactionStatus.IDLE:
            with contextlib.suppress(psycopg.Error):
                self.run(conn.rollback())


def worker_class(adapter: type[Adapter]) -> type[AdapterWorker]:
    return type(
        f"{adapter.__name__}Worker", (AdapterWorker,), {"mode": adapter.mode(), "adapter": adapter}
    )
