"""Reference worker loops: the processes that run durable work, as they would be deployed.

Theory of operation
-------------------

A store (``impl/<kind>.py``) is one transaction per operation on a connection the caller owns.
A loop is what calls them forever: it finds work with a read (``sql/loops.sql``), acts on it
through the store, and paces itself. The outbox's loop is
:class:`knownstate.impl.outbox.OutboxWorker`; this module holds the others:

:class:`PlanExecutor`
    approved-plan executor: claims one approved plan (``mark_executing``, which hands out the
    claim token), then runs each step in payload order under the token (a step stamps the
    heartbeat itself; one step in three is a long one, which renews the heartbeat halfway).
    A step that loses its connection is retried *as the same step*: its
    identity is its position in the frozen payload, so a retry of a step that did commit is
    answered from its receipt. A fenced heartbeat or step (the run is no longer executing under
    this token) ends the run for this executor: somebody healed it, and nothing it does counts.
:class:`PlanReader`
    what reads runs: a status page polling the executing ones (each read heals a stale run, the
    approved plan's only reaper) and repeated execute requests on finished ones (answered from
    receipts).
:class:`ResetPoller`
    branch-reset worker: starts queued runs (claim + create the external operation once) and
    polls the running runs it started; it never polls another worker's run, so a dead owner's
    lease lapses and the reaper ends its run.
:class:`Periodic`
    a reaper job: one store operation every interval (outbox ``reclaim_stale``, branch-reset
    ``reap``).

Every loop owns one connection, opened lazily and dropped after any error, so the next turn
reconnects; an error never ends a loop (:meth:`Loop.run` counts it). Stopping is an event the
loop checks between operations, so a stop never cuts a transaction in half; a loop told to stop
in the middle of a plan leaves it executing, exactly as a process that dies would, and the run
is healed by the next read once its heartbeat is stale.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

import psycopg

from knownstate.model.contract import Outcome, Won

from . import queries
from .errors import ExternalCallFailed, KnownstateError, boundary

QUERIES = queries.load("loops.sql")

Connect = Callable[[], psycopg.Connection]


@dataclass
class Stats:
    turns: int = 0
    claimed: int = 0
    done: int = 0  # steps run, polls that moved a run, runs reaped
    fenced: int = 0  # operations the fence (or a lost race) refused
    errors: int = 0


class Loop:
    """One connection, lazily opened, and the run-until-stopped loop around :meth:`run_once`."""

    autocommit = False

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
        """A read from ``sql/loops.sql``, its transaction ended at once (no lock is kept)."""
        conn = self.conn()
        with boundary(f"loops.{name}"):
            rows = conn.execute(QUERIES[name], params).fetchall()
            if not conn.autocommit:
                conn.rollback()
        return rows

    def run_once(self) -> int:
        """One turn; returns how much work it found (0: idle until the next turn)."""
        raise NotImplementedError

    def run(self) -> None:
        while not self.stop.is_set():
            self.stats.turns += 1
            try:
                busy = self.run_once()
            except KnownstateError:
                self.stats.errors += 1
                self.drop()
                busy = 0
            if not busy:
                self.stop.wait(self.idle)
        self.drop()


class PlanExecutor(Loop):
    """The approved-plan executor (see the module docstring). ``pace``: seconds a step prepares
    (twice that for a long one, steps 2, 5, ...); ``retries``: how often one step is retried
    after lost connections before the executor gives the run up to the lazy heal."""

    def __init__(
        self,
        connect: Connect,
        store,
        stop: threading.Event | None = None,
        *,
        idle: float = 0.1,
        pace: float = 0.1,
        batch: int = 5,
        retries: int = 30,
    ):
        super().__init__(connect, stop, idle)
        self.store, self.pace, self.batch, self.retries = store, pace, batch, retries

    def run_once(self) -> int:
        for pid, n_steps in self.find("plans_ready", n=self.batch):
            claimed = self.store.mark_executing(self.conn(), pid)
            if isinstance(claimed, Won):
                self.stats.claimed += 1
                self.execute(pid, n_steps, claimed.value)
                return 1
            self.stats.fenced += 1
        return 0

    def execute(self, pid: int, n_steps: int, token: int) -> None:
        step, failures = 0, 0
        while step < n_steps:
            if self.stop.wait(self.pace):
                return
            try:
                if step % 3 == 2:  # a long step: renew the lease halfway through its preparation
                    beat = self.store.heartbeat(self.conn(), pid, token)
                    if not isinstance(beat, Won):
                        self.stats.fenced += 1
                        return
                    if self.stop.wait(self.pace):
                        return
                out = self.store.run_step(self.conn(), pid, step, token)
            except KnownstateError:
                self.stats.errors += 1
                self.drop()
                failures += 1
                if failures > self.retries:
                    return
                continue  # the same step again: a retry of a committed step finds its receipt
            if not isinstance(out, Won):
                self.stats.fenced += 1
                return
            self.stats.done += 1
            if not out.value.ok:
                return  # the run failed at this step: no step after it runs
            step += 1


class PlanReader(Loop):
    """Reads executing runs (healing stale ones) and repeats execute requests on finished ones."""

    def __init__(
        self,
        connect: Connect,
        store,
        stop: threading.Event | None = None,
        *,
        idle: float = 0.3,
        repeats: int = 2,
    ):
        super().__init__(connect, stop, idle)
        self.store, self.repeats = store, repeats

    def run_once(self) -> int:
        for (pid,) in self.find("plans_executing", n=50):
            self.store.read(self.conn(), pid)
        for (pid,) in self.find("plans_finished", n=self.repeats):
            self.store.repeat(self.conn(), pid)
        return 0


class ResetPoller(Loop):
    """Starts queued branch resets and polls the running ones it started."""

    def __init__(
        self,
        connect: Connect,
        store,
        stop: threading.Event | None = None,
        *,
        idle: float = 0.3,
        batch: int = 3,
    ):
        super().__init__(connect, stop, idle)
        self.store, self.batch = store, batch

    def _call(self, op: Callable[[], Outcome]) -> Outcome | None:
        try:
            return op()
        except ExternalCallFailed:  # the store rolled back; the run is as it was
            self.stats.errors += 1
            return None

    def run_once(self) -> int:
        started = 0
        for (run_id,) in self.find("resets_queued", n=self.batch):
            out = self._call(lambda run_id=run_id: self.store.start(self.conn(), run_id))
            if isinstance(out, Won):
                self.stats.claimed += 1
                started += 1
            elif out is not None:
                self.stats.fenced += 1
        for (run_id,) in self.find("resets_mine", worker=self.store.worker):
            out = self._call(lambda run_id=run_id: self.store.poll(self.conn(), run_id))
            if isinstance(out, Won):
                self.stats.done += 1
            elif out is not None:
                self.stats.fenced += 1
        return started


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
