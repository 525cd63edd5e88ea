"""What every benchmark measures with: CPU per consumer, loops run in interleaved slices, and
the ceiling they are compared with (see the package's docstring for why)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import psycopg

MAX_SECONDS = 600.0
MAX_LOOPS = 64
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


class CpuMeter:
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


class Loops:
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

    def __enter__(self) -> "Loops":
        for i in range(self.n):
            t = threading.Thread(
                target=self._run, args=(i,), name=f"bench-{self.name}-{i}", daemon=True
            )
            t.start()
            self._threads.append(t)
        return self

    def run_slice(
        self, seconds: float, meter: CpuMeter, fig: Figure, during: Callable[[], None] | None = None
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
                    target=capture(during, helper_error),
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


def capture(fn: Callable[[], None], errors: list) -> Callable[[], None]:
    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised by the main thread
            errors.append(e)

    return run


def slices_of(seconds: float) -> tuple[int, float]:
    """How many slices, and how long each, for a figure of ``seconds``."""
    n = max(1, round(seconds / SLICE_SECONDS))
    return n, seconds / n


def check_bounds(n: int, seconds: float, what: str) -> None:
    if not 1 <= n <= MAX_LOOPS:
        raise ValueError(f"{what} must be 1..{MAX_LOOPS}, got {n}")
    if not 0 < seconds <= MAX_SECONDS:
        raise ValueError(f"seconds must be in (0, {MAX_SECONDS:g}], got {seconds:g}")


# ---------------------------------------------------------------------------------------
# The ceiling: one-row UPDATE commits in autocommit, each connection on its own row.
# ---------------------------------------------------------------------------------------


def ceiling_loops(dsn: str, n: int) -> Loops:
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

    return Loops(n, make, lambda i: conns.pop(i).close() if i in conns else None, "ceiling")


def ratio_to(fig: Figure, ceiling: Figure) -> float:
    return round(fig.rate / ceiling.rate, 4) if ceiling.rate else 0.0


def cpu_per_op(fig: Figure) -> float:
    """CPU microseconds per unit of work, everything the work itself used (not the others)."""
    return fig.cpu_us("bench") + fig.cpu_us("postgres") + fig.cpu_us("app")
