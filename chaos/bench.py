"""Benchmarks: every figure is a ratio to a ceiling measured in the same run, on the same machine.

Absolute numbers depend on the machine; a ratio much less so. The **ceiling** is the cheapest
durable write PostgreSQL offers over the same number of connections: a one-row
``UPDATE ... SET n = n + 1`` in autocommit, each connection on its own row. A ratio of 0.5 means
the code under test gets half as many units of useful work through per second as that bare
commit loop gets commits.

``bench outbox``
    The reference worker loop (:class:`knownstate.impl.outbox.OutboxWorker`: claim a batch, send
    each, record each outcome with a fenced write) over a queue kept full, with a no-op effect
    and with the real HTTP notification sink (in a process of its own) on loopback.
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
else on the machine, so the output can say what bounds the ratio: on a small machine with
fsync off it is CPU per unit of work, not the database's commit rate.

Bounds: at most :data:`MAX_LOOPS` concurrent loops and :data:`MAX_SECONDS` per figure; every
loop stops at the end of its slice; everything (threads, processes, servers, the cluster) is
stopped and removed on exit, also after Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import os
import select
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

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
    return stat[stat.rindex(")") + 2:].split()  # [0] state, [1] ppid, [11..14] utime stime cutime cstime


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
    """CPU seconds the whole machine spent busy so far (all cores, everything but idle and iowait)."""
    with open("/proc/stat") as f:
        parts = [int(x) for x in f.readline().split()[1:]]
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)
    guest = sum(parts[8:10]) if len(parts) > 9 else 0  # guest time is already counted in user
    return (sum(parts) - idle - guest) / _TICK


@dataclass
class Cpu:
    """Seconds of wall time and of CPU, per consumer, accumulated over the windows of one figure."""

    wall: float = 0.0
    bench: float = 0.0      # this process: the loops (threads) and the bench itself
    postgres: float = 0.0   # the PostgreSQL server (postmaster and backends)
    app: float = 0.0        # the server process the loops drive (sink or document server), if any
    machine: float = 0.0    # every core of the machine, busy

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
        return Cpu(time.monotonic(), time.process_time(), _tree_cpu(self.postmaster), _tree_cpu(self.app),
                   _machine_busy())


def _diff(a: Cpu, b: Cpu) -> Cpu:
    return Cpu(*(getattr(b, k) - getattr(a, k) for k in ("wall", "bench", "postgres", "app", "machine")))


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
        out = {"count": self.count, "seconds": round(self.seconds, 3), "per_second": round(self.rate, 1),
               "slices": len(self.slices),
               "slice_rate_min": round(min(self.slices), 1) if self.slices else 0.0,
               "slice_rate_max": round(max(self.slices), 1) if self.slices else 0.0,
               "cpu_us_per_op": {k: round(self.cpu_us(k), 1) for k in ("bench", "postgres", "app", "others")
                                 if k != "app" or self.cpu.app},
               "cores_busy": round(self.cpu.machine / self.cpu.wall, 2) if self.cpu.wall else 0.0,
               "cores": cores}
        return out


class _Loops:
    """``n`` threads; thread ``i`` calls ``make(i)`` once (connect, warm up) to get its ``step``,
    then runs ``step()`` (returning units of work done) repeatedly during each slice the main
    thread opens with :meth:`run_slice`. ``close(i)`` runs in the thread when it ends."""

    def __init__(self, n: int, make: Callable[[int], Callable[[], int]],
                 close: Callable[[int], None] = lambda i: None, name: str = "loop"):
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
            t = threading.Thread(target=self._run, args=(i,), name=f"bench-{self.name}-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def run_slice(self, seconds: float, meter: _CpuMeter, fig: Figure,
                  during: Callable[[], None] | None = None) -> None:
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
                helper = threading.Thread(target=_capture(during, helper_error), name=f"bench-{self.name}-during",
                                          daemon=True)
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
        admin.execute(f"CREATE TABLE {CEILING_TABLE} (id integer PRIMARY KEY, n bigint NOT NULL DEFAULT 0)")
        admin.execute(f"INSERT INTO {CEILING_TABLE} (id) SELECT generate_series(0, %s::int)", (n - 1,))
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
                print(json.dumps({"received": len(sink.log), "duplicates": sink.duplicates()}), flush=True)
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
        code = "import sys; from knownstate.chaos.bench import _serve; _serve(sys.argv[1], sys.argv[2])"
        self.proc = subprocess.Popen([sys.executable, "-c", code, self.kind, self.arg], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, preexec_fn=tools.die_with_parent)
        try:
            line = self._line(60)
            if not line.strip().isdigit():
                raise RuntimeError(f"the {self.kind} server process did not start (exit code {self.proc.poll()})")
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

PAYLOAD_SQL = "jsonb_build_object('event', 'bench', 'n', g)"


class _Queue:
    """The outbox table, kept full between windows (never during one) so no window runs dry."""

    def __init__(self, dsn: str):
        self.dsn = dsn
        self.added = 0
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("DROP TABLE IF EXISTS outbox_delivery")
            conn.execute(ob.SCHEMA)

    def top_up(self, claimed: int, need: int) -> None:
        """Make sure at least ``need`` deliveries wait (``claimed`` were taken so far)."""
        missing = need - (self.added - claimed)
        if missing <= 0:
            return
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(f"INSERT INTO outbox_delivery (payload) SELECT {PAYLOAD_SQL} "
                         f"FROM generate_series(%s::bigint, %s::bigint) g", (self.added + 1, self.added + missing))
        self.added += missing

    def analyze(self) -> None:
        """Statistics as on a busy queue: ANALYZE while the workers have deliveries in flight.

        Gathered while nothing is in flight, they tell the planner the partial lease index is
        empty, and it then plans every fenced write through that index instead of the primary
        key, so each completion scans every row in flight: harmless at 40 in flight, about four
        times the server CPU per completion at 3000. :func:`completion_plan` reports the plan."""
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute("ANALYZE outbox_delivery")

    def pending(self) -> int:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            return conn.execute("SELECT count(*) FROM outbox_delivery WHERE status = 'pending'").fetchone()[0]


def completion_plan(dsn: str) -> str:
    """The index the fenced completion's UPDATE goes through, as the workers' prepared statement
    plans it (generic plan) and for literal values (custom plan)."""
    sql = ob.OutboxStore().q["complete"].replace("%(id)s", "$1").replace("%(attempt)s", "$2")
    found = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"PREPARE bench_complete (bigint, integer) AS {sql}")
        for mode in ("force_generic_plan", "force_custom_plan"):
            conn.execute(f"SET plan_cache_mode = {mode}")
            plan = [r[0] for r in conn.execute("EXPLAIN EXECUTE bench_complete (1, 1)")]
            scan = next((line.strip().removeprefix("->").strip() for line in plan[1:] if "Scan" in line), "?")
            found.append(f"{mode.split('_')[1]}: {scan.split('  (')[0]}")
    return "; ".join(found)


@dataclass
class _WorkerSet:
    """The reference worker loops of one effect, with what they did."""

    effect: str
    workers: list[ob.OutboxWorker | None]
    idle: int = 0

    def total(self, attr: str) -> int:
        return sum(getattr(w.stats, attr) for w in self.workers if w is not None)


def _worker_loops(dsn: str, n: int, batch: int, effect: str, sink_url: str | None) -> tuple[_Loops, _WorkerSet]:
    store = ob.OutboxStore()
    if effect == "noop":
        def send(claim: Claim, payload: dict) -> str:
            return ob.OK
    elif effect == "sink":
        def send(claim: Claim, payload: dict) -> str:
            return ob.send_to_sink(sink_url, claim, payload)
    else:
        raise ValueError(f"unknown effect {effect!r}: one of {', '.join(EFFECTS)}")
    ws = _WorkerSet(effect, [None] * n)

    def make(i: int) -> Callable[[], int]:
        # The worker connects (and sets up its connection) itself, in the unmeasured warm-up.
        worker = ws.workers[i] = ob.OutboxWorker(lambda: psycopg.connect(dsn), store, send, batch)
        stats = worker.stats

        def step() -> int:  # one turn of the reference loop: OutboxWorker.run() without the close
            sent = stats.sent
            if worker.run_once() == 0:
                ws.idle += 1  # the queue ran dry in a window: the figure is starved (reported)
                time.sleep(0.001)
            return stats.sent - sent
        return step

    def close(i: int) -> None:
        w = ws.workers[i]
        if w is not None and w.conn is not None:
            w.conn.close()

    return _Loops(n, make, close, f"outbox-{effect}"), ws


def bench_outbox(workers: int = 4, seconds: float = 10, batch: int = 10, effect: str = "both",
                 *, progress: Callable[[str], None] | None = None) -> dict:
    """Deliveries/s of the reference worker loop with each effect, and the ceiling, in one run.

    Returns the figures as a dict (see :func:`outbox_lines` for what they mean)."""
    _check_bounds(workers, seconds, "--workers")
    if not 1 <= batch <= 10_000:
        raise ValueError(f"--batch must be 1..10000, got {batch}")
    effects = EFFECTS if effect == "both" else (effect,)
    if any(e not in EFFECTS for e in effects):
        raise ValueError(f"unknown effect {effect!r}: noop, sink or both")
    say = progress or (lambda _m: None)
    n_slices, slice_s = _slices(seconds)
    ceiling = Figure("ceiling", workers)
    figs = {e: Figure(e, workers) for e in effects}

    with contextlib.ExitStack() as stack:
        pg = stack.enter_context(PostgresCluster(faketime=False))
        dsn = pg.dsn()
        sink = stack.enter_context(_ServerProcess("sink")) if "sink" in effects else None
        meter = _CpuMeter(pg._proc.pid if pg._proc else None, sink.pid if sink else None)
        say(f"{pg.describe()}; {os.cpu_count()} cores; {n_slices} interleaved slices of {slice_s:.2f}s per figure")
        queue = _Queue(dsn)
        queue.top_up(0, workers * batch * 20)
        ceil_loops = stack.enter_context(_ceiling_loops(dsn, workers))
        sets = {}
        for e in effects:
            loops, ws = _worker_loops(dsn, workers, batch, e, sink.url if sink else None)
            sets[e] = (stack.enter_context(loops), ws)

        def claimed() -> int:
            return sum(ws.total("claimed") for _, ws in sets.values())

        def fill(ceiling_rate: float, seconds: float) -> None:
            # A delivery needs at least its own commit, so no loop outruns the ceiling's rate;
            # twice that per effect, filled outside every window, cannot run dry.
            queue.top_up(claimed(), int(ceiling_rate * seconds * 2 * len(effects)) + workers * batch * 4)

        # Warm-up, not measured: connections, prepared statements, caches, and the queue table's
        # statistics gathered while deliveries are in flight, as on a busy queue.
        warm = min(slice_s, 0.5)
        ceil_loops.run_slice(warm, meter, (w := Figure("warm-up", workers)))
        fill(w.rate, warm)
        for e in effects:
            sets[e][0].run_slice(warm, meter, Figure("warm-up", workers), during=queue.analyze)
            sets[e][1].idle = 0
        for k in range(n_slices):
            ceil_loops.run_slice(slice_s, meter, ceiling)
            fill(ceiling.slices[-1], slice_s)
            for e in effects:
                sets[e][0].run_slice(slice_s, meter, figs[e])
            say(f"  slice {k + 1}/{n_slices}: ceiling {ceiling.slices[-1]:.0f}/s"
                + "".join(f", {e} {figs[e].slices[-1]:.0f}/s" for e in effects))
        plan = completion_plan(dsn)
        left = queue.pending()
    sink_log = (sink.final.get("received", -1), sink.final.get("duplicates", -1)) if sink else (0, 0)

    out: dict = {"bench": "outbox", "workers": workers, "seconds": seconds, "batch": batch,
                 "ceiling": ceiling.as_dict()}
    for e in effects:
        ws = sets[e][1]
        d = figs[e].as_dict()
        d.update(ratio=_ratio(figs[e], ceiling), sent=ws.total("sent"), fenced=ws.total("fenced"),
                 failed=ws.total("failed"), errors=ws.total("errors"), starved=ws.idle > 0 or left == 0,
                 expected_ratio_cpu=round(_cpu_per_op(ceiling) / _cpu_per_op(figs[e]), 3) if figs[e].count else 0.0)
        if e == "sink":
            d.update(sink_received=sink_log[0], sink_duplicates=sink_log[1])
        out[e] = d
    out["commit_bound_ratio"] = round(batch / (batch + 1), 3)
    out["completion_plan"] = plan
    return out


def _cpu_line(label: str, unit: str, d: dict, app: str | None = None) -> str:
    u = d["cpu_us_per_op"]
    app_part = f"  {app} {u.get('app', 0.0):7.1f}" if app else ""
    return (f"  {label:<9} {unit:<9} bench {u['bench']:7.1f}{app_part}  postgres {u['postgres']:7.1f}  "
            f"others {u['others']:7.1f}  (machine busy {d['cores_busy']:.2f} of {d['cores']} cores)")


def outbox_lines(r: dict) -> list[str]:
    """The outbox bench's result as plain readable lines."""
    c, batch = r["ceiling"], r["batch"]
    effects = [e for e in EFFECTS if e in r]
    lines = [f"bench outbox: {r['workers']} workers (threads), batch {batch}, {r['seconds']:g}s per figure in "
             f"{c['slices']} interleaved slices, {c['cores']} cores",
             f"  ceiling   {c['per_second']:>8.0f} commits/s     one-row UPDATE in autocommit over {r['workers']} "
             f"connections (slices {c['slice_rate_min']:.0f}..{c['slice_rate_max']:.0f}/s)"]
    for e in effects:
        d = r[e]
        what = "reference worker loop, no-op effect" if e == "noop" else \
            "reference worker loop, real HTTP sink on loopback"
        lines.append(f"  {e:<9} {d['per_second']:>8.0f} deliveries/s  {what} "
                     f"(slices {d['slice_rate_min']:.0f}..{d['slice_rate_max']:.0f}/s)")
    for e in effects:
        lines.append(f"  ratio {e} = {r[e]['ratio']:.3f}  ({e} deliveries/s / ceiling commits/s)")
    lines.append("CPU per unit, microseconds (bench: this process, the loops; sink: the sink's process; postgres: "
                 "the server; others: the rest of the machine, same windows):")
    lines.append(_cpu_line("ceiling", "commit", c, "sink" if "sink" in r else None))
    for e in effects:
        lines.append(_cpu_line(e, "delivery", r[e], "sink" if "sink" in r else None))
    lines += [
        "what the ratio means:",
        f"  A delivery costs one fenced completion commit plus 1/{batch} of a claim commit. Were commits the whole "
        "cost",
        f"  (a disk flush each), the ratio would approach batch/(batch+1) = {r['commit_bound_ratio']:.2f}. This "
        "cluster runs with",
        "  fsync off, so a commit costs CPU, not a flush, and the machine is CPU-bound: the honest expectation is",
        "  CPU per ceiling commit / CPU per delivery (bench + sink + postgres):",
    ]
    for e in effects:
        lines.append(f"    {e}: expected {r[e]['expected_ratio_cpu']:.2f}, measured {r[e]['ratio']:.2f}")
    if "noop" in r:
        u, cu = r["noop"]["cpu_us_per_op"], c["cpu_us_per_op"]
        pg_x = u["postgres"] / cu["postgres"] if cu["postgres"] else 0.0
        py_x = u["bench"] / cu["bench"] if cu["bench"] else 0.0
        lines += [
            "what limits it:",
            f"  postgres spends {pg_x:.1f}x a ceiling commit's CPU per delivery: the claim locks each row (FOR UPDATE "
            "SKIP",
            "  LOCKED) and writes a new version of it, the completion writes another, and neither is a HOT update",
            "  (status is in the partial indexes' predicates); the ceiling is one HOT update of one row.",
            f"  this process spends {py_x:.1f}x: psycopg's cost per statement (1 + 1/{batch} statements per "
            "delivery, each its",
            "  own transaction in one round trip), decoding each payload, and the loop's bookkeeping.",
        ]
    if "sink" in r:
        lines.append("  with the sink, each delivery adds an HTTP POST on a new TCP connection (urllib) to a Python "
                     "http.server:")
        lines.append("  the sink's and the client's HTTP work per delivery, not the database, bound it.")
    lines.append(f"  the completion's plan: {r['completion_plan']}")
    for e in effects:
        d, notes = r[e], []
        if d["fenced"] or d["errors"] or d["failed"]:
            notes.append(f"fenced {d['fenced']}, failed {d['failed']}, errors {d['errors']} (whole run)")
        if d["starved"]:
            notes.append("STARVED: the queue ran dry in a window, the figure is too low")
        if e == "sink" and (d["sink_duplicates"] or d["sink_received"] != d["sent"]):
            notes.append(f"sink received {d['sink_received']} for {d['sent']} sent, "
                         f"{d['sink_duplicates']} duplicates")
        if notes:
            lines.append(f"  {e}: " + "; ".join(notes))
    if "noop" in r:
        at = "at 4 workers" if r["workers"] == 4 else f"(the goal is at 4 workers; this ran {r['workers']})"
        verdict = "met" if r["noop"]["ratio"] >= 0.5 else "not met"
        lines.append(f"goal (issue 2): no-op ratio >= 0.5 {at}: {verdict} ({r['noop']['ratio']:.2f}; an unfenced "
                     f"PostgreSQL queue measured 0.27 at batch 10)")
    return lines


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
        body = {"expectedVersion": self.version, "writerId": self.writer, "saveSeq": self.seq,
                "content": {"title": f"save {self.seq}", "count": self.seq}}
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

    return _Loops(len(clients), make, lambda i: https.pop(i).close() if i in https else None,
                  "documents")


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

    threads = [threading.Thread(target=_capture(lambda i=i: run(i), errors), daemon=True,
                                name=f"bench-open-loop-{i}") for i in range(len(clients))]
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
    return {"rate": rate, "seconds": seconds, "requests": total, "saves": len(lat),
            "achieved_per_second": round(len(lat) / took, 1) if took > 0 else 0.0,
            "errors": sum(c.errors for c in clients), "conflicts": sum(c.conflicts for c in clients),
            "p50_ms": _ms(lat, 0.50), "p90_ms": _ms(lat, 0.90), "p99_ms": _ms(lat, 0.99),
            "max_ms": _ms(lat, 1.0), "behind_ms": round(max(late) * 1e3, 2)}


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    k = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[k]


def _ms(sorted_values: list[float], q: float) -> float:
    return round(_percentile(sorted_values, q) * 1e3, 2)


def bench_documents(clients: int = 8, seconds: float = 10, rate: float | None = None, *,
                    progress: Callable[[str], None] | None = None) -> dict:
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
    out: dict = {"bench": "documents", "clients": clients, "seconds": seconds,
                 "load_before": round(os.getloadavg()[0], 2)}
    with contextlib.ExitStack() as stack:
        pg = stack.enter_context(PostgresCluster(faketime=False))
        dsn = pg.dsn()
        with DocumentStore(dsn, pool_size=None) as store:
            store.install()
            for i in range(clients):  # one document per client: saves never conflict
                store.seed(f"bench{i}", "record", DOC_SCHEMA, {"title": "new", "count": 0},
                           f"user{i}")
        server = stack.enter_context(_ServerProcess("documents", dsn))
        postmaster = pg._proc.pid if pg._proc else None
        meter = _CpuMeter(postmaster, server.pid)
        say(f"{pg.describe()}; document server {server.url} (uvicorn, own process, a pool of "
            f"connections); {os.cpu_count()} cores; load average {out['load_before']}")
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
            say(f"  slice {k + 1}/{n_slices}: ceiling {ceiling.slices[-1]:.0f}/s, "
                f"saves {saves.slices[-1]:.0f}/s")
    lat = sorted(x for c in state for x in c.latencies)
    d = saves.as_dict()
    d.update(ratio=_ratio(saves, ceiling), conflicts=sum(c.conflicts for c in state),
             errors=sum(c.errors for c in state), p50_ms=_ms(lat, 0.50), p99_ms=_ms(lat, 0.99),
             mean_ms=round(statistics.fmean(lat) * 1e3, 2) if lat else 0.0,
             expected_ratio_cpu=(round(_cpu_per_op(ceiling) / _cpu_per_op(saves), 4)
                                 if saves.count else 0.0))
    return {**out, "ceiling": ceiling.as_dict(), "documents": d}


def documents_lines(r: dict) -> list[str]:
    """The documents bench's result as plain readable lines."""
    c, d = r["ceiling"], r["documents"]
    u = d["cpu_us_per_op"]
    lines = [f"bench documents: {r['clients']} clients (threads, keep-alive http.client), "
             f"{r['seconds']:g}s per "
             f"figure, {c['cores']} cores, load average {r['load_before']} before the run"]
    if "open_loop" in r:
        o = r["open_loop"]
        verdict = "met" if o["p99_ms"] <= P99_GOAL_MS else "not met"
        lines += [
            f"  open loop {o['rate']:g} PUT/s for {o['seconds']:g}s: {o['saves']} saves "
            f"({o['achieved_per_second']:.1f}/s), errors {o['errors']}, conflicts "
            f"{o['conflicts']}",
            f"  PUT latency at {o['rate']:g}/s: p50 {o['p50_ms']:.2f} ms, p90 {o['p90_ms']:.2f} ms, "
            f"p99 {o['p99_ms']:.2f} ms, max {o['max_ms']:.2f} ms (from each request's due time)",
            f"  goal (issue 10): p99 <= {P99_GOAL_MS:g} ms at 200 PUT/s on an idle machine: "
            f"{verdict} on this run (a benchmark figure; this machine may be shared)",
        ]
    lines += [
        f"  ceiling   {c['per_second']:>8.0f} commits/s  one-row UPDATE in autocommit over "
        f"{r['clients']} connections (slices {c['slice_rate_min']:.0f}..{c['slice_rate_max']:.0f}/s)",
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
        + ("The database's commit rate is not the bound: the ceiling is "
           f"{c['per_second'] / d['per_second']:.0f}x the saves." if d["per_second"]
           and c["per_second"] > 5 * d["per_second"] else
           "The saves come close to the ceiling: the database's commit rate is near the bound."),
    ]
    return lines


def _largest(u: dict) -> str:
    shares = {"the document server's Python": u.get("app", 0.0), "the clients": u["bench"],
              "PostgreSQL": u["postgres"]}
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
        raise argparse.ArgumentTypeError(f"must be more than 0 and at most {MAX_SECONDS:g}, got {s}")
    return v


def add_parser(subparsers) -> None:
    """Register ``bench`` with its sub-commands ``outbox`` and ``documents`` (each sets ``func``)."""
    p = subparsers.add_parser("bench", help="throughput as a ratio to a one-row UPDATE ceiling, in one run",
                              description="Benchmarks. Each figure is printed with its ratio to the ceiling "
                                          "(one-row UPDATE commits/s over the same number of connections), "
                                          "measured in the same run on interleaved slices.")
    sub = p.add_subparsers(dest="bench", metavar="{outbox,documents}", required=True)
    o = sub.add_parser("outbox", help="deliveries/s of the reference worker loop",
                       description="Deliveries/s of the reference outbox worker loop (claim a batch, send "
                                   "each, fenced completion) with a no-op effect and with the real HTTP sink.")
    o.add_argument("--workers", type=int, default=4, help="worker threads (and ceiling connections); default 4")
    o.add_argument("--seconds", type=_seconds, default=10.0, help="seconds per figure; default 10")
    o.add_argument("--batch", type=int, default=10, help="deliveries per claim; default 10")
    o.add_argument("--effect", choices=("noop", "sink", "both"), default="both",
                   help="the send: no-op, the HTTP sink, or both (default)")
    o.set_defaults(func=run_outbox)
    d = sub.add_parser("documents", help="PUT throughput and latency of the document server",
                       description="Saves/s and PUT latency of the real document server, each client "
                                   "saving its own document; with --rate, first the PUT latency at a "
                                   "fixed rate (open loop).")
    d.add_argument("--clients", type=int, default=8, help="client threads (and ceiling connections); default 8")
    d.add_argument("--seconds", type=_seconds, default=10.0, help="seconds per figure; default 10")
    d.add_argument("--rate", type=_rate, default=None, metavar="PUTS_PER_SECOND",
                   help="first, PUT latency at this fixed rate (open loop), e.g. 200")
    d.set_defaults(func=run_documents)


def run_outbox(args) -> int:
    try:
        r = bench_outbox(args.workers, args.seconds, args.batch, args.effect, progress=lambda m: print(m, flush=True))
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
        r = bench_documents(args.clients, args.seconds, args.rate,
                            progress=lambda m: print(m, flush=True))
    except ValueError as e:
        print(f"bench documents: {e}")
        return 2
    print("\n".join(documents_lines(r)), flush=True)
    return 0
