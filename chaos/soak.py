"""``knownstate soak KIND``: a kind's worker loops as OS processes, under a nemesis.

Theory of operation
-------------------

The check (``knownstate verify``) drives one operation at a time and judges every step against
the model. A soak does the opposite: it lets the real processes run on their own, for a
duration, while a nemesis hurts them, and judges afterwards, from what was recorded.

The parts start where every check's start, in :class:`~knownstate.chaos.harness.Env`: a
throwaway PostgreSQL under libfaketime (its clock is the nemesis's to move), the real Toxiproxy
server, the stand-in the kind calls (the notification sink for the outbox, the operations API
for branch reset, the receiver of a described kind's external call); the kind's tables in a
workspace of their own, every one of them audited (:mod:`~knownstate.chaos.soakparts`). Each
process has its own link to PostgreSQL, and each worker one to the stand-in, with a little
latency drawn from the seed. The processes (:mod:`knownstate.chaos.soakworker`): ``p0`` the
producer, ``w0``..``w2`` the kind's worker loop, ``r0`` its reaper (for the approved plan the
reader, whose reads heal stale runs). What each runs is the kind's soak binding
(:mod:`knownstate.chaos.soakkinds`: its check module's ``SOAK``), found like ``verify`` finds
the kind: by name, by entry point, or ``--kind package.module:Thing`` (a described kind: its
description and adapter).

Phases. Start everything and wait until each process is ready; run for ``seconds`` while the
nemesis (:mod:`knownstate.chaos.nemesis`) carries out the schedule the seed names, printed
first; then the quiet period: every fault healed, the producer stopped, and the soak waits
until every run asked for is terminal, or no progress is possible — no committed change for a
while even after the soak let time pass on the database clock (lapsed leases are reaped,
backoffs come due, stale heartbeats heal). The wait polls with a generous deadline and ends on
the state, never on a timer alone, so a slow machine makes a soak slower, not wrong.

The verdict comes from the history (:mod:`knownstate.chaos.history`), judged by the contract's
predicates (:mod:`knownstate.chaos.judge`): the operation logs, an audit of every committed row
change, the stand-in's records, the nemesis periods. Exit codes as ``verify``: 0 passed, 1 a
violation, 2 usage, 3 a real part died that the harness did not kill (a worker process,
PostgreSQL outside a planned crash, Toxiproxy, the stand-in), 130 interrupted. Every process
and server is stopped at the end, also after Ctrl-C. A failure prints the command that replays
the schedule, and writes the timeline (:mod:`knownstate.chaos.timeline`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import random
import secrets
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psycopg

from . import history as hist
from . import nemesis as nem
from . import leftovers, outpath
from .harness import Env, EnvironmentFault
from .judge import judge
from .soakparts import Processes, SoakEnvironmentError, SoakParts, audit_ddl, audits, read_logs
from .soakreport import (
    _LiveLine,
    default_timeline,
    soak_report,
    summary_lines,
    write_cut_short,
    write_reports,
)
from .toxi import Toxic, ToxiproxyError

DEFAULT_SECONDS = 60.0
MIN_SECONDS = 5.0
MAX_SECONDS = 3600.0
QUIET_DEADLINE = 600.0
"""The quiet period ends at the latest this long after it began, even while progress continues."""
PROGRESS_EVERY = 5.0

PROCESSES = (
    ("w0", "worker"),
    ("w1", "worker"),
    ("w2", "worker"),
    ("p0", "producer"),
    ("r0", "reaper"),
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
    expected: tuple[str, ...] = ()  # what the kind should see happen

    @property
    def passed(self) -> bool:
        return self.verdict.passed

    def replay(self) -> str:
        return replay_command(self.kind, self.seconds, self.seed, self.mutant)


def replay_command(kind: str, seconds: float, seed: int, mutant: str | None) -> str:
    from . import kinds

    cmd = f"knownstate soak {kinds.argument(kind)} --seconds {seconds:g} --seed {seed}"
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
        from . import kinds

        self.kind, self.seconds, self.seed, self.mutant = kind, seconds, seed, mutant
        self.check = check_class(kind, mutant)
        self.binding = kinds.soak(kind)
        self.say, self.live = say, live
        self.procs_names = [n for n, _ in PROCESSES]
        b = self.binding
        label = b.stand_in.label if b.stand_in is not None else ""
        self.schedule = nem.schedule(seed, seconds, self.procs_names, b.lease, label, b.refusals)
        self.nemesis: nem.Nemesis | None = None

    # -- observation ---------------------------------------------------------------------
    def _alive(self) -> None:
        problem = self.env.health()
        if problem:
            raise SoakEnvironmentError(problem)
        if self.nemesis is not None and self.nemesis.error is not None:
            e = self.nemesis.error
            raise SoakEnvironmentError(
                f"the nemesis could not act on a real part: {type(e).__name__}: {e}"
            )
        self.procs.check()

    def _runs(self) -> dict | None:
        """Every run as the kind reads it now (None: the database cannot be read now)."""
        try:
            return self.binding.current(self.ws.admin())
        except (psycopg.Error, EnvironmentFault):
            return None

    def _statuses(self) -> str:
        runs = self._runs()
        if runs is None:
            return "database down"
        counts: dict[str, int] = {}
        for r in runs.values():
            counts[r.status] = counts.get(r.status, 0) + 1
        return ", ".join(f"{s} {n}" for s, n in sorted(counts.items())) or "no runs yet"

    # -- the whole run ---------------------------------------------------------------------
    def run(self) -> SoakResult:
        started = time.time()
        logdir = leftovers.make("knownstate-soak-")  # swept by a later run if this one is killed
        # Every child process (workers, a restarted PostgreSQL) is forked on this one thread, which
        # outlives them all: a child's parent-death signal fires when the *thread* that forked it
        # ends, and the nemesis thread, which restarts what it killed, ends before the soak does.
        spawner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="soak-spawner")
        with contextlib.ExitStack() as stack:
            stack.callback(spawner.shutdown)
            stack.callback(leftovers.remove, logdir)
            self.env = env = stack.enter_context(Env.open())
            self.ws = ws = env.workspace(self.check.kind, self.check.schema)
            ws.admin().execute(audit_ddl(ws.tables))
            self.binding.prepare(env, ws)
            stand_in = None
            if self.binding.stand_in is not None:
                cls = self.binding.stand_in
                stand_in = env.stand_in(f"soak-{cls.label}", lambda: cls())
            links = self._links(stand_in)
            spec = {
                "kind": self.check.kind,
                "kind_ref": _kind_ref(self.kind),
                "seed": self.seed,
                "mutant": self.mutant,
                "params": self.binding.params,
            }
            self.procs = Processes(
                spec,
                logdir,
                links,
                lambda link: ws.conninfo(host=link.host, port=link.port),
                lambda name, inc: env.app_name(f"soak-{name}.{inc}"),
                spawner,
            )
            stack.callback(self.procs.stop_all, 2.0)  # after an error or Ctrl-C: quickly
            self.parts = SoakParts(env, ws, self.procs, links, stand_in, self.binding)
            stack.callback(self.parts.close)
            self.parts.postmasters.append(env.db._proc.pid)
            try:
                return self._run(started, logdir, stand_in)
            except ToxiproxyError as e:
                raise SoakEnvironmentError(f"a real part failed: {e}") from None
            finally:
                if self.nemesis is not None:
                    with contextlib.suppress(Exception):
                        self.nemesis.heal()

    def _links(self, stand_in) -> dict:
        env = self.env
        rng = random.Random(f"knownstate-soak-links:{self.seed}")
        links = {}
        for name, role in PROCESSES:
            db = env.api.link(f"soak-{name}-db", env.db.host, env.db.port)
            ext = None
            if stand_in is not None and role == "worker":
                ext = env.api.link(f"soak-{name}-ext", stand_in.host, stand_in.port)
                ext.add(
                    Toxic("latency", "downstream", {"latency": rng.randint(15, 45), "jitter": 0})
                )
            links[name] = (db, ext)
        return links

    def _run(self, started: float, logdir: Path, stand_in) -> SoakResult:
        for name, role in PROCESSES:
            self.procs.spawn(name, role)
        self.procs.ready()
        background = self.binding.background(stand_in, self.seed) if stand_in else None
        if background is not None:
            background.start()
        try:
            t0 = time.time()
            self.nemesis = nem.Nemesis(self.schedule, self.parts, t0).start()
            self._active(t0)
            self.nemesis.heal()
            quiet_from = time.time()
            self.procs.stop_role("producer")
            if stand_in is not None:
                stand_in.calm()
            if background is not None:
                background.hurry = True
            why = self._quiet()
            quiet_seconds = time.time() - quiet_from
            self._alive()
        finally:
            if background is not None:
                background.stop()
        self.procs.stop_all()
        h = self._history(t0, quiet_from, stand_in, logdir)
        verdict = judge(h, self.binding)
        pids = self.procs.pids + self.parts.postmasters
        pids.append(self.env.toxiproxy._proc.pid)
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
            self.binding.expected(),
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

    def _quiet(self) -> str:
        """Wait until every run asked for is terminal, or no progress is possible."""
        b = self.binding
        open_statuses = set(b.claimable()) | set(b.description.owned)
        patience = max(10.0, 2 * b.lease + 2)
        began = time.time()
        nudges, last_change, last_mark = 0, time.time(), None
        while True:
            self._alive()
            runs = self._runs()
            try:
                ((mark,),) = self.ws.query("SELECT coalesce(max(id), 0) FROM soak_audit")
            except (psycopg.Error, EnvironmentFault):
                runs = None
            if runs is None:
                time.sleep(0.2)
                continue
            open_runs = sum(1 for r in runs.values() if r.status in open_statuses)
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
                if b.nudge:
                    self.env.clock.jump(b.nudge)
                self.say(
                    f"  quiet: {open_runs} run(s) open, no change for {patience:.0f} s; letting "
                    f"{b.nudge or b.lease:g} s pass"
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
            self.check.kind,
            self.seed,
            t0,
            dict(self.binding.params),
            mutant=self.mutant,
            quiet_from=quiet_from,
        )
        h.procs = self.procs.procs
        h.periods = sorted(self.nemesis.periods, key=lambda p: p.start)
        h.ops = read_logs(logdir)
        conn = self.ws.admin()
        h.audit = audits(conn)
        self.binding.annotate(conn, h.audit)
        if stand_in is not None:
            h.external = stand_in.record()
        return h


def _kind_ref(name: str) -> str:
    """How a worker process finds the kind: its name, or where ``--kind`` named it."""
    from . import kinds

    arg = kinds.argument(name)
    return arg.removeprefix("--kind ") if arg != name else name


# ---------------------------------------------------------------------------------------
# The command.
# ---------------------------------------------------------------------------------------


def cmd_soak(args) -> int:
    from . import cli, kinds
    from . import timeline as tl

    if not MIN_SECONDS <= args.seconds <= MAX_SECONDS:
        raise cli.UsageError(f"--seconds must be between {MIN_SECONDS:g} and {MAX_SECONDS:g}")
    if (args.kind is None) == (args.kind_spec is None):
        raise cli.UsageError(
            ("name one kind, not both" if args.kind else "name the kind to soak")
            + ": KIND (one of "
            + ", ".join(soak_kinds())
            + ") or --kind package.module:Thing"
        )
    try:
        kind = kinds.load(args.kind_spec) if args.kind_spec else args.kind
        kinds.soak(kind)
    except kinds.KindNotFound as e:
        raise cli.UsageError(str(e)) from None
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
            kind,
            args.seconds,
            seed,
            args.mutant,
            say=out.say if out else (lambda line: print(line, flush=True)),
            live=live,
        )
    except ValueError as e:
        raise cli.UsageError(str(e)) from None
    mutant = next((m for m in kinds.mutants(kind) if m.name == args.mutant), None)
    print(
        f"knownstate soak {kind}: {args.seconds:g} s under a nemesis, seed {seed}"
        + (f", mutant {mutant.name}: {mutant.description}" if mutant else ""),
        flush=True,
    )
    print(f"  replay: {replay_command(kind, args.seconds, seed, args.mutant)}")
    print(f"  nemesis schedule ({len(soak.schedule)} faults, drawn from the seed):")
    for f in soak.schedule:
        print(f"    {f.describe()}")
    sys.stdout.flush()
    report = soak_report(args, kind, seed, mutant)  # made now, so that its seconds are the soak's
    try:
        r = soak.run()
    except (KeyboardInterrupt, EnvironmentFault) as e:  # reports on every exit but 2, as verify
        if args.json or args.junit:
            write_cut_short(args, report, e)
        raise
    if out:
        out.done()
    timeline = args.timeline or (None if r.passed else default_timeline(args, kind, seed))
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
    code = _exit_code(r, mutant)
    return code if code or written else cli.EXIT_ENVIRONMENT


def _exit_code(r: SoakResult, mutant) -> int:
    from . import cli

    if mutant is None:
        return cli.EXIT_OK if r.passed else cli.EXIT_FAILED
    # As `verify --mutant`: caught when the soak failed naming the invariant the mutant declares.
    caught = not r.passed and mutant.invariant in {f.invariant for f in r.verdict.findings}
    print(
        f"knownstate soak: {'CAUGHT' if caught else 'NOT CAUGHT'} — mutant {r.mutant} "
        f"({'the violations name' if caught else 'no violation names'} {mutant.invariant})"
    )
    return cli.EXIT_OK if caught else cli.EXIT_FAILED


def soak_kinds() -> list[str]:
    """The built-in kinds a soak runs (a described kind too, named with ``--kind``)."""
    from . import kinds

    return [name for name, entry in kinds.built_in().items() if entry.soaks]


def add_parser(subparsers) -> None:
    """Register ``soak``."""
    from . import cli

    p = subparsers.add_parser(
        "soak",
        help="run a kind's worker processes under a nemesis and judge the history",
        description="Runs a kind's worker loops as OS processes against the real parts for a "
        "duration while a nemesis drawn from the seed kills, stalls and partitions them, "
        "crashes PostgreSQL and moves its clock; then judges what was recorded.",
    )
    p.add_argument(
        "kind",
        metavar="KIND",
        nargs="?",
        help=f"one of {', '.join(soak_kinds())}, or a kind an installed package registers",
    )
    p.add_argument(
        "--kind",
        dest="kind_spec",
        metavar="PACKAGE.MODULE:THING",
        help="a kind of your own: a check class, e.g. built by knownstate.chaos.generic.kind",
    )
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
        help="write the timeline (HTML) here; on failure it is always written (next to "
        "--json/--junit, else in .knownstate/timelines/)",
    )
    p.set_defaults(func=cmd_soak)
