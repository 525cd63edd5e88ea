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
:mod:`.linearize`
    Not a subcommand: the linearizability checker's own figure, seconds to judge a random
    1,000-operation outbox history with its final rows (``bench()``, run by its tests).

The loops under test (and the ceiling's) are threads of this process. psycopg releases the GIL
while it waits on the server, the loops' own Python uses well under one core here, and a
comparison with one OS process per worker gave the same CPU per delivery and the same ratio
within the noise; threads let every loop be started, parked and stopped together. The servers
they drive run in processes of their own, as they would be deployed, started as the check starts
its stand-ins (:class:`~knownstate.chaos.standin.StandInProcess`), on a throwaway cluster from
the harness's :func:`~knownstate.chaos.cluster.open_database` (with the real clock: no
libfaketime).

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

Modules: :mod:`.measure` (CPU accounting, loops run in slices, the ceiling), :mod:`.queues`
(ours and the peer queues, and the loops that drain them), :mod:`.outbox` and
:mod:`.documents` (each benchmark and its report); here, the command line.
"""

from __future__ import annotations

import argparse

from .documents import MAX_RATE, bench_documents, documents_lines
from .measure import MAX_LOOPS, MAX_SECONDS
from .outbox import (
    BATCHES,
    DURABILITY,
    OURS_PER_ROW,
    OURS_SINK,
    bench_outbox,
    check_batches,
    fenced_write_plans,
    outbox_lines,
)
from .queues import OURS, PEERS, peer_versions

__all__ = [
    "BATCHES",
    "DURABILITY",
    "MAX_LOOPS",
    "MAX_RATE",
    "MAX_SECONDS",
    "OURS",
    "OURS_PER_ROW",
    "OURS_SINK",
    "PEERS",
    "add_parser",
    "bench_documents",
    "bench_outbox",
    "documents_lines",
    "fenced_write_plans",
    "outbox_lines",
    "peer_versions",
    "run_documents",
    "run_outbox",
]

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
        return check_batches(int(x) for x in s.split(","))
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
