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

import re
import shlex
import time
from dataclasses import dataclass
from importlib import metadata, resources
from pathlib import Path
from typing import Any, Iterable

from . import dsn as dsns
from . import outpath, timings
from .check import SHRINKS as DEFAULT_SHRINKS  # run_check's and --shrinks's default
from xml.etree import ElementTree as ET

SCHEMA_VERSION = 1
STATUSES = ("passed", "failed", "vacuous", "interrupted", "environment", "not run", "not covered")
OUTCOMES = ("passed", "failed", "vacuous", "interrupted", "environment")
EXIT_CODES = {"passed": 0, "failed": 1, "vacuous": 1, "environment": 3}
SIGNAL_EXIT = {"SIGINT": 130, "SIGTERM": 143}


def schema() -> dict:
    """The JSON Schema of the report (shipped as package data)."""
    import json

    return json.loads(resources.files(__package__).joinpath("report.schema.json").read_text())


def knownstate_version() -> str:
    try:
        return metadata.version("knownstate")
    except metadata.PackageNotFoundError:  # pragma: no cover - running from a bare checkout
        return "0+unknown"


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
    if result.failure:
        rec["replay"] = replay.command(
            unit.kind, unit.seed, result.batch, unit.mutant.name if unit.mutant else None
        )
    if unit.mutant is None:
        rec["ok"] = result.passed
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
    """passed, failed or vacuous: what the finished runs say (a caught mutant is a good run)."""
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


def merge(docs: list[tuple[str, dict]]) -> dict:
    """The document of a whole run from the documents of its shards (``(path, document)``).
    Every shard of the run must be there, once: together they are the plan of one run."""
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
    runs = sorted((r for _, d in docs for r in d["runs"]), key=lambda r: r["index"])
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


# ---------------------------------------------------------------------------------------
# JUnit XML.
# ---------------------------------------------------------------------------------------

_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _x(text: str) -> str:
    return _NOT_XML.sub("?", text)


def _counts(counter: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counter.items())) or "none"


def case_name(r: dict, doc: dict) -> str:
    """A test case's name, the same on every run (a random seed is not in it): CI tools track
    a test's history by its name."""
    name = (
        r["mutant"]["name"]
        if r["mutant"]
        else (r["kind"] if doc["command"] == "verify" else "reference")
    )
    seeds = doc["seeds"]
    return name + (
        f" (seed {seeds.index(r['seed']) + 1} of {len(seeds)})"
        if len(seeds) > 1 and r["seed"] in seeds
        else ""
    )


def junit(doc: dict) -> str:
    runs = doc["runs"]
    suite = ET.Element(
        "testsuite",
        name=f"knownstate {doc['command']}",
        tests=str(len(runs)),
        time=f"{doc['seconds']:.3f}",
    )
    props = ET.SubElement(suite, "properties")
    for key in ("version", "knownstate", "profile", "seed", "outcome", "exit_code", "message"):
        if doc[key] is not None:
            ET.SubElement(props, "property", name=key, value=_x(str(doc[key])))
    tallies = {"failures": 0, "errors": 0, "skipped": 0}
    for r in runs:
        classname = f"knownstate.{doc['command']}" + (
            f".{r['kind']}" if doc["command"] == "mutants" else ""
        )
        case = ET.SubElement(
            suite,
            "testcase",
            classname=classname,
            name=case_name(r, doc),
            time=f"{r['seconds']:.3f}",
        )
        tag, kind, message, text = _junit_outcome(r, doc)
        if tag:
            tallies[{"failure": "failures", "error": "errors", "skipped": "skipped"}[tag]] += 1
            el = ET.SubElement(case, tag, message=_x(message), type=kind)
            if text:
                el.text = _x(text)
        if r["status"] != "not run":
            ET.SubElement(case, "system-out").text = _x("\n".join(run_lines(r)))
    for k, v in tallies.items():
        suite.set(k, str(v))
    root = ET.Element(
        "testsuites",
        name="knownstate",
        tests=str(len(runs)),
        time=f"{doc['seconds']:.3f}",
        **{k: str(v) for k, v in tallies.items()},
    )
    root.append(suite)
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, "unicode") + "\n"


def _junit_outcome(r: dict, doc: dict) -> tuple[str | None, str, str, str]:
    status = r["status"]
    if status == "not run":
        why = {
            "interrupted": "the command was interrupted before it began",
            "environment": "a real part died before it began",
        }.get(doc["outcome"], "")
        return "skipped", "not-run", "not run" + (f": {why}" if why else ""), ""
    if status in ("interrupted", "environment"):
        message = (
            f"interrupted ({doc['signal'] or 'SIGINT'})"
            if status == "interrupted"
            else f"environment: {doc['message'] or 'a real part died'}"
        )
        return "error", status, f"{message} after {r['examples']} examples", ""
    if r["mutant"] is not None:
        if r["caught"]:
            return None, "", "", ""
        return "failure", "not-caught", f"NOT CAUGHT: {_why_not_caught(r)}", ""
    if status == "failed":
        text = "\n".join(
            [r["failure"], "counterexample:", *r["counterexample"], f"replay: {r['replay']}"]
        )
        return "failure", "counterexample", r["failure"].splitlines()[0], text
    if status == "vacuous":
        return "failure", "vacuous", "vacuous: never observed " + "; ".join(r["vacuous"]), ""
    return None, "", "", ""


def _why_not_caught(r: dict) -> str:
    declared = r["mutant"]["invariant"]
    if r["failure"] is None:
        n = r["examples"]
        return f"it survived {n} example{'s' if n != 1 else ''} (it breaks {declared})"
    named = ", ".join(r["invariants"]) or "no invariant"
    return f"the failure names {named}, not {declared}, the invariant the mutant breaks"


# ---------------------------------------------------------------------------------------
# Text: what a run prints, and the summaries.
# ---------------------------------------------------------------------------------------


def status_word(r: dict) -> str:
    if r["mutant"] is not None and r["status"] in ("passed", "failed"):
        return "CAUGHT" if r["caught"] else "NOT CAUGHT"
    return {
        "passed": "passed",
        "not run": "not run",
        "not covered": "not covered on this database",
    }.get(r["status"], r["status"].upper())


def run_lines(r: dict) -> list[str]:
    """A run's summary, as printed at its end and kept in the JUnit test case."""
    rate = r["steps"] / r["seconds"] if r["seconds"] else 0.0
    head = r["kind"] + (f" mutant {r['mutant']['name']}" if r["mutant"] else "")
    out = [
        f"{head}: {status_word(r)} — {r['examples']} examples, {r['steps']} steps "
        f"({rate:.0f} steps/s), {r['seconds']:.1f} s, seed {r['seed']}"
    ]
    if r["stored_examples"]:
        out.append(
            f"  replayed first: {r['stored_examples']} stored failing example(s) from "
            "the example database"
        )
    out.append(f"  faults injected: {_counts(r['faults'])}")
    out += [f"  fault unavailable: {u}" for u in r["unavailable"]]
    out.append(f"  events observed: {_counts(r['events'])}")
    seen = sum(1 for n in r["transitions"].values() if n)
    out.append(f"  transitions observed: {seen} distinct, {sum(r['transitions'].values())} taken")
    out.append(f"  invariants checked: {r['invariants_checked']}")
    if r["stopped"]:
        out.append(f"  stopped: {r['stopped']}")
    out += [f"  not covered on this database: {n}" for n in r["not_covered"]]
    if r.get("timings"):
        out += timings.table(r["timings"])
    if r["mutant"] is not None and r["status"] in ("passed", "failed"):
        out.append(
            f"  {status_word(r)}: "
            + (
                f"the failure names {r['mutant']['invariant']}, the invariant the mutant breaks"
                if r["caught"]
                else _why_not_caught(r)
            )
        )
    if r["failure"]:
        out.append(f"  failure: {r['failure']}")
        if r["counterexample"]:  # none when the check could not start (a refused schema)
            out.append(
                f"  counterexample ({r['counterexample_steps']} steps, one operation or "
                "fault per line):"
            )
            out += [f"    {line}" for line in r["counterexample"]]
        out.append(f"  replay: {r['replay']}")
    elif r["vacuous"]:
        out.append("  vacuous: the run never observed " + "; ".join(r["vacuous"]))
        out.append(
            "  (a gate that never reached these proves nothing about them: raise "
            "--examples/--steps, or try another seed)"
        )
    return out


def _seeds(runs: Iterable[dict]) -> str:
    return ", ".join(str(r["seed"]) for r in runs)


def stability_lines(doc: dict) -> list[str]:
    """Per kind, over the seeds: passes, vacuous, failed, and the seeds of each."""
    runs = [r for r in doc["runs"] if r["mutant"] is None]
    kinds = list(dict.fromkeys(r["kind"] for r in runs))
    out = [
        f"over {len(doc['seeds'])} seeds ({_seeds_list(doc['seeds'])}):",
        f"  {'kind':<18} {'passed':>6} {'vacuous':>8} {'failed':>7} {'unfinished':>11}",
    ]
    for kind in kinds:
        mine = [r for r in runs if r["kind"] == kind]
        by = {s: [r for r in mine if r["status"] == s] for s in STATUSES}
        unfinished = by["interrupted"] + by["environment"] + by["not run"]
        line = (
            f"  {kind:<18} {len(by['passed']):>6} {len(by['vacuous']):>8} "
            f"{len(by['failed']):>7} {len(unfinished):>11}"
        )
        notes = [f"{s} at seed {_seeds(by[s])}" for s in ("vacuous", "failed") if by[s]]
        out.append(line + ("   " + "; ".join(notes) if notes else ""))
    return out


def _seeds_list(seeds: list[int]) -> str:
    return (
        ", ".join(map(str, seeds))
        if len(seeds) <= 6
        else f"{seeds[0]}, {seeds[1]}, ..., {seeds[-1]}"
    )


def mutant_lines(doc: dict) -> list[str]:
    """Per mutant: on how many seeds it was caught, seconds, counterexample steps."""
    finished = ("passed", "failed", "vacuous")
    out = [
        f"  {'kind':<16} {'mutant':<28} {'invariant broken':<30} {'caught':>14} "
        f"{'seconds':>8} {'steps':>6}"
    ]
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in doc["runs"]:
        groups.setdefault((r["kind"], r["mutant"]["name"] if r["mutant"] else ""), []).append(r)
    for (kind, name), runs in groups.items():
        done = [r for r in runs if r["status"] in finished]
        if not name:
            bad = [r for r in done if not r["ok"]]
            if bad or doc["command"] == "mutants":
                word = f"FAILS at seed {_seeds(bad)}" if bad else f"passes {len(done)}/{len(runs)}"
                out.append(f"  {kind:<16} {'(reference)':<28} {'':<30} {word:>14}")
            continue
        if all(r["status"] == "not covered" for r in runs):
            out.append(
                f"  {kind:<16} {name:<28} {runs[0]['mutant']['invariant']:<30} "
                f"{'not covered':>14}   needs {', '.join(runs[0]['not_covered'])}"
            )
            continue
        caught = [r for r in done if r["caught"]]
        missed = [r for r in done if not r["caught"]]
        tally = f"{len(caught)}/{len(runs)}"
        word = (
            tally
            if not missed and len(done) == len(runs)
            else (f"NOT CAUGHT {tally}" if missed else f"{tally} (unfinished)")
        )
        secs = sum(r["seconds"] for r in done) / len(done) if done else 0.0
        steps = max((r["counterexample_steps"] for r in caught), default=None)
        line = (
            f"  {kind:<16} {name:<28} {runs[0]['mutant']['invariant']:<30} {word:>14} "
            f"{secs:>8.1f} {steps if steps is not None else '-':>6}"
        )
        out.append(line + (f"   missed at seed {_seeds(missed)}" if missed else ""))
    return out


def verdict_line(doc: dict) -> str:
    runs, c = doc["runs"], doc["counts"]
    mutants = [r for r in runs if r["mutant"] is not None]
    outcome = doc["outcome"]
    seeds = (
        f"seed {doc['seed']}" if len(doc["seeds"]) == 1 else f"seeds {_seeds_list(doc['seeds'])}"
    )
    tail = f", {doc['seconds']:.1f} s, {seeds}"
    if outcome in ("interrupted", "environment"):
        done = c["runs"] - c["not run"] - c["interrupted"] - c["environment"]
        word = "INTERRUPTED" if outcome == "interrupted" else "STOPPED (environment)"
        return f"knownstate {doc['command']}: {word} — {done} of {c['runs']} runs finished{tail}"
    if doc["command"] == "verify" and mutants and len(mutants) == len(runs):
        caught = sum(1 for r in mutants if r["caught"])
        word = "CAUGHT" if caught == len(mutants) else "NOT CAUGHT"
        return (
            f"knownstate verify: {word} — mutant {mutants[0]['mutant']['name']} of "
            f"{mutants[0]['kind']} caught at {caught} of {len(mutants)} seeds{tail}"
        )
    if doc["command"] == "mutants":
        names = list(dict.fromkeys((r["kind"], r["mutant"]["name"]) for r in mutants))
        missed = list(dict.fromkeys(f"{r['mutant']['name']}" for r in mutants if not r["ok"]))
        ref_bad = [r for r in runs if r["mutant"] is None and not r["ok"]]
        word = "PASSED" if outcome == "passed" else "FAILED"
        text = (
            f"knownstate mutants: {word} — {len(names) - len(missed)}/{len(names)} mutants "
            f"caught at every seed"
        )
        text += f"; NOT CAUGHT: {', '.join(missed)}" if missed else ""
        text += (
            f"; the reference FAILS ({', '.join(r['kind'] for r in ref_bad)})" if ref_bad else ""
        )
        return text + tail
    word = {"passed": "PASSED", "failed": "FAILED", "vacuous": "VACUOUS"}[outcome]
    return f"knownstate verify: {word} — {c['ok']}/{c['runs']} runs passed{tail}"
