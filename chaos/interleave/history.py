"""What a concurrent block did, and the block as a history for the linearizability checker
(:mod:`knownstate.chaos.linearize`): the operations started together, what became of each, the
schedule taken and its readable trace."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import psycopg

from .connection import ScheduledConnection

# ---------------------------------------------------------------------------------------
# Operations and what became of them.
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Op:
    """One operation of a block: ``run(conn)`` on ``worker``'s own connection, on a thread."""

    worker: str
    label: str
    conn: ScheduledConnection
    run: Callable[[ScheduledConnection], Any]


@dataclass(frozen=True)
class OpResult:
    """What an operation of a block did: returned ``value`` or raised ``error``."""

    worker: str
    label: str
    value: Any = None
    error: BaseException | None = None
    statements: int = 0
    returned_at: int = 0
    """The step after which the operation had ended (0: before the first step)."""
    left_open: bool = False
    """The operation ended with its transaction still open on its connection."""

    @property
    def server_error(self) -> psycopg.Error | None:
        """The server's error behind ``error`` (its cause chain), if any."""
        seen: set[int] = set()
        e = self.error
        while e is not None and id(e) not in seen:
            seen.add(id(e))
            if isinstance(e, psycopg.Error):
                return e
            e = e.__cause__ or e.__context__
        return None

    @property
    def sqlstate(self) -> str | None:
        """The SQLSTATE of the server's error behind ``error``, if any."""
        e = self.server_error
        return e.sqlstate if e is not None else None

    @property
    def transient(self) -> bool:
        """Aborted by the server as a deadlock victim (40P01) or a serialization failure
        (40001): nothing of it committed, and a caller may retry it."""
        return self.sqlstate in ("40P01", "40001")

    def describe(self) -> str:
        if self.error is None:
            return f"{self.worker} {self.label} -> {short(repr(self.value))}"
        name = type(self.error).__name__
        if self.lost_connection:
            # How a lost connection is worded (the socket closed, or the server said it was
            # exiting first) depends on timing: the trace says what happened, not the words.
            return f"{self.worker} {self.label} raised {name} (the connection was lost)"
        server = self.server_error
        cause = server if server is not None else self.error
        text = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
        state = f"{server.sqlstate} " if server is not None and server.sqlstate else ""
        return f"{self.worker} {self.label} raised {name} ({state}{short(text)})"

    @property
    def lost_connection(self) -> bool:
        from knownstate.impl.errors import CommitIndeterminate, ConnectionLost, is_connection_error

        if isinstance(self.error, (ConnectionLost, CommitIndeterminate)):
            return True
        server = self.server_error
        return server is not None and is_connection_error(server)


@dataclass(frozen=True)
class BlockResult:
    """The outcome of every operation, the schedule taken and the readable trace."""

    ops: tuple[OpResult, ...]
    schedule: tuple[str, ...]
    """Which worker each step granted, in order: the same choices give the same schedule."""
    trace: tuple[str, ...]
    waits: int = 0
    """How many times a worker's statement waited on another's lock (seen by the server)."""

    @property
    def steps(self) -> int:
        return len(self.schedule)

    def overlapped(self, a: str, b: str) -> bool:
        """Whether workers ``a`` and ``b`` raced: one ran a step between the other's first and
        last steps (run one after the other, or one of them without a step, they did not)."""
        mine = [i for i, n in enumerate(self.schedule) if n == a]
        theirs = [i for i, n in enumerate(self.schedule) if n == b]
        return bool(mine and theirs) and mine[0] < theirs[-1] and theirs[0] < mine[-1]

    def by_worker(self) -> dict[str, OpResult]:
        return {r.worker: r for r in self.ops}


def short(text: str, width: int = 100) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


# ---------------------------------------------------------------------------------------
# A block as a history for the linearizability checker.
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Raised:
    """An operation ended with an error the model has no outcome for (a refused statement,
    a crash of the implementation): no model outcome equals it, so the check names it."""

    error: str
    sqlstate: str | None
    message: str


def history(
    result: BlockResult,
    model_ops: Any,
    *,
    start: float = 0,
    keys: Any = None,
    no_effect: tuple[type[BaseException], ...] | None = None,
    maybe: tuple[type[BaseException], ...] | None = None,
) -> list:
    """The block's operations as a :mod:`knownstate.chaos.linearize` history.

    ``model_ops[worker]`` applies the worker's operation to a model and returns its outcome;
    ``keys[worker]`` is its part for a partitioned check. All operations are called together
    at ``start``; each returns after the step it ended at. By what became of it, an operation

    * returned a value: that is its observed outcome;
    * was aborted by the server as a deadlock victim or a serialization failure (40P01, 40001),
      or raised one of ``no_effect`` (default ``ConnectionLost``: nothing committed): it did not
      happen, and is left out;
    * raised one of ``maybe`` (default ``CommitIndeterminate``, or a raw connection error):
      indeterminate, it may or may not have happened;
    * raised anything else: its outcome is :class:`Raised`, which no model outcome equals.
    """
    from knownstate.impl.errors import CommitIndeterminate, ConnectionLost

    from ..linearize import UNKNOWN, Operation

    no_effect = (ConnectionLost,) if no_effect is None else no_effect
    maybe = (CommitIndeterminate, psycopg.OperationalError) if maybe is None else maybe
    out = []
    for r in result.ops:
        ret: float | None = start + r.returned_at + 1
        output: Any = r.value
        if r.error is not None:
            if r.transient or isinstance(r.error, no_effect):
                continue
            if isinstance(r.error, maybe):
                ret, output = None, UNKNOWN
            else:
                server = r.server_error
                text = str(server if server is not None else r.error).strip()
                output = Raised(
                    type(r.error).__name__,
                    r.sqlstate,
                    short(text.splitlines()[0] if text else "", 120),
                )
        out.append(
            Operation(
                r.worker,
                r.label,
                model_ops[r.worker],
                start,
                ret,
                output,
                None if keys is None else keys[r.worker],
            )
        )
    return out
