"""The intercepted connection of a concurrent block (:mod:`.scheduler` has the theory of
operation): a psycopg connection, synchronous or asyncio, whose every server round trip waits
at a gate, and the short label of each step (which statement it is)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import socket
import threading
from functools import cache
from importlib import resources
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterator

import psycopg
from psycopg import pq
from psycopg.transaction import BaseTransaction

from .server import NOTICE

if TYPE_CHECKING:
    from .scheduler import _Worker

# ---------------------------------------------------------------------------------------
# Labels: which statement a step is.
# ---------------------------------------------------------------------------------------


@cache
def _known_queries() -> dict[str, str]:
    """Normalized SQL text -> ``file.name`` for every named query of the implementation."""
    from knownstate.impl import queries

    out: dict[str, str] = {}
    for entry in resources.files("knownstate.impl").joinpath("sql").iterdir():
        name = entry.name
        if name.endswith(".sql") and not name.endswith("_schema.sql"):
            for qname, body in queries.load(name).items():
                out[_normalize(body)] = f"{name[:-4]}.{qname}"
    return out


def _normalize(sql: str) -> str:
    lines = [ln for ln in sql.splitlines() if not ln.strip().startswith("--")]
    return " ".join(" ".join(lines).split())


def statement_label(query: Any, width: int = 60) -> str:
    """A short name for a statement: ``outbox.claim_due`` for a named query of the
    implementation, else its first words (an edited query of a mutant shows its text)."""
    if isinstance(query, bytes):
        query = query.decode(errors="replace")
    if not isinstance(query, str):
        query = getattr(query, "_obj", None) or type(query).__name__
        if not isinstance(query, str):
            return str(query)[:width]
    text = _normalize(query)
    known = _known_queries().get(text)
    if known:
        return known
    return text if len(text) <= width else text[: width - 3] + "..."


_NO_SEND = frozenset(
    {
        "_set_autocommit_gen",
        "_set_isolation_level_gen",
        "_set_read_only_gen",
        "_set_deferrable_gen",
        "_check_intrans_gen",
    }
)


def round_trip_label(gen: Any, conn: psycopg.BaseConnection) -> str | None:
    """What a round trip through ``Connection.wait`` sends, or None when it sends nothing."""
    name = getattr(gen, "__name__", "") or type(gen).__name__
    status = conn.pgconn.transaction_status
    if name in _NO_SEND:
        return None
    if name in ("_commit_gen", "_rollback_gen"):
        if status in (pq.TransactionStatus.IDLE, pq.TransactionStatus.UNKNOWN):
            return None
        return "COMMIT" if name == "_commit_gen" else "ROLLBACK"
    frame = getattr(gen, "gi_frame", None)
    local = frame.f_locals if frame is not None else {}
    tx = local.get("self")
    if isinstance(tx, BaseTransaction):
        if name == "_enter_gen":
            if status == pq.TransactionStatus.IDLE:
                return "BEGIN (transaction block)"
            return f"SAVEPOINT {tx.savepoint_name or '(nested transaction block)'}"
        if name == "_exit_gen":
            failed = local.get("exc_val") is not None or tx.force_rollback
            if not tx._outer_transaction:
                verb = "ROLLBACK TO SAVEPOINT" if failed else "RELEASE SAVEPOINT"
                return f"{verb} {tx.savepoint_name}"
            return f"{'ROLLBACK' if failed else 'COMMIT'} (end of transaction block)"
    return f"round trip {name.strip('_')}"


# ---------------------------------------------------------------------------------------
# The intercepted connection.
# ---------------------------------------------------------------------------------------


class Gated:
    """What a scheduled connection is, synchronous or asyncio: while a block runs, each server
    round trip of its worker's thread waits at the gate (:meth:`step`); outside a block (no
    seat), or called from another thread, it is a plain psycopg connection."""

    _seat: "_Worker | None" = None
    _in_step = False
    _block_settings = False  # a block's settings are on it (``Scheduler(keep_settings=True)``)

    def _seated(self) -> "_Worker | None":
        """The block's seat of the calling thread, when the call is to be scheduled."""
        seat = self._seat
        if seat is None or self._in_step or threading.current_thread() is not seat.thread:
            return None
        return seat

    @contextlib.contextmanager
    def step(self, label: str) -> Iterator[None]:
        """One scheduled step: wait for the grant, then run the body. Nested steps, calls from
        another thread and calls outside a block pass straight through."""
        seat = self._seated()
        if seat is None:
            yield
            return
        seat.block._gate(seat, label)
        self._in_step = True
        try:
            yield
        except psycopg.Error as e:
            seat.block._step_failed(seat, e)
            raise
        finally:
            self._in_step = False

    def at_rest(self, result: Any) -> Any:
        """What a call made between a block's steps gave (its settings, a rollback, a close):
        for the synchronous connection, the call's result itself."""
        return result

    def _lock_notice(self, diag: psycopg.errors.Diagnostic) -> None:
        seat = self._seat
        if seat is None:
            return
        m = NOTICE.match(diag.message_primary or "")
        if m:
            seat.block._lock_notice(seat, m["kind"], m["mode"], m["lock"])


class ScheduledConnection(Gated, psycopg.Connection):
    """A psycopg connection whose server round trips wait at a gate while a block runs.

    A subclass that must act at the instant a statement or COMMIT is scheduled (a fault armed
    on COMMIT) wraps its action in :meth:`step`::

        def commit(self):
            with self.step("COMMIT"):
                hook(self)
                super().commit()
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.cursor_factory = ScheduledCursor
        self.server_cursor_factory = ScheduledServerCursor
        self.add_notice_handler(self._lock_notice)

    def wait(self, gen: Any, *args: Any, **kwargs: Any) -> Any:
        label = round_trip_label(gen, self) if self._seated() else None
        if label is None:
            return super().wait(gen, *args, **kwargs)
        with self.step(label):
            return super().wait(gen, *args, **kwargs)


class AsyncScheduledConnection(Gated, psycopg.AsyncConnection):
    """The same for asyncio. A block runs each worker's operation on the worker's own thread,
    and the worker runs its coroutines to completion there on an event loop of its own: the
    gate holds that thread, and with it that worker's loop alone. Calls at rest run on the loop
    the connection was opened on (:meth:`at_rest`)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.cursor_factory = AsyncScheduledCursor
        self.server_cursor_factory = AsyncScheduledServerCursor
        self.add_notice_handler(self._lock_notice)
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    async def connect(cls, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        conn = await super().connect(*args, **kwargs)
        conn._loop = asyncio.get_running_loop()
        return conn

    async def wait(self, gen: Any, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        label = round_trip_label(gen, self) if self._seated() else None
        if label is None:
            return await super().wait(gen, *args, **kwargs)
        with self.step(label):
            return await super().wait(gen, *args, **kwargs)

    def at_rest(self, result: Any) -> Any:
        """A coroutine of this connection, run to its end on the connection's own loop (idle
        between a block's steps)."""
        return run_on(self._loop, result)


class ScheduledCalls:
    """A client of an external service (an HTTP API, a sink) whose every call is a step of the
    block its worker is in, like a statement: the call waits at the gate of ``conn_of()`` (the
    worker's connection now), labelled ``name.method(first argument)``, so the schedule decides
    when the service sees it. Outside a block, or from another thread, calls pass straight
    through. Attributes that are not methods are the client's own."""

    def __init__(self, inner: Any, conn_of: Any, name: str):
        self._inner, self._conn_of, self._name = inner, conn_of, name

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self._inner, attr)
        if not callable(value) or attr.startswith("_"):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            conn = self._conn_of()
            if not isinstance(conn, Gated):
                return value(*args, **kwargs)
            first = str(args[0]) if args else ""
            with conn.step(f"{self._name}.{attr}({first})"):
                return value(*args, **kwargs)

        return call


def run_on(loop: asyncio.AbstractEventLoop, value: Any) -> Any:
    """A coroutine's result, run to its end on ``loop``; any other value as is. Where this
    thread already runs a loop (another worker's, inside its COMMIT hook; Playwright's sync API,
    whose loop stays running while the browser kind's Chromium is kept for the run), ``loop``
    runs on a thread of its own and the caller waits for it: run here, it would refuse ("Cannot
    run the event loop while another loop is running"), and an async adapter's run after the
    browser kind failed with that as the implementation's bug."""
    if not inspect.isawaitable(value):
        return value
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return loop.run_until_complete(value)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = loop.run_until_complete(value)
        except BaseException as e:  # handed back to the caller's thread as is
            box["error"] = e

    thread = threading.Thread(target=target, name="knownstate-loop")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


@contextlib.contextmanager
def _cursor_step(cursor: Any, query: Any) -> Iterator[None]:
    conn = cursor.connection
    if isinstance(conn, Gated) and conn._seat is not None:
        with conn.step(statement_label(query)):
            yield
    else:
        yield


class ScheduledCursor(psycopg.Cursor):
    """The cursor of a :class:`ScheduledConnection`: each execute is one step, labelled."""

    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> "ScheduledCursor":
        with _cursor_step(self, query):
            return super().execute(query, params, **kwargs)

    def executemany(self, query: Any, params_seq: Any, **kwargs: Any) -> None:
        """One step for the whole batch (psycopg pipelines it)."""
        with _cursor_step(self, query):
            return super().executemany(query, params_seq, **kwargs)

    def stream(self, query: Any, params: Any = None, **kwargs: Any) -> Iterator[Any]:
        """One step for the whole stream."""
        with _cursor_step(self, query):
            yield from super().stream(query, params, **kwargs)

    @contextlib.contextmanager
    def copy(self, statement: Any, params: Any = None, **kwargs: Any) -> Iterator[Any]:
        """One step for the whole COPY."""
        with _cursor_step(self, statement), super().copy(statement, params, **kwargs) as cp:
            yield cp


class ScheduledServerCursor(psycopg.ServerCursor):
    """A named cursor: DECLARE is a labelled step, each FETCH a step of its own (through
    ``Connection.wait``)."""

    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> "ScheduledServerCursor":
        with _cursor_step(self, query):
            return super().execute(query, params, **kwargs)


class AsyncScheduledCursor(psycopg.AsyncCursor):
    """The cursor of an :class:`AsyncScheduledConnection`, as :class:`ScheduledCursor`."""

    async def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
        with _cursor_step(self, query):
            return await super().execute(query, params, **kwargs)

    async def executemany(self, query: Any, params_seq: Any, **kwargs: Any) -> None:
        with _cursor_step(self, query):
            return await super().executemany(query, params_seq, **kwargs)

    async def stream(self, query: Any, params: Any = None, **kwargs: Any) -> AsyncIterator[Any]:
        with _cursor_step(self, query):
            async for row in super().stream(query, params, **kwargs):
                yield row

    @contextlib.asynccontextmanager
    async def copy(self, statement: Any, params: Any = None, **kwargs: Any) -> AsyncIterator[Any]:
        with _cursor_step(self, statement):
            async with super().copy(statement, params, **kwargs) as cp:
                yield cp


class AsyncScheduledServerCursor(psycopg.AsyncServerCursor):
    """A named cursor of an :class:`AsyncScheduledConnection`, as :class:`ScheduledServerCursor`."""

    async def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
        with _cursor_step(self, query):
            return await super().execute(query, params, **kwargs)


def shutdown_socket(conn: psycopg.BaseConnection) -> None:
    """Cut a connection's socket from another thread, as a dying process would: a statement in
    flight on it fails at once. Never closes the psycopg object (its owner thread may be in it)."""
    with contextlib.suppress(Exception):
        s = socket.socket(fileno=os.dup(conn.pgconn.socket))
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        s.close()
