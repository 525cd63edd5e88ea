"""``--jobs N``: a plan's runs in N processes side by side.

A check spends much of a step waiting: on PostgreSQL, on a crash's restart, on a stand-in. With
``--jobs N``, ``verify`` and ``mutants`` start N shards (``--shard I/N``), each a ``knownstate``
process of its own with its own PostgreSQL and Toxiproxy, and join their reports as ``report
merge`` does. A shard takes its runs one at a time: each time it is free it asks this process for
the next run of the plan, so no process stands idle while another still has several runs to go
(dealt round-robin, as ``--shard I/N`` alone deals them, the two longest kinds of ``verify`` at
seed 5 met in one process: 69.7 s, the other done after 22.4 s). Each run's verdict depends on
its seed alone, so the verdicts, examples and steps are those of the same command without
``--jobs``; only which process runs which, and the order in which runs end, differ.

A shard's process is the same command line with its shard, its seeds and its report added
(argparse keeps an option's last value), and ``--part``: it prints each block of its output as
one JSON line, which this process prints whole, so two shards' blocks never interleave; a line
:data:`ASK` asks for its next run, answered on its stdin with the run's index in the plan (end of
input: there is none left). Progress lines go to stderr as plain lines. Ctrl-C or SIGTERM stops
every shard (each stops its servers and writes its report), and the joined report says the run
was interrupted; runs no shard began are reported as not run.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
from collections import deque
from pathlib import Path
from typing import Iterator

from . import kinds, leftovers, tools
from .report import Report, ReportError, Unit, merge, partial_record, read

ASK = {"next": "run"}
"""What a shard prints, as one JSON line, when it is free for its next run."""


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
    lock, left = threading.Lock(), deque(sorted(p.units, key=_longest_first))
    # the shards' reports: swept by a later run if this process is killed outright
    with contextlib.ExitStack() as stack:
        tmp = leftovers.make("knownstate-jobs-")
        stack.callback(leftovers.remove, tmp)
        paths = [tmp / f"shard-{i}.json" for i in range(1, n + 1)]
        procs = [_start(args, p, i, n, path, tmp) for i, path in enumerate(paths, 1)]
        relays = [threading.Thread(target=_relay, args=(pr, lock, left)) for pr in procs]
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
            docs = [(str(path), read(str(path))) for path in paths]
            began = {r["index"] for _, d in docs for r in d["runs"]}
            unrun = [partial_record(u, args.profile, "not run") for u in p.units]
            doc = merge(docs, [r for r in unrun if r["index"] not in began])
        except ReportError as e:
            print(f"knownstate: the shards' reports do not join: {e}", file=sys.stderr)
            return EXIT_ENVIRONMENT
    doc.update(argv=["knownstate", *args.argv], merged_from=[])  # its shards' reports are gone
    return finish(doc)


def _longest_first(unit: Unit) -> tuple[bool, int]:
    """The order runs are handed out in: those likely to take longest first, so that no long
    one starts last, alone, while the other processes are done. A reference before a mutant
    (which ends once caught), and the kind with more requirements first (a reference runs until
    each was observed). ``verify`` of the four kinds at seeds 1-8 (simulated from the measured
    time of each run): the document session and the approved plan first, at most 58 s; in the
    plan's order, up to 64 s."""
    return (unit.mutant is not None, -len(kinds.check(unit.kind).requirements()))


def _start(args, p, i: int, n: int, report: Path, tmp: Path) -> subprocess.Popen:
    seeds = ["--seed", str(p.seeds[0]), "--seeds", str(len(p.seeds))]
    argv = [*args.argv, *seeds, "--shard", f"{i}/{n}", "--json", str(report)]
    argv += ["--junit", str(tmp / f"shard-{i}.xml"), "--jobs", "1", "--part"]
    return subprocess.Popen(
        [sys.executable, "-m", "knownstate.chaos.cli", *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "CI": os.environ.get("CI") or "1"},  # plain progress lines
    )


def _relay(proc: subprocess.Popen, lock: threading.Lock, left: deque) -> None:
    """Print a shard's blocks whole, as they come; answer its asks with the next run of those
    ``left`` (none left: its stdin closed)."""
    for line in proc.stdout:
        try:
            text = json.loads(line)
        except ValueError:
            text = line.rstrip("\n")  # not a block: printed as it is
        if text == ASK:
            _hand(proc, left)
            continue
        with lock:
            print(text, flush=True)


def _hand(proc: subprocess.Popen, left: deque) -> None:
    try:
        unit = left.popleft()  # (atomic: two shards asking at once get one run each)
    except IndexError:
        with contextlib.suppress(OSError):
            proc.stdin.close()
        return
    try:
        proc.stdin.write(f"{unit.index}\n")
        proc.stdin.flush()
    except OSError:  # the shard has ended (its lines say why): another may run it
        left.appendleft(unit)


PR_SET_PDEATHSIG = 1  # prctl(2)


def follow_parent() -> None:
    """A shard ends with its parent: killed outright (SIGKILL, the OOM killer), the parent
    cannot stop it, so the kernel sends it SIGTERM (Linux's ``PR_SET_PDEATHSIG``), which stops
    it as a signal stops any run, its servers with it, instead of running on alone (a shard of
    ``--examples 100000`` whose parent was killed ran on, with its servers, until killed by
    hand)."""
    parent = os.getppid()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # it died before the line above
        os.kill(os.getpid(), signal.SIGTERM)


def pulled(units: list[Unit], report: Report) -> Iterator[Unit]:
    """A ``--jobs`` shard's runs, of the plan's ``units``: asked of its parent one at a time,
    each once the last has ended; each joins ``report`` as it is handed over."""
    by_index = {u.index: u for u in units}
    while True:
        print(json.dumps(ASK), flush=True)
        line = sys.stdin.readline()
        if not line.strip():
            return
        unit = by_index[int(line)]
        report.units.append(unit)
        yield unit
