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


def default_timeline(args, kind: str, seed: int) -> str:
    for report in (args.json, args.junit):
        if report:
            p = Path(report)
            return str(p.with_name(p.stem + ".timeline.html"))
    return f"knownstate-soak-{kind}-{seed}.html"


def write_reports(args, r: "SoakResult", timeline: str | None) -> None:
    """The JSON and JUnit reports ``verify`` writes (one run, of profile ``soak``), the soak's
    own findings under ``soak``, the soak's replay command."""
    from . import kinds
    from . import report as rp

    mutant = next((m for m in kinds.mutants(r.kind) if m.name == r.mutant), None)
    unit = rp.Unit(0, r.kind, r.seed, mutant)
    rep = rp.Report("soak", sys.argv[1:], "soak", [r.seed], [unit], 1)
    rec = rp.finished_record(unit, check_result(r), rp.Replay(profile="soak"))
    rec["replay"] = None if r.passed else r.replay()
    rep.finish(unit, rec)
    doc = rep.document()
    doc["soak"] = report_extra(r, timeline)["soak"]
    rp.write_reports(doc, args.json, args.junit)


class _LiveLine:
    """On a terminal: one line rewritten in place."""

    def say(self, line: str) -> None:
        sys.stdout.write("\r\033[K" + line.strip()[:150])
        sys.stdout.flush()

    def done(self) -> None:
        sys.stdout.write("\r\033[K")
        sys.stdout.flush()
