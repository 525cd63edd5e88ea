"""The server's side of a concurrent block (:mod:`.scheduler` has the theory of operation):
lock waits as ``pg_stat_activity`` and ``pg_locks`` show them (read by the :class:`Observer`,
on a connection of its own) and as the server's wait notices word them; the session settings a
block needs; the check that a pid is a PostgreSQL backend before it is paused; and the errors
that mean the environment failed a block."""

from __future__ import annotations

import contextlib
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import psycopg
from psycopg import pq

from knownstate.impl.errors import first_line

POLL = 0.002  # seconds between two looks at the server while a worker is in flight

SESSION_SETTINGS = {
    "deadlock_timeout": "1ms",
    "log_lock_waits": "on",
    "client_min_messages": "log",
    "lc_messages": "C",
    "lock_timeout": "0",
    "statement_timeout": "0",
    "idle_in_transaction_session_timeout": "0",
    "max_parallel_workers_per_gather": "0",
}
"""Set on every worker session for the duration of a block (with
``Scheduler(keep_settings=True)``: from its first block on). ``deadlock_timeout`` and
``log_lock_waits`` (and ``lc_messages``, so the notice is parsed in English) need a superuser."""


class SchedulerEnvironmentError(BaseException):
    """The environment failed a concurrent block, not the code under test. A BaseException so
    that Hypothesis does not shrink it as a counterexample."""


class WorkerStuck(SchedulerEnvironmentError):
    """A worker of a concurrent block neither reached its next statement, nor finished, nor
    waited on a lock the server shows, within the deadline."""


class SettingsRefused(SchedulerEnvironmentError):
    """The server refused the session settings a concurrent block needs (deadlock_timeout and
    log_lock_waits need a superuser): connect the workers as one."""


class ClockAhead(SchedulerEnvironmentError):
    """The database server's clock is ahead of real time: under libfaketime its lock-wait
    timers (deadlock_timeout) then fire that much late. Keep the fake clock's base in the past
    (e.g. a day back) and jump from there."""


# ---------------------------------------------------------------------------------------
# Lock waits, as the server reports them.
# ---------------------------------------------------------------------------------------


NOTICE = re.compile(
    r"^process \d+ (?P<kind>still waiting|acquired|avoided deadlock|"
    r"detected deadlock while waiting|failed to acquire) "
    r"for (?P<mode>\S+) on (?P<lock>.+?)"
    r"(?: by rearranging queue order)? after [\d.]+ ms$"
)


@dataclass
class Activity:
    blocking: tuple[int, ...]
    state: str
    wait: str
    mode: str | None
    lock: str | None
    """The awaited lock as the server's wait notice words it (None: any notice matches)."""
    what: str
    """The awaited lock for the trace, without ids that change from run to run."""


OBSERVE = """
SELECT a.pid, pg_blocking_pids(a.pid), coalesce(a.state, ''),
       coalesce(a.wait_event_type || ':' || a.wait_event, ''),
       l.locktype, l.database, l.relation, l.page, l.tuple, l.virtualxid, l.transactionid, l.mode,
       CASE WHEN l.relation IS NOT NULL THEN l.relation::regclass::text END
FROM pg_stat_activity a LEFT JOIN pg_locks l ON l.pid = a.pid AND NOT l.granted
WHERE a.pid = ANY(%(pids)s)
"""


def lock_text(locktype: str | None, database, relation, page, tuple_, vxid, xid) -> str | None:
    """The lock as PostgreSQL's DescribeLockTag words it in the wait notice (None: a kind this
    does not spell out, which then matches any notice)."""
    return {
        "transactionid": f"transaction {xid}",
        "tuple": f"tuple ({page},{tuple_}) of relation {relation} of database {database}",
        "relation": f"relation {relation} of database {database}",
        "extend": f"extension of relation {relation} of database {database}",
        "page": f"page {page} of relation {relation} of database {database}",
        "virtualxid": f"virtual transaction {vxid}",
    }.get(locktype or "")


def lock_what(locktype: str | None, mode: str | None, relname: str | None) -> str:
    """A stable, readable name of the awaited lock (row and transaction ids vary by run)."""
    what = {
        "transactionid": "its transaction",
        "tuple": f"a row of {relname}",
        "relation": f"table {relname}",
        "extend": f"extending {relname}",
        "page": f"a page of {relname}",
        "virtualxid": "its virtual transaction",
    }
    return f"{mode} on {what.get(locktype or '', locktype or 'a lock')}"


class Observer:
    """A direct connection to the server (never through a proxy) on which the scheduler reads
    what the backends of a block are doing; it reconnects after a database crash, for up to
    ``deadline_s``."""

    def __init__(
        self,
        dsn: str,
        *,
        deadline_s: float,
        clock_guard: bool = True,
        gone: Callable[[], bool] | None = None,
    ):
        self.dsn = dsn
        self.deadline_s = deadline_s
        self.gone = gone
        """Whether the server is gone for good (killed, not restarting): then a failed
        connection is not waited out to ``deadline_s``."""
        self.clock_guard = clock_guard
        """Refuse a block while the server's clock is ahead of this machine's (see
        :class:`ClockAhead`). Switch off for a server on another host whose clock runs ahead
        without libfaketime."""
        self._conn: psycopg.Connection | None = None

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
            self._conn = None

    def observe(self, pids: Iterable[int]) -> dict[int, Activity]:
        """What the server says about these backends: whom each waits for, on which lock."""
        pids = sorted(set(pids))
        deadline = time.monotonic() + self.deadline_s
        while True:
            try:
                if self._conn is None or self._conn.closed or self._conn.broken:
                    self._conn = psycopg.connect(
                        self.dsn,
                        autocommit=True,
                        connect_timeout=5,
                        application_name="knownstate-scheduler",
                    )
                if not pids:
                    return {}
                rows = self._conn.execute(OBSERVE, {"pids": pids}).fetchall()
                break
            except psycopg.OperationalError as e:
                self.close()
                if self.gone is not None and self.gone():
                    raise WorkerStuck(
                        f"the scheduler's observer connection to PostgreSQL failed "
                        f"({first_line(e)}), and the server is gone"
                    ) from None
                if time.monotonic() > deadline:
                    first = first_line(e)
                    raise WorkerStuck(
                        f"the scheduler's observer connection to PostgreSQL failed "
                        f"for {self.deadline_s:.0f} s ({first}): is the server up?"
                    ) from None
                time.sleep(POLL * 5)  # the server is restarting: poll again, within the deadline
        out: dict[int, Activity] = {}
        for pid, blocking, state, wait, locktype, db, rel, page, tup, vxid, xid, mode, rn in rows:
            text = lock_text(locktype, db, rel, page, tup, vxid, xid)
            if pid not in out or (text and not out[pid].lock):
                out[pid] = Activity(
                    tuple(blocking or ()), state, wait, mode, text, lock_what(locktype, mode, rn)
                )
        return out

    def check_clock(self, tolerance_s: float = 1.0) -> None:
        """Raise :class:`ClockAhead` when the server's clock is ahead of this machine's."""
        if not self.clock_guard:
            return
        self.observe([])
        before = time.time()
        (server,) = self._conn.execute(
            "SELECT extract(epoch FROM clock_timestamp())::float8"
        ).fetchone()
        ahead = server - (before + time.time()) / 2
        if ahead > tolerance_s:
            raise ClockAhead(
                f"the database clock is {ahead:.0f} s ahead of real time: under "
                f"libfaketime its lock-wait timers would fire {ahead:.0f} s late, "
                "so a concurrent block cannot run; keep the fake clock's base in "
                "the past (e.g. jump it a day back first) and jump from there"
            )

    def terminate(self, pids: Iterable[int]) -> None:
        """End these backends (the workers of an aborted block); errors are ignored."""
        with contextlib.suppress(psycopg.Error):
            self.observe([])
            if self._conn is not None:
                self._conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid = ANY(%s)",
                    (sorted(set(pids)),),
                )


# ---------------------------------------------------------------------------------------
# The workers' sessions and backends.
# ---------------------------------------------------------------------------------------


def check_backend(pid: int) -> bool:
    """Whether backend ``pid`` can be paused: False when it is exiting (its client gone, the
    server has not reaped it yet: a zombie, or a process whose command line is already empty;
    there is nothing left to pause). Refuses to signal a process that is not a PostgreSQL
    backend on this machine."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
        with open(f"/proc/{pid}/stat") as f:
            state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
        with open(f"/proc/{ppid}/cmdline", "rb") as f:
            parent = f.read()
    except (OSError, ValueError, IndexError):
        cmdline = parent = b""
        state = ""
    if b"postgres" in parent and (state in ("Z", "X") or not cmdline):
        return False
    if b"postgres" not in cmdline or b"postgres" not in parent:
        raise SchedulerEnvironmentError(
            f"backend pid {pid} is not a PostgreSQL process on this "
            "machine: pausing backends needs the server here; use "
            "Scheduler(pause=False) for a remote server"
        )
    return True


def apply_settings(conn: Any, worker: str) -> None:
    """Set a block's session settings on a scheduled connection (sync or asyncio), at rest."""
    sql = "SELECT " + ", ".join(
        f"set_config('{k}', '{v}', false)" for k, v in SESSION_SETTINGS.items()
    )
    try:
        conn.at_rest(conn.execute(sql))
        if not conn.autocommit:
            conn.at_rest(conn.commit())
    except psycopg.errors.InsufficientPrivilege as e:
        with contextlib.suppress(psycopg.Error):
            conn.at_rest(conn.rollback())
        raise SettingsRefused(
            f"{worker}: {first_line(e)}: concurrent blocks set "
            "deadlock_timeout and log_lock_waits per session, which needs a "
            "superuser; connect the workers as one"
        ) from None


def reset_settings(conn: Any) -> None:
    """Back to the connection's own values (what RESET restores: its connect-time options),
    when it is alive and has no transaction open."""
    if conn.closed or conn.broken or conn.pgconn.transaction_status != pq.TransactionStatus.IDLE:
        return
    with contextlib.suppress(psycopg.Error):
        conn.at_rest(
            conn.execute(
                "SELECT set_config(name, reset_val, false) FROM pg_settings WHERE name = ANY(%s)",
                (list(SESSION_SETTINGS),),
            )
        )
        if not conn.autocommit:
            conn.at_rest(conn.commit())
