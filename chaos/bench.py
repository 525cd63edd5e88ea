"""Benchmarks: every figure is a ratio to a ceiling measured in the same run, on the same machine.

Absolute numbers depend on the machine; a ratio much less so. The **ceiling** is the cheapest
durable write PostgreSQL offers over the same number of connections: a one-row
``UPDATE ... SET n = n + 1`` in autocommit, each connection on its own row. A ratio of 0.5 means
the code under test gets half as many units of useful work through per second as that bare
commit loop gets commits.

``bench outbox``
    The reference worker loop (:class:`knownstate.impl.outbox.OutboxWorker`: claim a batch, a
    no-op effect, record the batch's outcomes with one fenced write) over a queue kept full; the
    same loop recording row by row; optionally with the real HTTP notification sink (in a
    process of its own) as its effect; and, side by side in the same run, the peer queues that
    are installed (pgqueuer, procrastinate: the ``bench`` extra) with the same workers and batch
    size. A sweep of batch sizes, each from fresh tables. The cluster runs with fsync on by
    default, as a user runs PostgreSQL (``--durability no-fsync`` is the harness's setting).
``bench documents``
    The real document server (FastAPI under uvicorn, in a process of its own, its store on a
    connection pool); each client saves its own document, PUT after PUT (it knows the version
    from the previous answer); saves/s against the ceiling and PUT latency. With ``--rate R``,
    first an open loop: PUTs due at R per second whatever the answers' pace, each one's latency
    counted from when it was due.

The loops under test (and the ceiling's) are threads of this process. psycopg releases the GIL
while it waits on the server, the loops' own Python uses well under one core here, and a
comparison with one OS process per worker gave the same CPU per delivery and the same ratio
within the noise; threads let every loop be started, parked and stopped together. The servers
they drive run in processes of their own, as they would be deployed.

**Interleaved windows.** The machine may be shared, and other load comes and goes within
seconds. So each figure's S seconds are cut into slices of about one second, and the slices of
the ceiling and of the loops under test alternate (ceiling, no-op, sink, ceiling, ...): every
figure sees the same background. Each loop keeps its connection across slices and sits idle
between its own slices.

**Where the time goes.** Each window also records the CPU spent in it by this process, the
PostgreSQL server, the server process under test (sink or document server), and everything
else on the machine, so the output can say what bounds the ratio: CPU per unit of work when the
cores are saturated, otherwise (fsync on) the wait for WAL flushes. The outbox bench also counts
each figure's transactions and the WAL it wrote per job.

Bounds: at most :data:`MAX_LOOPS` concurrent loops and :data:`MAX_SECONDS` per figure; every
loop stops at the end of its slice; everything (threads, processes, servers, the cluster) is
stopped and removed on exit, also after Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import math
import os
import re
import select
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import psycopg

from knownstate.impl import outbox as ob
from knownstate.model.outbox import Claim

from . import tools
from .cluster import PostgresCluster
from .sink import NotificationSink

MAX_SECONDS = 600.0
MAX_LOOPS = 64
EFFECTS = ("noop", "sink")
SLICE_SECONDS = 1.0
CEILING_TABLE = "bench_ceiling"
CEILING_SQL = f"UPDATE {CEILING_TABLE} SET n = n + 1 WHERE id = %s"


# ---------------------------------------------------------------------------------------
# CPU accounting.
# ---------------------------------------------------------------------------------------

_TICK = os.sysconf("SC_CLK_TCK")


def _proc_stat(pid: int | str) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # [0] state, [1] ppid, [11..14] utime stime cutime cstime
    return stat[stat.rindex(")") + 2 :].split()


def _tree_cpu(root: int | None) -> float:
    """CPU seconds used so far by process ``root``, its live children and its reaped children.

    PostgreSQL backends are each their own process group, so they are found by parent pid; a
    backend that exited is counted in the postmaster's cutime/cstime. The difference of two
    readings is what the tree spent in between, even if connections closed meanwhile."""
    if root is None:
        return 0.0
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        fields = _proc_stat(pid)
        if fields and (int(pid) == root or int(fields[1]) == root):
            total += sum(int(x) for x in fields[11:15])
    return total / _TICK


def _machine_busy() -> float:
    """CPU seconds the whole machine spent busy so far (all cores, everything but idle and
    iowait)."""
    with open("/proc/stat") as f:
        parts = [int(x) for x in f.readline().split()[1:]]
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)
    guest = sum(parts[8:10]) if len(parts) > 9 else 0  # guest time is already counted in user
    return (sum(parts) - idle - guest) / _TICK


@dataclass
class Cpu:
    """Seconds of wall time and of CPU, per consumer, accumulated over the windows of one figure."""

    wall: float = 0.0
    bench: float = 0.0  # this process: the loops (threads) and the bench itself
    postgres: float = 0.0  # the PostgreSQL server (postmaster and backends)
    app: float = 0.0  # the server process the loops drive (sink or document server), if any
    machine: float = 0.0  # every core of the machine, busy

    @property
    def others(self) -> float:
        return max(0.0, self.machine - self.bench - self.postgres - self.app)

    def add(self, other: "Cpu") -> None:
        for k in ("wall", "bench", "postgres", "app", "machine"):
            setattr(self, k, getattr(self, k) + getattr(other, k))


class _CpuMeter:
    def __init__(self, postmaster: int | None, app: int | None = None):
        self.postmaster, self.app = postmaster, app

    def read(self) -> Cpu:
        return Cpu(
            time.monotonic(),
            time.process_time(),
            _tree_cpu(self.postmaster),
            _tree_cpu(self.app),
            _machine_busy(),
        )


def _diff(a: Cpu, b: Cpu) -> Cpu:
    return Cpu(
        *(getattr(b, k) - getattr(a, k) for k in ("wall", "bench", "postgres", "app", "machine"))
    )


# ---------------------------------------------------------------------------------------
# N loops, run in slices: started together, stopped together, idle in between.
# ---------------------------------------------------------------------------------------


@dataclass
class Figure:
    """One measured loop set: units of work done, in how many seconds, the CPU it took."""

    name: str
    loops: int
    count: int = 0
    seconds: float = 0.0
    cpu: Cpu = field(default_factory=Cpu)
    slices: list[float] = field(default_factory=list)  # the rate of each slice, for the spread

    @property
    def rate(self) -> float:
        return self.count / self.seconds if self.seconds else 0.0

    def cpu_us(self, consumer: str) -> float:
        """CPU microseconds per unit of work spent by ``consumer``."""
        return getattr(self.cpu, consumer) / self.count * 1e6 if self.count else 0.0

    def as_dict(self) -> dict:
        cores = os.cpu_count() or 1
        out = {
            "count": self.count,
            "seconds": round(self.seconds, 3),
            "per_second": round(self.rate, 1),
            "slices": len(self.slices),
            "slice_rate_min": round(min(self.slices), 1) if self.slices else 0.0,
            "slice_rate_max": round(max(self.slices), 1) if self.slices else 0.0,
            "cpu_us_per_op": {
                k: round(self.cpu_us(k), 1)
                for k in ("bench", "postgres", "app", "others")
                if k != "app" or self.cpu.app
            },
            "cores_busy": round(self.cpu.machine / self.cpu.wall, 2) if self.cpu.wall else 0.0,
            "cores": cores,
        }
        return out


class _Loops:
    """``n`` threads; thread ``i`` calls ``make(i)`` once (connect, warm up) to get its ``step``,
    then runs ``step()`` (returning units of work done) repeatedly during each slice the main
    thread opens with :meth:`run_slice`. ``close(i)`` runs in the thread when it ends."""

    def __init__(
        self,
        n: int,
        make: Callable[[int], Callable[[], int]],
        close: Callable[[int], None] = lambda i: None,
        name: str = "loop",
    ):
        self.n, self.make, self.close, self.name = n, make, close, name
        self._start = threading.Barrier(n + 1)
        self._end = threading.Barrier(n + 1)
        self._stop = True
        self._counts = [0] * n
        self._errors: list[BaseException] = []
        self._threads: list[threading.Thread] = []

    def _run(self, i: int) -> None:
        try:
            step = self.make(i)
            while True:
                self._start.wait()
                done = 0
                while not self._stop:
                    done += step()
                self._counts[i] += done
                self._end.wait()
        except threading.BrokenBarrierError:
            pass
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            self._errors.append(e)
            self._start.abort()
            self._end.abort()
        finally:
            with contextlib.suppress(Exception):
                self.close(i)

    def __enter__(self) -> "_Loops":
        for i in range(self.n):
            t = threading.Thread(
                target=self._run, args=(i,), name=f"bench-{self.name}-{i}", daemon=True
            )
            t.start()
            self._threads.append(t)
        return self

    def run_slice(
        self,
        seconds: float,
        meter: _CpuMeter,
        fig: Figure,
        during: Callable[[], None] | None = None,
    ) -> None:
        """Run every loop for ``seconds``; add the work done, the window and its CPU to ``fig``.
        ``during`` runs in a helper thread halfway through the window, concurrently with the
        loops (e.g. ANALYZE while deliveries are in flight); it is charged to the window."""
        before = sum(self._counts)
        self._stop = False
        helper: threading.Thread | None = None
        helper_error: list[BaseException] = []
        try:
            self._start.wait(timeout=60)  # every loop is connected and ready: the window opens
            a = meter.read()
            if during is not None:
                time.sleep(seconds / 2)
                helper = threading.Thread(
                    target=_capture(during, helper_error),
                    name=f"bench-{self.name}-during",
                    daemon=True,
                )
                helper.start()
                time.sleep(seconds / 2)
            else:
                time.sleep(seconds)
            self._stop = True
            self._end.wait(timeout=60)
            if helper is not None:
                helper.join(timeout=60)
            b = meter.read()
        except threading.BrokenBarrierError:
            self._stop = True
            if self._errors:
                raise self._errors[0] from None
            raise RuntimeError(f"bench loops {self.name!r} did not start or stop in time") from None
        if helper_error:
            raise helper_error[0]
        done = sum(self._counts) - before
        window = _diff(a, b)
        fig.count += done
        fig.seconds += window.wall
        fig.cpu.add(window)
        fig.slices.append(done / window.wall if window.wall else 0.0)

    def __exit__(self, *exc) -> None:
        self._stop = True
        self._start.abort()
        self._end.abort()
        for t in self._threads:
            t.join(timeout=30)


def _capture(fn: Callable[[], None], errors: list) -> Callable[[], None]:
    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised by the main thread
            errors.append(e)

    return run


def _slices(seconds: float) -> tuple[int, float]:
    """How many slices, and how long each, for a figure of ``seconds``."""
    n = max(1, round(seconds / SLICE_SECONDS))
    return n, seconds / n


def _check_bounds(n: int, seconds: float, what: str) -> None:
    if not 1 <= n <= MAX_LOOPS:
        raise ValueError(f"{what} must be 1..{MAX_LOOPS}, got {n}")
    if not 0 < seconds <= MAX_SECONDS:
        raise ValueError(f"seconds must be in (0, {MAX_SECONDS:g}], got {seconds:g}")


# ---------------------------------------------------------------------------------------
# The ceiling: one-row UPDATE commits in autocommit, each connection on its own row.
# ---------------------------------------------------------------------------------------


def _ceiling_loops(dsn: str, n: int) -> _Loops:
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(f"DROP TABLE IF EXISTS {CEILING_TABLE}")
        admin.execute(
            f"CREATE TABLE {CEILING_TABLE} (id integer PRIMARY KEY, n bigint NOT NULL DEFAULT 0)"
        )
        admin.execute(
            f"INSERT INTO {CEILING_TABLE} (id) SELECT generate_series(0, %s::int)", (n - 1,)
        )
        admin.execute(f"VACUUM ANALYZE {CEILING_TABLE}")
    conns: dict[int, psycopg.Connection] = {}

    def make(i: int) -> Callable[[], int]:
        conn = conns[i] = psycopg.connect(dsn, autocommit=True)
        for _ in range(6):  # past psycopg's prepare threshold: the loop runs a prepared statement
            conn.execute(CEILING_SQL, (i,))
        args = (i,)

        def step() -> int:
            conn.execute(CEILING_SQL, args)
            return 1

        return step

    return _Loops(n, make, lambda i: conns.pop(i).close() if i in conns else None, "ceiling")


def _ratio(fig: Figure, ceiling: Figure) -> float:
    return round(fig.rate / ceiling.rate, 4) if ceiling.rate else 0.0


def _cpu_per_op(fig: Figure) -> float:
    """CPU microseconds per unit of work, everything the work itself used (not the others)."""
    return fig.cpu_us("bench") + fig.cpu_us("postgres") + fig.cpu_us("app")


# ---------------------------------------------------------------------------------------
# Servers under test in a process of their own (as they would be deployed): their Python does
# not share a GIL with the loops driving them, and their CPU is counted apart.
# ---------------------------------------------------------------------------------------


def _serve(kind: str, arg: str) -> None:
    """Child process: serve until stdin closes. Prints the port first; a sink prints, last, what it
    received as JSON."""
    import json

    try:
        if kind == "documents":
            from knownstate.impl.documents import DocumentServer

            with DocumentServer(arg) as server:
                print(server.port, flush=True)
                sys.stdin.read()  # returns when the parent closes the pipe (or dies)
        else:
            with NotificationSink() as sink:
                print(sink.port, flush=True)
                sys.stdin.read()
                print(
                    json.dumps({"received": len(sink.log), "duplicates": sink.duplicates()}),
                    flush=True,
                )
    except KeyboardInterrupt:
        pass


class _ServerProcess:
    """``kind`` ("documents" or "sink") in a child process; a context manager like every real part.
    The child dies with its parent (PDEATHSIG) and stops when its stdin closes."""

    def __init__(self, kind: str, arg: str = ""):
        self.kind, self.arg = kind, arg
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self.final: dict = {}

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def __enter__(self) -> "_ServerProcess":
        code = (
            "import sys; from knownstate.chaos.bench import _serve; "
            "_serve(sys.argv[1], sys.argv[2])"
        )
        self.proc = tools.spawn(
            [sys.executable, "-c", code, self.kind, self.arg],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            line = self._line(60)
            if not line.strip().isdigit():
                raise RuntimeError(
                    f"the {self.kind} server process did not start (exit code {self.proc.poll()})"
                )
            self.port = int(line)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _line(self, timeout: float) -> str:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        return self.proc.stdout.readline() if ready else ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc) -> None:
        import json

        proc = self.proc
        if proc is None:
            return
        with contextlib.suppress(OSError):
            proc.stdin.close()
        with contextlib.suppress(Exception):
            line = self._line(10)
            if line.strip():
                self.final = json.loads(line)
        self.proc = None
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        with contextlib.suppress(OSError):
            proc.stdout.close()


# ---------------------------------------------------------------------------------------
# bench outbox
# ---------------------------------------------------------------------------------------

DURABILITY: dict[str, tuple[dict[str, str], str]] = {
    "fsync": (
        {"fsync": "on", "full_page_writes": "on", "synchronous_commit": "on"},
        "fsync on (PostgreSQL's default, what a user runs): a commit returns once its WAL "
        "is on disk",
    ),
    "no-fsync": (
        {"fsync": "off", "full_page_writes": "off", "synchronous_commit": "on"},
        "fsync off (the test harness's throwaway setting): a commit never waits for the "
        "disk, and a power loss can corrupt the cluster",
    ),
}
BATCHES = (1, 10, 100)
MAX_BATCH = 10_000
PEERS = ("pgqueuer", "procrastinate")
OURS = "outbox"  # the reference worker loop, batched completion, no-op effect
OURS_PER_ROW = "outbox-per-row"  # the same loop recording each row in its own transaction
OURS_SINK = "outbox-sink"  # the batched loop with the real HTTP sink as its effect
PAYLOAD_SQL = "jsonb_build_object('event', 'bench', 'n', g)"
WARM_FILL = 20_000  # jobs each queue holds before its warm-up window


class _Queue:
    """One queue's tables, kept full between windows (never during one): no window runs dry."""

    name = ""
    tables: tuple[str, ...] = ()
    waiting_sql = ""

    def __init__(self, dsn: str):
        self.dsn = dsn

    def install(self) -> None:
        raise NotImplementedError

    def add(self, n: int) -> None:
        raise NotImplementedError

    def _sql(self, sql: str, params=None) -> list[tuple]:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            cur = conn.execute(sql, params)
            return cur.fetchall() if cur.description else []

    def top_up(self, need: int) -> None:
        """Make sure at least ``need`` jobs wait."""
        missing = need - self._sql(self.waiting_sql)[0][0]
        if missing > 0:
            self.add(missing)

    def reset(self) -> None:
        """Empty this queue's tables: every batch size starts from the same state."""
        self._sql(f"TRUNCATE {', '.join(self.tables)} RESTART IDENTITY CASCADE")

    def analyze(self) -> None:
        """Statistics gathered with nothing in flight: the case that could mislead a planner into
        a partial index of in-flight rows for each fenced write (see fenced_write_plans)."""
        for t in self.tables:
            self._sql(f"ANALYZE {t}")


class _OutboxQueue(_Queue):
    name = OURS
    tables = ("outbox_delivery",)
    waiting_sql = "SELECT count(*) FROM outbox_delivery WHERE status = 'pending'"

    def install(self) -> None:
        self._sql("DROP TABLE IF EXISTS outbox_delivery")
        self._sql(ob.SCHEMA)

    def add(self, n: int) -> None:
        self._sql(
            f"INSERT INTO outbox_delivery (payload) SELECT {PAYLOAD_SQL} "
            "FROM generate_series(1, %s) g",
            (n,),
        )


class _PgqueuerQueue(_Queue):
    """pgqueuer's tables, installed by its ``Queries.install()`` with its default durability
    (every table logged), filled by its batch ``Queries.enqueue``."""

    name = "pgqueuer"
    entrypoint = "bench"

    def __init__(self, dsn: str):
        super().__init__(dsn)
        from pgqueuer.queries import Queries

        names = Queries.__dataclass_fields__["qbe"].default_factory().qualified
        self.tables = (names.queue_table, names.queue_table_log)
        self.waiting_sql = f"SELECT count(*) FROM {names.queue_table} WHERE status = 'queued'"

    def _run(self, fn) -> None:
        from pgqueuer.queries import Queries

        async def run() -> None:
            async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as conn:
                await fn(Queries.from_psycopg_connection(conn))

        asyncio.run(run())

    def install(self) -> None:
        self._run(lambda queries_: queries_.install())

    def add(self, n: int) -> None:
        async def add(queries_) -> None:
            for k in range(0, n, 10_000):
                m = min(10_000, n - k)
                await queries_.enqueue([self.entrypoint] * m, [None] * m, [0] * m)

        self._run(add)


class _ProcrastinateQueue(_Queue):
    """procrastinate's schema (``apply_schema``), filled by its ``batch_defer_jobs``."""

    name = "procrastinate"
    tables = ("procrastinate_jobs", "procrastinate_events", "procrastinate_workers")
    waiting_sql = "SELECT count(*) FROM procrastinate_jobs WHERE status = 'todo'"

    def app(self):
        """An App on a pool of one connection (each bench loop gets its own)."""
        import procrastinate

        connector = procrastinate.PsycopgConnector(conninfo=self.dsn, min_size=1, max_size=1)
        return procrastinate.App(connector=connector)

    def _run(self, fn) -> None:
        async def run() -> None:
            app = self.app()
            async with app.open_async():
                await fn(app)

        asyncio.run(run())

    def install(self) -> None:
        self._run(lambda app: app.schema_manager.apply_schema_async())

    def add(self, n: int) -> None:
        from procrastinate.jobs import Job

        async def add(app) -> None:
            for k in range(0, n, 5_000):
                jobs = [
                    Job(queue="bench", lock=None, queueing_lock=None, task_name="bench")
                    for _ in range(min(5_000, n - k))
                ]
                await app.job_manager.batch_defer_jobs_async(jobs)

        self._run(add)


PEER_QUEUES: dict[str, type[_Queue]] = {
    "pgqueuer": _PgqueuerQueue,
    "procrastinate": _ProcrastinateQueue,
}


def peer_versions(peers: Iterable[str]) -> dict[str, str | None]:
    """Each peer's installed version, or None when it is not installed (then it is not measured)."""
    from importlib import metadata

    out: dict[str, str | None] = {}
    for p in peers:
        if p not in PEER_QUEUES:
            raise ValueError(f"unknown peer {p!r}: choose from {', '.join(PEERS)}")
        try:
            __import__(p)
            out[p] = metadata.version(p)
        except ImportError:
            out[p] = None
    return out


_PARAM = re.compile(r"%\((\w+)\)s")
_SETTINGS = {"max_attempts": ("integer", 3), "base": ("integer", 60), "cap": ("integer", 3600)}
FENCED_WRITES: dict[str, dict[str, tuple[str, object]]] = {  # query: parameter: (type, value)
    "complete": {"id": ("bigint", 1), "attempt": ("integer", 1)},
    "extend_lease": {"id": ("bigint", 1), "attempt": ("integer", 1), "lease": ("integer", 300)},
    "fail": {
        "id": ("bigint", 1),
        "attempt": ("integer", 1),
        "permanent": ("boolean", False),
        "error": ("text", "x"),
        **_SETTINGS,
    },
    "record_batch": {
        "ids": ("bigint[]", list(range(1, 11))),
        "attempts": ("integer[]", [1] * 10),
        "results": ("text[]", ["ok"] * 10),
        "errors": ("text[]", [""] * 10),
        **_SETTINGS,
    },
}


def fenced_write_plans(conn: psycopg.Connection) -> dict[str, dict[str, str]]:
    """How each fenced write reaches the outbox table, ``{query: {"generic": scan, "custom":
    scan}}``; the generic plan is what a prepared statement (the worker loop's) may settle on.
    ``conn`` must be in autocommit; the statements are planned (EXPLAIN), never run."""
    from psycopg import sql

    out: dict[str, dict[str, str]] = {}
    for name, params in FENCED_WRITES.items():
        text = ob.OutboxStore().q[name]
        order = list(dict.fromkeys(_PARAM.findall(text)))
        text = _PARAM.sub(lambda m: f"${order.index(m.group(1)) + 1}", text)
        types = ", ".join(params[p][0] for p in order)
        conn.execute(f"PREPARE knownstate_plan ({types}) AS {text}")
        args = sql.SQL(", ").join(
            sql.SQL("{}::{}").format(sql.Literal(params[p][1]), sql.SQL(params[p][0]))
            for p in order
        )
        explain = sql.SQL("EXPLAIN EXECUTE knownstate_plan ({})").format(args)
        try:
            for mode in ("generic", "custom"):
                conn.execute(f"SET plan_cache_mode = force_{mode}_plan")
                plan = [r[0] for r in conn.execute(explain)]
                scan = next((s for s in plan if "Scan" in s and "outbox_delivery" in s), "?")
                scan = scan.strip().removeprefix("->").strip().split("  (")[0]
                out.setdefault(name, {})[mode] = scan
        finally:
            conn.execute("DEALLOCATE knownstate_plan")
            conn.execute("RESET plan_cache_mode")
    return out


@dataclass
class _Tally:
    """What one loop did besides finishing jobs: transactions, turns that found nothing."""

    tx: int = 0
    empty: int = 0


def _outbox_loops(
    dsn: str, n: int, batch: int, per_row: bool, send: Callable[[Claim, dict], str], name: str
):
    """The reference worker loops (:class:`~knownstate.impl.outbox.OutboxWorker`), a thread
    each. Returns the loops, the workers (for their stats) and each loop's tally."""
    store = ob.OutboxStore()
    workers: list[ob.OutboxWorker | None] = [None] * n
    tallies = [_Tally() for _ in range(n)]

    def make(i: int) -> Callable[[], int]:
        # The worker connects (and sets up its connection) itself, in the unmeasured warm-up.
        worker = workers[i] = ob.OutboxWorker(
            lambda: psycopg.connect(dsn), store, send, batch, per_row=per_row
        )
        tally = tallies[i]

        def step() -> int:  # one turn of the reference loop: OutboxWorker.run() without the close
            sent = worker.stats.sent
            got = worker.run_once()
            tally.tx += 1 + (got if per_row else min(got, 1))
            if got == 0:
                tally.empty += 1  # the queue ran dry in a window: the figure is starved (reported)
                time.sleep(0.001)
            return worker.stats.sent - sent

        return step

    def close(i: int) -> None:
        w = workers[i]
        if w is not None and w.conn is not None:
            w.conn.close()

    return _Loops(n, make, close, name), workers, tallies


def _async_loops(n: int, setup: Callable, name: str) -> tuple[_Loops, list[_Tally]]:
    """Loops for an asyncio library, each thread with its own event loop. ``setup(i)`` (run in
    it) returns ``(turn, close)``: ``turn()`` a coroutine answering (jobs done, transactions),
    ``close()`` what lets go of the connection (a coroutine)."""
    tallies = [_Tally() for _ in range(n)]
    closers: dict[int, tuple[asyncio.AbstractEventLoop, Callable | None]] = {}

    def make(i: int) -> Callable[[], int]:
        loop = asyncio.new_event_loop()
        closers[i] = (loop, None)
        turn, close = loop.run_until_complete(setup(i))
        closers[i] = (loop, close)
        tally = tallies[i]

        def step() -> int:
            done, tx = loop.run_until_complete(turn())
            tally.tx += tx
            if not done:
                tally.empty += 1
                time.sleep(0.001)
            return done

        return step

    def close(i: int) -> None:
        loop, closer = closers.pop(i, (None, None))
        if loop is not None:
            with contextlib.suppress(Exception):
                if closer is not None:
                    loop.run_until_complete(closer())
            loop.close()

    return _Loops(n, make, close, name), tallies


def _pgqueuer_loops(dsn: str, n: int, batch: int) -> tuple[_Loops, list[_Tally]]:
    """pgqueuer's batch: ``Queries.dequeue`` (one statement) then, for the whole batch,
    ``Queries.log_jobs`` (one statement), on its psycopg driver: what its QueueManager runs per
    batch, without the asyncio tasks, heartbeats and buffers around them (its best case)."""
    import uuid
    from datetime import timedelta

    from pgqueuer.ports.repository import EntrypointExecutionParameter
    from pgqueuer.queries import Queries

    entrypoints = {_PgqueuerQueue.entrypoint: EntrypointExecutionParameter(concurrency_limit=0)}
    heartbeat = timedelta(seconds=30)

    async def setup(i: int):
        conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
        queries_ = Queries.from_psycopg_connection(conn)
        manager = uuid.uuid4()

        async def turn() -> tuple[int, int]:
            jobs = await queries_.dequeue(
                batch_size=batch,
                entrypoints=entrypoints,
                queue_manager_id=manager,
                global_concurrency_limit=None,
                heartbeat_timeout=heartbeat,
            )
            if not jobs:
                return 0, 1
            await queries_.log_jobs([(job, "successful", None) for job in jobs])
            return len(jobs), 2

        return turn, conn.close

    return _async_loops(n, setup, "pgqueuer")


def _procrastinate_loops(dsn: str, n: int) -> tuple[_Loops, list[_Tally]]:
    """procrastinate's job manager: ``fetch_job`` then ``finish_job``, as its worker runs each
    job (without the worker's event and heartbeat tasks: its best case). It fetches one job per
    query; it has no batch."""
    from procrastinate.jobs import Status

    async def setup(i: int):
        app = _ProcrastinateQueue(dsn).app()
        await app.open_async()
        manager = app.job_manager
        worker_id = await manager.register_worker()

        async def turn() -> tuple[int, int]:
            job = await manager.fetch_job(queues=None, worker_id=worker_id)
            if job is None:
                return 0, 1
            await manager.finish_job(job, Status.SUCCEEDED, delete_job=False)
            return 1, 2

        return turn, app.close_async

    return _async_loops(n, setup, "procrastinate")


def _wal_lsn(conn: psycopg.Connection) -> int:
    hi, lo = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0].split("/")
    return (int(hi, 16) << 32) + int(lo, 16)


@dataclass
class _Set:
    """One figure's loops, the queue they drain, and what they did."""

    name: str
    loops: _Loops
    queue: _Queue
    tallies: list[_Tally]
    workers: list = field(default_factory=list)  # ours: the OutboxWorkers, for their stats
    fig: Figure | None = None
    wal: int = 0  # WAL bytes written in its windows
    estimate: float = 0.0  # the highest rate seen, to size the next fill

    def total(self, attr: str) -> int:
        return sum(getattr(t, attr) for t in self.tallies)


def _figures(
    dsn: str,
    stack: contextlib.ExitStack,
    workers: int,
    batch: int,
    names: list[str],
    queues: dict[str, _Queue],
    sink_url: str | None,
) -> list[_Set]:
    def noop(claim: Claim, payload: dict) -> str:
        return ob.OK

    def sink(claim: Claim, payload: dict) -> str:
        return ob.send_to_sink(sink_url, claim, payload)

    sets = []
    for name in names:
        ws: list = []
        if name in (OURS, OURS_PER_ROW, OURS_SINK):
            loops, ws, tallies = _outbox_loops(
                dsn, workers, batch, name == OURS_PER_ROW, sink if name == OURS_SINK else noop, name
            )
        elif name == "pgqueuer":
            loops, tallies = _pgqueuer_loops(dsn, workers, batch)
        else:
            loops, tallies = _procrastinate_loops(dsn, workers)
        queue = queues[OURS if name.startswith(OURS) else name]
        sets.append(_Set(name, stack.enter_context(loops), queue, tallies, ws))
    return sets


def _outbox_step(
    dsn: str,
    admin: psycopg.Connection,
    workers: int,
    batch: int,
    names: list[str],
    queues: dict[str, _Queue],
    sink_url: str | None,
    n_slices: int,
    slice_s: float,
    meter: _CpuMeter,
    say: Callable[[str], None],
) -> dict:
    """Every figure at one batch size, from fresh tables, in interleaved slices."""
    for q in queues.values():
        q.reset()
    ceiling = Figure("ceiling", workers)
    ceiling_wal = 0
    with contextlib.ExitStack() as stack:
        ceil_loops = stack.enter_context(_ceiling_loops(dsn, workers))
        sets = _figures(dsn, stack, workers, batch, names, queues, sink_url)

        def run(s: _Set, fig: Figure, seconds: float) -> None:
            # Jobs wait for the window with room for the highest rate seen, and then some.
            s.queue.top_up(int(max(s.estimate, ceiling.rate) * seconds * 2.5) + workers * batch * 4)
            before = _wal_lsn(admin)
            s.loops.run_slice(seconds, meter, fig)
            s.wal += _wal_lsn(admin) - before
            s.estimate = max(s.estimate, fig.slices[-1])

        # Warm-up, not measured: connections, prepared statements, caches. Statistics are
        # gathered first, with nothing in flight.
        for q in queues.values():
            q.top_up(WARM_FILL + workers * batch * 20)
            q.analyze()
        warm = min(slice_s, 0.5)
        ceil_loops.run_slice(warm, meter, Figure("warm-up", workers))
        for s in sets:
            run(s, Figure("warm-up", workers), warm)
            s.wal, s.fig = 0, Figure(s.name, workers)
            for t in s.tallies:
                t.tx = t.empty = 0
            for w in s.workers:
                w.stats = ob.LoopStats()
        for k in range(n_slices):
            before = _wal_lsn(admin)
            ceil_loops.run_slice(slice_s, meter, ceiling)
            ceiling_wal += _wal_lsn(admin) - before
            for s in sets:
                run(s, s.fig, slice_s)
            say(
                f"  batch {batch}, slice {k + 1}/{n_slices}: ceiling {ceiling.slices[-1]:.0f}/s"
                + "".join(f", {s.name} {s.fig.slices[-1]:.0f}/s" for s in sets)
            )

    out = {"ceiling": _figure_dict(ceiling, ceiling, 1.0, ceiling_wal)}
    for s in sets:
        d = _figure_dict(s.fig, ceiling, s.total("tx") / s.fig.count if s.fig.count else 0.0, s.wal)
        d["starved"] = s.total("empty") > 0
        for k in ("sent", "fenced", "failed", "errors") if s.workers else ():
            d[k] = sum(getattr(w.stats, k) for w in s.workers)
        out[s.name] = d
    return out


def _figure_dict(fig: Figure, ceiling: Figure, tx_per_job: float, wal: int) -> dict:
    d = fig.as_dict()
    own = fig.cpu.bench + fig.cpu.postgres + fig.cpu.app
    d.update(
        ratio=_ratio(fig, ceiling),
        tx_per_job=round(tx_per_job, 4),
        wal_per_job=round(wal / fig.count, 1) if fig.count else 0.0,
        cpu_per_job=round(_cpu_per_op(fig), 1),
        cores_own=round(own / fig.cpu.wall, 2) if fig.cpu.wall else 0.0,
    )
    return d


def _check_batches(batches: Iterable[int]) -> tuple[int, ...]:
    out = tuple(batches)
    if not out or any(not 1 <= b <= MAX_BATCH for b in out) or len(set(out)) != len(out):
        got = ",".join(map(str, out)) or "none"
        raise ValueError(f"--batch must be distinct sizes in 1..{MAX_BATCH}, got {got}")
    return out


def bench_outbox(
    workers: int = 4,
    seconds: float = 10,
    batches: Iterable[int] = BATCHES,
    effect: str = "noop",
    durability: str = "fsync",
    peers: Iterable[str] = (),
    *,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Jobs/s of the reference worker loop (batched and per-row completion), of each peer that is
    installed, and of the ceiling, at each batch size, in one run on one cluster.

    Returns the figures as a dict (see :func:`outbox_lines` for what they mean)."""
    if isinstance(batches, int):
        batches = (batches,)
    _check_bounds(workers, seconds, "--workers")
    batches = _check_batches(batches)
    if effect not in ("noop", "sink", "both"):
        raise ValueError(f"unknown effect {effect!r}: noop, sink or both")
    if durability not in DURABILITY:
        raise ValueError(f"unknown durability {durability!r}: {' or '.join(DURABILITY)}")
    versions = peer_versions(peers)
    measured = [p for p, v in versions.items() if v is not None]
    names = (
        ([OURS, OURS_PER_ROW] if effect != "sink" else [])
        + ([OURS_SINK] if effect != "noop" else [])
        + measured
    )
    say = progress or (lambda _m: None)
    n_slices, slice_s = _slices(seconds)
    settings, meaning = DURABILITY[durability]
    load = os.getloadavg()[0]
    runs: dict[int, dict] = {}
    with contextlib.ExitStack() as stack:
        pg = stack.enter_context(PostgresCluster(faketime=False, settings=settings))
        dsn = pg.dsn()
        sink = stack.enter_context(_ServerProcess("sink")) if effect != "noop" else None
        meter = _CpuMeter(pg._proc.pid if pg._proc else None, sink.pid if sink else None)
        admin = stack.enter_context(psycopg.connect(dsn, autocommit=True))
        say(
            f"{pg.describe()}, {meaning}; {os.cpu_count()} cores, load {load:.2f}; {n_slices} "
            f"interleaved slices of {slice_s:.2f}s per figure; figures: ceiling, "
            f"{', '.join(names)}"
        )
        for p, v in versions.items():
            if v is None:
                say(f"{p}: not installed, not measured (pip install -e '.[bench]')")
        queues: dict[str, _Queue] = {OURS: _OutboxQueue(dsn)}
        queues.update({p: PEER_QUEUES[p](dsn) for p in measured})
        for q in queues.values():
            q.install()
        for batch in batches:
            runs[batch] = _outbox_step(
                dsn,
                admin,
                workers,
                batch,
                names,
                queues,
                sink.url if sink else None,
                n_slices,
                slice_s,
                meter,
                say,
            )
        plans = fenced_write_plans(admin)
    return {
        "bench": "outbox",
        "workers": workers,
        "seconds": seconds,
        "batches": list(batches),
        "durability": durability,
        "durability_means": meaning,
        "settings": settings,
        "figures": names,
        "peers": versions,
        "cores": os.cpu_count() or 1,
        "load": [round(load, 2), round(os.getloadavg()[0], 2)],
        "runs": runs,
        "plans": plans,
    }


def _cpu_line(label: str, unit: str, d: dict, app: str | None = None) -> str:
    u = d["cpu_us_per_op"]
    app_part = f"  {app} {u.get('app', 0.0):7.1f}" if app else ""
    return (
        f"  {label:<9} {unit:<9} bench {u['bench']:7.1f}{app_part}  "
        f"postgres {u['postgres']:7.1f}  others {u['others']:7.1f}  "
        f"(machine busy {d['cores_busy']:.2f} of {d['cores']} cores)"
    )


FIGURE_MEANS = {
    "ceiling": "one-row UPDATE commits in autocommit, a row per connection",
    OURS: "reference loop, batched fenced completion: 2 commits per batch",
    OURS_PER_ROW: "reference loop, a fenced completion per row: 1 + 1/batch commits per job",
    OURS_SINK: "batched reference loop, the real HTTP sink on loopback as its effect",
    "pgqueuer": "its dequeue + log_jobs per batch, no fence: 2 commits per batch",
    "procrastinate": "its fetch_job + finish_job per job, no batch: 2 commits per job",
}


def _ratio_of(run: dict, a: str, b: str) -> float | None:
    if a not in run or b not in run or not run[b]["per_second"]:
        return None
    return round(run[a]["per_second"] / run[b]["per_second"], 2)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _limit_lines(batch: int, run: dict, cores: int, durability: str) -> list[str]:
    """What bounds ours at this batch size, read from the figures of the same run."""
    o, c = run[OURS], run["ceiling"]
    u, cu = o["cpu_us_per_op"], c["cpu_us_per_op"]
    commits = o["per_second"] * o["tx_per_job"]
    lines = [
        f"  batch {batch}: {o['tx_per_job']:.2f} commits, {o['wal_per_job']:.0f} WAL bytes "
        f"and {o['cpu_per_job']:.0f} us of CPU per job (postgres {u['postgres']:.0f}, the "
        f"loop {u['bench']:.0f});",
        f"    a ceiling commit: {c['wal_per_job']:.0f} WAL bytes, {c['cpu_per_job']:.0f} us "
        f"(postgres {cu['postgres']:.0f}); ours committed {commits:.0f}/s, the ceiling "
        f"{c['per_second']:.0f}/s",
    ]
    if o["cores_busy"] >= 0.85 * cores:
        why = (
            f"CPU: the machine was busy {o['cores_busy']:.2f} of {cores} cores, "
            f"{o['cores_own']:.2f} of them this loop and its server, the rest other work"
        )
    elif durability == "fsync":
        why = (
            "the commit: the cores were not saturated, so the loops waited on WAL flushes; "
            "ours needs 2 per batch"
        )
    else:
        why = "round trips: no core was saturated and no commit waits for the disk"
    return lines + [f"    -> bound by {why}"]


def outbox_lines(r: dict) -> list[str]:
    """The outbox bench's result as plain readable lines."""
    runs, cores = r["runs"], r["cores"]
    slices = next(iter(runs.values()))["ceiling"]["slices"]
    lines = [
        f"bench outbox: {r['workers']} workers for every figure (threads, a connection "
        f"each), no-op effect unless named, {r['seconds']:g}s per figure in {slices} "
        f"interleaved slices; {cores} cores, load average {r['load'][0]:.2f} at start, "
        f"{r['load'][1]:.2f} at end",
        f"  durability {r['durability']}: {r['durability_means']}",
    ]
    for p, v in r["peers"].items():
        lines.append(
            f"  {p} {v}: measured in the same run, same workers and batch size"
            if v
            else f"  {p}: not installed, not measured (pip install -e '.[bench]')"
        )
    for batch, run in runs.items():
        lines += [
            f"batch {batch}:",
            f"  {'figure':<15} {'jobs/s':>8} {'/ceiling':>8} {'tx/job':>7} {'WAL B/job':>9} "
            f"{'CPU us/job':>10} {'busy':>5}  {'slices/s':<13} what",
        ]
        for name, d in run.items():
            spread = f"{d['slice_rate_min']:.0f}..{d['slice_rate_max']:.0f}"
            lines.append(
                f"  {name:<15} {d['per_second']:>8.0f} {d.get('ratio', 1.0):>8.3f} "
                f"{d['tx_per_job']:>7.2f} {d['wal_per_job']:>9.0f} "
                f"{d['cpu_per_job']:>10.1f} {d['cores_busy']:>5.2f}  {spread:<13} "
                f"{FIGURE_MEANS[name]}"
            )
            if d.get("starved"):
                lines.append(f"  {'':<15} STARVED: its queue ran dry in a window: too low")
            if d.get("fenced") or d.get("errors") or d.get("failed"):
                lines.append(
                    f"  {'':<15} fenced {d['fenced']}, failed {d['failed']}, errors {d['errors']}"
                )
        pairs = [(f"{OURS} / {p}", _ratio_of(run, OURS, p)) for p in (*PEERS, OURS_PER_ROW)]
        lines.append("  " + "; ".join(f"{k} = {_fmt(v)}" for k, v in pairs if v is not None))
    batches = list(runs)
    lines.append(f"ratios at batch {' / '.join(map(str, batches))}:")
    for name in r["figures"]:
        lines.append(
            f"  {name + ' / ceiling':<30} "
            + " / ".join(_fmt(runs[b][name]["ratio"]) for b in batches)
        )
    if OURS in r["figures"]:
        for other in [p for p in (*PEERS, OURS_PER_ROW) if p in r["figures"]]:
            lines.append(
                f"  {OURS + ' / ' + other:<30} "
                + " / ".join(_fmt(_ratio_of(runs[b], OURS, other)) for b in batches)
            )
        lines.append("what limits ours:")
        for b in batches:
            lines += _limit_lines(b, runs[b], cores, r["durability"])
        lines += [
            "  ours writes each row twice (claim, record); pgqueuer writes each job three",
            "  times (dequeue, delete, log insert). Recording the batch in one statement",
            "  took ours from 1 + 1/batch commits per job to 2/batch, pgqueuer's count.",
        ]
    lines.append("the fenced writes' plans (after an ANALYZE with nothing in flight):")
    for q, modes in r["plans"].items():
        lines.append(f"  {q}: " + "; ".join(f"{m} {scan}" for m, scan in modes.items()))
    lines += _goal_lines(r)
    return lines


def _goal_lines(r: dict) -> list[str]:
    """Issue 11's goals, judged on this run (fsync on, batch 10 and 100 when measured)."""
    runs, at = r["runs"], [b for b in (10, 100) if b in r["runs"]]
    if r["durability"] != "fsync" or OURS not in r["figures"] or not at:
        return []
    out = []
    for peer, goal in (("pgqueuer", 1.0), ("procrastinate", 10.0)):
        if peer in r["figures"]:
            v = [_ratio_of(runs[b], OURS, peer) for b in at]
            verdict = "met" if all(x is not None and x >= goal for x in v) else "not met"
            out.append(
                f"goal (issue 11, fsync on): ours >= {goal:g}x {peer} at batch "
                f"{' and '.join(map(str, at))}: {verdict} ({', '.join(map(_fmt, v))})"
            )
    return out


# ---------------------------------------------------------------------------------------
# bench documents
# ---------------------------------------------------------------------------------------

DOC_SCHEMA = {"attributes": {"title": "text", "count": "number"}}
MAX_RATE = 5000.0
P99_GOAL_MS = 5.0


class _Http:
    """A keep-alive HTTP/1.1 connection from the standard library: the lightest client there
    is, so the bench measures the server, not the client's Python (httpx costs several times
    as much CPU per request, on the same cores)."""

    def __init__(self, url: str, user: str):
        import http.client
        from urllib.parse import urlsplit

        u = urlsplit(url)
        self.conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
        self.headers = {"X-User": user, "Content-Type": "application/json"}

    def request(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        import json

        data = json.dumps(body).encode() if body is not None else None
        self.conn.request(method, path, body=data, headers=self.headers)
        r = self.conn.getresponse()
        return r.status, json.loads(r.read())

    def close(self) -> None:
        self.conn.close()


@dataclass
class _Client:
    """One client's document and what it saw: it knows its version from its last answer."""

    doc: str
    writer: str
    version: int = 1
    seq: int = 0
    latencies: list[float] = field(default_factory=list)
    conflicts: int = 0
    errors: int = 0

    def read(self, http: _Http) -> None:
        status, body = http.request("GET", f"/api/desk/files/{self.doc}")
        if status != 200:
            raise RuntimeError(f"bench: GET {self.doc} answered {status}: {body}")
        self.version = body["version"]

    def put(self, http: _Http) -> bool:
        self.seq += 1
        body = {
            "expectedVersion": self.version,
            "writerId": self.writer,
            "saveSeq": self.seq,
            "content": {"title": f"save {self.seq}", "count": self.seq},
        }
        status, answer = http.request("PUT", f"/api/desk/files/{self.doc}", body)
        if status == 200:
            self.version = answer["version"]
            return True
        if status == 409:
            self.conflicts += 1
            self.version = answer.get("version", self.version)
        else:
            self.errors += 1
        return False


def _http(url: str, user: str) -> _Http:
    return _Http(url, user)


def _doc_loops(url: str, clients: list[_Client]) -> _Loops:
    """Full load: each client saves its own document as fast as the server answers (PUT only:
    it knows the version from the previous answer)."""
    https: dict = {}

    def make(i: int) -> Callable[[], int]:
        c = clients[i]
        http = https[i] = _http(url, f"user{i}")
        c.read(http)

        def step() -> int:
            t = time.perf_counter()
            ok = c.put(http)
            if ok:
                c.latencies.append(time.perf_counter() - t)
            return int(ok)

        return step

    return _Loops(
        len(clients), make, lambda i: https.pop(i).close() if i in https else None, "documents"
    )


def _open_loop(url: str, clients: list[_Client], rate: float, seconds: float) -> dict:
    """PUTs at a fixed ``rate`` for ``seconds``, whatever the answers' pace (open loop): request
    k is due at ``start + k / rate`` and its latency runs from that moment to its answer, so a
    server that falls behind is charged for the queue it builds (no coordinated omission, up to
    one request in flight per client)."""
    total = max(1, round(rate * seconds))
    due = itertools.count()
    errors: list[BaseException] = []
    https = [_http(url, f"user{i}") for i in range(len(clients))]
    for c, http in zip(clients, https):
        c.read(http)
        c.latencies.clear()
    start = time.perf_counter() + 0.05
    late = [0.0] * len(clients)

    def run(i: int) -> None:
        c, http = clients[i], https[i]
        while (k := next(due)) < total:
            at = start + k / rate
            wait = at - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            else:
                late[i] = max(late[i], -wait)
            if c.put(http):
                c.latencies.append(time.perf_counter() - at)

    threads = [
        threading.Thread(
            target=_capture(lambda i=i: run(i), errors), daemon=True, name=f"bench-open-loop-{i}"
        )
        for i in range(len(clients))
    ]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=seconds + 60)
    finally:
        for http in https:
            http.close()
    if errors:
        raise errors[0]
    took = time.perf_counter() - start
    lat = sorted(x for c in clients for x in c.latencies)
    return {
        "rate": rate,
        "seconds": seconds,
        "requests": total,
        "saves": len(lat),
        "achieved_per_second": round(len(lat) / took, 1) if took > 0 else 0.0,
        "errors": sum(c.errors for c in clients),
        "conflicts": sum(c.conflicts for c in clients),
        "p50_ms": _ms(lat, 0.50),
        "p90_ms": _ms(lat, 0.90),
        "p99_ms": _ms(lat, 0.99),
        "max_ms": _ms(lat, 1.0),
        "behind_ms": round(max(late) * 1e3, 2),
    }


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    k = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[k]


def _ms(sorted_values: list[float], q: float) -> float:
    return round(_percentile(sorted_values, q) * 1e3, 2)


def bench_documents(
    clients: int = 8,
    seconds: float = 10,
    rate: float | None = None,
    *,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Saves/s of the real document server at full load, against the ceiling, in one run; with
    ``rate``, first the PUT latency at that fixed rate (open loop)."""
    _check_bounds(clients, seconds, "--clients")
    if rate is not None and not 0 < rate <= MAX_RATE:
        raise ValueError(f"--rate must be in (0, {MAX_RATE:g}] saves/s, got {rate:g}")
    from knownstate.impl.documents import DocumentStore

    say = progress or (lambda _m: None)
    n_slices, slice_s = _slices(seconds)
    ceiling, saves = Figure("ceiling", clients), Figure("documents", clients)
    state = [_Client(f"bench{i}", f"bench-writer-{i}") for i in range(clients)]
    out: dict = {
        "bench": "documents",
        "clients": clients,
        "seconds": seconds,
        "load_before": round(os.getloadavg()[0], 2),
    }
    with contextlib.ExitStack() as stack:
        pg = stack.enter_context(PostgresCluster(faketime=False))
        dsn = pg.dsn()
        with DocumentStore(dsn, pool_size=None) as store:
            store.install()
            for i in range(clients):  # one document per client: saves never conflict
                store.seed(
                    f"bench{i}", "record", DOC_SCHEMA, {"title": "new", "count": 0}, f"user{i}"
                )
        server = stack.enter_context(_ServerProcess("documents", dsn))
        postmaster = pg._proc.pid if pg._proc else None
        meter = _CpuMeter(postmaster, server.pid)
        say(
            f"{pg.describe()}; document server {server.url} (uvicorn, own process, a pool of "
            f"connections); {os.cpu_count()} cores; load average {out['load_before']}"
        )
        if rate is not None:
            say(f"open loop: {rate:g} PUT/s for {seconds:g}s over {clients} clients")
            _open_loop(server.url, state, rate, min(seconds, 1.0))  # warm-up, not measured
            out["open_loop"] = _open_loop(server.url, state, rate, seconds)
            say(f"  p50 {out['open_loop']['p50_ms']} ms, p99 {out['open_loop']['p99_ms']} ms")
        say(f"full load: {n_slices} interleaved slices of {slice_s:.2f}s per figure")
        ceil_loops = stack.enter_context(_ceiling_loops(dsn, clients))
        doc_loops = stack.enter_context(_doc_loops(server.url, state))
        # Warm-up, not measured: connections, the app's first requests, caches.
        ceil_loops.run_slice(min(slice_s, 0.5), meter, Figure("warm-up", clients))
        doc_loops.run_slice(min(slice_s, 0.5), meter, Figure("warm-up", clients))
        for c in state:  # the loops are parked between slices: nothing writes these now
            c.latencies.clear()
            c.conflicts = c.errors = 0
        for k in range(n_slices):
            ceil_loops.run_slice(slice_s, meter, ceiling)
            doc_loops.run_slice(slice_s, meter, saves)
            say(
                f"  slice {k + 1}/{n_slices}: ceiling {ceiling.slices[-1]:.0f}/s, "
                f"saves {saves.slices[-1]:.0f}/s"
            )
    lat = sorted(x for c in state for x in c.latencies)
    d = saves.as_dict()
    d.update(
        ratio=_ratio(saves, ceiling),
        conflicts=sum(c.conflicts for c in state),
        errors=sum(c.errors for c in state),
        p50_ms=_ms(lat, 0.50),
        p99_ms=_ms(lat, 0.99),
        mean_ms=round(statistics.fmean(lat) * 1e3, 2) if lat else 0.0,
        expected_ratio_cpu=(
            round(_cpu_per_op(ceiling) / _cpu_per_op(saves), 4) if saves.count else 0.0
        ),
    )
    return {**out, "ceiling": ceiling.as_dict(), "documents": d}


def documents_lines(r: dict) -> list[str]:
    """The documents bench's result as plain readable lines."""
    c, d = r["ceiling"], r["documents"]
    u = d["cpu_us_per_op"]
    lines = [
        f"bench documents: {r['clients']} clients (threads, keep-alive http.client), "
        f"{r['seconds']:g}s per "
        f"figure, {c['cores']} cores, load average {r['load_before']} before the run"
    ]
    if "open_loop" in r:
        o = r["open_loop"]
        verdict = "met" if o["p99_ms"] <= P99_GOAL_MS else "not met"
        lines += [
            f"  open loop {o['rate']:g} PUT/s for {o['seconds']:g}s: {o['saves']} saves "
            f"({o['achieved_per_second']:.1f}/s), errors {o['errors']}, conflicts "
            f"{o['conflicts']}",
            f"  PUT latency at {o['rate']:g}/s: p50 {o['p50_ms']:.2f} ms, "
            f"p90 {o['p90_ms']:.2f} ms, "
            f"p99 {o['p99_ms']:.2f} ms, max {o['max_ms']:.2f} ms (from each request's due time)",
            f"  goal (issue 10): p99 <= {P99_GOAL_MS:g} ms at 200 PUT/s on an idle machine: "
            f"{verdict} on this run (a benchmark figure; this machine may be shared)",
        ]
    lines += [
        f"  ceiling   {c['per_second']:>8.0f} commits/s  one-row UPDATE in autocommit over "
        f"{r['clients']} connections "
        f"(slices {c['slice_rate_min']:.0f}..{c['slice_rate_max']:.0f}/s)",
        f"  saves     {d['per_second']:>8.1f} PUT/s      full load: each client saves its own "
        f"document, PUT after PUT (slices {d['slice_rate_min']:.0f}..{d['slice_rate_max']:.0f}/s)",
        f"  PUT latency at full load p50 {d['p50_ms']:.1f} ms, p99 {d['p99_ms']:.1f} ms (mean "
        f"{d['mean_ms']:.1f} ms over {d['count']} saves); conflicts {d['conflicts']}, errors "
        f"{d['errors']}",
        f"  ratio documents = {d['ratio']:.4f}  (saves/s / ceiling commits/s)",
        "CPU per unit, microseconds (bench: this process, the clients; app: the document "
        "server's process; postgres: the server; others: the rest of the machine, same windows):",
        _cpu_line("ceiling", "commit", c, "app"),
        _cpu_line("documents", "save", d, "app"),
        "what the ratio means:",
        "  A save is one HTTP PUT through uvicorn, FastAPI and pydantic, the strict reading of its",
        "  body, then two statements on a pooled connection (the access read, and the compare-",
        "  and-swap that writes the history row). The ceiling is one statement on an open",
        f"  connection. Both are CPU-bound here: expect CPU per ceiling commit / CPU per save = "
        f"{d['expected_ratio_cpu']:.4f}; measured {d['ratio']:.4f}.",
        "what limits it:",
        f"  CPU. Per save: the document server {u.get('app', 0.0):.0f} us (HTTP parsing, routing, "
        f"validation, JSON, psycopg), the clients {u['bench']:.0f} us, PostgreSQL "
        f"{u['postgres']:.0f} us",
        f"  (two statements, against {c['cpu_us_per_op']['postgres']:.0f} us for the ceiling's "
        f"one). The largest share is {_largest(u)}; the",
        f"  machine's other load took {u['others']:.0f} us per save in the same windows. "
        + (
            "The database's commit rate is not the bound: the ceiling is "
            f"{c['per_second'] / d['per_second']:.0f}x the saves."
            if d["per_second"] and c["per_second"] > 5 * d["per_second"]
            else "The saves come close to the ceiling: the database's commit rate is near "
            "the bound."
        ),
    ]
    return lines


def _largest(u: dict) -> str:
    shares = {
        "the document server's Python": u.get("app", 0.0),
        "the clients": u["bench"],
        "PostgreSQL": u["postgres"],
    }
    return max(shares, key=shares.get)


# ---------------------------------------------------------------------------------------
# CLI: `knownstate bench outbox|documents`.
# ---------------------------------------------------------------------------------------


def _seconds(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {s!r}") from None
    if not 0 < v <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(
            f"must be more than 0 and at most {MAX_SECONDS:g}, got {s}"
        )
    return v


def _batches(s: str) -> tuple[int, ...]:
    try:
        return _check_batches(int(x) for x in s.split(","))
    except ValueError as e:
        msg = str(e) if "--batch" in str(e) else f"not a list of whole numbers: {s!r}"
        raise argparse.ArgumentTypeError(msg.removeprefix("--batch ")) from None


def _peers(s: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in s.split(",") if x.strip())
    unknown = [x for x in names if x not in PEERS]
    if unknown or not names:
        name = unknown[0] if unknown else s
        raise argparse.ArgumentTypeError(f"unknown peer {name!r}: choose from {', '.join(PEERS)}")
    return names


def add_parser(subparsers) -> None:
    """Register ``bench`` with its sub-commands ``outbox`` and ``documents`` (each sets
    ``func``)."""
    p = subparsers.add_parser(
        "bench",
        help="throughput as a ratio to a one-row UPDATE ceiling, in one run",
        description="Benchmarks. Each figure is printed with its ratio to "
        "the ceiling (one-row UPDATE commits/s over the same "
        "number of connections), "
        "measured in the same run on interleaved slices.",
    )
    sub = p.add_subparsers(dest="bench", metavar="{outbox,documents}", required=True)
    o = sub.add_parser(
        "outbox",
        help="jobs/s of the reference outbox loop beside peer queues",
        description="Jobs/s of the reference outbox worker loop (claim a batch, a "
        "no-op effect, the batch's outcomes recorded with one fenced "
        "write), of the same loop recording row by row, and of the peer "
        "queues named: each a ratio to the ceiling and to the others, "
        "at each batch size, in one run.",
    )
    o.add_argument(
        "--workers",
        type=int,
        default=4,
        help="worker threads, a connection each, for every figure; default 4",
    )
    o.add_argument(
        "--seconds",
        type=_seconds,
        default=10.0,
        help="seconds per figure and batch size; default 10",
    )
    o.add_argument(
        "--batch",
        type=_batches,
        default=BATCHES,
        metavar="N[,N...]",
        help="jobs per claim, for ours and pgqueuer alike; default 1,10,100",
    )
    o.add_argument(
        "--durability",
        choices=tuple(DURABILITY),
        default="fsync",
        help="fsync: PostgreSQL's default, a commit waits for the disk (default); "
        "no-fsync: the test harness's setting, it never does",
    )
    o.add_argument(
        "--peers",
        type=_peers,
        default=(),
        metavar="NAME[,NAME]",
        help=f"also measure {' and '.join(PEERS)} (pip install -e '.[bench]')",
    )
    o.add_argument(
        "--effect",
        choices=("noop", "sink", "both"),
        default="noop",
        help="our loop's effect: no-op (default), the real HTTP sink, or both",
    )
    o.set_defaults(func=run_outbox)
    d = sub.add_parser(
        "documents",
        help="PUT throughput and latency of the document server",
        description="Saves/s and PUT latency of the real document server, each "
        "client saving its own document; with --rate, first the PUT "
        "latency at a fixed rate (open loop).",
    )
    d.add_argument(
        "--clients", type=int, default=8, help="client threads (and ceiling connections); default 8"
    )
    d.add_argument("--seconds", type=_seconds, default=10.0, help="seconds per figure; default 10")
    d.add_argument(
        "--rate",
        type=_rate,
        default=None,
        metavar="PUTS_PER_SECOND",
        help="first, PUT latency at this fixed rate (open loop), e.g. 200",
    )
    d.set_defaults(func=run_documents)


def run_outbox(args) -> int:
    try:
        r = bench_outbox(
            args.workers,
            args.seconds,
            args.batch,
            args.effect,
            args.durability,
            args.peers,
            progress=lambda m: print(m, flush=True),
        )
    except ValueError as e:
        print(f"bench outbox: {e}")
        return 2
    print("\n".join(outbox_lines(r)), flush=True)
    return 0


def _rate(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of saves per second: {s!r}") from None
    if not 0 < v <= MAX_RATE:
        raise argparse.ArgumentTypeError(f"must be more than 0 and at most {MAX_RATE:g}, got {s}")
    return v


def run_documents(args) -> int:
    try:
        r = bench_documents(
            args.clients, args.seconds, args.rate, progress=lambda m: print(m, flush=True)
        )
    except ValueError as e:
        print(f"bench documents: {e}")
        return 2
    print("\n".join(documents_lines(r)), flush=True)
    return 0
