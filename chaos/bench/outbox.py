"""``bench outbox``: jobs/s of the reference worker loop beside the peer queues and the
ceiling, at each batch size, in one run on one cluster; and how its fenced writes are planned."""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass, field
from typing import Callable, Iterable

import psycopg

from knownstate.impl import outbox as ob
from knownstate.impl.loops import Stats
from knownstate.model.outbox import Claim

from ..cluster import open_database
from ..sink import NotificationSink
from ..standin import StandInProcess
from .measure import (
    CpuMeter,
    Figure,
    Loops,
    ceiling_loops,
    check_bounds,
    cpu_per_op,
    ratio_to,
    slices_of,
)
from .queues import (
    OURS,
    PEER_QUEUES,
    PEERS,
    OutboxQueue,
    Queue,
    Tally,
    outbox_loops,
    peer_versions,
    pgqueuer_loops,
    procrastinate_loops,
)

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
OURS_PER_ROW = "outbox-per-row"  # the same loop recording each row in its own transaction
OURS_SINK = "outbox-sink"  # the batched loop with the real HTTP sink as its effect
WARM_FILL = 20_000  # jobs each queue holds before its warm-up window
# A figure's worker counts in the report, each from its workers' Stats field.
_WORKER_STATS = {"sent": "done", "fenced": "fenced", "failed": "failed", "errors": "errors"}


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


def _wal_lsn(conn: psycopg.Connection) -> int:
    hi, lo = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0].split("/")
    return (int(hi, 16) << 32) + int(lo, 16)


@dataclass
class _Set:
    """One figure's loops, the queue they drain, and what they did."""

    name: str
    loops: Loops
    queue: Queue
    tallies: list[Tally]
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
    queues: dict[str, Queue],
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
            loops, ws, tallies = outbox_loops(
                dsn, workers, batch, name == OURS_PER_ROW, sink if name == OURS_SINK else noop, name
            )
        elif name == "pgqueuer":
            loops, tallies = pgqueuer_loops(dsn, workers, batch)
        else:
            loops, tallies = procrastinate_loops(dsn, workers)
        queue = queues[OURS if name.startswith(OURS) else name]
        sets.append(_Set(name, stack.enter_context(loops), queue, tallies, ws))
    return sets


def _outbox_step(
    dsn: str,
    admin: psycopg.Connection,
    workers: int,
    batch: int,
    names: list[str],
    queues: dict[str, Queue],
    sink_url: str | None,
    n_slices: int,
    slice_s: float,
    meter: CpuMeter,
    say: Callable[[str], None],
) -> dict:
    """Every figure at one batch size, from fresh tables, in interleaved slices."""
    for q in queues.values():
        q.reset()
    ceiling = Figure("ceiling", workers)
    ceiling_wal = 0
    with contextlib.ExitStack() as stack:
        ceil_loops = stack.enter_context(ceiling_loops(dsn, workers))
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
                w.stats = Stats()
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
        for k, attr in _WORKER_STATS.items() if s.workers else ():
            d[k] = sum(getattr(w.stats, attr) for w in s.workers)
        out[s.name] = d
    return out


def _figure_dict(fig: Figure, ceiling: Figure, tx_per_job: float, wal: int) -> dict:
    d = fig.as_dict()
    own = fig.cpu.bench + fig.cpu.postgres + fig.cpu.app
    d.update(
        ratio=ratio_to(fig, ceiling),
        tx_per_job=round(tx_per_job, 4),
        wal_per_job=round(wal / fig.count, 1) if fig.count else 0.0,
        cpu_per_job=round(cpu_per_op(fig), 1),
        cores_own=round(own / fig.cpu.wall, 2) if fig.cpu.wall else 0.0,
    )
    return d


def check_batches(batches: Iterable[int]) -> tuple[int, ...]:
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
    check_bounds(workers, seconds, "--workers")
    batches = check_batches(batches)
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
    n_slices, slice_s = slices_of(seconds)
    settings, meaning = DURABILITY[durability]
    load = os.getloadavg()[0]
    runs: dict[int, dict] = {}
    with contextlib.ExitStack() as stack:
        pg = stack.enter_context(open_database(faketime=False, settings=settings))
        dsn = pg.dsn()
        sink = None
        if effect != "noop":  # in a process of its own, as it would be deployed
            sink = stack.enter_context(StandInProcess("sink", NotificationSink))
        meter = CpuMeter(pg._proc.pid if pg._proc else None, sink.pid if sink else None)
        admin = stack.enter_context(psycopg.connect(dsn, autocommit=True))
        say(
            f"{pg.describe()}, {meaning}; {os.cpu_count()} cores, load {load:.2f}; {n_slices} "
            f"interleaved slices of {slice_s:.2f}s per figure; figures: ceiling, "
            f"{', '.join(names)}"
        )
        for p, v in versions.items():
            if v is None:
                say(f"{p}: not installed, not measured (pip install -e '.[bench]')")
        queues: dict[str, Queue] = {OURS: OutboxQueue(dsn)}
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
