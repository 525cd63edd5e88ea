"""The intercepted connection of a concurrent block (:mod:`.scheduler` has the theory of
operation): a psycopg connection whose every server round trip waits at a gate, and the short
label of each step (which statement it is)."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from functools import cache
from importlib import resources
from typing import TYPE_CHECKING, Any, Iterator

import psycopg
from psycopg import pq

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


def _round_trip_label(gen: Any, conn: psycopg.Connection) -> str | None:
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
    if isinstance(tx, psycopg.Transaction):
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


class ScheduledConnection(psycopg.Connection):
    """A psycopg connection whose server round trips wait at a gate while a block runs.

    Outside a block (no scheduler attached, or a call from another thread) it is a plain
    psycopg connection. A subclass that must act at the instant a statement or COMMIT is
    scheduled (a fault armed on COMMIT) wraps its action in :meth:`step`::

        def commit(self):
            with self.step("COMMIT"):
                hook(self)
                super().commit()
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.cursor_factory = ScheduledCursor
        self.server_cursor_factory = ScheduledServerCursor
        self._seat: _Worker | None = None
        self._in_step = False
        self.add_notice_handler(self._lock_notice)

    @contextlib.contextmanager
    def step(self, label: str) -> Iterator[None]:
        """One scheduled step: wait for the grant, then run the body. Nested steps, calls from
        another thread and calls outside a block pass straight through."""
        seat = self._seat
        if seat is None or self._in_step or threading.current_thread() is not seat.thread:
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

    def wait(self, gen: Any, *args: Any, **kwargs: Any) -> Any:
        seat = self._seat
        if seat is None or self._in_step or threading.current_thread() is not seat.thread:
            return super().wait(gen, *args, **kwargs)
        label = _round_trip_label(gen, self)
        if label is None:
            return super().wait(gen, *args, **kwargs)
        with self.step(label):
            return super().wait(gen, *args, **kwargs)

    def _lock_notice(self, diag: psycopg.errors.Diagnostic) -> None:
        seat = self._seat
        if seat is None:
            return
        m = NOTICE.match(diag.message_primary or "")
        if m:
            seat.block._lock_notice(seat, m["kind"], m["mode"], m["lock"])


@contextlib.contextmanager
def _cursor_step(cursor: psycopg.Cursor | psycopg.ServerCursor, query: Any) -> Iterator[None]:
    conn = cursor.connection
    if isinstance(conn, ScheduledConnection) and conn._seat is not None:
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


def shutdown_socket(conn: psycopg.Connection) -> None:
    """Cut a connection's socket from another thread, as a dying process would: a statement in
    flight on it fails at once. Never closes the psycopg object (its owner thread may be in it)."""
    with contextlib.suppress(Exception):
        s = socket.socket(fileno=os.dup(conn.pgconn.socket))
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        s.close()
