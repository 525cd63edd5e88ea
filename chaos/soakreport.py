"""What a soak prints and writes: its summary, the reports ``verify`` writes, its timeline's path.

The summary says what happened (runs, operations, committed changes, faults injected by their
names in :data:`~knownstate.chaos.faults.FAULTS`, events observed), what the kind should have
seen and did not, the duplicate external effects and their causes, and every violation with
the nemesis periods around it, then the command that replays the soak. The JSON and JUnit
reports are ``verify``'s (one run, of profile ``soak``), with the soak's own findings under
``soak``.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from . import outpath

if TYPE_CHECKING:
    from .soak import SoakResult


def summary_lines(r: "SoakResult", timeline: str | None) -> list[str]:
    v, h = r.verdict, r.history
    faults = Counter(p.kind for p in h.periods)
    ops = len(h.ops)
    status = "passed" if r.passed else "FAILED"
    lines = [
        f"{r.kind}: {status} — {v.runs} runs ({v.terminal} terminal), {ops} operations, "
        f"{len(h.audit)} committed changes, {r.seconds:g} s + quiet {r.quiet_seconds:.1f} s, "
        f"seed {r.seed}" + (f", mutant {r.mutant}" if r.mutant else ""),
        f"  faults injected: {_counts(faults)}",
        f"  events observed: {_counts(v.observed)}",
        f"  quiet period: {r.quiet_end}",
    ]
    missing = [e for e in r.expected if not v.observed.get(e)]
    if missing:
        lines.append(
            f"  not observed (the nemesis never caused it; a longer soak or another seed "
            f"may): {', '.join(missing)}"
        )
    causes = Counter(d.why for d in v.duplicates)
    lines.append(
        f"  duplicate external effects: {len(v.duplicates)}"
        + (f", attributed: {_counts(causes)}" if causes else "")
    )
    for d in v.duplicates[:3]:
        lines.append(f"    {d.line(h.t0)}")
    if v.findings:
        by = Counter(f.invariant for f in v.findings)
        lines.append(f"  violations: {len(v.findings)} ({_counts(by)})")
        for f in v.findings[:5]:
            lines.append(f"    {f.line(h.t0)}")
        if len(v.findings) > 5:
            lines.append(
                f"    ... and {len(v.findings) - 5} more (in the JSON report and the timeline)"
            )
        lines.append(f"  replay: {r.replay()}")
    if timeline:
        lines.append(f"  timeline: {timeline}")
    return lines


def _counts(counter: dict) -> str:
    return ", ".join(f"{k} {n}" for k, n in sorted(counter.items())) or "none"


def check_result(r: "SoakResult"):
    """The soak as the CheckResult the CLI's report writers take."""
    from .check import CheckResult, Stats

    h, v = r.history, r.verdict
    stats = Stats(
        examples=1,
        steps=len(h.ops),
        invariants_checked=len(h.audit),
        faults=Counter(p.kind for p in h.periods),
        events=Counter(v.observed),
        transitions=Counter(v.transitions),
    )
    failure = v.findings[0].line(h.t0) if v.findings else None
    return CheckResult(
        kind=r.kind,
        seed=r.seed,
        examples=1,
        steps=len(h.ops),
        seconds=r.wall_seconds,
        stats=stats,
        profile="soak",
        failure=failure,
        invariants=tuple(sorted({f.invariant for f in v.findings})),
        counterexample=[f.line(h.t0) for f in v.findings],
        stopped=f"{r.seconds:g} s of work and a quiet period ({r.quiet_end})",
    )


def report_extra(r: "SoakResult", timeline: str | None) -> dict:
    h, v = r.history, r.verdict
    return {
        "seed": r.seed,
        "profile": "soak",
        "soak": {
            "kind": r.kind,
            "seconds": r.seconds,
            "mutant": r.mutant,
            "replay": r.replay(),
            "schedule": [f.describe() for f in r.schedule],
            "periods": [
                {
                    "kind": p.kind,
                    "target": p.target,
                    "start": round(p.start - h.t0, 3),
                    "end": round(p.end - h.t0, 3),
                    "detail": p.detail,
                }
                for p in h.periods
            ],
            "violations": [
                {
                    "invariant": f.invariant,
                    "message": f.message,
                    "run": f.run,
                    "operation": f.ref,
                    "at": None if f.t is None else round(f.t - h.t0, 3),
                    "nemesis": [p.describe(h.t0) for p in f.periods],
                }
                for f in v.findings
            ],
            "duplicates": [
                {
                    "run": d.run,
                    "effect": d.effect,
                    "owner": d.owner,
                    "attempt": d.attempt,
                    "cause": d.cause,
                    "why": d.why,
                    "at": round(d.t - h.t0, 3),
                    "nemesis": [p.describe(h.t0) for p in d.periods],
                }
                for d in v.duplicates
            ],
            "quiet": {"seconds": round(r.quiet_seconds, 3), "ended": r.quiet_end},
            "timeline": timeline,
        },
    }


TIMELINES = ".knownstate/timelines"
"""Where a failing soak's timeline goes when no report names a place (``.knownstate`` is the
project's own folder, as for the example database)."""


def default_timeline(args, kind: str, seed: int) -> str:
    for report in (args.json, args.junit):
        if report and not outpath.is_stream(report):  # no "/dev/stdout.timeline.html"
            p = Path(report)
            return str(p.with_name(p.stem + ".timeline.html"))
    folder = Path(TIMELINES)  # beside the example database, not into the current directory
    folder.mkdir(parents=True, exist_ok=True)
    return str(folder / f"soak-{kind}-{seed}.html")


def soak_report(args, kind, seed: int, mutant):
    """The report of this soak (one run, of profile ``soak``), begun before the run so that its
    seconds are the soak's."""
    from . import report as rp

    unit = rp.Unit(0, kind, seed, mutant)
    argv = ["knownstate", *getattr(args, "argv", sys.argv[1:])]
    report = rp.Report("soak", argv, "soak", [seed], [unit], 1)
    report.start(unit)
    return report


def write_cut_short(args, report, e: BaseException) -> None:
    """The reports of a soak a signal (130, 143) or a real part (3) stopped."""
    from . import cli
    from .soak import replay_command

    if isinstance(e, KeyboardInterrupt):
        sig = getattr(e, "signal", "SIGINT")
        doc = report.document("interrupted", f"interrupted by {sig}", sig)
    else:
        doc = report.document("environment", str(e))
    unit = report.units[0]
    doc["soak"] = {
        "kind": unit.kind,
        "seconds": args.seconds,
        "mutant": args.mutant,
        "replay": replay_command(unit.kind, args.seconds, unit.seed, args.mutant),
    }
    cli.reports(doc, args.json, args.junit)


def write_reports(args, report, r: "SoakResult", timeline: str | None) -> bool:
    """The JSON and JUnit reports ``verify`` writes (one run, of profile ``soak``), the soak's
    own findings under ``soak``, the command that runs this soak again; False when one could
    not be written (said in one line)."""
    from . import cli
    from . import report as rp

    unit = report.units[0]
    rec = rp.finished_record(unit, check_result(r), rp.Replay(profile="soak"))
    rec["replay"] = r.replay()  # also on a pass: the command that runs this soak again
    report.finish(unit, rec)
    doc = report.document()
    doc["soak"] = report_extra(r, timeline)["soak"]
    return cli.reports(doc, args.json, args.junit) == doc["exit_code"]


class _LiveLine:
    """On a terminal: one line rewritten in place."""

    def say(self, line: str) -> None:
        sys.stdout.write("\r\033[K" + line.strip()[:150])
        sys.stdout.flush()

    def done(self) -> None:
        sys.stdout.write("\r\033[K")
        sys.stdout.flush()
