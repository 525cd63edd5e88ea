"""Reference worker loops: the processes that run durable work, as they would be deployed.

Theory of operation
-------------------

A store (``impl/<kind>.py``) is one transaction per operation on a connection the caller owns.
A loop is what calls them forever: it finds work with a read (a named query of its kind's SQL),
acts on it through the store, and paces itself. This module holds what every loop shares,
:class:`Loop` (and :class:`StoreLoop`, a loop around a kind's store), and the one loop that
is no kind's own:

:class:`Periodic`
    a reaper job: one store operation every interval (outbox ``reclaim_stale``, branch-reset
    ``reap``).

Each kind's loop lives with its store: :class:`knownstate.impl.outbox.OutboxWorker`,
:class:`knownstate.impl.approved_plan.PlanExecutor` and
:class:`~knownstate.impl.approved_plan.PlanReader`,
:class:`knownstate.impl.branch_reset.ResetPoller`.

Every loop owns one connection, opened lazily and dropped after any error, so the next turn
reconnects; an error never ends a loop (:meth:`Loop.run` counts it). Stopping is an event the
loop checks between operations, so a stop never cuts a transaction in half; a loop told to stop
in the middle of a plan leaves it executing, exactly as a process that dies would, and the run
is healed by the next read once its heartbeat is stale.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, ClassVar

import psycopg

from knownstate.model.contract import Outcome, Won

from .errors import KnownstateError, boundary

Connect = Callable[[], psycopg.Connection]


@dataclass
class Stats:
    turns: int = 0
    claimed: int = 0
    done: int = 0  # steps run, effects sent, polls that moved a run, runs reaped
    failed: int = 0  # effects answered not-ok, recorded for a retry or as failed
    fenced: int = 0  # operations the fence (or a lost race) refused
    errors: int = 0


class Loop:
    """One connection, lazily opened, and the run-until-stopped loop around :meth:`run_once`.
    ``queries``: the named SQL its reads (:meth:`find`) come from, its kind's."""

    autocommit = False
    queries: ClassVar[dict[str, str]] = {}

    def __init__(self, connect: Connect, stop: threading.Event | None = None, idle: float = 0.1):
        self.connect, self.idle = connect, idle
        self.stop = stop or threading.Event()
        self._conn: psycopg.Connection | None = None
        self.stats = Stats()

    def conn(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed or self._conn.broken:
            with boundary("connect"):
                self._conn = self.connect()
                self._conn.autocommit = self.autocommit
        return self._conn

    def drop(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except psycopg.Error:
                pass
        self._conn = None

    def find(self, name: str, **params) -> list[tuple]:
        """A read (one of ``queries``), its transaction ended at once (no lock is kept)."""
        conn = self.conn()
        with boundary(f"loops.{name}"):
            rows = conn.execute(self.queries[name], params).fetchall()
            if not conn.autocommit:
                conn.rollback()
        return rows

    def run_once(self) -> int:
        """One turn; returns how much work it found (0: idle until the next turn)."""
        raise NotImplementedError

    def turn(self) -> int:
        """:meth:`run_once`, an error counted (the connection dropped, the turn idle)."""
        self.stats.turns += 1
        try:
            return self.run_once()
        except KnownstateError:
            self.stats.errors += 1
            self.drop()
            return 0

    def run(self) -> None:
        while not self.stop.is_set():
            if not self.turn():
                self.stop.wait(self.idle)
        self.drop()


class StoreLoop(Loop):
    """A kind's own loop around its store (``impl/<kind>.py``). Its knobs are numbers, class
    attributes with their defaults (``idle`` among them); a keyword of the constructor sets one for
    this loop, e.g. ``PlanExecutor(connect, store, stop, pace=0.2)``. An unknown keyword is a
    ``TypeError``, as an unknown parameter would be."""

    idle = 0.1

    def __init__(self, connect: Connect, store, stop: threading.Event | None = None, **knobs):
        unknown = [k for k in knobs if not isinstance(getattr(type(self), k, None), int | float)]
        if unknown:
            raise TypeError(f"{type(self).__name__} has no knob {', '.join(unknown)}")
        super().__init__(connect, stop, knobs.pop("idle", self.idle))
        self.store = store
        for name, value in knobs.items():
            setattr(self, name, value)


class Periodic(Loop):
    """A reaper job: ``operation(conn)`` every ``idle`` seconds."""

    def __init__(
        self,
        connect: Connect,
        operation: Callable[[psycopg.Connection], Outcome],
        stop: threading.Event | None = None,
        *,
        idle: float = 0.5,
        autocommit: bool = False,
    ):
        super().__init__(connect, stop, idle)
        self.operation, self.autocommit = operation, autocommit

    def run_once(self) -> int:
        out = self.operation(self.conn())
        if isinstance(out, Won) and out.value:
            self.stats.done += len(out.value)
        return 0
