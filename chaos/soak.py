"""``knownstate soak KIND``: the reference worker loops as OS processes, under a nemesis.

Theory of operation
-------------------

The check (``knownstate verify``) drives one operation at a time and judges every step against
the model. A soak does the opposite: it lets the real processes run on their own, for a
duration, while a nemesis hurts them, and judges afterwards, from what was recorded.

The parts. A throwaway PostgreSQL under libfaketime (its clock is the nemesis's to move); the
real Toxiproxy server with one link per process to PostgreSQL, and one per worker to the
stand-in (the notification sink for the outbox, the operations API for branch reset), with a
little latency drawn from the seed on each stand-in link; the stand-in itself, recording what
it received. The processes (:mod:`knownstate.chaos.soakworker`): ``p0`` the producer, ``w0``..
``w2`` the kind's reference worker loop, ``r0`` its reaper (for the approved plan the reader,
whose reads heal stale runs). For branch reset the harness also finishes the external
operations, after a delay drawn per operation from the seed.

Phases. Start everything and wait until each process is ready; run for ``seconds`` while the
nemesis (:mod:`knownstate.chaos.nemesis`) carries out the schedule the seed names, printed
first; then the quiet period: every fault healed, the producer stopped, and the soak waits
until every run asked for is terminal, or no progress is possible — no committed change for a
while even after the soak let time pass on the database clock (lapsed leases are reaped,
backoffs come due, stale heartbeats heal). The wait polls with a generous deadline and ends on
the state, never on a timer alone, so a slow machine makes a soak slower, not wrong.

The verdict comes from the history (:mod:`knownstate.chaos.history`): the operation logs, an
audit of every committed row change (a trigger in the soak's database, written in the same
transaction as the change and naming the operation that made it), the stand-in's records, the
nemesis periods. Exit codes as ``verify``: 0 passed, 1 a violation, 2 usage, 3 a real part died
that the harness did not kill (a worker process, PostgreSQL outside a planned crash,
Toxiproxy), 130 interrupted. Every process and server is stopped at the end, also after Ctrl-C.
A failure prints the command that replays the schedule, and writes the timeline
(:mod:`knownstate.chaos.timeline`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psycopg
from psycopg.rows import dict_row

from . import history as hist
from . import nemesis as nem
from . import leftovers, outpath, soakworker, tools
from .check import EnvironmentFault
from .cluster import ClusterError, PostgresCluster
from .opsapi import OpsApi
from .sink import NotificationSink
from .toxi import Toxic, ToxiproxyError, ToxiproxyServer

KINDS = ("outbox", "approved-plan", "branch-reset")
DEFAULT_SECONDS = 60.0
MAX_SECONDS = 3600.0
QUIET_DEADLINE = 600.0
"""The quiet period ends at the latest this long after it began, even while progress continues."""
PROGRESS_EVERY = 5.0


class SoakEnvironmentError(EnvironmentFault):
    """A real part of the soak died or misbehaved, and the harness did not make it."""


# ---------------------------------------------------------------------------------------
# The kinds: tables, parameters, processes.
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Kind:
    name: str
    tables: tuple[str, ...]  # audited
    stand_in: str  # "sink" or "ops"
    params: dict
    lease: float  # seconds a stall must outlast
    open_sql: str  # runs asked for and not terminal
    status_sql: str
    nudge: float  # database clock seconds that let every lease lapse and every backoff come due
    refusals: tuple[int, ...] = (503,)
    lease_of: tuple[str, str, str, str, int] = ("", "", "", "", 0)
    """(table, status of a held run, its fence token, the statuses of a run taken back and
    waiting for a claim, the most writes its loop makes under one lease before the last one,
    0: no bound): what a hold of the nemesis reads (:func:`held_sql`)."""


def held_sql(kind: "Kind") -> str:
    """The runs a process incarnation (%(app)s: its application_name) holds a lease on now, with
    their token and how many changes it committed to the run under that token so far (the claim
    is the first): held, and the claim that made them so under that token was its (the audit
    names the application of every change)."""
    table, held, token, _, _ = kind.lease_of
    mine = (
        f"FROM soak_audit a WHERE a.app = %(app)s AND a.tbl = '{table}' "
        f"AND a.new->>'id' = t.id::text AND a.new->'{token}' = to_jsonb(t.{token})"
    )
    return (
        f"SELECT t.id::text, t.{token}, (SELECT count(*) {mine}) FROM {table} t "
        f"WHERE t.status = '{held}' AND EXISTS (SELECT 1 {mine} "
        f"AND a.new->>'status' = '{held}' AND a.old->>'status' IS DISTINCT FROM '{held}')"
    )


def where_sql(kind: "Kind") -> str:
    """Where the runs %(runs)s are now: (run, held / free / reheld under %(tokens)s, or done)."""
    table, held, token, free, _ = kind.lease_of
    return (
        f"SELECT t.id::text, CASE WHEN t.status = '{held}' AND t.{token}::text = "
        f"(%(tokens)s::text[])[array_position(%(runs)s::text[], t.id::text)] THEN 'held' "
        f"WHEN t.status = '{held}' THEN 'reheld' WHEN t.status IN ({free}) THEN 'free' "
        f"ELSE 'done' END FROM {table} t WHERE t.id::text = ANY(%(runs)s::text[])"
    )


KIND_SPECS = {
    "outbox": Kind(
        "outbox",
        ("outbox_delivery",),
        "sink",
        {
            "lease": 3,
            "backoff_base": 1,
            "backoff_cap": 4,
            "max_attempts": 4,
            "batch": 10,
            "idle": 0.05,
            "http_timeout": 2.0,
            "reap_every": 0.5,
            "rate": 25.0,
        },
        3.0,
        "SELECT count(*) FROM outbox_delivery WHERE status IN ('pending', 'processing')",
        "SELECT status, count(*) FROM outbox_delivery GROUP BY status",
        3 + 4 + 1,
        (503, 503, 422),
        ("outbox_delivery", "processing", "attempts", "'pending'", 1),
    ),
    "approved-plan": Kind(
        "approved-plan",
        ("agent_proposal", "agent_proposal_step", "demo_ledger"),
        "",
        {"heartbeat_s": 3, "pace": 0.08, "idle": 0.1, "read_every": 0.3, "rate": 4.0},
        3.0,
        "SELECT count(*) FROM agent_proposal WHERE status IN ('approved', 'executing')",
        "SELECT status, count(*) FROM agent_proposal GROUP BY status",
        3 + 1,
        lease_of=("agent_proposal", "executing", "generation", "'approved'", 0),
    ),
    "branch-reset": Kind(
        "branch-reset",
        ("branch_reset",),
        "ops",
        {
            "lease": 4,
            "http_timeout": 1.0,
            "poll_every": 0.3,
            "reap_every": 0.5,
            "rate": 2.0,
            "branches": 6,
        },
        4.0,
        "SELECT count(*) FROM branch_reset WHERE status IN ('queued', 'running')",
        "SELECT status, count(*) FROM branch_reset GROUP BY status",
        0,
        lease_of=("branch_reset", "running", "claimed_by", "'queued'", 0),
    ),
}

EXPECTED = {
    "outbox": ("reclaim of a lapsed lease", "lost race or fence refusal", "duplicate delivery"),
    "approved-plan": ("lazy heal", "lost race or fence refusal"),
    "branch-reset": ("reap", "lost race or fence refusal", "create retried, one creation"),
}
"""What a soak of each kind should see happen, printed when it did not (it does not fail)."""

PROCESSES = (
    ("w0", "worker"),
    ("w1", "worker"),
    ("w2", "worker"),
    ("p0", "producer"),
    ("r0", "reaper"),
)

AUDIT_DDL = r"""
CREATE TABLE soak_audit (
    id  bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tbl text NOT NULL,
    op  text NOT NULL,
    ref text,            -- the operation that made the change (from its statements' comment)
    app text,
    old jsonb,
    new jsonb,
    at  double precision NOT NULL DEFAULT extract(epoch FROM now()),  -- the guards' clock
    xid bigint NOT NULL DEFAULT txid_current()
);
CREATE FUNCTION soak_audit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO soak_audit (tbl, op, ref, app, old, new)
    VALUES (TG_TABLE_NAME, TG_OP, substring(current_query() FROM '^/\* ks:([^ ]+) \*/'),
            current_setting('application_name'),
            CASE WHEN TG_OP <> 'INSERT' THEN to_jsonb(OLD) END,
            CASE WHEN TG_OP <> 'DELETE' THEN to_jsonb(NEW) END);
    RETURN NULL;
END $$;
"""


def audit_ddl(tables: tuple[str, ...]) -> str:
    return (
        AUDIT_DDL
        + "CREATE INDEX ON soak_audit (app, tbl, (new->>'id'));\n"
        + "".join(
            f"CREATE TRIGGER soak_audit AFTER INSERT OR UPDATE OR DELETE ON {t} "
            "FOR EACH ROW EXECUTE FUNCTION soak_audit();\n"
            for t in tables
        )
    )


def check_class(kind: str, mutant: str | None):
    """The kind's check class, with the mutant applied (it says which schema and store to run)."""
    from . import kinds

    check = kinds.check(kind)
    if mutant is None:
        return check
    found = [m for m in kinds.mutants(kind) if m.name == mutant]
    if not found:
        raise ValueError(
            f"{kind} has no mutant {mutant!r}: choose from "
            + ", ".join(m.name for m in kinds.mutants(kind))
        )
    return found[0].machine(check)


# ---------------------------------------------------------------------------------------
# Stand-ins that also record when.
# ---------------------------------------------------------------------------------------


_request = threading.local()  # the operation that sent the request this thread is handling


def _noting_operation(handler: type) -> type:
    """The stand-in's request handler, also noting the sender's operation (its header)."""

    class Noting(handler):
        def parse_request(self) -> bool:
            ok = super().parse_request()
            _request.op = self.headers.get(soakworker.OP_HEADER) if ok else None
            return ok

    return Noting


class RecordingSink(NotificationSink):
    """The notification sink, also keeping (time, delivery, attempt, answer, sender's operation)
    per request."""

    def start(self) -> "RecordingSink":
        super().start()
        self._server.RequestHandlerClass = _noting_operation(self._server.RequestHandlerClass)
        return self

    def reset(self) -> None:
        super().reset()
        self.timed: list[tuple[float, int, int, int, str | None]] = []

    def _record(self, key: tuple[int, int]) -> int:
        code = super()._record(key)
        with self._lock:
            self.timed.append((time.time(), key[0], key[1], code, getattr(_request, "op", None)))
        return code


class RecordingOpsApi(OpsApi):
    """The operations API, also keeping (time, run, key, operation id, created?, sender's
    operation) per create request it acted on."""

    def start(self) -> "RecordingOpsApi":
        super().start()
        self._server.RequestHandlerClass = _noting_operation(self._server.RequestHandlerClass)
        return self

    def _clear(self) -> None:
        super()._clear()
        self.timed: list[tuple[float, str, str, str, bool, str | None]] = []

    def _create(self, body):
        code, op = super()._create(body)
        sender = getattr(_request, "op", None)
        with self._lock:
            self.timed.append(
                (time.time(), body.run_id, body.idempotency_key, op.op_id, code == 201, sender)
            )
        return code, op


# ---------------------------------------------------------------------------------------
# The worker processes.
# ---------------------------------------------------------------------------------------


@dataclass
class Running:
    name: str
    role: str
    inc: int
    proc: subprocess.Popen
    log: Path
    err: Path
    started: float
    expected_exit: bool = False  # the harness killed or stopped it


class Processes:
    """Spawns, signals and supervises the soak's worker processes."""

    def __init__(
        self, kind: str, spec: dict, logdir: Path, links: dict, seed: int, mutant: str | None
    ):
        self.kind, self.spec, self.logdir, self.links = kind, spec, logdir, links
        self.seed, self.mutant = seed, mutant
        self.running: dict[str, Running] = {}
        self.procs: list[hist.Proc] = []
        self.pids: list[int] = []
        self._lock = threading.RLock()
        self._incs: Counter = Counter()
        self.spawner: concurrent.futures.Executor

    def spawn(self, name: str, role: str) -> Running:
        """Start a new incarnation of ``name`` (forked on the spawner thread)."""
        return self.spawner.submit(self._spawn, name, role).result()

    def _spawn(self, name: str, role: str) -> Running:
        with self._lock:
            self._incs[name] += 1
            inc = self._incs[name]
            log, err = self.logdir / f"{name}.{inc}.jsonl", self.logdir / f"{name}.{inc}.err"
            db, ext = self.links[name]
            spec = {
                "kind": self.kind,
                "role": role,
                "name": name,
                "inc": inc,
                "seed": self.seed,
                "mutant": self.mutant,
                "log": str(log),
                "params": self.spec,
                "dsn": self.spec_dsn(db),
                "url": f"http://{ext.host}:{ext.port}" if ext else None,
            }
            with open(err, "wb") as errf:
                proc = tools.spawn(
                    [sys.executable, "-m", "knownstate.chaos.soakworker", json.dumps(spec)],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=errf,
                )
            r = Running(name, role, inc, proc, log, err, time.time())
            self.running[name] = r
            self.pids.append(proc.pid)
            self.procs.append(hist.Proc(name, inc, role, proc.pid, r.started))
            return r

    spec_dsn: Callable[[object], str]

    def _record_end(self, r: Running, how: str) -> None:
        for p in self.procs:
            if p.name == r.name and p.inc == r.inc and p.end is None:
                p.end, p.how = time.time(), how

    def kill(self, name: str) -> None:
        with self._lock:
            r = self.running[name]
            r.expected_exit = True
            with contextlib.suppress(ProcessLookupError):
                os.kill(r.proc.pid, signal.SIGKILL)
            r.proc.wait(timeout=30)
            self._record_end(r, "killed")

    def restart(self, name: str) -> None:
        self.spawn(name, self.running[name].role)

    def signal(self, name: str, sig: int) -> None:
        with self._lock:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.running[name].proc.pid, sig)

    def ready(self, deadline_s: float = 60.0) -> None:
        """Poll until every process wrote its ``ready`` line."""
        deadline = time.monotonic() + deadline_s
        while True:
            self.check()
            waiting = [
                r.name
                for r in self.running.values()
                if not r.log.exists() or '"ev":"ready"' not in r.log.read_text()
            ]
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise SoakEnvironmentError(
                    f"worker processes {', '.join(waiting)} did not start within {deadline_s:.0f} s"
                )
            time.sleep(0.05)

    def check(self) -> None:
        """A process that ended without the harness ending it: an environment failure."""
        with self._lock:
            for r in self.running.values():
                code = r.proc.poll()
                if code is not None and not r.expected_exit:
                    tail = [
                        ln for ln in r.err.read_text(errors="replace").splitlines() if ln.strip()
                    ]
                    why = tail[-1] if tail else "no output"
                    self._record_end(r, "died")
                    raise SoakEnvironmentError(
                        f"worker process {r.name} (pid {r.proc.pid}) exited with code "
                        f"{code}, and the harness did not kill it: {why}"
                    )

    def stop_role(self, role: str) -> None:
        for r in [r for r in self.running.values() if r.role == role]:
            self._end(r)

    def _end(self, r: Running, grace: float = 15.0) -> None:
        r.expected_exit = True
        for sig in (signal.SIGCONT, signal.SIGTERM):
            with contextlib.suppress(ProcessLookupError):
                os.kill(r.proc.pid, sig)
        try:
            r.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(r.proc.pid, signal.SIGKILL)
            r.proc.wait(timeout=30)
        self._record_end(r, "stopped")

    def stop_all(self, grace: float = 15.0) -> None:
        """SIGCONT and SIGTERM to every process, SIGKILL to one still there after ``grace``."""
        with self._lock:
            for r in self.running.values():
                if r.proc.poll() is None:
                    self._end(r, grace)
                else:
                    self._record_end(r, "killed" if r.expected_exit else "died")


# ---------------------------------------------------------------------------------------
# The real parts, as the nemesis sees them.
# ---------------------------------------------------------------------------------------


def _reconnected(conn: psycopg.Connection | None, dsn: str, timeout: int) -> psycopg.Connection:
    """``conn``, or a new autocommit connection when it is gone (a crash, a restart)."""
    if conn is None or conn.closed or conn.broken:
        conn = psycopg.connect(dsn, autocommit=True, connect_timeout=timeout)
    return conn


class SoakParts:
    """Implements :class:`knownstate.chaos.nemesis.Parts` over the soak's real parts."""

    def __init__(
        self, cluster: PostgresCluster, procs: Processes, links: dict, stand_in, kind: Kind
    ):
        self.cluster, self.procs, self.links, self.stand_in = cluster, procs, links, stand_in
        self.kind = kind
        self.db_down = False
        self.db_lock = threading.Lock()  # held while the nemesis crashes or restarts the server
        self.postmasters: list[int] = []
        self._conn: psycopg.Connection | None = None  # the nemesis's own look at the database

    # -- what a hold reads: the server's view, never a guess from a timer -----------------
    def _read(self, sql: str, params: dict) -> list | None:
        """Rows, or None when the database cannot be read now (crashed, restarting)."""
        try:
            self._conn = _reconnected(self._conn, self.cluster.dsn("soak"), 2)
            return self._conn.execute(sql, params).fetchall()
        except psycopg.Error:
            if self._conn is not None:
                self._conn.close()
            self._conn = None
            return None

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()

    def _app(self, proc: str) -> str:
        return f"ks-soak-{proc}.{self.procs.running[proc].inc}"

    def holds(self, proc: str) -> dict[str, tuple[object, int]]:
        rows = self._read(held_sql(self.kind), {"app": self._app(proc)})
        return {run: (token, writes) for run, token, writes in rows or ()}

    def writes_bound(self) -> int:
        return self.kind.lease_of[4]

    def quiet(self, proc: str, within: float) -> bool:
        deadline = time.monotonic() + within
        while True:
            rows = self._read(
                "SELECT count(*) FILTER (WHERE state = 'active'), count(*) FILTER "
                "(WHERE state <> 'idle') FROM pg_stat_activity WHERE application_name = %(app)s",
                {"app": self._app(proc)},
            )
            if rows is None:
                return False
            ((active, busy),) = rows
            if not busy:
                return True
            if not active or time.monotonic() > deadline:
                return False  # a transaction left open: it cannot move while its owner is stopped
            time.sleep(0.01)

    def taken(self, held: dict[str, object]) -> dict[str, str] | None:
        runs = sorted(held)
        rows = self._read(
            where_sql(self.kind), {"runs": runs, "tokens": [str(held[r]) for r in runs]}
        )
        return None if rows is None else dict(rows)

    def slow_others(self, proc: str, ms: int | None) -> None:
        toxic = Toxic("latency", "upstream", {"latency": ms or 0, "jitter": 0}, label="hold")
        for name, (_, ext) in self.links.items():
            if ext is None or name == proc:
                continue
            if ms is None:
                ext.remove(toxic)
            else:
                ext.add(toxic)

    def kill(self, proc: str) -> None:
        self.procs.kill(proc)

    def restart(self, proc: str) -> None:
        self.procs.restart(proc)

    def stop(self, proc: str) -> None:
        self.procs.signal(proc, signal.SIGSTOP)

    def cont(self, proc: str) -> None:
        self.procs.signal(proc, signal.SIGCONT)

    def _links(self, proc: str, which: str):
        db, ext = self.links[proc]
        return [
            link for link, name in ((db, "db"), (ext, "ext")) if link and which in (name, "both")
        ] or [db]

    def partition(self, proc: str, links: str) -> None:
        for link in self._links(proc, links):
            link.down()

    def reconnect(self, proc: str, links: str) -> None:
        for link in self._links(proc, links):
            link.up()

    def clock_jump(self, seconds: float) -> None:
        self.cluster.clock.jump(seconds)

    def db_crash(self) -> None:
        with self.db_lock:
            self.db_down = True
            self.cluster.crash()

    def db_restart(self) -> None:
        with self.db_lock:
            self.procs.spawner.submit(self.cluster.restart).result()
            self.postmasters.append(self.cluster._proc.pid)
            self.db_down = False

    def db_died(self) -> bool:
        """PostgreSQL is not running, and not because the nemesis crashed it."""
        if not self.db_lock.acquire(blocking=False):
            return False  # a planned crash or restart is under way
        try:
            return not self.db_down and not self.cluster.running
        finally:
            self.db_lock.release()

    def slow(self, stand_in: str, ms: int | None) -> None:
        """Latency on every worker's link to the stand-in (``ms`` None: remove it)."""
        for _, ext in self.links.values():
            if ext is None:
                continue
            toxic = Toxic("latency", "upstream", {"latency": ms or 0, "jitter": 0})
            if ms is None:
                ext.remove(toxic)
            else:
                ext.add(toxic)

    def refuse(self, stand_in: str, calls: int, code: int) -> None:
        if isinstance(self.stand_in, NotificationSink):
            self.stand_in.plan(*[code] * calls)
        elif isinstance(self.stand_in, OpsApi):
            self.stand_in.fail_next(calls)


# ---------------------------------------------------------------------------------------
# One soak.
# ---------------------------------------------------------------------------------------


@dataclass
class SoakResult:
    kind: str
    seed: int
    seconds: float
    mutant: str | None
    schedule: list[nem.Fault]
    history: hist.History
    verdict: hist.Verdict
    quiet_seconds: float
    quiet_end: str  # why the quiet period ended
    wall_seconds: float
    pids: list[int] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.verdict.passed

    def replay(self) -> str:
        return replay_command(self.kind, self.seconds, self.seed, self.mutant)


def replay_command(kind: str, seconds: float, seed: int, mutant: str | None) -> str:
    cmd = f"knownstate soak {kind} --seconds {seconds:g} --seed {seed}"
    return cmd + (f" --mutant {mutant}" if mutant else "")


class Soak:
    """Runs one soak of one kind. :meth:`run` returns the :class:`SoakResult`."""

    def __init__(
        self,
        kind: str,
        seconds: float,
        seed: int,
        mutant: str | None = None,
        say: Callable[[str], None] = print,
        live: bool = False,
    ):
        self.kind, self.seconds, self.seed, self.mutant = kind, seconds, seed, mutant
        self.spec = KIND_SPECS[kind]
        self.check = check_class(kind, mutant)
        self.say, self.live = say, live
        self.procs_names = [n for n, _ in PROCESSES]
        self.schedule = nem.schedule(
            seed, seconds, self.procs_names, self.spec.lease, self.spec.stand_in, self.spec.refusals
        )
        self._observer: psycopg.Connection | None = None

    # -- observation ---------------------------------------------------------------------
    def _query(self, sql: str, params=None) -> list:
        for attempt in (1, 2):
            try:
                self._observer = _reconnected(self._observer, self.cluster.dsn("soak"), 5)
                return self._observer.execute(sql, params).fetchall()
            except psycopg.OperationalError:
                self._observer = None
                if attempt == 2:
                    raise
        return []

    def _alive(self) -> None:
        if self.parts.db_died():
            raise SoakEnvironmentError(
                "PostgreSQL died outside a planned crash: was it killed from outside? "
                f"Log tail: {self.cluster.log_tail(200)!r}"
            )
        if not self.toxiproxy.running:
            raise SoakEnvironmentError("toxiproxy-server died: was it killed from outside?")
        if self.nemesis is not None and self.nemesis.error is not None:
            e = self.nemesis.error
            raise SoakEnvironmentError(
                f"the nemesis could not act on a real part: {type(e).__name__}: {e}"
            )
        self.procs.check()

    def _statuses(self) -> str:
        try:
            rows = self._query(self.spec.status_sql)
        except psycopg.Error:
            return "database down"
        return ", ".join(f"{s} {n}" for s, n in sorted(rows)) or "no runs yet"

    # -- the whole run ---------------------------------------------------------------------
    def run(self) -> SoakResult:
        started = time.time()
        self.nemesis: nem.Nemesis | None = None
        logdir = leftovers.make("knownstate-soak-")  # swept by a later run if this one is killed
        # Every child process (workers, a restarted PostgreSQL) is forked on this one thread, which
        # outlives them all: a child's parent-death signal fires when the *thread* that forked it
        # ends, and the nemesis thread, which restarts what it killed, ends before the soak does.
        spawner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="soak-spawner")
        with contextlib.ExitStack() as stack:
            stack.callback(spawner.shutdown)
            stack.callback(leftovers.remove, logdir)
            try:
                self.cluster = stack.enter_context(PostgresCluster())
                self.toxiproxy = stack.enter_context(ToxiproxyServer())
            except (ClusterError, ToxiproxyError) as e:
                raise SoakEnvironmentError(f"could not start the real parts: {e}") from None
            stack.callback(self._close_observer)
            stand_in = self._stand_in(stack)
            links = self._links(stand_in)
            self.procs = Processes(
                self.kind, self.spec.params, logdir, links, self.seed, self.mutant
            )
            self.procs.spec_dsn = lambda link: self.cluster.dsn(
                "soak", host=link.host, port=link.port
            )
            self.procs.spawner = spawner
            stack.callback(self.procs.stop_all, 2.0)  # after an error or Ctrl-C: quickly
            self.parts = SoakParts(self.cluster, self.procs, links, stand_in, self.spec)
            stack.callback(self.parts.close)
            self.parts.postmasters.append(self.cluster._proc.pid)
            self._database()
            try:
                return self._run(started, logdir, stand_in)
            except (ClusterError, ToxiproxyError) as e:
                raise SoakEnvironmentError(f"a real part failed: {e}") from None
            finally:
                if self.nemesis is not None:
                    with contextlib.suppress(Exception):
                        self.nemesis.heal()

    def _close_observer(self) -> None:
        if self._observer is not None:
            with contextlib.suppress(Exception):
                self._observer.close()

    def _stand_in(self, stack: contextlib.ExitStack):
        if self.spec.stand_in == "sink":
            return stack.enter_context(RecordingSink())
        if self.spec.stand_in == "ops":
            return stack.enter_context(RecordingOpsApi())
        return None

    def _links(self, stand_in) -> dict:
        api = self.toxiproxy.client()
        rng = random.Random(f"knownstate-soak-links:{self.seed}")
        links = {}
        for name, role in PROCESSES:
            db = api.link(f"soak-{name}-db", self.cluster.host, self.cluster.port)
            ext = None
            if stand_in is not None and role == "worker":
                ext = api.link(f"soak-{name}-ext", stand_in.host, stand_in.port)
                ext.add(
                    Toxic("latency", "downstream", {"latency": rng.randint(15, 45), "jitter": 0})
                )
            links[name] = (db, ext)
        return links

    def _database(self) -> None:
        with psycopg.connect(self.cluster.dsn(), autocommit=True) as admin:
            admin.execute("CREATE DATABASE soak")
        with psycopg.connect(self.cluster.dsn("soak"), autocommit=True) as conn:
            conn.execute(self.check.schema)
            conn.execute(audit_ddl(self.spec.tables))

    def _run(self, started: float, logdir: Path, stand_in) -> SoakResult:
        for name, role in PROCESSES:
            self.procs.spawn(name, role)
        self.procs.ready()
        finisher = None
        if isinstance(stand_in, OpsApi):
            finisher = Finisher(stand_in, self.seed)
            finisher.start()
        try:
            t0 = time.time()
            self.nemesis = nem.Nemesis(self.schedule, self.parts, t0).start()
            self._active(t0)
            self.nemesis.heal()
            quiet_from = time.time()
            self.procs.stop_role("producer")
            if isinstance(stand_in, NotificationSink):
                stand_in.reset_plan()
            elif isinstance(stand_in, OpsApi):
                stand_in.fail_next(0)
            if finisher is not None:
                finisher.hurry = True
            why = self._quiet(finisher)
            quiet_seconds = time.time() - quiet_from
            self._alive()
        finally:
            if finisher is not None:
                finisher.stop()
        self.procs.stop_all()
        h = self._history(t0, quiet_from, stand_in, logdir)
        verdict = hist.judge(h)
        pids = self.procs.pids + self.parts.postmasters + [self.toxiproxy._proc.pid]
        return SoakResult(
            self.kind,
            self.seed,
            self.seconds,
            self.mutant,
            self.schedule,
            h,
            verdict,
            quiet_seconds,
            why,
            time.time() - started,
            pids,
        )

    def _active(self, t0: float) -> None:
        """The nemesis phase: supervise and report progress until the duration is over."""
        end = t0 + self.seconds
        last = time.time()
        while time.time() < end:
            self._alive()
            now = time.time()
            if self.live or now - last >= PROGRESS_EVERY:
                last = now
                active = (
                    ", ".join(
                        f"{f.kind} {f.target}" if f.target != "*" else f.kind
                        for f in self.nemesis.now_active()
                    )
                    or "none"
                )
                self.say(f"  {now - t0:5.0f} s: {self._statuses()}; faults now: {active}")
            time.sleep(min(0.2, max(0.0, end - time.time())))

    def _quiet(self, finisher: "Finisher | None") -> str:
        """Wait until every run asked for is terminal, or no progress is possible."""
        patience = max(10.0, 2 * self.spec.lease + 2)
        began = time.time()
        nudges, last_change, last_mark = 0, time.time(), None
        while True:
            self._alive()
            try:
                ((open_runs,),) = self._query(self.spec.open_sql)
                ((mark,),) = self._query("SELECT coalesce(max(id), 0) FROM soak_audit")
            except psycopg.Error:
                time.sleep(0.2)
                continue
            if open_runs == 0:
                return "every run asked for is terminal"
            now = time.time()
            if mark != last_mark:
                last_mark, last_change = mark, now
            elif now - last_change > patience:
                if nudges >= 3:
                    return f"no progress for {patience:.0f} s after {nudges} nudges of the clock"
                nudges += 1
                last_change = now
                if self.spec.nudge:
                    self.cluster.clock.jump(self.spec.nudge)
                self.say(
                    f"  quiet: {open_runs} run(s) open, no change for {patience:.0f} s; letting "
                    f"{self.spec.nudge or self.spec.lease:g} s pass"
                )
            if now - began > QUIET_DEADLINE:
                return (
                    f"quiet-period deadline ({QUIET_DEADLINE:.0f} s) reached with "
                    f"{open_runs} run(s) open"
                )
            time.sleep(0.2)

    # -- the history ---------------------------------------------------------------------
    def _history(self, t0: float, quiet_from: float, stand_in, logdir: Path) -> hist.History:
        h = hist.History(
            self.kind,
            self.seed,
            t0,
            dict(self.spec.params),
            mutant=self.mutant,
            quiet_from=quiet_from,
        )
        h.procs = self.procs.procs
        h.periods = sorted(self.nemesis.periods, key=lambda p: p.start)
        h.ops = read_logs(logdir)
        with psycopg.connect(
            self.cluster.dsn("soak"), autocommit=True, row_factory=dict_row
        ) as conn:
            h.audit = [
                hist.Audit(
                    r["id"], r["tbl"], r["op"], r["ref"], r["old"], r["new"], r["at"], r["xid"]
                )
                for r in conn.execute("SELECT * FROM soak_audit ORDER BY id")
            ]
            for table in self.spec.tables:
                h.final[table] = [_plain_row(r) for r in conn.execute(f"SELECT * FROM {table}")]
        if isinstance(stand_in, RecordingSink):
            h.external["deliveries"] = list(stand_in.timed)
        elif isinstance(stand_in, RecordingOpsApi):
            h.external["creates"] = list(stand_in.timed)
            h.external["ops"] = [
                {"id": o.op_id, "run_id": o.run_id, "status": o.status.value}
                for o in stand_in.snapshot().ops.values()
            ]
        return h


def _plain_row(row: dict) -> dict:
    return {k: (v.timestamp() if hasattr(v, "timestamp") else v) for k, v in row.items()}


def read_logs(logdir: Path) -> list[hist.Op]:
    """Every operation of every process incarnation, from their logs."""
    ops: list[hist.Op] = []
    for path in sorted(logdir.glob("*.jsonl")):
        proc_inc = path.name[: -len(".jsonl")]
        proc = proc_inc.split(".")[0]
        open_ops: dict[int, hist.Op] = {}
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # the last line of a process killed while writing it
            if rec["ev"] == "begin":
                op = hist.Op(
                    f"{proc_inc}:{rec['op']}",
                    proc,
                    rec["name"],
                    dict(rec["runs"]),
                    rec["t"],
                    args=rec.get("args", {}),
                )
                open_ops[rec["op"]] = op
                ops.append(op)
            elif rec["ev"] == "end" and rec["op"] in open_ops:
                op = open_ops.pop(rec["op"])
                op.t1, op.out, op.value = rec["t"], rec["out"], rec.get("value")
                op.app_now = rec.get("app_now")
                op.runs.update(rec.get("runs", {}))
    return sorted(ops, key=lambda o: o.t0)


class Finisher:
    """Finishes the operations API's operations: each after a delay, succeeded or failed, both
    drawn from the seed and the operation's id. ``hurry``: finish every one at once (quiet)."""

    def __init__(self, api: RecordingOpsApi, seed: int):
        self.api, self.seed = api, seed
        self.hurry = False
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ops-finisher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._halt.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._halt.wait(0.1):
            with self.api._lock:
                born = {r[3]: r[0] for r in self.api.timed if r[4]}
            for op in self.api.snapshot().ops.values():
                if op.status.value != "in_progress":
                    continue
                rng = random.Random(f"{self.seed}:{op.op_id}")
                delay, ok = rng.uniform(0.3, 3.0), rng.random() < 0.9
                if self.hurry or time.time() - born.get(op.op_id, 0.0) >= delay:
                    with contextlib.suppress(Exception):
                        self.api.finish(op.op_id, ok)


# ---------------------------------------------------------------------------------------
# The command.
# ---------------------------------------------------------------------------------------


def summary_lines(r: SoakResult, timeline: str | None) -> list[str]:
    v, h = r.verdict, r.history
    faults = Counter(p.kind for p in h.periods)
    ops = len(h.ops)
    status = "passed" if r.passed else "FAILED"
    lines = [
        f"{r.kind}: {status} — {v.runs} runs ({v.terminal} terminal), {ops} operations, "
        f"{len(h.audit)} committed changes, {r.seconds:g} s + quiet {r.quiet_seconds:.1f} s, "
        f"seed {r.seed}" + (f", mutant {r.mutant}" if r.mutant else ""),
        f"  faults injected: {_counts(faults)}",
        f"  events observed: {_counts(v.observed)}",
        f"  quiet period: {r.quiet_end}",
    ]
    missing = [e for e in EXPECTED[r.kind] if not v.observed.get(e)]
    if missing:
        lines.append(
            f"  not observed (the nemesis never caused it; a longer soak or another seed "
            f"may): {', '.join(missing)}"
        )
    causes = Counter(d.why for d in v.duplicates)
    lines.append(
        f"  duplicate external effects: {len(v.duplicates)}"
        + (f", attributed: {_counts(causes)}" if causes else "")
    )
    for d in v.duplicates[:3]:
        lines.append(f"    {d.line(h.t0)}")
    if v.findings:
        by = Counter(f.invariant for f in v.findings)
        lines.append(f"  violations: {len(v.findings)} ({_counts(by)})")
        for f in v.findings[:5]:
            lines.append(f"    {f.line(h.t0)}")
        if len(v.findings) > 5:
            lines.append(
                f"    ... and {len(v.findings) - 5} more (in the JSON report and the timeline)"
            )
        lines.append(f"  replay: {r.replay()}")
    if timeline:
        lines.append(f"  timeline: {timeline}")
    return lines


def _counts(counter: dict) -> str:
    return ", ".join(f"{k} {n}" for k, n in sorted(counter.items())) or "none"


def check_result(r: SoakResult):
    """The soak as the CheckResult the CLI's report writers take."""
    from .check import CheckResult, Stats

    h, v = r.history, r.verdict
    transitions: Counter = Counter()
    ops = h.by_ref()
    for a in h.audit:
        if a.op == "UPDATE" and "status" in a.new:
            op = ops.get(a.ref or "")
            transitions[(a.old["status"], op.name if op else "?", a.new["status"])] += 1
    stats = Stats(
        examples=1,
        steps=len(h.ops),
        invariants_checked=len(h.audit),
        faults=Counter(p.kind for p in h.periods),
        events=Counter(v.observed),
        transitions=transitions,
    )
    failure = v.findings[0].line(h.t0) if v.findings else None
    return CheckResult(
        kind=r.kind,
        seed=r.seed,
        examples=1,
        steps=len(h.ops),
        seconds=r.wall_seconds,
        stats=stats,
        profile="soak",
        failure=failure,
        invariants=tuple(sorted({f.invariant for f in v.findings})),
        counterexample=[f.line(h.t0) for f in v.findings],
        stopped=f"{r.seconds:g} s of work and a quiet period ({r.quiet_end})",
    )


def report_extra(r: SoakResult, timeline: str | None) -> dict:
    h, v = r.history, r.verdict
    return {
        "seed": r.seed,
        "profile": "soak",
        "soak": {
            "kind": r.kind,
            "seconds": r.seconds,
            "mutant": r.mutant,
            "replay": r.replay(),
            "schedule": [f.describe() for f in r.schedule],
            "periods": [
                {
                    "kind": p.kind,
                    "target": p.target,
                    "start": round(p.start - h.t0, 3),
                    "end": round(p.end - h.t0, 3),
                    "detail": p.detail,
                }
                for p in h.periods
            ],
            "violations": [
                {
                    "invariant": f.invariant,
                    "message": f.message,
                    "run": f.run,
                    "operation": f.ref,
                    "at": None if f.t is None else round(f.t - h.t0, 3),
                    "nemesis": [p.describe(h.t0) for p in f.periods],
                }
                for f in v.findings
            ],
            "duplicates": [
                {
                    "run": d.run,
                    "effect": d.effect,
                    "owner": d.owner,
                    "attempt": d.attempt,
                    "cause": d.cause,
                    "why": d.why,
                    "at": round(d.t - h.t0, 3),
                    "nemesis": [p.describe(h.t0) for p in d.periods],
                }
                for d in v.duplicates
            ],
            "quiet": {"seconds": round(r.quiet_seconds, 3), "ended": r.quiet_end},
            "timeline": timeline,
        },
    }


def default_timeline(args, kind: str, seed: int) -> str:
    for report in (args.json, args.junit):
        if report and not outpath.is_stream(report):  # no "/dev/stdout.timeline.html"
            p = Path(report)
            return str(p.with_name(p.stem + ".timeline.html"))
    return f"knownstate-soak-{kind}-{seed}.html"


def cmd_soak(args) -> int:
    from . import cli, timeline as tl

    if not MIN_SECONDS <= args.seconds <= MAX_SECONDS:
        raise cli.UsageError(f"--seconds must be between {MIN_SECONDS:g} and {MAX_SECONDS:g}")
    outputs = (("json", "JSON report"), ("junit", "JUnit report"), ("timeline", "timeline"))
    for flag, what in outputs:
        problem = getattr(args, flag) and outpath.problem(getattr(args, flag), what)
        if problem:
            raise cli.UsageError(problem)
    seed = args.seed if args.seed is not None else secrets.randbelow(2**32)
    live = sys.stdout.isatty() and not os.environ.get("CI")
    out = _LiveLine() if live else None
    try:
        soak = Soak(
            args.kind,
            args.seconds,
            seed,
            args.mutant,
            say=out.say if out else (lambda line: print(line, flush=True)),
            live=live,
        )
    except ValueError as e:
        raise cli.UsageError(str(e)) from None
    print(
        f"knownstate soak {args.kind}: {args.seconds:g} s under a nemesis, seed {seed}"
        + (
            f", mutant {args.mutant}: {_mutant_description(args.kind, args.mutant)}"
            if args.mutant
            else ""
        ),
        flush=True,
    )
    print(f"  replay: {replay_command(args.kind, args.seconds, seed, args.mutant)}")
    print(f"  nemesis schedule ({len(soak.schedule)} faults, drawn from the seed):")
    for f in soak.schedule:
        print(f"    {f.describe()}")
    sys.stdout.flush()
    report = _report(args, seed)  # made now, so that its seconds are the soak's
    try:
        r = soak.run()
    except (KeyboardInterrupt, EnvironmentFault) as e:  # reports on every exit but 2, as verify
        if args.json or args.junit:
            _write_cut_short(args, report, e)
        raise
    if out:
        out.done()
    timeline = args.timeline or (None if r.passed else default_timeline(args, args.kind, seed))
    if timeline:
        try:
            tl.write(
                timeline,
                r.history,
                r.verdict,
                title=f"knownstate soak {r.kind}, seed {r.seed}"
                + (f", mutant {r.mutant}" if r.mutant else ""),
            )
        except outpath.OutputError as e:
            print(f"knownstate: {e}", file=sys.stderr)
            timeline = None
    for line in summary_lines(r, timeline):
        print(line)
    written = write_reports(args, report, r, timeline) if args.json or args.junit else True
    code = _exit_code(r)
    return code if code or written else cli.EXIT_ENVIRONMENT


def _exit_code(r: SoakResult) -> int:
    from . import cli

    if r.mutant is None:
        return cli.EXIT_OK if r.passed else cli.EXIT_FAILED
    # As `verify --mutant`: caught when the soak failed naming the invariant the mutant declares.
    declared = next(m.invariant for m in kinds_mutants(r.kind) if m.name == r.mutant)
    caught = not r.passed and declared in {f.invariant for f in r.verdict.findings}
    print(
        f"knownstate soak: {'CAUGHT' if caught else 'NOT CAUGHT'} — mutant {r.mutant} "
        f"({'the violations name' if caught else 'no violation names'} {declared})"
    )
    return cli.EXIT_OK if caught else cli.EXIT_FAILED


def kinds_mutants(kind: str):
    from . import kinds

    return kinds.mutants(kind)


def _report(args, seed: int):
    """The report of this soak: one run, of profile ``soak``."""
    from . import report as rp

    mutant = next((m for m in kinds_mutants(args.kind) if m.name == args.mutant), None)
    unit = rp.Unit(0, args.kind, seed, mutant)
    argv = ["knownstate", *getattr(args, "argv", sys.argv[1:])]
    report = rp.Report("soak", argv, "soak", [seed], [unit], 1)
    report.start(unit)
    return report


def _write_cut_short(args, report, e: BaseException) -> None:
    """The reports of a soak a signal (130, 143) or a real part (3) stopped."""
    from . import cli

    if isinstance(e, KeyboardInterrupt):
        sig = getattr(e, "signal", "SIGINT")
        doc = report.document("interrupted", f"interrupted by {sig}", sig)
    else:
        doc = report.document("environment", str(e))
    unit = report.units[0]
    doc["soak"] = {
        "kind": unit.kind,
        "seconds": args.seconds,
        "mutant": args.mutant,
        "replay": replay_command(unit.kind, args.seconds, unit.seed, args.mutant),
    }
    cli.reports(doc, args.json, args.junit)


def write_reports(args, report, r: SoakResult, timeline: str | None) -> bool:
    """The JSON and JUnit reports ``verify`` writes (one run, of profile ``soak``), the soak's
    own findings under ``soak``, the soak's replay command; False when one could not be written
    (said in one line)."""
    from . import cli
    from . import report as rp

    unit = report.units[0]
    rec = rp.finished_record(unit, check_result(r), rp.Replay(profile="soak"))
    rec["replay"] = r.replay()  # also on a pass: the command that runs this soak again
    report.finish(unit, rec)
    doc = report.document()
    doc["soak"] = report_extra(r, timeline)["soak"]
    return cli.reports(doc, args.json, args.junit) == doc["exit_code"]


def _mutant_description(kind: str, mutant: str) -> str:
    from . import kinds

    return next((m.description for m in kinds.mutants(kind) if m.name == mutant), "")


class _LiveLine:
    """On a terminal: one line rewritten in place."""

    def say(self, line: str) -> None:
        sys.stdout.write("\r\033[K" + line.strip()[:150])
        sys.stdout.flush()

    def done(self) -> None:
        sys.stdout.write("\r\033[K")
        sys.stdout.flush()


MIN_SECONDS = 5.0


def add_parser(subparsers) -> None:
    """Register ``soak``."""
    from . import cli

    p = subparsers.add_parser(
        "soak",
        help="run the reference worker processes under a nemesis and judge the history",
        description="Runs a kind's reference worker loops as OS processes against the real parts "
        "for a duration while a nemesis drawn from the seed kills, stalls and partitions them, "
        "crashes PostgreSQL and moves its clock; then judges what was recorded.",
    )
    p.add_argument("kind", metavar="KIND", choices=KINDS, help=f"one of {', '.join(KINDS)}")
    p.add_argument(
        "--seconds",
        type=float,
        default=DEFAULT_SECONDS,
        help=f"duration of the nemesis phase (default {DEFAULT_SECONDS:g}, "
        f"at most {MAX_SECONDS:g})",
    )
    p.add_argument("--seed", type=cli.seed_option, help=cli.SEED_HELP)
    p.add_argument("--mutant", metavar="NAME", help="run the worker processes on a named mutant")
    p.add_argument("--json", metavar="FILE", help="write a JSON report")
    p.add_argument("--junit", metavar="FILE", help="write a JUnit XML report")
    p.add_argument(
        "--timeline",
        metavar="FILE",
        help="write the timeline (HTML) here; on failure it is always written",
    )
    p.set_defaults(func=cmd_soak)
