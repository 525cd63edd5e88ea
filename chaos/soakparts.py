"""The real parts of a soak as the nemesis and the recorder see them.

- the stand-ins, each also recording when it acted and for which operation (the sender names it
  in a header or in its URL): the notification sink, the operations API, the receiver of a
  described kind; each can be told to refuse calls and to calm down, and gives its record to
  the history;
- the audit: a trigger on every table of the kind's workspace that writes, in the same
  transaction as each committed row change, the row before and after, the database clock and
  the operation that made it (its statements' comment);
- the worker processes (:class:`Processes`): spawned, signalled, supervised; their logs read
  back (:func:`read_logs`);
- :class:`SoakParts`, the :class:`~knownstate.chaos.nemesis.Parts` the nemesis acts on; what
  a hold reads comes from the server (the audit of the incarnation's changes and the runs as
  the kind reads them, :meth:`~.soakkinds.SoakKind.current`), never from a timer.

The real parts themselves start in :class:`~knownstate.chaos.harness.Env`, like every check's.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable
from urllib.parse import parse_qs, urlsplit

import psycopg

from . import history as hist
from . import soakworker, tools
from .generic import Receiver
from .harness import EnvironmentFault
from .judge import RunRow
from .opsapi import OpsApi
from .sink import NotificationSink
from .toxi import Toxic

if TYPE_CHECKING:
    from .harness import Env, Workspace
    from .soakkinds import SoakKind


class SoakEnvironmentError(EnvironmentFault):
    """A real part of the soak died or misbehaved, and the harness did not make it."""


# ---------------------------------------------------------------------------------------
# Stand-ins that also record when, and for which operation.
# ---------------------------------------------------------------------------------------

_request = threading.local()  # the operation that sent the request this thread is handling


def _noting_operation(handler: type) -> type:
    """The stand-in's request handler, also noting the sender's operation: its header, or the
    ``ks-op`` parameter of its URL (a client whose requests take no header of ours)."""

    class Noting(handler):
        def parse_request(self) -> bool:
            ok = super().parse_request()
            query = parse_qs(urlsplit(self.path).query) if ok else {}
            _request.op = (self.headers.get(soakworker.OP_HEADER) if ok else None) or next(
                iter(query.get("ks-op", [])), None
            )
            _request.token = next(iter(query.get("ks-token", [])), None)
            return ok

    return Noting


class _Recording:
    def start(self):
        super().start()
        self._server.RequestHandlerClass = _noting_operation(self._server.RequestHandlerClass)
        return self


class RecordingSink(_Recording, NotificationSink):
    """The notification sink, also keeping (time, delivery, attempt, answer, sender's operation)
    per request."""

    label = "sink"

    def reset(self) -> None:
        super().reset()
        self.timed: list[tuple[float, int, int, int, str | None]] = []

    def _record(self, key: tuple[int, int], asked: int | None = None) -> int:
        code = super()._record(key, asked)
        with self._lock:
            self.timed.append((time.time(), key[0], key[1], code, getattr(_request, "op", None)))
        return code

    def refuse(self, calls: int, code: int) -> None:
        self.plan(*[code] * calls)

    def calm(self) -> None:
        self.reset_plan()

    def record(self) -> dict:
        with self._lock:
            return {"deliveries": list(self.timed)}


class RecordingReceiver(_Recording, Receiver):
    """The receiver of a described kind, also keeping (time, run, the attempt its sender carried,
    answer, sender's operation) per call, and the idempotency keys each run's calls carried."""

    label = "receiver"

    def reset(self) -> None:
        super().reset()
        self.timed: list[tuple[float, str, int | None, int, str | None]] = []

    def _record(self, key: tuple[str, str], asked: int | None = None) -> int:
        code = super()._record(key, asked)
        token = getattr(_request, "token", None)
        with self._lock:
            self.timed.append(
                (
                    time.time(),
                    key[0],
                    int(token) if token and token.isdigit() else None,
                    code,
                    getattr(_request, "op", None),
                )
            )
        return code

    refuse, calm = RecordingSink.refuse, RecordingSink.calm

    def record(self) -> dict:
        keys = {run: sorted(sent) for run, sent in self.keys().items()}
        with self._lock:
            return {"deliveries": list(self.timed), "keys": keys}


class RecordingOpsApi(_Recording, OpsApi):
    """The operations API, also keeping (time, run, key, operation id, created?, sender's
    operation) per create request it acted on."""

    label = "ops"

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

    def refuse(self, calls: int, code: int) -> None:
        self.fail_next(calls)

    def calm(self) -> None:
        self.fail_next(0)

    def record(self) -> dict:
        ops = [
            {"id": o.op_id, "run_id": o.run_id, "status": o.status.value}
            for o in self.snapshot().ops.values()
        ]
        with self._lock:
            return {"creates": list(self.timed), "ops": ops}


class Finisher:
    """Finishes the operations API's operations: each after a delay, succeeded or failed, both
    drawn from the seed and the operation's id. ``hurry``: finish every one at once (quiet)."""

    def __init__(self, api: RecordingOpsApi, seed: int):
        self.api, self.seed = api, seed
        self.hurry = False
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ops-finisher", daemon=True)

    def start(self) -> "Finisher":
        self._thread.start()
        return self

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
# The audit.
# ---------------------------------------------------------------------------------------

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
CREATE INDEX ON soak_audit (app, id);
"""


def audit_ddl(tables: tuple[str, ...]) -> str:
    """The audit table and its trigger on each of ``tables`` (a workspace's: all of them)."""
    return AUDIT_DDL + "".join(
        f"CREATE TRIGGER soak_audit AFTER INSERT OR UPDATE OR DELETE ON {t} "
        "FOR EACH ROW EXECUTE FUNCTION soak_audit();\n"
        for t in tables
    )


def audits(conn: psycopg.Connection, where: str = "TRUE", params=None) -> list[hist.Audit]:
    rows = conn.execute(
        f"SELECT id, tbl, op, ref, old, new, at, xid FROM soak_audit WHERE {where} ORDER BY id",
        params,
    ).fetchall()
    return [hist.Audit(*r) for r in rows]


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
    """Spawns, signals and supervises the soak's worker processes. ``spec``: what every process
    is told (its kind, the seed, the mutant, the kind's parameters); ``dsn(link)``: the
    workspace through a link; ``app(name, inc)``: an incarnation's application name."""

    def __init__(
        self,
        spec: dict,
        logdir: Path,
        links: dict,
        dsn: Callable,
        app: Callable[[str, int], str],
        spawner: concurrent.futures.Executor,
    ):
        self.spec, self.logdir, self.links, self.dsn, self.app = spec, logdir, links, dsn, app
        self.spawner = spawner
        self.running: dict[str, Running] = {}
        self.procs: list[hist.Proc] = []
        self.pids: list[int] = []
        self._lock = threading.RLock()
        self._incs: Counter = Counter()

    def spawn(self, name: str, role: str) -> Running:
        """Start a new incarnation of ``name`` (forked on the spawner thread, which outlives
        every child: a child's parent-death signal fires when the thread that forked it ends)."""
        return self.spawner.submit(self._spawn, name, role).result()

    def _spawn(self, name: str, role: str) -> Running:
        with self._lock:
            self._incs[name] += 1
            inc = self._incs[name]
            log, err = self.logdir / f"{name}.{inc}.jsonl", self.logdir / f"{name}.{inc}.err"
            db, ext = self.links[name]
            spec = {
                **self.spec,
                "role": role,
                "name": name,
                "inc": inc,
                "app": self.app(name, inc),
                "log": str(log),
                "dsn": self.dsn(db),
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


# ---------------------------------------------------------------------------------------
# The real parts, as the nemesis sees them.
# ---------------------------------------------------------------------------------------


class SoakParts:
    """Implements :class:`knownstate.chaos.nemesis.Parts` over the soak's real parts."""

    def __init__(
        self, env: "Env", ws: "Workspace", procs: Processes, links: dict, stand_in, kind: "SoakKind"
    ):
        self.env, self.ws, self.procs, self.links = env, ws, procs, links
        self.stand_in, self.kind = stand_in, kind
        self.owned = kind.description.owned
        self.claimable = set(kind.claimable())
        self._conn: psycopg.Connection | None = None  # the nemesis's own look at the database
        self._seen: dict[str, tuple[int, dict]] = {}  # app -> (last audit id, run -> claim)
        self.postmasters: list[int] = []

    # -- what a hold reads: the server's view, never a guess from a timer -----------------
    def read(self, fn: Callable[[psycopg.Connection], object]):
        """``fn(conn)`` on the nemesis's own connection (direct, autocommit), or None when the
        database cannot be read now (crashed, restarting)."""
        try:
            if self._conn is None or self._conn.closed or self._conn.broken:
                self._conn = self.ws.connect(application_name=self.env.app_name("nemesis"))
            return fn(self._conn)
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
        r = self.procs.running[proc]
        return self.procs.app(r.name, r.inc)

    def holds(self, proc: str, again: bool = False) -> dict[str, tuple[object, int]]:
        """The runs ``proc``'s incarnation claimed (its committed changes, from the audit) that
        the kind still shows owned under that claim's token, with how many changes it committed
        to each under that token (the claim is the first). ``again``: only those a claim can
        take again once the reaper took them back (:meth:`SoakKind.claimed_again`)."""
        app = self._app(proc)
        last, claims = self._seen.get(app, (0, {}))

        def look(conn) -> dict[str, RunRow]:
            new = audits(conn, "app = %(app)s AND id > %(last)s", {"app": app, "last": last})
            rows = self.kind.versions(conn, new) if new else {}
            for a in new:
                before, after = rows.get((a.id, "old")), rows.get((a.id, "new"))
                if not isinstance(after, RunRow):
                    continue
                if after.status in self.owned and (
                    before is None or before.status not in self.owned
                ):
                    claims[after.key] = [after.token, 0]
                if after.key in claims and claims[after.key][0] == after.token:
                    claims[after.key][1] += 1
            self._seen[app] = (max([last, *(a.id for a in new)]), claims)
            return self.kind.current(conn, list(claims))

        now = self.read(look)
        if now is None:
            return {}
        return {
            run: (token, writes)
            for run, (token, writes) in claims.items()
            if run in now
            and now[run].status in self.owned
            and now[run].token == token
            and (not again or self.kind.claimed_again(now[run]))
        }

    def writes_bound(self) -> int:
        return self.kind.writes_bound

    def quiet(self, proc: str, within: float) -> bool:
        deadline = time.monotonic() + within
        sql = (
            "SELECT count(*) FILTER (WHERE state = 'active'), count(*) FILTER "
            "(WHERE state <> 'idle') FROM pg_stat_activity WHERE application_name = %(app)s"
        )
        while True:
            rows = self.read(lambda c: c.execute(sql, {"app": self._app(proc)}).fetchall())
            if rows is None:
                return False
            ((active, busy),) = rows
            if not busy:
                return True
            if not active or time.monotonic() > deadline:
                return False  # a transaction left open: it cannot move while its owner is stopped
            time.sleep(0.01)

    def taken(self, held: dict[str, object]) -> dict[str, str] | None:
        now = self.read(lambda conn: self.kind.current(conn, list(held)))
        if now is None:
            return None
        out = {}
        for run, token in held.items():
            row = now.get(run)
            if row is not None and row.status in self.owned:
                out[run] = "held" if row.token == token else "reheld"
            else:
                out[run] = "free" if row is not None and row.status in self.claimable else "done"
        return out

    def slow_others(self, proc: str, ms: int | None) -> None:
        toxic = Toxic("latency", "upstream", {"latency": ms or 0, "jitter": 0}, label="hold")
        for name, (_, ext) in self.links.items():
            if ext is None or name == proc:
                continue
            if ms is None:
                ext.remove(toxic)
            else:
                ext.add(toxic)

    # -- the processes ----------------------------------------------------------------------
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

    # -- the database and the stand-in --------------------------------------------------------
    def clock_jump(self, seconds: float) -> None:
        self.env.clock.jump(seconds)

    def db_crash(self) -> None:
        self.env.crash()

    def db_restart(self) -> None:
        self.procs.spawner.submit(self.env.restart).result()  # forked where the workers are
        self.postmasters.append(self.env.db._proc.pid)

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
        self.stand_in.refuse(calls, code)
