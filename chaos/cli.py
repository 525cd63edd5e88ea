"""``knownstate``: the gate (verify), the mutant catalogue (mutants), reports (report merge),
the generated specs (specs) and the benchmarks (bench).

A command's work is a plan of runs, one per (kind, seed, mutant) (:func:`plan`), checked
before anything starts — kinds, mutants, shard, output paths, the example database — so a bad
command line is exit 2 with one line and nothing started. :func:`execute` runs the plan on one
set of real parts and writes the reports on every way out (:mod:`.report`).
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import time
from dataclasses import dataclass

from . import browser_cli, kinds, memory, outpath
from . import dsn as dsns
from .check import PROFILES, EnvironmentFault, Env, run_check
from .cluster import Unavailable
from .mutants import catalogue_problems
from .report import (
    not_covered_record,
    DEFAULT_SHRINKS,
    Replay,
    Report,
    ReportError,
    Unit,
    finished_record,
    knownstate_version,
    merge,
    mutant_lines,
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

EXIT_CODES_HELP = """exit codes:
  0    passed: every run passed (verify), every mutant caught (mutants, verify --mutant)
  1    failed: a counterexample, a vacuous run, a mutant NOT CAUGHT, a broken mutant catalogue
  2    bad command line (unknown kind, unwritable report path, ...): nothing was started
  3    a real part died or could not start (PostgreSQL, Toxiproxy, a stand-in): not a bug
  130  interrupted (Ctrl-C)
  143  terminated (SIGTERM, e.g. a CI job's timeout)
--junit and --json are written on every exit but 2, with the runs that finished and the
rest marked interrupted / not run."""


def profiles_help() -> str:
    return "profiles:\n" + "\n".join(f"  {name:<5} {p.description}" for name, p in PROFILES.items())


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
    for name, low in (("seeds", 1), ("shrinks", 0), ("batch", 0)):
        if getattr(args, name) is not None and getattr(args, name) < low:
            raise UsageError(f"--{name} must be at least {low}")
    shard = parse_shard(args.shard) if args.shard else None
    if shard and args.seed is None:
        raise UsageError(
            "--shard needs --seed: every shard must run the same seeds "
            "(in CI, e.g. --seed $GITHUB_RUN_ID)"
        )
    base = args.seed if args.seed is not None else secrets.randbelow(2**32)
    seeds = [base + i for i in range(args.seeds or 1)]
    wanted = args.mutant if isinstance(args.mutant, list) else [args.mutant] if args.mutant else []
    if command == "verify" and wanted and len(selected) != 1:
        raise UsageError("--mutant needs exactly one KIND")
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
    if shard:
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
    )
    return Plan(command, units, planned, seeds, shard, replay, mem, len(seeds) == 1, notes)


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


def execute(args, p: Plan) -> int:
    report = Report(
        p.command,
        ["knownstate", *args.argv],
        args.profile,
        p.seeds,
        p.units,
        p.planned,
        p.shard,
        p.memory.local if p.memory else None,
    )
    print(_header(args, p), flush=True)
    for note in p.notes:
        print(f"  note: {note}", flush=True)
    if args.mutant and p.command == "verify":
        m = p.units[0].mutant if p.units else None
        if m is not None:
            print(f"  against mutant {m.name}: {m.description}", flush=True)
    outcome = message = sig = None
    try:
        with Env.open(args.dsn) as env:
            report.database = env.db.describe()
            print(f"  on {env.db.describe()}, Toxiproxy {env.toxiproxy.url}", flush=True)
            if p.memory and p.memory.local:
                how = "replayed first" if p.replay_stored else "new ones kept, none replayed"
                print(f"  example database: {p.memory.local} (failing examples {how})", flush=True)
            for unit in p.units:
                _run_unit(args, p, report, env, unit)
        tools.interrupt_caught()  # a signal from here on waits for the reports
    except (KeyboardInterrupt, EnvironmentFault, MissingTool, Unavailable) as e:
        tools.interrupt_caught()
        outcome, sig, message = _stopped_by(e, report)
    doc = report.document(outcome, message, sig)
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


def _run_unit(args, p: Plan, report: Report, env, unit: Unit) -> None:
    report.start(unit)
    missing = unit.mutant.missing(env.capabilities()) if unit.mutant else []
    if missing:
        report.finish(unit, not_covered_record(unit, args.profile, missing))
        print(
            f"  {unit.label}: not covered on this database (the mutant needs {', '.join(missing)})"
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
        )
    finally:
        progress.done()
    rec = report.finish(unit, finished_record(unit, r, p.replay, db.stored if db else 0))
    if p.command == "mutants":
        print(_unit_line(rec))
        if rec["failure"] and (args.verbose or rec["mutant"] is None):
            print("\n".join("    " + line for line in run_lines(rec)[1:]))
    else:
        print("\n".join(run_lines(rec)))
    sys.stdout.flush()


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
        report = Report(
            "mutants",
            ["knownstate", *args.argv],
            args.profile,
            p.seeds,
            p.units,
            p.planned,
            p.shard,
        )
        doc = report.document("failed", message)
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


MAX_SEED = 2**64 - 1
SEED_HELP = f"the seed, 0..{MAX_SEED} (default: a random one, printed)"


def seed_option(text: str) -> int:
    """argparse type of ``--seed``: a whole number from 0 (a seed is printed and replayed as
    given, so ``-5`` or ``1e3`` is refused rather than read as something else)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_SEED or not text.strip().isdigit():
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a seed: give a whole number 0..{MAX_SEED}"
        )
    return value


def build_parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(
        prog="knownstate",
        formatter_class=raw,
        epilog=EXIT_CODES_HELP + "\n\n" + profiles_help(),
        description="The verification gate for durable work on PostgreSQL: pure models checked "
        "against the reference implementation under real faults.",
    )
    p.add_argument("--version", action="version", version=f"knownstate {knownstate_version()}")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp):
        sp.add_argument(
            "kinds",
            nargs="*",
            metavar="KIND",
            help=f"run kinds (default: all of {', '.join(kinds.names())})",
        )
        sp.add_argument("--examples", type=int, help="examples per kind (default: the profile's)")
        sp.add_argument(
            "--steps", type=int, help="maximum steps per example (default: the profile's)"
        )
        sp.add_argument("--seed", type=seed_option, help=SEED_HELP)
        sp.add_argument(
            "--dsn",
            type=dsns.option,
            metavar="DSN",
            help=(
                "an external PostgreSQL (default: a throwaway cluster). Only the database the DSN "
                "names is used, in schemas the run creates and drops; its user needs CONNECT and "
                "CREATE on it. env:NAME reads the DSN from the environment variable NAME (e.g. "
                "--dsn env:DATABASE_URL); DATABASE_URL is never read otherwise. What the DSN "
                "leaves out, libpq takes from PGHOST, PGPORT, PGUSER, PGPASSWORD, PGSSLMODE and "
                "its other PG* variables (and ~/.pgpass), as psql does; the throwaway cluster "
                "reads none of them"
            ),
        )
        sp.add_argument("--json", metavar="FILE", help="write a JSON report")
        sp.add_argument(
            "--shrinks",
            type=int,
            default=DEFAULT_SHRINKS,
            help="replays at most, shrinking a failure to its shortest "
            f"counterexample (default {DEFAULT_SHRINKS}; a count, never a time)",
        )
        sp.add_argument(
            "--batch",
            type=int,
            default=0,
            help="start at this batch of examples (a failure's replay command gives it)",
        )
        sp.add_argument(
            "--kind",
            action="append",
            default=[],
            metavar="MODULE:CHECK",
            dest="own_kinds",
            help="also a kind of your own: a check class, e.g. mypkg.kinds:WebhookKind",
        )
        sp.add_argument("--junit", metavar="FILE", help="write a JUnit XML report")
        sp.add_argument(
            "--profile",
            choices=sorted(PROFILES),
            default="ci",
            help="how long each run goes on: "
            + "; ".join(f"{n}: {pr.description}" for n, pr in PROFILES.items()),
        )
        sp.add_argument(
            "--seeds",
            type=int,
            metavar="N",
            help="run each check at N seeds (--seed, --seed + 1, ...) and print per "
            "kind or mutant how many passed / were caught, and at which seeds",
        )
        browser_cli.add_options(sp)
        sp.add_argument(
            "--shard",
            metavar="I/N",
            help="run only shard I of N of the runs (kinds x seeds x mutants, dealt "
            "round-robin); needs --seed; join the reports with 'report merge'",
        )

    v = sub.add_parser(
        "verify",
        formatter_class=raw,
        epilog=EXIT_CODES_HELP,
        help="run the gate: each kind's model against its implementation under faults",
    )
    common(v)
    v.add_argument(
        "--mutant",
        metavar="NAME",
        help="check a named mutant instead of the reference (one KIND): CAUGHT exits "
        "0, NOT CAUGHT exits 1",
    )
    v.add_argument(
        "--timings",
        action="store_true",
        help="print per run where its time went (crash and restart, Toxiproxy, new "
        "connections, waits, the implementation, the checks, Hypothesis) and put it in the "
        "JSON report; reported only, never part of a verdict",
    )
    db = v.add_mutually_exclusive_group()
    db.add_argument(
        "--example-db",
        metavar="DIR",
        help=f"keep failing examples here and replay them first (default "
        f"{memory.DEFAULT_DIR}, git-ignored)",
    )
    db.add_argument(
        "--no-example-db", action="store_true", help="neither replay nor keep failing examples"
    )
    v.add_argument(
        "--example-db-github",
        metavar="OWNER/REPO[:ARTIFACT]",
        help="also replay the failing examples in this GitHub Actions artifact "
        f"(read-only; artifact name default {memory.ARTIFACT}; needs "
        "GITHUB_TOKEN for a private repository)",
    )
    v.set_defaults(func=cmd_verify)

    m = sub.add_parser(
        "mutants",
        formatter_class=raw,
        epilog=EXIT_CODES_HELP,
        help="run the gate against each named bug; every one must be caught",
    )
    common(m)
    m.add_argument(
        "--mutant",
        metavar="NAME",
        action="append",
        help="only this mutant (repeatable); the reference always runs",
    )
    m.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="print each mutant's counterexample and replay command",
    )
    m.set_defaults(func=cmd_mutants, no_example_db=True, example_db=None)

    r = sub.add_parser("report", help="work with JSON reports")
    rsub = r.add_subparsers(dest="report_command", required=True)
    rm = rsub.add_parser(
        "merge",
        formatter_class=raw,
        epilog=EXIT_CODES_HELP,
        help="join the JSON reports of the shards of one run (--shard I/N)",
        description="Join the JSON reports of every shard of one run into the "
        "report of the whole; exits as that run would have.",
    )
    rm.add_argument("reports", nargs="+", metavar="REPORT.json")
    rm.add_argument("--json", metavar="FILE", help="write the merged JSON report")
    rm.add_argument("--junit", metavar="FILE", help="write the merged JUnit XML report")
    rm.set_defaults(func=cmd_report_merge)

    sp = sub.add_parser(
        "specs", help="regenerate the diagrams and the contract table in specs/ from model/"
    )
    sp.add_argument("--check", action="store_true", help="only report drift (exit 1 when found)")
    sp.set_defaults(func=cmd_specs)

    from . import bench

    bench.add_parser(sub)
    from . import soak

    soak.add_parser(sub)  # noqa: E702
    from . import scaffold

    scaffold.add_parser(sub)  # noqa: E702
    from . import serve

    serve.add_parser(sub)  # noqa: E702
    return p


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
    sys.exit(main())
