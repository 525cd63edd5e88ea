"""``knownstate``: the gate (verify), the mutant catalogue (mutants) and the benchmarks (bench)."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import sys
import time
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

from . import kinds
from .check import PROFILES, CheckResult, EnvironmentFault, Env, Stats, run_check
from .cluster import Unavailable
from .tools import MissingTool

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_ENVIRONMENT, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


class UsageError(Exception):
    """The command line asks for something that does not exist."""


def _kinds(requested: list[str]) -> list[str]:
    known = kinds.names()
    unknown = [k for k in requested if k not in known]
    if unknown:
        raise UsageError(f"unknown kind {', '.join(unknown)}: choose from {', '.join(known)}")
    return requested or known


class Progress:
    """On a terminal: one live line per kind (examples done of total, faults so far). In CI: nothing
    until the summary, which is plain lines."""

    def __init__(self, kind: str, total: int, stream=sys.stderr):
        self.kind, self.total, self.stream = kind, total, stream
        self.live = stream.isatty() and not os.environ.get("CI")
        self._last = 0.0

    def __call__(self, stats: Stats) -> None:
        if not self.live or time.monotonic() - self._last < 0.2:
            return
        self._last = time.monotonic()
        done = min(stats.examples, self.total)
        self.stream.write(f"\r  {self.kind}: example {done}/{self.total}, {stats.steps} steps, "
                          f"{sum(stats.faults.values())} faults ")
        self.stream.flush()

    def done(self) -> None:
        if self.live:
            self.stream.write("\r\033[K")
            self.stream.flush()


def _counts(counter: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counter.items())) or "none"


def replay_command(r: CheckResult, examples: int, steps: int, dsn: str | None, mutant: str | None = None) -> str:
    cmd = f"knownstate verify {r.kind} --seed {r.seed} --examples {examples} --steps {steps}"
    return cmd + (f" --mutant {mutant}" if mutant else "") + (" --dsn '<your DSN>'" if dsn else "")


def print_result(r: CheckResult, examples: int, steps: int, dsn: str | None, out=sys.stdout,
                 mutant: str | None = None) -> None:
    status = "passed" if r.passed else ("FAILED" if r.failure else "VACUOUS")
    rate = r.steps / r.seconds if r.seconds else 0.0
    print(f"{r.kind}: {status} — {r.examples} examples, {r.steps} steps ({rate:.0f} steps/s), "
          f"{r.seconds:.1f} s, seed {r.seed}", file=out)
    print(f"  faults injected: {_counts(dict(r.stats.faults))}", file=out)
    for u in r.unavailable:
        print(f"  fault unavailable: {u}", file=out)
    print(f"  events observed: {_counts(dict(r.stats.events))}", file=out)
    seen = sum(1 for n in r.stats.transitions.values() if n)
    print(f"  transitions observed: {seen} distinct, {sum(r.stats.transitions.values())} taken", file=out)
    print(f"  invariants checked: {r.stats.invariants_checked}", file=out)
    if r.failure:
        print(f"  failure: {r.failure}", file=out)
        print(f"  counterexample ({r.counterexample_steps} steps, one operation or fault per line):", file=out)
        for line in r.counterexample:
            print(f"    {line}", file=out)
        print(f"  replay: {replay_command(r, examples, steps, dsn, mutant)}", file=out)
    elif r.vacuous:
        print("  vacuous: the run never observed " + "; ".join(r.vacuous), file=out)
        print(f"  (a gate that never reached these proves nothing about them: raise --examples/--steps, "
              f"or replay with {replay_command(r, examples, steps, dsn)})", file=out)


def write_json(path: str, results: list[CheckResult], extra: dict | None = None) -> None:
    data = {"passed": all(r.passed for r in results), **(extra or {}), "kinds": [
        {"kind": r.kind, "passed": r.passed, "seed": r.seed, "examples": r.examples, "steps": r.steps,
         "seconds": round(r.seconds, 3), "failure": r.failure, "counterexample": r.counterexample,
         "vacuous": r.vacuous, "unavailable": r.unavailable, **r.stats.as_dict()} for r in results]}
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


def write_junit(path: str, results: list[CheckResult], examples: int, steps: int, dsn: str | None) -> None:
    cases = []
    for r in results:
        body = ""
        if r.failure:
            text = "\n".join([r.failure, "counterexample:", *r.counterexample,
                              "replay: " + replay_command(r, examples, steps, dsn)])
            body = f"<failure message={quoteattr(r.failure.splitlines()[0])}>{escape(text)}</failure>"
        elif r.vacuous:
            body = f"<failure message={quoteattr('vacuous')}>{escape('never observed: ' + '; '.join(r.vacuous))}</failure>"
        out = escape(f"seed {r.seed}; faults {_counts(dict(r.stats.faults))}; events {_counts(dict(r.stats.events))}")
        cases.append(f'  <testcase classname="knownstate.verify" name={quoteattr(r.kind)} time="{r.seconds:.3f}">'
                     f"{body}<system-out>{out}</system-out></testcase>")
    failures = sum(1 for r in results if not r.passed)
    Path(path).write_text(f'<?xml version="1.0" encoding="utf-8"?>\n<testsuite name="knownstate" tests="{len(results)}" '
                          f'failures="{failures}" time="{sum(r.seconds for r in results):.3f}">\n'
                          + "\n".join(cases) + "\n</testsuite>\n")


def cmd_verify(args) -> int:
    selected = _kinds(args.kinds)
    profile = PROFILES[args.profile]
    examples = args.examples or profile["examples"]
    steps = args.steps or profile["steps"]
    seed = args.seed if args.seed is not None else secrets.randbelow(2**32)
    print(f"knownstate verify: {', '.join(selected)} — profile {args.profile} ({examples} examples × up to "
          f"{steps} steps per kind), seed {seed}", flush=True)
    check_for = kinds.check
    if args.mutant:
        if len(selected) != 1:
            raise UsageError("--mutant needs exactly one KIND")
        found = [m for m in kinds.mutants(selected[0]) if m.name == args.mutant]
        if not found:
            raise UsageError(f"{selected[0]} has no mutant {args.mutant!r}: choose from "
                             + ", ".join(m.name for m in kinds.mutants(selected[0])))
        check_for = lambda name: found[0].machine(kinds.check(name))  # noqa: E731
        print(f"  against mutant {args.mutant}: {found[0].description}", flush=True)
    results = []
    start = time.monotonic()
    with Env.open(args.dsn) as env:
        print(f"  on {env.db.describe()}, Toxiproxy {env.toxiproxy.url}", flush=True)
        for name in selected:
            progress = Progress(name, examples)
            r = run_check(check_for(name), env, examples=examples, steps=steps, seed=seed, progress=progress,
                          require_all=not args.mutant, shrink_seconds=args.shrink_seconds)
            progress.done()
            print_result(r, examples, steps, args.dsn, mutant=args.mutant)
            sys.stdout.flush()
            results.append(r)
    passed = all(r.passed for r in results)
    print(f"knownstate verify: {'PASSED' if passed else 'FAILED'} — {sum(r.passed for r in results)}/{len(results)} "
          f"kinds, {time.monotonic() - start:.1f} s, seed {seed}")
    if args.json:
        write_json(args.json, results, {"seed": seed, "profile": args.profile})
    if args.junit:
        write_junit(args.junit, results, examples, steps, args.dsn)
    return EXIT_OK if passed else EXIT_FAILED


def cmd_mutants(args) -> int:
    selected = _kinds(args.kinds)
    profile = PROFILES["ci"]
    examples = args.examples or profile["examples"]
    steps = args.steps or profile["steps"]
    seed = args.seed if args.seed is not None else secrets.randbelow(2**32)
    print(f"knownstate mutants: {', '.join(selected)} — {examples} examples × up to {steps} steps each, seed {seed}",
          flush=True)
    rows, ok = [], True
    with Env.open(args.dsn) as env:
        for name in selected:
            check = kinds.check(name)
            ref = run_check(check, env, examples=examples, steps=steps, seed=seed, require_all=False,
                            shrink_seconds=args.shrink_seconds)
            print(f"{name}: reference {'passes' if ref.failure is None else 'FAILS'} ({ref.seconds:.1f} s)", flush=True)
            if ref.failure:
                ok = False
                print_result(ref, examples, steps, args.dsn)
                continue
            print(f"  {'mutant':<30} {'invariant broken':<32} {'caught':<7} {'seconds':>8} {'steps':>6}")
            for m in kinds.mutants(name):
                r = run_check(m.machine(check), env, examples=examples, steps=steps, seed=seed, require_all=False,
                              shrink_seconds=args.shrink_seconds)
                caught = r.failure is not None
                ok &= caught
                rows.append({"kind": name, "mutant": m.name, "invariant": m.invariant, "description": m.description,
                             "caught": caught, "seconds": round(r.seconds, 2),
                             "counterexample_steps": r.counterexample_steps, "counterexample": r.counterexample,
                             "failure": r.failure})
                print(f"  {m.name:<30} {m.invariant:<32} {'yes' if caught else 'NO':<7} {r.seconds:>8.1f} "
                      f"{r.counterexample_steps if caught else '-':>6}", flush=True)
                if args.verbose and caught:
                    print(f"      {r.failure.splitlines()[0]}")
                    for line in r.counterexample:
                        print(f"        {line}")
                    print(f"      replay: {replay_command(r, examples, steps, args.dsn, m.name)}")
    missed = [r["mutant"] for r in rows if not r["caught"]]
    print(f"knownstate mutants: {'PASSED' if ok else 'FAILED'} — {sum(r['caught'] for r in rows)}/{len(rows)} caught"
          + (f"; not caught: {', '.join(missed)}" if missed else "") + f", seed {seed}")
    if args.json:
        Path(args.json).write_text(json.dumps({"passed": ok, "seed": seed, "mutants": rows}, indent=2) + "\n")
    return EXIT_OK if ok else EXIT_FAILED


def cmd_specs(args) -> int:
    from . import specs

    if args.check:
        problems = specs.drift()
        for p in problems:
            print(f"knownstate specs: {p}")
        print("knownstate specs: " + ("drift found" if problems else "specs/ agree with model/"))
        return EXIT_FAILED if problems else EXIT_OK
    changed = specs.write()
    print("knownstate specs: rewrote " + (", ".join(changed) if changed else "nothing (already current)"))
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="knownstate", description=(
        "The verification gate for durable work on PostgreSQL: pure models checked against the reference "
        "implementation under real faults."))
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp):
        sp.add_argument("kinds", nargs="*", metavar="KIND", help=f"run kinds (default: all of {', '.join(kinds.names())})")
        sp.add_argument("--examples", type=int, help="examples per kind (default: the profile's)")
        sp.add_argument("--steps", type=int, help="maximum steps per example (default: the profile's)")
        sp.add_argument("--seed", type=int, help="the seed (default: a random one, printed)")
        sp.add_argument("--dsn", default=os.environ.get("DATABASE_URL"),
                        help="an external PostgreSQL (default: $DATABASE_URL, else a throwaway cluster)")
        sp.add_argument("--json", metavar="FILE", help="write a JSON report")
        sp.add_argument("--shrink-seconds", type=float, default=120,
                        help="time to spend shrinking a failure to its shortest counterexample (default 120)")

    v = sub.add_parser("verify", help="run the gate: each kind's model against its implementation under faults")
    common(v)
    v.add_argument("--profile", choices=sorted(PROFILES), default="ci", help="depth: ci (default) or deep (nightly)")
    v.add_argument("--junit", metavar="FILE", help="write a JUnit XML report")
    v.add_argument("--mutant", metavar="NAME", help="check a named mutant instead of the reference (one KIND)")
    v.set_defaults(func=cmd_verify)

    m = sub.add_parser("mutants", help="run the gate against each named bug; every one must be caught")
    common(m)
    m.add_argument("-v", "--verbose", action="store_true", help="print each mutant's counterexample")
    m.set_defaults(func=cmd_mutants)

    sp = sub.add_parser("specs", help="regenerate the diagrams and the contract table in specs/ from model/")
    sp.add_argument("--check", action="store_true", help="only report drift (exit 1 when found)")
    sp.set_defaults(func=cmd_specs)

    from . import bench

    bench.add_parser(sub)
    from . import serve; serve.add_parser(sub)  # noqa: E702
    return p


def _sigterm(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("examples", "steps"):
        if getattr(args, name, None) is not None and getattr(args, name) < 1:
            print(f"knownstate: --{name} must be at least 1", file=sys.stderr)
            return EXIT_USAGE
    signal.signal(signal.SIGTERM, _sigterm)
    try:
        return args.func(args)
    except UsageError as e:
        print(f"knownstate: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (EnvironmentFault, MissingTool, Unavailable) as e:
        print(f"knownstate: {e}", file=sys.stderr)
        print("knownstate: stopped; every server it started has been stopped.", file=sys.stderr)
        return EXIT_ENVIRONMENT
    except KeyboardInterrupt:
        print("\nknownstate: interrupted; every server it started has been stopped.", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
