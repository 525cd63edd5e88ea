"""A worker: its own connection through its own Toxiproxy link, a hook around COMMIT (where faults
act), and a watch on every statement it runs for a wait on another worker's lock (seen by the
server, ``pg_blocking_pids``, never guessed from a timeout). Importable from :mod:`.harness`."""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import psycopg

from knownstate.impl.errors import first_line

from . import timings
from .interleave import ScheduledConnection
from .toxi import Link
from .envfaults import EnvironmentFault

if TYPE_CHECKING:
    from .harness import Env
    from .workspace import Workspace


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
                    # by the server, whatever the worker's connection is (sync, asyncio, a
                    # driver's own) and whether or not its link lets a cancel request through
                    with contextlib.suppress(psycopg.Error):
                        observer.execute("select pg_cancel_backend(%s)", (pid,))
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
        """Drop the connection after an error and wait until the server has let go of it. Once
        it has, a second call (a block's fault, then the operation's error) asks nothing."""
        if self.conn is not None:
            cut_socket(self.conn)
            self.conn = None
        if self.app_name:
            self.env.settle(self.app_name)
            self.app_name = ""

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
                    self.still_answers(conn)
            except psycopg.Error:
                self.abandon()
        try:
            self.connection()
        except ConnectionLost as e:
            raise EnvironmentFault(
                f"{self.name} could not connect through its clean link: {e}"
            ) from None

    def still_answers(self, conn) -> None:
        """The seam of :meth:`ready` that asks a kept connection whether it still answers (a
        driver's connection asks through its own loop)."""
        conn.autocommit = True  # one round trip, and no transaction left open (now() would stay)
        try:
            conn.execute("select 1")
        finally:
            conn.autocommit = False

    def faulted(self) -> bool:
        """A toxic on one of its links, a link down, or a COMMIT fault armed."""
        return self.before_commit is not None or any(l.toxics or not l.enabled for l in self.links)

    def clean(self) -> bool:
        return not self.faulted()

    def arm(self, hook: Callable[[HookedConnection], None]) -> None:
        """Run ``hook`` just before this worker's next COMMIT, on whatever connection it has
        then."""
        self.before_commit = hook
