"""The command line's grammar: every option of ``knownstate`` and its help, the exit codes, the
seed's type. The commands themselves are in :mod:`.cli` (which re-exports these names)."""

from __future__ import annotations

import argparse

from . import browser_cli, kinds, memory
from . import dsn as dsns
from .check import PROFILES
from .report import DEFAULT_SHRINKS, knownstate_version

EXIT_CODES_HELP = """exit codes:
  0    passed: every run passed (verify), every mutant caught (mutants, verify --mutant)
  1    failed: a counterexample, a vacuous run, a mutant NOT CAUGHT, a broken mutant catalogue
       (a mutant NOT APPLICABLE: its edit changed nothing in the code it ran on)
  2    bad command line (unknown kind, unwritable report path, ...): nothing was started
  3    a real part died or could not start (PostgreSQL, Toxiproxy, a stand-in): not a bug
  130  interrupted (Ctrl-C)
  143  terminated (SIGTERM, e.g. a CI job's timeout)
--junit and --json are written on every exit but 2, with the runs that finished and the
rest marked interrupted / not run."""


def profiles_help() -> str:
    return "profiles:\n" + "\n".join(f"  {name:<5} {p.description}" for name, p in PROFILES.items())


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
    from .cli import cmd_mutants, cmd_report_merge, cmd_specs, cmd_verify

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
            f"counterexample (default {DEFAULT_SHRINKS}; a count, never a time); shrinking "
            "stops sooner after 200 replays that delete no step, or a fifth of a budget over "
            "1000",
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
            "--jobs",
            type=int,
            default=1,
            metavar="N",
            help="run the runs in N processes side by side, each with its own PostgreSQL and "
            "Toxiproxy, each taking the next run when it is free (their reports joined): the "
            "same verdicts, examples and steps as one after another, sooner where the checks "
            "wait on I/O",
        )
        sp.add_argument("--part", action="store_true", help=argparse.SUPPRESS)  # a --jobs shard
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
        action="append",
        help="check a named mutant instead of the reference (one KIND, one mutant: for "
        "several, knownstate mutants KIND --mutant A --mutant B): CAUGHT exits 0, NOT CAUGHT "
        "exits 1",
    )
    v.add_argument(
        "--invariant",
        metavar="NAME",
        help="look for a failure naming this invariant and shrink it: failures naming only "
        "others are kept in the report's shortest failures seen but do not end the run (when "
        "none names it, the shortest of them is the verdict's, unshrunk)",
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
