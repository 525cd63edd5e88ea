"""Calling a described kind's adapter: one door for its results and its errors.

A mixin of :class:`~.generic.GenericCheck`. :meth:`AdapterCalls._call` runs one of the
adapter's operations on the worker's connection (sync, async, or a driver of its own) and
says whether the library signalled a lost race (``Adapter.lost_race``); every other error
becomes the engine's: a lost connection (indeterminate when COMMIT was in flight, in
autocommit, or on a driver of its own), a statement the server refused, a call the driver
refused, or the adapter's own bug, reported as its own. It counts the statements a mutant's
edits of the SQL a library sends changed, and says when they changed nothing
(:meth:`AdapterCalls.not_applied`): such a mutant ran as the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from knownstate.impl.errors import (
    ClientError,
    CommitIndeterminate,
    ConnectionLost,
    KnownstateError,
    TransactionAborted,
    is_connection_error,
)

from .adapter import unwrap
from .check import Failure
from .harness import EnvironmentFault, WorkerDied

EDITED = "statement edited by the mutant"
"""The event of a statement a mutant's edit of the SQL a library sends (``sql_edits``) changed:
counted by its worker as psycopg converts it (:mod:`.adapter`), into the run's events by
:meth:`AdapterCalls._call`."""


class AdapterCalls:
    """The adapter's operations, called (``adapter``, ``adapter_class``, ``kind``, ``event``
    and ``fail`` are the check's)."""

    @classmethod
    def not_applied(cls, events) -> str:
        """Why this check, a mutant's that edits the SQL a library sends (``sql_edits``, and
        the schema by the same patterns), ran as the reference in a run that observed
        ``events``: its edits changed no statement the library sent (:data:`EDITED`) and not
        the schema. "" when they changed either, and for a check that edits no statement."""
        edits = getattr(cls, "sql_edits", None)
        if not edits or events.get(EDITED, 0) or cls.schema != cls.adapter_class.schema:
            return ""
        patterns = [f"'{pattern}'" for sent in edits.values() for pattern, _ in sent]
        # a driver of its own: none of its statements passes through psycopg, where edits apply
        own = " (the gate edits what psycopg sends; the adapter's driver is its own)"
        return (
            f"its edit (pattern {', '.join(patterns)}) matched no statement the library sent "
            f"for {' or '.join(edits)} and nothing in its schema"
        ) + (own if cls.adapter_class.mode() == "own" else "")

    def _call(
        self, worker, op: str, conn, *args, closes: bool = True, named: dict | None = None
    ) -> tuple[Any, bool]:
        """Run the adapter's ``op``: (its result, whether it signalled a lost race). Driver
        errors become the engine's: a lost connection (indeterminate when COMMIT was in
        flight, in autocommit, or on a driver of its own), a refused statement, a refused call."""
        fn = getattr(self.adapter, op)
        worker.op = op  # what a mutant's edits of the SQL it sends apply to
        try:
            result = worker.run(fn(conn, *args, **(named or {})))
        except (WorkerDied, EnvironmentFault, Failure, KnownstateError):
            raise
        except Exception as e:
            if self.adapter.lost_race.raised(e):
                worker.settle_after_error()
                return None, True
            raise self._translate(e, worker, op) from e
        finally:
            worker.op = None
            self.event(EDITED, worker.edited)
            worker.edited = 0
        if closes and worker.mode != "own" and worker.in_transaction():
            worker.abandon()
            self.fail(
                f"{op}: the adapter returned with its transaction still open: commit it "
                "(or use conn.transaction())"
            )
        return result, self.adapter.lost_race.returned(result)

    def _translate(self, e: BaseException, worker, op: str) -> BaseException:
        where = f"{self.kind}.{op}"
        pg = unwrap(e)
        text = str(pg or e).strip().splitlines()[0] if str(pg or e).strip() else type(e).__name__
        if pg is not None and is_connection_error(pg):
            conn = worker.conn
            if (
                worker.mode == "own"
                or getattr(conn, "in_commit", False)
                or getattr(conn, "autocommit", False)
            ):
                return CommitIndeterminate(f"{where}: {text}")
            return ConnectionLost(f"{where}: {text}")
        if pg is not None and not pg.sqlstate:
            return ClientError(f"{where}: {type(pg).__name__}: {text}")
        if pg is not None:
            return TransactionAborted(f"{where}: {pg.sqlstate} {text}")
        if isinstance(e, self.adapter_class.connection_errors):
            return CommitIndeterminate(f"{where}: {type(e).__name__}: {text}")
        worker.abandon()
        self.fail(f"{op}: the adapter raised {type(e).__name__}: {text}")


@dataclass(frozen=True, eq=False)
class Counted:
    """A reaper's answer that says how many runs it took back (``n``), or nothing (None), not
    which: equal to any model answer that took that many (or any). The rows read back decide."""

    n: int | None

    def __eq__(self, other: object) -> bool:
        if isinstance(other, tuple):
            return self.n is None or self.n == len(other)
        return isinstance(other, Counted) and other.n == self.n

    def __hash__(self) -> int:
        return hash(self.n)
