"""The report of one gate run: one document, written as JSON and as JUnit XML, on every exit.

A run of ``knownstate verify`` or ``knownstate mutants`` is a list of *runs*, one per (kind,
seed, mutant): the plan. :class:`Report` collects each run's record as it finishes; when the
command ends — passed, failed, vacuous, a real part died (exit 3), Ctrl-C (130), SIGTERM (143)
— :meth:`Report.document` returns every run of the plan: the finished ones, the one in progress
marked ``interrupted`` or ``environment`` with what it had done so far, and the rest marked
``not run``. JSON and JUnit are both rendered from that document (:func:`write_reports`), and so
are the summaries printed at the end; ``knownstate report merge`` joins the documents of the
shards of one run into the document of the whole (:func:`merge`).

The JSON document's shape is ``report.schema.json`` beside this file (JSON Schema 2020-12),
versioned by ``version`` (:data:`SCHEMA_VERSION`): a reader refuses a version it does not know.
"""

from __future__ import annotations

import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import dsn as dsns
from . import outpath
from .check import SHRINKS as DEFAULT_SHRINKS  # run_check's and --shrinks's default
from .junit import case_name, junit
from .reportschema import (
    EXIT_CODES,
    OUTCOMES,
    SCHEMA_VERSION,
    SIGNAL_EXIT,
    STATUSES,
    knownstate_version,
    schema,
)
from .reporttext import (
    mutant_lines,
    not_applicable,
    run_lines,
    stability_lines,
    status_word,
    verdict_line,
)

__all__ = [  # the document, and (re-exported) its vocabulary and renderings
    "Replay",
    "Report",
    "ReportError",
    "Unit",
    "counts",
    "finished_record",
    "merge",
    "not_covered_record",
    "partial_record",
    "path_problem",
    "read",
    "verdict",
    "write_reports",
    "EXIT_CODES",
    "OUTCOMES",
    "SCHEMA_VERSION",
    "SIGNAL_EXIT",
    "STATUSES",
    "case_name",
    "junit",
    "knownstate_version",
    "mutant_lines",
    "not_applicable",
    "run_lines",
    "schema",
    "stability_lines",
    "status_word",
    "verdict_line",
]

# ---------------------------------------------------------------------------------------
# The plan: which runs a command makes, and how to replay one.
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Unit:
    """One run of the plan: a kind at a seed, against the reference or a named mutant."""

    index: int  # position in the plan of the whole run (all shards)
    kind: str
    seed: int
    mutant: Any = None  # a chaos.mutants.Mutant

    @property
    def label(self) -> str:
        return (
            self.kind
            + (f" mutant {self.mutant.name}" if self.mutant else "")
            + f" seed {self.seed}"
        )


@dataclass(frozen=True)
class Replay:
    """The options a replay command repeats: those the user gave, and the example database."""

    profile: str = "ci"
    examples: int | None = None
    steps: int | None = None
    shrinks: int = DEFAULT_SHRINKS
    example_db: str | None = None  # a directory other than the default
    no_example_db: bool = False
    dsn: bool = False
    invariant: str | None = None  # --invariant: the failure looked for

    def command(self, kind: str, seed: int, batch: int = 0, mutant: str | None = None) -> str:
        from . import kinds  # a kind named with --kind is named so again

        words = [
            "knownstate",
            "verify",
            *kinds.argument(kind).split(),
            "--seed",
            str(seed),
            "--profile",
            self.profile,
        ]
        words += ["--batch", str(batch)] if batch else []
        words += ["--examples", str(self.examples)] if self.examples else []
        words += ["--steps", str(self.steps)] if self.steps else []
        words += ["--shrinks", str(self.shrinks)] if self.shrinks != DEFAULT_SHRINKS else []
        words += ["--mutant", mutant] if mutant else []
        words += ["--invariant", self.invariant] if self.invariant else []
        words += ["--no-example-db"] if self.no_example_db else []
        words += ["--example-db", self.example_db] if self.example_db else []
        cmd = " ".join(shlex.quote(w) for w in words)
        return cmd + (" --dsn '<your DSN>'" if self.dsn else "")


# ---------------------------------------------------------------------------------------
# Run records.
# ---------------------------------------------------------------------------------------


def _mutant(unit: Unit) -> dict | None:
    m = unit.mutant
    return (
        None
        if m is None
        else {"name": m.name, "invariant": m.invariant, "description": m.description}
    )


def _empty(unit: Unit, profile: str, status: str) -> dict:
    return {
        "index": unit.index,
        "kind": unit.kind,
        "seed": unit.seed,
        "mutant": _mutant(unit),
        "status": status,
        "caught": None,
        "ok": False,
        "profile": profile,
        "examples": 0,
        "steps": 0,
        "invariants_checked": 0,
        "seconds": 0.0,
        "faults": {},
        "events": {},
        "transitions": {},
        "shortest": {},
        "coverage": {},
        "not_covered": [],
        "unavailable": [],
        "vacuous": [],
        "stopped": "",
        "batch": 0,
        "failure": None,
        "invariants": [],
        "counterexample": [],
        "counterexample_steps": 0,
        "replay": None,
        "stored_examples": 0,
    }


def _stats(rec: dict, stats) -> None:
    d = stats.as_dict()
    rec.update(
        examples=d["examples"],
        steps=d["steps"],
        invariants_checked=d["invariants_checked"],
        faults=d["faults"],
        events=d["events"],
        transitions=d["transitions"],
        shortest=d.get("shortest", {}),
    )


def finished_record(unit: Unit, result, replay: Replay, stored: int = 0) -> dict:
    """The record of a run that ended with a CheckResult."""
    rec = _empty(unit, result.profile, result.status.lower())
    _stats(rec, result.stats)
    rec.update(
        seconds=round(result.seconds, 3),
        coverage=dict(result.coverage),
        not_covered=list(result.not_covered),
        unavailable=list(result.unavailable),
        vacuous=list(result.vacuous),
        stopped=result.stopped,
        batch=result.batch,
        failure=result.failure,
        invariants=list(result.invariants),
        counterexample=list(result.counterexample),
        counterexample_steps=result.counterexample_steps,
        stored_examples=stored,
    )
    if result.timings is not None:
        rec["timings"] = result.timings
    if result.shrinking is not None:
        rec["shrinking"] = result.shrinking
    if result.failure:
        rec["replay"] = replay.command(
            unit.kind, unit.seed, result.batch, unit.mutant.name if unit.mutant else None
        )
    if unit.mutant is None:
        rec["ok"] = result.passed
    elif result.not_applied:  # it ran as the reference: neither caught nor missed, and not ok
        rec.update(status="not applicable", not_applicable=result.not_applied)
    else:
        rec["caught"] = rec["ok"] = (
            result.failure is not None and unit.mutant.invariant in result.invariants
        )
    return rec


def not_covered_record(unit: Unit, profile: str, missing: list[str]) -> dict:
    """A mutant this database cannot reach (it needs what the database cannot do): not run,
    and not a gap in the check; it counts as neither caught nor missed."""
    rec = _empty(unit, profile, "not covered")
    rec.update(ok=True, not_covered=list(missing))
    return rec


def partial_record(unit: Unit, profile: str, status: str, state=None) -> dict:
    """The record of a run that did not finish (``state``: its RunState so far, if it began)."""
    rec = _empty(unit, profile, status)
    if state is not None:
        _stats(rec, state.stats)
        rec.update(
            seconds=round(time.monotonic() - state.started, 3),
            batch=state.batch,
            coverage={r.key: state.count(r) for r in state.reachable()},
            not_covered=[r.key for r in state.not_covered()],
        )
        if state.timings is not None:
            rec["timings"] = state.timings.as_dict(rec["seconds"], rec["steps"])
    return rec


def verdict(runs: list[dict]) -> str:
    """passed, failed or vacuous: what the finished runs say (a caught mutant is a good run; a
    mutant not applicable is not: the catalogue does not fit the code, exit 1)."""
    bad = [r for r in runs if not r["ok"]]
    if not bad:
        return "passed"
    return "vacuous" if all(r["status"] == "vacuous" for r in bad) else "failed"


# ---------------------------------------------------------------------------------------
# The document.
# ---------------------------------------------------------------------------------------


class Report:
    """What one command did, kept up to date as its runs finish."""

    def __init__(
        self,
        command: str,
        argv: list[str],
        profile: str,
        seeds: list[int],
        units: list[Unit],
        planned: int,
        shard: tuple[int, int] | None = None,
        example_db: str | None = None,
    ):
        self.command, self.profile = command, profile
        self.argv = dsns.redact_argv(argv)  # a --dsn password is never stored
        self.seeds, self.units, self.planned, self.shard = list(seeds), list(units), planned, shard
        self.example_db = example_db
        self.database: str | None = None
        self.records: dict[int, dict] = {}
        self.current: Unit | None = None
        self.state = None  # the RunState of the run in progress
        self.started = time.monotonic()

    def start(self, unit: Unit) -> None:
        self.current, self.state = unit, None

    def finish(self, unit: Unit, record: dict) -> dict:
        self.records[unit.index] = record
        self.current, self.state = None, None
        return record

    def finished(self) -> list[dict]:
        return [self.records[u.index] for u in self.units if u.index in self.records]

    def document(
        self, outcome: str | None = None, message: str | None = None, signal_name: str | None = None
    ) -> dict:
        """The report. ``outcome`` is ``interrupted`` or ``environment`` when the command was
        cut short (the run in progress is marked so); otherwise the finished runs decide."""
        runs = []
        for u in self.units:
            if u.index in self.records:
                runs.append(self.records[u.index])
            elif u == self.current and outcome in ("interrupted", "environment"):
                runs.append(partial_record(u, self.profile, outcome, self.state))
            else:
                runs.append(partial_record(u, self.profile, "not run"))
        outcome = outcome or verdict(runs)
        code = (
            SIGNAL_EXIT.get(signal_name or "SIGINT")
            if outcome == "interrupted"
            else EXIT_CODES[outcome]
        )
        return {
            "version": SCHEMA_VERSION,
            "knownstate": knownstate_version(),
            "command": self.command,
            "argv": self.argv,
            "profile": self.profile,
            "seed": self.seeds[0],
            "seeds": self.seeds,
            "shard": None
            if self.shard is None
            else {"index": self.shard[0], "count": self.shard[1]},
            "planned": self.planned,
            "database": self.database,
            "example_db": self.example_db,
            "outcome": outcome,
            "exit_code": code,
            "signal": signal_name,
            "message": message,
            "seconds": round(time.monotonic() - self.started, 3),
            "merged_from": [],
            "counts": counts(runs),
            "runs": runs,
        }


def counts(runs: list[dict]) -> dict:
    out = {s: 0 for s in STATUSES}
    for r in runs:
        out[r["status"]] += 1
    return {"runs": len(runs), "ok": sum(1 for r in runs if r["ok"]), **out}


class ReportError(Exception):
    """A report cannot be read or merged: the message says which file and why."""


def merge(docs: list[tuple[str, dict]], unrun: list[dict] = ()) -> dict:
    """The document of a whole run from the documents of its shards (``(path, document)``).
    Every shard of the run must be there, once: together they are the plan of one run, with
    the records of runs no shard began (``unrun``: shards that take their runs one at a time,
    :mod:`.jobs`)."""
    if not docs:
        raise ReportError("nothing to merge: give the JSON report of every shard")
    for path, d in docs:
        if d.get("version") != SCHEMA_VERSION:
            raise ReportError(
                f"{path}: report version {d.get('version')!r}; this knownstate "
                f"reads version {SCHEMA_VERSION} (merge with the knownstate that "
                "wrote it)"
            )
        if d.get("shard") is None:
            raise ReportError(
                f"{path}: not the report of a shard (--shard I/N): merge joins "
                "the shards of one run"
            )
    first_path, first = docs[0]
    for path, d in docs[1:]:
        for field in ("command", "profile", "seeds", "planned"):
            if d[field] != first[field]:
                raise ReportError(
                    f"{path}: {field} {d[field]!r} differs from {first_path}'s "
                    f"{first[field]!r}: these are shards of different runs"
                )
        if d["shard"]["count"] != first["shard"]["count"]:
            raise ReportError(
                f"{path}: shard {d['shard']['index']}/{d['shard']['count']} is "
                f"not a shard of the {first['shard']['count']}-way run of "
                f"{first_path}"
            )
    n = first["shard"]["count"]
    given = sorted(d["shard"]["index"] for _, d in docs)
    twice = sorted({i for i in given if given.count(i) > 1})
    if twice:
        raise ReportError(f"shard {', '.join(map(str, twice))} of {n} given twice")
    missing = [i for i in range(1, n + 1) if i not in given]
    if missing:
        raise ReportError(
            f"shard {', '.join(f'{i}/{n}' for i in missing)} missing: give the "
            "JSON report of every shard"
        )
    runs = sorted([*(r for _, d in docs for r in d["runs"]), *unrun], key=lambda r: r["index"])
    if [r["index"] for r in runs] != list(range(first["planned"])):
        raise ReportError(
            "the shards' runs do not make up the plan of one run (a run is "
            "missing or given twice): were they written with the same options?"
        )
    cut = [d for _, d in docs if d["outcome"] in ("environment", "interrupted")]
    outcome = (
        "environment"
        if any(d["outcome"] == "environment" for d in cut)
        else "interrupted"
        if cut
        else verdict(runs)
    )
    signal_name = next((d["signal"] for d in cut if d["signal"]), None)
    messages = [f"shard {d['shard']['index']}/{n}: {d['message']}" for _, d in docs if d["message"]]
    databases = {d["database"] for _, d in docs}
    code = (
        SIGNAL_EXIT.get(signal_name or "SIGINT")
        if outcome == "interrupted"
        else EXIT_CODES[outcome]
    )
    return {
        **first,
        "argv": ["knownstate", "report", "merge", *(p for p, _ in docs)],
        "shard": None,
        "database": databases.pop() if len(databases) == 1 else "several",
        "outcome": outcome,
        "exit_code": code,
        "signal": signal_name,
        "message": "; ".join(messages) or None,
        "seconds": max(d["seconds"] for _, d in docs),
        "merged_from": [p for p, _ in docs],
        "counts": counts(runs),
        "runs": runs,
    }


def read(path: str) -> dict:
    import json

    try:
        doc = json.loads(Path(path).read_text())
    except OSError as e:
        raise ReportError(f"{path}: cannot read it ({e.strerror})") from None
    except ValueError as e:
        raise ReportError(f"{path}: not JSON ({e})") from None
    if not isinstance(doc, dict) or "version" not in doc:
        raise ReportError(f"{path}: not a knownstate JSON report (no version field)")
    return doc


# ---------------------------------------------------------------------------------------
# Output paths and writing.
# ---------------------------------------------------------------------------------------


def path_problem(path: str, what: str) -> str | None:
    """Why ``path`` cannot take the ``what`` (None: it can). Checked before anything runs."""
    return outpath.problem(path, what)


def write_reports(doc: dict, json_path: str | None, junit_path: str | None) -> None:
    """Write both reports (each whole, or not at all: :func:`.outpath.write`); when one cannot
    be written the other still is, and :class:`~.outpath.OutputError` names every failure."""
    import json

    failed = []
    for path, what, render in (
        (json_path, "JSON report", lambda: json.dumps(doc, indent=2) + "\n"),
        (junit_path, "JUnit report", lambda: junit(doc)),
    ):
        if path:
            try:
                outpath.write(path, render(), what)
            except outpath.OutputError as e:
                failed.append(str(e))
    if failed:
        raise outpath.OutputError("; ".join(failed))
