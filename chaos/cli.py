"""``knownstate``: the gate (verify), the mutant catalogue (mutants), reports (report merge),
the generated specs (specs) and the benchmarks (bench).

A command's work is a plan of runs, one per (kind, seed, mutant) (:func:`plan`), checked
before anything starts — kinds, mutants, shard, output paths, the example database — so a bad
command line is exit 2 with one line and nothing started. :func:`execute` runs the plan on one
set of real parts and writes the reports on every way out (:mod:`.report`).
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
import time
from dataclasses import dataclass
from typing import Iterable

from . import browser_cli, jobs, kinds, memory, outpath
from . import dsn as dsns
from .check import PROFILES, EnvironmentFault, Env, run_check
from .cliargs import EXIT_CODES_HELP, MAX_SEED, SEED_HELP, build_parser, profiles_help, seed_option
from .cluster import Unavailable
from .mutants import catalogue_problems
from .report import (
    not_covered_record,
    Replay,
    Report,
    ReportError,
    Unit,
    finished_record,
    merge,
    mutant_lines,
    not_applicable,
    path_problem,
    read,
    run_lines,
    stability_lines,
    status_word,
    verdict_line,
    write_reports,
)
from . import tools
from .outpath import OutputError
from .tools import MissingTool

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_ENVIRONMENT = 0, 1, 2, 3
EXIT_INTERRUPTED, EXIT_TERMINATED = 130, 143

__all__ = [  # the command line's grammar, re-exported from .cliargs
    "EXIT_CODES_HELP",
    "MAX_SEED",
    "SEED_HELP",
    "build_parser",
    "profiles_help",
    "seed_option",
]


class UsageError(Exception):
    """The command line asks for something that does not exist."""


def _kinds(requested: list[str]) -> list[str]:
    known = kinds.names()
    unknown = [k for k in requested if k not in known]
    if unknown:
        raise UsageError(f"unknown kind {', '.join(unknown)}: choose from {', '.join(known)}")
    try:
        for name in requested or known:
            kinds.check(name)  # a kind that cannot be imported: one line, before anything starts
    except kinds.KindNotFound as e:
        raise UsageError(str(e)) from None
    return list(dict.fromkeys(requested)) or known


class Progress:
    """On a terminal: one live line (examples, steps, faults, requirements still to observe).
    In CI (no terminal, or CI set): the same as a plain line every few seconds per run."""

    EVERY = 5.0

    def __init__(self, label: str, report: Report, stream=None):
        self.label, self.report = label, report
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty() and not os.environ.get("CI")
        self._last: float | None = None

    def __call__(self, run) -> None:
        self.report.state = run
        now = time.monotonic()
        if self._last is not None and now - self._last < (0.2 if self.live else self.EVERY):
            return
        self._last = now
        stats = run.stats
        todo = [r.key for r in run.missing(run.profile.times_each)]
        line = (
            f"  {self.label}: {stats.examples} examples, {stats.steps} steps, "
            f"{sum(stats.faults.values())} faults, "
            + (
                "shrinking a failure"
                if run.failures
                else f"{len(todo)} requirements still to observe"
                + (": " + ", ".join(todo) if 0 < len(todo) <= 3 else "")
            )
        )
        if self.live:
            self.stream.write("\r\033[K" + line[: self._width()])
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    @staticmethod
    def _width() -> int:
        return os.get_terminal_size(sys.stderr.fileno()).columns - 1 if sys.stderr.isatty() else 200

    def done(self) -> None:
        if self.live and self._last is not None:
            self.stream.write("\r\033[K")
            self.stream.flush()


# ---------------------------------------------------------------------------------------
# The plan: everything checked before anything starts.
# ---------------------------------------------------------------------------------------


@dataclass
class Plan:
    command: str
    units: list[Unit]
    planned: int  # runs in the whole plan (all shards)
    seeds: list[int]
    shard: tuple[int, int] | None
    replay: Replay
    memory: memory.Memory | None
    replay_stored: bool  # replay stored failing examples first (one seed) or only keep new ones
    notes: list[str]


def parse_shard(text: str) -> tuple[int, int]:
    i, slash, n = text.partition("/")
    try:
        index, count = int(i), int(n)
    except ValueError:
        index = count = 0
    if not slash or not 1 <= index <= count:
        raise UsageError(f"--shard {text}: give I/N with 1 <= I <= N, e.g. --shard 2/4")
    return index, count


def plan(args, command: str) -> Plan:
    """The runs of this command, after checking everything that can be checked without
    starting a server; raises UsageError (exit 2) naming the first problem."""
    selected = _kinds(args.kinds)
    for name, low in (("seeds", 1), ("shrinks", 0), ("batch", 0), ("jobs", 1)):
        if getattr(args, name) is not None and getattr(args, name) < low:
            raise UsageError(f"--{name} must be at least {low}")
    shard = parse_shard(args.shard) if args.shard else None
    if shard and args.jobs > 1:
        raise UsageError("--jobs runs the shards of the plan itself: give --jobs or --shard")
    if shard and args.seed is None:
        raise UsageError(
            "--shard needs --seed: every shard must run the same seeds "
            "(in CI, e.g. --seed $GITHUB_RUN_ID)"
        )
    base = args.seed if args.seed is not None else secrets.randbelow(2**32)
    seeds = [base + i for i in range(args.seeds or 1)]
    wanted = args.mutant or []  # both parsers append
    if command == "verify" and wanted and len(selected) != 1:
        raise UsageError("--mutant needs exactly one KIND")
    if command == "verify" and len(wanted) > 1:  # it would run the last one only
        raise UsageError(
            f"verify checks one mutant, not {len(wanted)}: for several, run knownstate mutants "
            f"{selected[0]} " + " ".join(f"--mutant {n}" for n in wanted)
        )
    _check_invariant(getattr(args, "invariant", None), selected)
    catalogue = {k: kinds.mutants(k) for k in selected}
    for name in wanted:
        if not any(m.name == name for ms in catalogue.values() for m in ms):
            choices = ", ".join(m.name for ms in catalogue.values() for m in ms)
            raise UsageError(f"{', '.join(selected)} has no mutant {name!r}: choose from {choices}")
    units: list[Unit] = []
    for kind in selected:
        chosen = [m for m in catalogue[kind] if not wanted or m.name in wanted]
        if command == "verify":
            targets = chosen if wanted else [None]
        else:
            targets = [None, *chosen]
        for target in targets:
            units += [Unit(len(units) + i, kind, s, target) for i, s in enumerate(seeds)]
    planned = len(units)
    if shard and not args.part:  # a --jobs shard asks for its runs (jobs.pulled)
        units = [u for u in units if u.index % shard[1] == shard[0] - 1]
    for flag, what in (("json", "JSON report"), ("junit", "JUnit report")):
        path = getattr(args, flag)
        problem = path and path_problem(path, what)
        if problem:
            raise UsageError(problem)
    if args.json and args.junit and _same_file(args.json, args.junit):
        raise UsageError("--json and --junit name the same file: give each its own")
    mem, notes = _memory(args, command)
    explicit_db = getattr(args, "example_db", None)
    replay = Replay(
        profile=args.profile,
        examples=args.examples,
        steps=args.steps,
        shrinks=args.shrinks,
        example_db=explicit_db if explicit_db != memory.DEFAULT_DIR else None,
        no_example_db=command == "mutants" or bool(args.no_example_db),
        dsn=bool(args.dsn),
        invariant=getattr(args, "invariant", None),
    )
    return Plan(command, units, planned, seeds, shard, replay, mem, len(seeds) == 1, notes)


def _check_invariant(name: str | None, selected: list[str]) -> None:
    for kind in selected if name else ():
        known = kinds.check(kind).named_invariants()
        if name not in known:
            raise UsageError(
                f"--invariant {name}: kind {kind} has no such invariant: choose from "
                + ", ".join(sorted(known))
            )


def _same_file(a: str, b: str) -> bool:
    """Two report paths that end at one file (a stream, like /dev/null, may take both)."""
    return outpath.resolve(a)[0] == outpath.resolve(b)[0] and not outpath.is_stream(a)


def _memory(args, command: str) -> tuple[memory.Memory | None, list[str]]:
    if command == "mutants":
        return None, []
    github = None
    if getattr(args, "example_db_github", None):
        try:
            github = memory.parse_github(args.example_db_github)
        except ValueError as e:
            raise UsageError(str(e)) from None
    if args.no_example_db:
        return (memory.Memory(None, github) if github else None), []
    if args.example_db:
        problem = memory.dir_problem(args.example_db)
        if problem:
            raise UsageError(problem + ": give another --example-db DIR, or --no-example-db")
        return memory.Memory(args.example_db, github), []
    problem = memory.prepare_default()
    if problem:
        return (memory.Memory(None, github) if github else None), [
            f"{problem}: running without memory of earlier failures (--example-db DIR)"
        ]
    return memory.Memory(memory.DEFAULT_DIR, github), []


# ---------------------------------------------------------------------------------------
# Running a plan.
# ---------------------------------------------------------------------------------------


def _machine(unit: Unit):
    check = kinds.check(unit.kind)
    return unit.mutant.machine(check) if unit.mutant else check


def _header(args, p: Plan) -> str:
    prof = PROFILES[args.profile]
    names = ", ".join(dict.fromkeys(u.kind for u in p.units)) or "nothing"
    seeds = (
        f"seed {p.seeds[0]}"
        if len(p.seeds) == 1
        else f"{len(p.seeds)} seeds ({p.seeds[0]}..{p.seeds[-1]})"
    )
    text = f"knownstate {p.command}: {names} — profile {args.profile} ({prof.description}), {seeds}"
    if p.shard:
        text += f"; shard {p.shard[0]}/{p.shard[1]}: {len(p.units)} of {p.planned} runs"
    return text


def _unit_line(rec: dict) -> str:
    """One line per run of ``mutants``."""
    name = rec["mutant"]["name"] if rec["mutant"] else "reference"
    word = status_word(rec) if rec["mutant"] else ("passes" if rec["ok"] else "FAILS")
    steps = f", {rec['counterexample_steps']} steps" if rec["caught"] else ""
    return f"  {rec['kind']} {name} seed {rec['seed']}: {word} ({rec['seconds']:.1f} s{steps})"


def _report(args, p: Plan, example_db: str | None = None) -> Report:
    """The report of this plan's command, as invoked."""
    argv = ["knownstate", *args.argv]
    return Report(p.command, argv, args.profile, p.seeds, p.units, p.planned, p.shard, example_db)


def execute(args, p: Plan) -> int:
    if args.jobs > 1 and len(p.units) > 1:
        return jobs.run(args, p, lambda doc: _finish(args, doc))
    report = _report(args, p, p.memory.local if p.memory else None)
    if args.part:  # a --jobs shard: its header is its parent's; the runs it is handed join it
        report.units = []
        jobs.follow_parent()
    else:
        print(_header(args, p), flush=True)
        for note in p.notes:
            print(f"  note: {note}", flush=True)
    if args.mutant and p.command == "verify":
        m = p.units[0].mutant if p.units else None
        if m is not None:
            jobs.say(args, f"  against mutant {m.name}: {m.description}")
    outcome = message = sig = None
    try:
        with Env.open(args.dsn) as env:
            report.database = env.db.describe()
            where = f"shard {p.shard[0]}/{p.shard[1]} " if args.part else ""
            jobs.say(args, f"  {where}on {env.db.describe()}, Toxiproxy {env.toxiproxy.url}")
            if p.memory and p.memory.local and not args.part:
                how = "replayed first" if p.replay_stored else "new ones kept, none replayed"
                jobs.say(args, f"  example database: {p.memory.local} (failing examples {how})")
            units = jobs.pulled(p.units, report) if args.part else p.units
            for unit in kind_by_kind(env, units):
                _run_unit(args, p, report, env, unit)
        tools.interrupt_caught()  # a signal from here on waits for the reports
    except (KeyboardInterrupt, EnvironmentFault, MissingTool, Unavailable) as e:
        tools.interrupt_caught()
        outcome, sig, message = _stopped_by(e, report)
    doc = report.document(outcome, message, sig)
    if args.part:  # a --jobs shard: its report is joined with the others', then judged
        return reports(doc, args.json, args.junit)
    return _finish(args, doc)


def _finish(args, doc: dict) -> int:
    """The verdict of a run's document, printed, and its reports written: the exit code."""
    summary(doc)
    code = reports(doc, args.json, args.junit)
    written = [x for x in (args.json, args.junit) if x]
    if written and code == doc["exit_code"]:
        print(f"reports: {', '.join(written)}")
    return code


def reports(doc: dict, json_path: str | None, junit_path: str | None) -> int:
    """Write the reports; the command's exit code: the document's, or 3 when a report could not
    be written after a run that passed (said in one line: a full disk, /dev/full)."""
    try:
        write_reports(doc, json_path, junit_path)
    except OutputError as e:
        print(f"knownstate: {e}", file=sys.stderr)
        return doc["exit_code"] or EXIT_ENVIRONMENT
    return doc["exit_code"]


def _stopped_by(e: BaseException, report: Report) -> tuple[str, str | None, str]:
    """Why a command ended early: (outcome, signal, message), said on stderr."""
    cause = e if isinstance(e, KeyboardInterrupt) else _interrupt_behind(e)
    if cause is None:
        print(f"knownstate: {e}", file=sys.stderr)
        print("knownstate: stopped; every server it started has been stopped.", file=sys.stderr)
        return "environment", None, str(e)
    sig = getattr(cause, "signal", "SIGINT")
    message = f"interrupted by {sig}" + (
        f" during {report.current.label}" if report.current else ""
    )
    print(f"\nknownstate: {message}; every server it started has been stopped.", file=sys.stderr)
    return "interrupted", sig, message


def _interrupt_behind(e: BaseException) -> KeyboardInterrupt | None:
    """The signal an exception was raised while handling, if any (cleanup after Ctrl-C can
    meet a server it was stopping)."""
    seen = e.__context__
    while seen is not None:
        if isinstance(seen, KeyboardInterrupt):
            return seen
        seen = seen.__context__
    return None


def kind_by_kind(env, units: Iterable[Unit]):
    """The units in order (a kind's are together); between two kinds the stand-ins the last
    one started are stopped, so its parts (the browser kind's Chromium) do not run beside the
    next kind's checks. Read one at a time: a ``--jobs`` shard asks for each
    (:func:`.jobs.pulled`)."""
    before = None
    for unit in units:
        if before is not None and before.kind != unit.kind:
            env.stop_stand_ins()
        yield unit
        before = unit


def _run_unit(args, p: Plan, report: Report, env, unit: Unit) -> None:
    report.start(unit)
    missing = unit.mutant.missing(env.capabilities()) if unit.mutant else []
    if missing:
        report.finish(unit, not_covered_record(unit, args.profile, missing))
        jobs.say(
            args,
            f"  {unit.label}: not covered on this database (the mutant needs {', '.join(missing)})",
        )
        return
    progress = Progress(unit.label, report)
    db = p.memory.database(p.replay_stored) if p.memory else None
    try:
        r = run_check(
            _machine(unit),
            env,
            seed=unit.seed,
            profile=args.profile,
            examples=args.examples,
            steps=args.steps,
            require_all=p.command == "verify" and unit.mutant is None,
            progress=progress,
            shrinks=args.shrinks,
            database=db,
            database_key=memory.key(unit.kind, unit.mutant and unit.mutant.name),
            start_batch=args.batch,
            timings=getattr(args, "timings", False),
            invariant=getattr(args, "invariant", None),
        )
    finally:
        progress.done()
    rec = report.finish(unit, finished_record(unit, r, p.replay, db.stored if db else 0))
    if p.command == "mutants":
        lines = [_unit_line(rec)]
        if rec["status"] == "not applicable":
            lines.append(f"    {not_applicable(rec)}")
        if rec["failure"] and (args.verbose or rec["mutant"] is None):
            lines += ["    " + line for line in run_lines(rec)[1:]]
    else:
        lines = run_lines(rec)
    jobs.say(args, "\n".join(lines))


def summary(doc: dict) -> None:
    """The tables and the verdict, from the report document (a run's, or a merge's)."""
    runs = doc["runs"]
    if doc["command"] == "mutants" or (any(r["mutant"] for r in runs) and len(doc["seeds"]) > 1):
        print("\n".join(mutant_lines(doc)))
    elif len(doc["seeds"]) > 1:
        print("\n".join(stability_lines(doc)))
    print(verdict_line(doc), flush=True)


# ---------------------------------------------------------------------------------------
# Commands.
# ---------------------------------------------------------------------------------------


def cmd_verify(args) -> int:
    return execute(args, plan(args, "verify"))


def cmd_mutants(args) -> int:
    p = plan(args, "mutants")
    problems = [
        q
        for k in dict.fromkeys(u.kind for u in p.units)
        for q in catalogue_problems(kinds.check(k), kinds.mutants(k))
    ]
    if problems:
        for q in problems:
            print(f"knownstate mutants: catalogue: {q}", file=sys.stderr)
        message = "the mutant catalogue has problems: " + "; ".join(problems)
        doc = _report(args, p).document("failed", message)
        reports(doc, args.json, args.junit)
        print("knownstate mutants: REFUSED — fix the catalogue first (nothing ran)")
        return EXIT_FAILED
    return execute(args, p)


def cmd_report_merge(args) -> int:
    for flag, what in (("json", "JSON report"), ("junit", "JUnit report")):
        problem = getattr(args, flag) and path_problem(getattr(args, flag), what)
        if problem:
            raise UsageError(problem)
    try:
        doc = merge([(path, read(path)) for path in args.reports])
    except ReportError as e:
        raise UsageError(f"report merge: {e}") from None
    for r in doc["runs"]:
        if not r["ok"]:
            print("\n".join(run_lines(r)))
    summary(doc)
    return reports(doc, args.json, args.junit)


def cmd_specs(args) -> int:
    from . import specs

    if args.check:
        problems = specs.drift()
        for p in problems:
            print(f"knownstate specs: {p}")
        print("knownstate specs: " + ("drift found" if problems else "specs/ agree with model/"))
        return EXIT_FAILED if problems else EXIT_OK
    changed = specs.write()
    print(
        "knownstate specs: rewrote "
        + (", ".join(changed) if changed else "nothing (already current)")
    )
    return EXIT_OK


THROWAWAY = ("verify", "mutants", "soak", "serve", "bench")
"""Commands that run on a throwaway PostgreSQL unless given --dsn: libpq's environment variables
are removed from their process (and its children), :func:`.dsn.ignore_environment`."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    for name in ("examples", "steps"):
        if getattr(args, name, None) is not None and getattr(args, name) < 1:
            print(f"knownstate: --{name} must be at least 1", file=sys.stderr)
            return EXIT_USAGE
    if args.command in THROWAWAY and not getattr(args, "dsn", None):
        ignored = dsns.ignore_environment()
        if ignored:
            print(
                f"knownstate: note: {', '.join(ignored)} ignored: the throwaway PostgreSQL reads "
                "no libpq variable (a server named with --dsn does)",
                file=sys.stderr,
            )
    tools.reset_interrupt()
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in previous:
        signal.signal(s, tools.on_signal)
    try:
        try:
            for spec in getattr(args, "own_kinds", None) or []:
                args.kinds.append(kinds.load(spec))
            browser_cli.apply(args)
        except (kinds.KindNotFound, browser_cli.ClientOptionError) as e:
            raise UsageError(str(e)) from None
        return args.func(args)
    except UsageError as e:
        print(f"knownstate: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (EnvironmentFault, MissingTool, Unavailable) as e:
        print(f"knownstate: {e}", file=sys.stderr)
        print("knownstate: stopped; every server it started has been stopped.", file=sys.stderr)
        return EXIT_ENVIRONMENT
    except KeyboardInterrupt as e:
        tools.interrupt_caught()
        print(
            "\nknownstate: interrupted; every server it started has been stopped.", file=sys.stderr
        )
        return EXIT_TERMINATED if getattr(e, "signal", "") == "SIGTERM" else EXIT_INTERRUPTED
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


if __name__ == "__main__":
    # ``python -m knownstate.chaos.cli``: run the module as imported, the one the commands and
    # the argument grammar (.cliargs) import, so their errors are this main's (one UsageError)
    from knownstate.chaos import cli

    sys.exit(cli.main())
