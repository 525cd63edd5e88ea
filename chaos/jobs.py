"""``--jobs N``: a plan's runs in N processes side by side.

A check spends much of a step waiting: on PostgreSQL, on a crash's restart, on a stand-in. With
``--jobs N``, ``verify`` and ``mutants`` run their plan as N shards (``--shard I/N``, runs dealt
round-robin), each a ``knownstate`` process of its own with its own PostgreSQL and Toxiproxy,
and join their reports as ``report merge`` does. Each run's verdict depends on its seed alone,
so the verdicts, examples and steps are those of the same command without ``--jobs``; only the
order in which runs end differs.

A shard's process is the same command line with its shard, its seeds and its report added
(argparse keeps an option's last value), and ``--part``: it prints each block of its output as
one JSON line, which this process prints whole, so two shards' blocks never interleave. Progress
lines go to stderr as plain lines. Ctrl-C or SIGTERM stops every shard (each stops its servers
and writes its report), and the joined report says the run was interrupted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from . import tools
from .report import ReportError, merge, read


def say(args, text: str) -> None:
    """Print a block of a command's output: as is, or, in a shard's process, as one JSON line."""
    print(json.dumps(text) if getattr(args, "part", False) else text, flush=True)


def run(args, p, finish) -> int:
    """Run plan ``p`` in ``args.jobs`` processes; ``finish(doc)`` prints the verdict and writes
    the reports of the merged document, and returns the exit code."""
    from .cli import EXIT_ENVIRONMENT, EXIT_USAGE, _header

    n = min(args.jobs, len(p.units))
    print(f"{_header(args, p)}; {n} processes side by side", flush=True)
    for note in p.notes:
        print(f"  note: {note}", flush=True)
    lock = threading.Lock()
    with tempfile.TemporaryDirectory(prefix="knownstate-jobs-") as tmp:
        paths = [Path(tmp) / f"shard-{i}.json" for i in range(1, n + 1)]
        procs = [_start(args, p, i, n, path, tmp) for i, path in enumerate(paths, 1)]
        relays = [threading.Thread(target=_relay, args=(pr, lock)) for pr in procs]
        for t in relays:
            t.start()
        try:
            for pr in procs:
                pr.wait()
        except KeyboardInterrupt as e:
            tools.interrupt_caught()  # the shards stop, write their reports, and are joined
            sig = signal.SIGTERM if getattr(e, "signal", "") == "SIGTERM" else signal.SIGINT
            for pr in procs:
                if pr.poll() is None:
                    pr.send_signal(sig)  # (one a terminal's Ctrl-C reached already ignores it)
            for pr in procs:
                pr.wait()
        finally:
            for t in relays:
                t.join()
        for i, (pr, path) in enumerate(zip(procs, paths), 1):
            if not path.exists():
                print(
                    f"knownstate: shard {i}/{n} ended with exit {pr.returncode} and wrote no "
                    "report: its lines above say why",
                    file=sys.stderr,
                )
                return EXIT_USAGE if pr.returncode == EXIT_USAGE else EXIT_ENVIRONMENT
        try:
            doc = merge([(str(path), read(str(path))) for path in paths])
        except ReportError as e:
            print(f"knownstate: the shards' reports do not join: {e}", file=sys.stderr)
            return EXIT_ENVIRONMENT
    doc.update(argv=["knownstate", *args.argv], merged_from=[])  # its shards' reports are gone
    return finish(doc)


def _start(args, p, i: int, n: int, report: Path, tmp: str) -> subprocess.Popen:
    seeds = ["--seed", str(p.seeds[0]), "--seeds", str(len(p.seeds))]
    argv = [*args.argv, *seeds, "--shard", f"{i}/{n}", "--json", str(report)]
    argv += ["--junit", str(Path(tmp) / f"shard-{i}.xml"), "--jobs", "1", "--part"]
    return subprocess.Popen(
        [sys.executable, "-m", "knownstate.chaos.cli", *argv],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "CI": os.environ.get("CI") or "1"},  # plain progress lines
    )


def _relay(proc: subprocess.Popen, lock: threading.Lock) -> None:
    """Print a shard's blocks whole, as they come."""
    for line in proc.stdout:
        try:
            text = json.loads(line)
        except ValueError:
            text = line.rstrip("\n")  # not a block: printed as it is
        with lock:
            print(text, flush=True)
