"""Deterministic statement-level interleaving of concurrent operations on real PostgreSQL.

Theory of operation
-------------------

A *block* starts two or three operations together, each on its own thread and its own
connection (in the check, each worker's connection goes through its own Toxiproxy link). The
operations are the implementation's own code, unchanged: what is intercepted is the
connection. A :class:`ScheduledConnection` (for asyncio, an :class:`AsyncScheduledConnection`,
whose worker runs its coroutines on a loop of its own on that thread) stops every server round
trip of its worker's thread at a *gate* until the scheduler grants it:

* every ``Cursor.execute`` / ``executemany`` / ``stream`` / ``copy`` (so ``conn.execute``,
  ``conn.cursor().execute`` and server-side cursors too),
* ``commit()`` and ``rollback()`` (so :func:`knownstate.impl.errors.commit`), skipped when the
  connection has no transaction and psycopg sends nothing,
* the BEGIN / SAVEPOINT and the COMMIT / RELEASE / ROLLBACK of a ``conn.transaction()`` block,
* and, as a safety net, any other round trip psycopg makes through ``Connection.wait``.

One gate is one *step*. Each time every worker has come to rest, the scheduler asks the
caller's ``choose(options)`` which parked worker runs its next statement; in a check that is
``data.draw(st.sampled_from(options))``, so the interleaving is part of the Hypothesis
example: drawn from the seed, replayed exactly, and shrunk (towards running the first worker
as far as it can, i.e. towards the sequential schedule).

Coming to rest
    After each step the scheduler waits until every worker is *parked* at its next gate,
    *done*, or *blocked*. Blocked is read from the server, on a separate observer connection:
    ``pg_blocking_pids(pid)`` is non-empty and ``pg_locks`` names the lock it waits for. It is
    never guessed from a timeout. A blocked statement stays in flight and completes when the
    holder commits or aborts; the scheduler simply offers the other workers meanwhile.

Deterministic deadlock victims
    The server looks for a deadlock only when a waiter's ``deadlock_timeout`` expires, and the
    waiter that runs the check is the victim. Left alone, the victim would depend on which
    timer fires first after the cycle forms: on machine load. So each worker session runs with
    ``deadlock_timeout = 1ms`` and ``log_lock_waits = on`` and receives LOG messages
    (``client_min_messages = log``): after its check a waiter sends its client
    ``still waiting for <lock>``. A worker counts as blocked only once that notice for the lock
    ``pg_locks`` shows has arrived, i.e. once its one deadlock check has run. Every earlier waiter
    has therefore already checked when the next statement is scheduled, and the statement that
    closes a cycle is always the one that finds it: the victim is the closer, for a given schedule.
    The victim's operation receives ``40P01`` like any other outcome (the implementation's error
    boundary makes it ``TransactionAborted``); so does a serialization failure (``40001``).

    The server runs under libfaketime, and that bends its timers. A backend arms a timeout in
    faked time (``now() + deadlock_timeout``) but waits for the lock inside libfaketime's
    ``epoll_wait`` wrapper, which stops faking while it blocks, so the SIGALRM handler compares
    that deadline with *real* time. Measured here (PostgreSQL 15, libfaketime 0.9.10): with the
    fake clock 2 s ahead, a 1 ms ``deadlock_timeout`` fires after 2.0 s; 300 s ahead, after
    300 s; 30 s behind, after 7 ms. So the fake clock must be at or behind real time while a
    block runs: the harness should keep its base in the past (a day back) and jump from there.
    A block refuses to start when the server's clock is ahead (:class:`ClockAhead`) rather than
    hang. (The same bends ``lock_timeout`` and ``statement_timeout``: ahead they fire late,
    behind they fire at the first alarm of any timer; so a block switches both off for its
    sessions, and ``RESET`` afterwards restores the connection's own values.) Nothing here waits
    for a time: the scheduler waits for the notice, and faults run only at rest, when no
    deadlock check is pending.

Faults inside a block
    :meth:`Block.fault` runs an action between two steps (a link cut, a database crash while a
    lock is held, a clock jump) and names the workers whose backends it kills. Such a backend
    becomes a *ghost*: the scheduler waits until the server has let it go (or until it waits on
    a lock itself, holding what it holds) before the next step, so what a lost worker's locks do
    to the others is decided by the schedule, not by how fast the server notices.

One backend at a time
    A step can release several waiters at once (a COMMIT frees two workers queued on its rows;
    a row update frees the waiter queued on the row's tuple lock). Run together, they would race
    on the row's next version and the server, not the schedule, would pick the winner. On a
    server on this machine (``Scheduler(pause=True)``: the harness's own cluster) every backend
    resting in a lock wait, asleep in the server's wait loop, is stopped (SIGSTOP) before a step;
    whatever the step releases stays stopped, and is let go (SIGCONT) one backend at a time, in
    worker order, each until it rests again. Without it, the trace notes which ran together.

What is not a step
    Rows fetched from a client-side cursor (already on the client), ``close()``, and anything
    outside ``Connection.wait`` (connecting, cancelling). A statement that runs long without
    waiting on a lock is waited for, up to the block's deadline.

Threads
    Nothing outlives a block: :meth:`Block.close` (also on an exception, e.g. Hypothesis
    stopping mid-draw) continues every stopped backend, raises :class:`BlockAborted` in every
    parked worker, cuts the socket of every worker still in flight or holding a transaction,
    joins every thread, closes those connections, and ends their backends.
    A worker that neither parks, finishes nor waits on a lock within the deadline is an
    environment error (:class:`WorkerStuck`), never a verdict.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import psycopg
from psycopg import pq

from knownstate.impl.errors import first_line

from .connection import Gated, shutdown_socket
from .history import BlockResult, Op, OpResult
from .server import (
    POLL,
    Activity,
    Observer,
    WorkerStuck,
    apply_settings,
    check_backend,
    reset_settings,
)

DEADLINE_SECONDS = 60.0
"""How long a worker may stay in flight (neither parked, done nor blocked on a lock) before the
block is an environment error. Generous: it only bounds a broken environment."""

MAX_STEPS = 400
"""More steps than this in one block is a runaway operation (:class:`Runaway`)."""

PARKED, RUNNING, DONE = "parked", "running", "done"


class BlockAborted(BaseException):
    """Raised inside a worker's operation at its gate when the block is torn down."""


class Runaway(AssertionError):
    """An operation of a concurrent block kept issuing statements past the block's step limit."""


# ---------------------------------------------------------------------------------------
# The scheduler and its blocks.
# ---------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Worker:
    block: "Block"
    op: Op
    pid: int
    thread: threading.Thread | None = None
    state: str = RUNNING
    pending: str | None = None
    granted: bool = False
    statements: int = 0
    notice: tuple[str, str, str] | None = None  # (kind, mode, lock) of its last lock notice
    blocked_by: tuple[str, ...] = ()
    waits_for: str = ""
    failed: str = ""  # the server error its last statement met, for the trace
    value: Any = None
    error: BaseException | None = None
    done_at: int | None = None

    @property
    def name(self) -> str:
        return self.op.worker


@dataclass(eq=False)
class _Ghost:
    name: str
    pid: int
    blocked: bool = False


class Scheduler:
    """Runs blocks of concurrent operations. ``observer_dsn`` is a direct connection to the
    same server (never through a proxy): the scheduler reads lock waits on it, and reconnects
    after a database crash (:class:`~.server.Observer`, which also holds ``clock_guard``)."""

    def __init__(
        self,
        observer_dsn: str,
        *,
        deadline_s: float = DEADLINE_SECONDS,
        max_steps: int = MAX_STEPS,
        clock_guard: bool = True,
        pause: bool = False,
        gone: Callable[[], bool] | None = None,
        keep_settings: bool = False,
    ):
        self.observer = Observer(
            observer_dsn, deadline_s=deadline_s, clock_guard=clock_guard, gone=gone
        )
        self.pause = pause
        """Stop and continue backends (SIGSTOP, SIGCONT) so that at most one runs at a time:
        needs the server on this machine, run by this user or one it may signal (the harness's
        own cluster). Without it, waiters that one step releases together run together."""
        self.deadline_s = deadline_s
        self.max_steps = max_steps
        self.keep_settings = keep_settings
        """Set a block's session settings once per connection and leave them on it after the
        block, instead of setting them at every block and restoring the connection's own after
        it: for a caller that owns its connections and runs nothing on them that the settings
        change (the check's workers; the settings only matter while a statement waits on a
        lock). Saves the round trips that set and restore them (three each) per connection per
        block."""

    def block(self, ops: Sequence[Op]) -> "Block":
        """Start ``ops`` together; use as a context manager (it always cleans up)."""
        return Block(self, ops)

    def run(
        self,
        ops: Sequence[Op],
        choose: Callable[[list[str]], str],
        *,
        between: Callable[["Block"], None] | None = None,
    ) -> BlockResult:
        """Start ``ops`` together, let ``choose`` pick each next step, return what happened.
        ``between(block)`` runs at rest before each choice (the engine's faults)."""
        with self.block(ops) as block:
            return block.run(choose, between=between)

    def close(self) -> None:
        self.observer.close()


class Block:
    """A running block of concurrent operations. Drive it with :meth:`run`, or step by step:

    ``options()`` (the parked workers), ``step(worker)``, ``fault(...)`` at rest, ``result()``.
    Always a context manager: leaving it ends every thread (:meth:`close`)."""

    def __init__(self, scheduler: Scheduler, ops: Sequence[Op]):
        names = [op.worker for op in ops]
        if len(set(names)) != len(names):
            raise ValueError(f"a block runs one operation per worker, got workers {names}")
        self.scheduler = scheduler
        self._cv = threading.Condition()
        self._workers: list[_Worker] = []
        self._ghosts: list[_Ghost] = []
        self._schedule: list[str] = []
        self._trace: list[str] = ["block: " + " | ".join(f"{op.worker} {op.label}" for op in ops)]
        self._aborting = False
        self._closed = False
        self._paused: set[int] = set()
        self._seen: dict[str, tuple] = {}
        self._waits = 0
        try:
            scheduler.observer.check_clock()
            for op in ops:
                self._prepare(op)
            for w in self._workers:
                w.thread = threading.Thread(
                    target=self._main, args=(w,), daemon=True, name=f"knownstate-{w.name}"
                )
                w.op.conn._seat = w
            for w in self._workers:
                w.thread.start()
            self._settle()
            self._note_changes()
        except BaseException:
            self.close()
            raise

    # -- set up and tear down ------------------------------------------------------------------
    def _prepare(self, op: Op) -> None:
        conn = op.conn
        if not isinstance(conn, Gated):
            raise TypeError(
                f"{op.worker}: a block needs a ScheduledConnection (or AsyncScheduledConnection), "
                f"got {type(conn).__name__}: connect with ScheduledConnection.connect()"
            )
        if conn.closed or conn.broken:
            raise ValueError(f"{op.worker}: its connection is closed; reconnect before the block")
        if conn._seat is not None:
            raise ValueError(f"{op.worker}: its connection is already in a running block")
        if conn.pgconn.transaction_status != pq.TransactionStatus.IDLE:
            raise ValueError(
                f"{op.worker}: its connection has a transaction open; a block starts "
                "whole operations on idle connections"
            )
        if not (self.scheduler.keep_settings and conn._block_settings):
            apply_settings(conn, op.worker)
            conn._block_settings = self.scheduler.keep_settings
        self._workers.append(_Worker(self, op, conn.info.backend_pid))

    def __enter__(self) -> "Block":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """End the block: every thread joined, every connection at rest or closed. After an abort
        (an exception, e.g. Hypothesis stopping mid-draw, or leaving early) the connections of
        the workers that were still running, or held a transaction open, are closed and their
        backends gone: reconnect them."""
        if self._closed:
            return
        self._closed = True
        self._resume_all()
        live = [w for w in self._workers if w.thread is not None and w.thread.is_alive()]
        if live:
            with self._cv:
                self._aborting = True
                self._cv.notify_all()
            cut = [w for w in self._workers if w in live or self._open(w)]
            for w in cut:
                shutdown_socket(w.op.conn)
            deadline = time.monotonic() + 10
            for w in live:
                w.thread.join(max(0.0, deadline - time.monotonic()))
            stuck = [w.name for w in live if w.thread.is_alive()]
            for w in self._workers:
                w.op.conn._seat = None
            for w in cut:
                if not w.thread.is_alive():  # its thread is gone: closing is safe now
                    with contextlib.suppress(Exception):
                        w.op.conn.at_rest(w.op.conn.close())
            if stuck:
                raise WorkerStuck(
                    f"worker threads {stuck} did not end within 10 s of the block's "
                    "abort: an operation is stuck outside the database"
                )
            self._await_gone([w.pid for w in cut])
            return
        for w in self._workers:
            w.op.conn._seat = None
            conn = w.op.conn
            if not conn.closed and conn.pgconn.transaction_status == pq.TransactionStatus.INERROR:
                with contextlib.suppress(psycopg.Error):
                    conn.at_rest(conn.rollback())  # the server already aborted it: nothing to lose
            if not self.scheduler.keep_settings:
                reset_settings(conn)

    @staticmethod
    def _open(w: _Worker) -> bool:
        status = w.op.conn.pgconn.transaction_status
        return status in (
            pq.TransactionStatus.INTRANS,
            pq.TransactionStatus.INERROR,
            pq.TransactionStatus.ACTIVE,
        )

    def _await_gone(self, pids: list[int]) -> None:
        self.scheduler.observer.terminate(pids)
        deadline = time.monotonic() + self.scheduler.deadline_s
        while left := self.scheduler.observer.observe(pids):
            if time.monotonic() > deadline:
                raise WorkerStuck(
                    f"backends {sorted(left)} of an aborted block did not go away "
                    f"within {self.scheduler.deadline_s:.0f} s"
                )
            time.sleep(POLL)  # polling the server with a deadline

    # -- the worker side -------------------------------------------------------------------------
    def _main(self, w: _Worker) -> None:
        try:
            w.value = w.op.run(w.op.conn)
        except BaseException as e:  # an outcome of the operation, never of this thread
            w.error = e
        finally:
            with self._cv:
                w.state, w.pending, w.blocked_by = DONE, None, ()
                w.done_at = len(self._schedule)
                conn = w.op.conn
                if (conn.closed or conn.broken) and all(g.pid != w.pid for g in self._ghosts):
                    self._ghosts.append(_Ghost(w.name, w.pid))  # the server may still hold it
                self._cv.notify_all()

    def _gate(self, w: _Worker, label: str) -> None:
        with self._cv:
            if self._aborting:
                raise BlockAborted(f"{w.name}: the block was torn down")
            w.state, w.pending = PARKED, label
            w.blocked_by, w.notice = (), None
            self._cv.notify_all()
            while not w.granted:
                if self._aborting:
                    raise BlockAborted(f"{w.name}: the block was torn down before {label}")
                self._cv.wait()
            w.granted = False
            w.state = RUNNING
            w.statements += 1

    def _step_failed(self, w: _Worker, e: psycopg.Error) -> None:
        from knownstate.impl.errors import is_connection_error

        with self._cv:
            if is_connection_error(e):  # its wording depends on timing, not on the schedule
                w.failed = "a lost connection"
                return
            text = first_line(e)
            w.failed = f"{e.sqlstate} {text}" if e.sqlstate else text

    def _lock_notice(self, w: _Worker, kind: str, mode: str, lock: str) -> None:
        with self._cv:
            w.notice = (kind, mode, lock)
            self._cv.notify_all()

    # -- the scheduler side -----------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return all(w.state == DONE for w in self._workers)

    @property
    def workers(self) -> list[str]:
        return [w.name for w in self._workers]

    def options(self) -> list[str]:
        """The workers parked at a gate, in worker order: who may run the next step."""
        with self._cv:
            return [w.name for w in self._workers if w.state == PARKED]

    def pending(self, worker: str) -> str | None:
        """The label of the statement ``worker`` is parked before (None: not parked)."""
        return self._worker(worker).pending

    def blocked_by(self, worker: str) -> tuple[str, ...]:
        """Whom ``worker``'s statement waits for (worker names, or ``pid N``); empty if none."""
        return self._worker(worker).blocked_by

    def in_transaction(self, worker: str) -> bool:
        """Whether ``worker``'s connection has a transaction open (it may hold locks)."""
        return self._open(self._worker(worker))

    def step(self, worker: str) -> None:
        """Let ``worker`` run its next statement, then wait until everyone is at rest."""
        w = self._worker(worker)
        with self._cv:
            if w.state != PARKED:
                raise ValueError(
                    f"{worker} is {w.state}, not parked at a statement: "
                    f"choose among {self.options()}"
                )
            if len(self._schedule) >= self.scheduler.max_steps:
                raise Runaway(
                    f"the block passed {self.scheduler.max_steps} steps: an operation "
                    f"keeps issuing statements ({w.name} next: {w.pending})"
                )
            self._pause_resting()
            self._schedule.append(w.name)
            n = len(self._schedule)
            self._trace.append(f"{n:>3}. {w.name} {w.pending}")
            w.granted = True
            w.state = RUNNING
            self._cv.notify_all()
        self._settle()
        self._note_changes()

    def fault(self, label: str, action: Callable[[], None], *, lost: Iterable[str] = ()) -> None:
        """Inject a fault at rest, between two steps: run ``action`` and wait until the server
        has let go of the backends of the ``lost`` workers (their links were cut, or the
        database crashed), or until each waits on a lock; and until each lost worker that was
        inside a statement (waiting on a lock) has seen its connection go. Its statement raises
        then, not at some point during the next step: the trace says so at the same place
        whatever the machine's load (the same seed, the same report)."""
        self._trace.append(f"     FAULT {label}")
        action()
        with self._cv:
            cut = [self._worker(name) for name in lost]
            inside = [w for w in cut if w.state == RUNNING]
            for w in cut:
                if all(g.pid != w.pid for g in self._ghosts):
                    self._ghosts.append(_Ghost(w.name, w.pid))
            seen = self._cv.wait_for(
                lambda: all(w.state != RUNNING for w in inside), self.scheduler.deadline_s
            )
        if not seen:
            raise WorkerStuck(
                f"{', '.join(w.name for w in inside)} still ran a statement "
                f"{self.scheduler.deadline_s:.0f} s after the fault ({label}) cut its connection "
                f"({self._states()}): the client never saw the connection go"
            )
        self._settle()
        self._note_changes()

    def run(
        self,
        choose: Callable[[list[str]], str],
        *,
        between: Callable[["Block"], None] | None = None,
    ) -> BlockResult:
        while not self.finished:
            if between is not None:
                between(self)
            options = self.options()
            if not options:
                if self.finished:
                    break
                raise WorkerStuck(self._deadlock_message())
            pick = choose(options)
            self.step(pick)
        return self.result()

    def result(self) -> BlockResult:
        if not self.finished:
            raise ValueError(f"the block has not finished: {self._states()}")
        ops = []
        for w in self._workers:
            status = w.op.conn.pgconn.transaction_status
            left_open = status in (pq.TransactionStatus.INTRANS, pq.TransactionStatus.INERROR)
            ops.append(
                OpResult(
                    w.name, w.op.label, w.value, w.error, w.statements, w.done_at or 0, left_open
                )
            )
        return BlockResult(tuple(ops), tuple(self._schedule), tuple(self._trace), self._waits)

    # -- coming to rest ---------------------------------------------------------------------------
    def _worker(self, name: str) -> _Worker:
        for w in self._workers:
            if w.name == name:
                return w
        raise KeyError(f"no worker {name!r} in this block (workers: {self.workers})")

    def _settle(self) -> None:
        """Wait until every worker is parked, done, or blocked on a lock (with its deadlock
        check run), and every ghost is gone or blocked. Polls the server with a deadline.

        With pausing, at most one backend runs at a time: the others that a step released
        stay stopped, and are let go one after another, in worker order, each until it rests."""
        deadline = time.monotonic() + self.scheduler.deadline_s
        noted = False
        while True:
            with self._cv:  # a worker that parks or ends wakes this at once
                self._cv.wait_for(
                    lambda: (
                        not any(
                            w.state == RUNNING and not w.blocked_by and w.pid not in self._paused
                            for w in self._workers
                        )
                    ),
                    POLL,
                )
                flying = [w for w in self._workers if w.state == RUNNING]
                ghosts = [g.pid for g in self._ghosts]
            if not flying and not ghosts:
                return
            seen = self.scheduler.observer.observe([w.pid for w in flying] + ghosts)
            active = self._active(flying, seen)
            if active is None:
                continue  # a worker parked or ended meanwhile: what the server said is stale
            if not active:
                return
            if self.scheduler.pause:
                if all(pid in self._paused for _, pid in active):
                    self._resume(active[0][1])
            elif len(active) > 1 and not noted:
                noted = True
                names = " and ".join(name for name, _ in active)
                self._trace.append(
                    f"       {names} run together: the server orders them "
                    "(pausing backends needs the server on this machine)"
                )
            if time.monotonic() > deadline:
                raise WorkerStuck(self._stuck_message(seen))

    def _active(
        self, flying: list[_Worker], seen: dict[int, Activity]
    ) -> list[tuple[str, int]] | None:
        """The backends not at rest, workers in order then ghosts: (name, pid). None when a
        worker parked or ended since ``flying`` was taken: its statement may have released
        locks after the server was asked, so the answer is stale."""
        active = []
        names = {w.pid: w.name for w in self._workers}
        with self._cv:
            if any(w.state != RUNNING for w in flying):
                return None
            for w in flying:
                act = seen.get(w.pid)
                checked = (
                    act is not None
                    and act.blocking
                    and w.notice is not None
                    and w.notice[0] == "still waiting"
                    and w.notice[1] == act.mode
                    and (act.lock is None or w.notice[2] == act.lock)
                )
                if checked:
                    w.blocked_by = tuple(names.get(p, f"pid {p}") for p in act.blocking)
                    w.waits_for = act.what
                else:
                    w.blocked_by = ()
                    active.append((w.name, w.pid))
            for g in list(self._ghosts):
                act = seen.get(g.pid)
                if act is None:
                    self._ghosts.remove(g)
                    self._paused.discard(g.pid)
                    self._trace.append(f"       {g.name}'s backend is gone")
                else:
                    g.blocked = bool(act.blocking)
                    if not g.blocked:
                        active.append((f"{g.name}'s lost backend", g.pid))
        return active

    # -- pausing backends (a server on this machine) --------------------------------------------
    def _pause_resting(self) -> None:
        """Stop every backend that rests in a lock wait, before a step: whatever the step
        releases then waits to be let go one at a time."""
        if not self.scheduler.pause:
            return
        with self._cv:
            pids = [w.pid for w in self._workers if w.state == RUNNING and w.blocked_by]
            pids += [g.pid for g in self._ghosts if g.blocked]
        for pid in pids:
            if pid not in self._paused and check_backend(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
                    self._paused.add(pid)

    def _resume(self, pid: int) -> None:
        self._paused.discard(pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)

    def _resume_all(self) -> None:
        for pid in list(self._paused):
            self._resume(pid)

    def _note_changes(self) -> None:
        """Trace what changed at this rest: who waits for whom, who resumed, who finished."""
        notes = []
        with self._cv:
            for w in self._workers:
                now = (w.state, w.blocked_by, w.waits_for if w.blocked_by else "", w.done_at)
                before = self._seen.get(w.name)
                self._seen[w.name] = now
                if w.failed and w.state != DONE:
                    notes.append(f"{w.name} got {w.failed}")
                w.failed = ""
                if now == before:
                    continue
                if w.state == DONE and (before is None or before[0] != DONE):
                    notes.append(OpResult(w.name, w.op.label, w.value, w.error).describe())
                elif w.blocked_by and (before is None or before[1:3] != now[1:3]):
                    notes.append(f"{w.name} waits for {', '.join(w.blocked_by)} ({w.waits_for})")
                    self._waits += 1
                elif before is not None and before[1] and not w.blocked_by:
                    notes.append(f"{w.name} resumed")
        for note in notes:
            self._trace.append(f"       {note}")

    def _states(self) -> str:
        parts = []
        for w in self._workers:
            if w.state == PARKED:
                parts.append(f"{w.name} parked before {w.pending}")
            elif w.state == DONE:
                parts.append(f"{w.name} done")
            elif w.blocked_by:
                parts.append(f"{w.name} waits for {', '.join(w.blocked_by)} ({w.waits_for})")
            else:
                parts.append(f"{w.name} running statement {w.statements}")
        return "; ".join(parts)

    def _stuck_message(self, seen: dict[int, Activity]) -> str:
        parts = []
        for w in self._workers:
            if w.state == RUNNING and not w.blocked_by:
                act = seen.get(w.pid)
                server = (
                    "its backend is gone"
                    if act is None
                    else f"server: state={act.state or '?'} wait={act.wait or 'none'}"
                    + (f" for {act.mode} on {act.lock}" if act.lock else "")
                    + f"; last lock notice: {' '.join(w.notice) if w.notice else 'none'}"
                )
                parts.append(f"{w.name} ({w.op.label}) still in statement {w.statements}; {server}")
        for g in self._ghosts:
            if not g.blocked:
                parts.append(f"the backend of lost worker {g.name} (pid {g.pid}) is still there")
        return (
            f"a concurrent block did not come to rest within "
            f"{self.scheduler.deadline_s:.0f} s: "
            + "; ".join(parts or [self._states()])
            + ". Is the server or the machine overloaded, or a link stalled?"
        )

    def _deadlock_message(self) -> str:
        return (
            f"every unfinished worker of the block waits on a lock nobody can release "
            f"({self._states()}): a holder ended with its transaction open, or a lock is held "
            f"outside the block"
        )
