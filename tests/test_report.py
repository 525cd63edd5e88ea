"""The report writers, without real parts: the JSON document and its schema, JUnit, reports of
runs cut short, merging the shards of a run, output paths, replay commands.

Fast: documents are built from real CheckResult / RunState objects with chosen outcomes.
"""

from __future__ import annotations

import copy
import json
import shlex
from xml.etree import ElementTree as ET

import jsonschema_rs
import pytest
from gate_fakes import result, run_state, validate

from knownstate.chaos import kinds
from knownstate.chaos.cli import build_parser
from knownstate.chaos.reporttext import mutant_lines, run_lines
from knownstate.chaos.report import (
    SCHEMA_VERSION,
    Replay,
    Report,
    ReportError,
    Unit,
    finished_record,
    junit,
    not_covered_record,
    merge,
    path_problem,
    schema,
    write_reports,
)

MUTANT = next(m for m in kinds.mutants("outbox") if m.name == "unfenced-complete")
REPLAY = Replay(profile="ci", examples=30)


def units(n: int = 3, mutant=None, seeds=(1,)) -> list[Unit]:
    names = kinds.names()
    out = []
    for kind in names[:n]:
        out += [Unit(len(out) + i, kind, s, mutant) for i, s in enumerate(seeds)]
    return out


def report(us: list[Unit], command: str = "verify", seeds=(1,), shard=None, planned=None):
    return Report(
        command,
        ["knownstate", command],
        "ci",
        list(seeds),
        us,
        len(us) if planned is None else planned,
        shard,
    )


def finish(rep: Report, unit: Unit, r) -> None:
    rep.start(unit)
    rep.finish(unit, finished_record(unit, r, REPLAY))


def test_the_schema_is_a_json_schema_shipped_with_the_package():
    s = schema()  # read through importlib.resources: it is package data
    assert jsonschema_rs.meta.is_valid(s)
    assert s["properties"]["version"]["const"] == SCHEMA_VERSION


def _passed():
    rep = report(units(2))
    for u in rep.units:
        finish(rep, u, result(u.kind, 1))
    return rep.document()


def _failed():
    rep = report(units(2))
    finish(rep, rep.units[0], result("outbox", 1))
    finish(
        rep,
        rep.units[1],
        result(
            rep.units[1].kind,
            1,
            failure="invariant violated: x",
            invariants=("lease-fence",),
            batch=4,
        ),
    )
    return rep.document()


def _vacuous():
    rep = report(units(2))
    finish(rep, rep.units[0], result("outbox", 1, vacuous=("event 'lost race'",)))
    finish(rep, rep.units[1], result(rep.units[1].kind, 1))
    return rep.document()


def _cut(outcome: str, signal_name: str | None):
    rep = report(units(3))
    finish(rep, rep.units[0], result("outbox", 1))
    rep.start(rep.units[1])
    rep.state = run_state(rep.units[1].kind, examples=4)
    return rep.document(outcome, f"stopped: {outcome}", signal_name)


DOCUMENTS = {
    "passed": (_passed, "passed", 0),
    "failed": (_failed, "failed", 1),
    "vacuous": (_vacuous, "vacuous", 1),
    "interrupted by Ctrl-C": (lambda: _cut("interrupted", "SIGINT"), "interrupted", 130),
    "terminated": (lambda: _cut("interrupted", "SIGTERM"), "interrupted", 143),
    "environment": (lambda: _cut("environment", None), "environment", 3),
}


@pytest.mark.parametrize("name", DOCUMENTS)
def test_a_report_of_every_outcome_follows_the_schema(name):
    make, outcome, code = DOCUMENTS[name]
    doc = make()
    validate(doc)
    assert (doc["version"], doc["outcome"], doc["exit_code"]) == (SCHEMA_VERSION, outcome, code)


def test_the_schema_refuses_what_a_reader_could_not_trust():
    doc = _failed()
    for broken in (
        {**doc, "version": SCHEMA_VERSION + 1},
        {**doc, "outcome": "mostly passed"},
        {k: v for k, v in doc.items() if k != "runs"},
        {**doc, "runs": [{**doc["runs"][0], "status": "flaky"}]},
        {**doc, "runs": [{**doc["runs"][1], "replay": None}]},  # a failure must say its replay
        {**doc, "runs": [{**doc["runs"][0], "caught": True}]},  # caught: mutants only
    ):
        with pytest.raises(jsonschema_rs.ValidationError):
            validate(broken)


@pytest.mark.parametrize("signal_name,code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_run_cut_short_keeps_what_finished_and_marks_the_rest(signal_name, code):
    doc = _cut("interrupted", signal_name)
    done, current, never = doc["runs"]
    assert (done["status"], done["ok"], done["examples"]) == ("passed", True, 5)
    assert (current["status"], current["examples"], current["ok"]) == ("interrupted", 4, False)
    assert current["coverage"], "what the interrupted run had observed is kept"
    assert (never["status"], never["examples"]) == ("not run", 0)
    assert (doc["signal"], doc["exit_code"]) == (signal_name, code)
    assert doc["counts"] == {
        "runs": 3,
        "ok": 1,
        "passed": 1,
        "failed": 0,
        "vacuous": 0,
        "interrupted": 1,
        "environment": 0,
        "not run": 1,
        "not covered": 0,
        "not applicable": 0,
    }


def test_a_failure_says_how_long_finding_and_shrinking_it_took():
    """In seconds and in replays (the budget ``--shrinks`` counts), and the steps it shrank
    from; a passing run has nothing of the kind."""
    doc = _failed()
    failed, passed = doc["runs"][1], doc["runs"][0]
    assert failed["shrinking"]["replays"] == 57 and "shrinking" not in passed
    lines = run_lines(failed)
    assert "  found after 0.4 s; shrunk in 1.1 s and 57 replays (from 14 rule steps to 4)" in lines
    assert (
        lines.index("  found after 0.4 s; shrunk in 1.1 s and 57 replays (from 14 rule steps to 4)")
        < len(lines) - 1
    )


def test_a_failure_shows_the_shortest_failure_seen_of_each_other_invariant():
    """A run shrinks the first bug it finds; another invariant's failure met on the way is
    reported too, the shortest seen of each, as seen (issue 20, item 2). Reported only: the
    verdict and the counterexample are the shrunk one's."""
    r = result(failure="invariant violated: lease: cut short", invariants=("lease",))
    stale = "invariant violated: lease-fence: a stale write landed"
    r.stats.saw_failure(stale, ("lease-fence",), ["a", "b", "c", "d", "e", "f"])
    r.stats.saw_failure(stale, ("lease-fence",), ["a", "b", "  (w0 resumes)", "c"])
    r.stats.saw_failure(stale, ("lease-fence",), ["x", "y", "z"])  # a tie: the first stays
    r.stats.saw_failure(stale, ("lease-fence", "claim"), ["a", "b", "  (w0 resumes)", "c"])
    r.stats.saw_failure("invariant violated: lease: cut short", ("lease",), ["a", "b"])
    unit = Unit(0, "outbox", 1, None)
    rec = finished_record(unit, r, REPLAY)
    validate(report_of(unit, rec))
    assert rec["shortest"]["lease-fence"]["steps"] == 3
    assert rec["shortest"]["lease-fence"]["counterexample"][:2] == ["a", "b"]
    lines = run_lines(rec)
    assert (
        "  shortest failure seen per invariant: claim 3 steps, lease 2 steps, lease-fence 3 steps"
        in lines
    )
    at = lines.index(f"  claim, lease-fence (3 steps, seen, not shrunk): {stale}")  # shown once
    assert lines[at + 1 : at + 5] == ["    a", "    b", "      (w0 resumes)", "    c"]
    assert rec["invariants"] == ["lease"] and rec["status"] == "failed"
    alone = result(failure="invariant violated: lease: cut short", invariants=("lease",))
    alone.stats.saw_failure("invariant violated: lease: cut short", ("lease",), ["a"])
    assert not any(
        "per invariant" in line for line in run_lines(finished_record(unit, alone, REPLAY))
    )


def report_of(unit: Unit, rec: dict) -> dict:
    rep = report([unit])
    rep.start(unit)
    rep.finish(unit, rec)
    return rep.document()


def test_an_environment_fault_marks_the_run_in_progress_not_a_failure():
    doc = _cut("environment", None)
    assert [r["status"] for r in doc["runs"]] == ["passed", "environment", "not run"]
    assert [r["failure"] for r in doc["runs"]] == [None, None, None]
    assert doc["exit_code"] == 3


def test_a_vacuous_run_is_not_a_failure_but_fails_the_gate():
    assert _vacuous()["outcome"] == "vacuous" and _vacuous()["exit_code"] == 1
    assert _failed()["outcome"] == "failed"


def test_a_mutant_counts_only_when_the_failure_names_its_invariant():
    u = Unit(0, "outbox", 1, MUTANT)
    caught = finished_record(u, result(failure="f", invariants=("lease-fence",)), REPLAY)
    wrong = finished_record(u, result(failure="f", invariants=("claim",)), REPLAY)
    survived = finished_record(u, result(), REPLAY)
    assert (caught["caught"], caught["ok"]) == (True, True)
    assert (wrong["caught"], wrong["ok"], wrong["status"]) == (False, False, "failed")
    assert (survived["caught"], survived["ok"], survived["status"]) == (False, False, "passed")
    assert "--mutant unfenced-complete" in caught["replay"]


def test_the_mutant_table_keeps_its_columns_whatever_the_length_of_a_mutants_name():
    from dataclasses import replace

    long = replace(MUTANT, name="a-mutant-name-longer-than-the-column-was")
    us = [Unit(0, "outbox", 1, MUTANT), Unit(1, "outbox", 1, long)]
    rep = report(us, command="mutants")
    for u in us:
        finish(rep, u, result(failure="f", invariants=("lease-fence",)))
    header, *rows = mutant_lines(rep.document())
    column = header.index("invariant broken")
    assert [r[column:].split()[0] for r in rows] == ["lease-fence", "lease-fence"], rows
    assert all(r[column - 1] == " " for r in rows), rows  # a space before the column


def _junit(doc) -> ET.Element:
    return ET.fromstring(junit(doc))


def test_junit_marks_failures_vacuity_interruptions_and_runs_never_started():
    failed = _junit(_failed())
    assert failed.get("failures") == "1" and failed.get("errors") == "0"
    [f] = failed.iter("failure")
    assert f.get("type") == "counterexample"
    assert COUNTEREXAMPLE_LINE in f.text and "replay: knownstate verify" in f.text
    vac = _junit(_vacuous())
    assert [f.get("type") for f in vac.iter("failure")] == ["vacuous"]
    cut = _junit(_cut("interrupted", "SIGTERM"))
    assert [e.get("type") for e in cut.iter("error")] == ["interrupted"]
    assert "SIGTERM" in next(cut.iter("error")).get("message")
    assert [s.get("type") for s in cut.iter("skipped")] == ["not-run"]
    assert (cut.get("tests"), cut.get("errors"), cut.get("skipped")) == ("3", "1", "1")


COUNTEREXAMPLE_LINE = "claim(w0, batch=3) -> Won(value=(Claim(id=1, attempt=0),))"


def test_junit_passes_a_caught_mutant_and_fails_a_surviving_one():
    us = [Unit(0, "outbox", 1, MUTANT), Unit(1, "outbox", 2, MUTANT)]
    rep = report(us, seeds=(1, 2))
    finish(rep, us[0], result(failure="f", invariants=("lease-fence",)))
    finish(rep, us[1], result())
    root = _junit(rep.document())
    cases = list(root.iter("testcase"))
    assert [len(list(c.iter("failure"))) for c in cases] == [0, 1]
    assert next(cases[1].iter("failure")).get("message").startswith("NOT CAUGHT")


def test_junit_skips_a_mutant_this_database_cannot_reach_instead_of_failing_it():
    u = Unit(0, "outbox", 1, MUTANT)
    rep = report([u])
    rep.start(u)
    rep.finish(u, not_covered_record(u, "ci", ["event 'db crash'"]))
    [case] = _junit(rep.document()).iter("testcase")
    assert not list(case.iter("failure"))
    assert "needs event 'db crash'" in next(case.iter("skipped")).get("message")


def test_junit_names_do_not_carry_random_seeds_and_survive_control_characters():
    rep = report(units(1, seeds=(912873, 912874)), seeds=(912873, 912874))
    finish(
        rep,
        rep.units[0],
        result(seed=912873, failure="bad byte \x00\x1b here", invariants=("claim",)),
    )
    finish(rep, rep.units[1], result(seed=912874))
    root = _junit(rep.document())  # parses: no character XML forbids
    names = [c.get("name") for c in root.iter("testcase")]
    first = kinds.names()[0]
    assert names == [f"{first} (seed 1 of 2)", f"{first} (seed 2 of 2)"]


def _shards(n: int, outcome_of=lambda u: result(u.kind, u.seed)):
    whole = units(4, seeds=(5, 6))
    docs = []
    for i in range(1, n + 1):
        mine = [u for u in whole if u.index % n == i - 1]
        rep = report(mine, seeds=(5, 6), shard=(i, n), planned=len(whole))
        for u in mine:
            finish(rep, u, outcome_of(u))
        docs.append((f"shard{i}.json", rep.document()))
    rep = report(whole, seeds=(5, 6))
    for u in whole:
        finish(rep, u, outcome_of(u))
    return docs, rep.document()


@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_merged_shards_are_the_report_of_one_run(n):
    def outcome_of(u):
        return result(u.kind, u.seed, vacuous=("event 'x'",) if u.index == 3 else ())

    docs, whole = _shards(n, outcome_of)
    merged = merge(list(reversed(docs)))
    validate(merged)
    assert merged["runs"] == whole["runs"]
    assert (merged["outcome"], merged["exit_code"], merged["counts"]) == (
        whole["outcome"],
        whole["exit_code"],
        whole["counts"],
    )
    assert merged["shard"] is None and merged["merged_from"] == [p for p, _ in reversed(docs)]


def test_a_merge_is_interrupted_when_one_shard_was():
    docs, _ = _shards(2)
    cut = copy.deepcopy(docs[1][1])
    cut["runs"][-1]["status"], cut["outcome"], cut["signal"] = (
        "interrupted",
        "interrupted",
        "SIGTERM",
    )
    merged = merge([docs[0], ("b.json", cut)])
    assert (merged["outcome"], merged["exit_code"]) == ("interrupted", 143)


@pytest.mark.parametrize("problem", ["missing", "twice", "other seeds", "version", "no shard"])
def test_merge_refuses_shards_that_do_not_make_one_run(problem):
    docs, whole = _shards(3)
    if problem == "missing":
        docs, expected = docs[:2], "shard 3/3 missing"
    elif problem == "twice":
        docs, expected = [docs[0], docs[0], docs[1]], "shard 1 of 3 given twice"
    elif problem == "other seeds":
        docs[1] = (docs[1][0], {**docs[1][1], "seeds": [7, 8]})
        expected = "seeds"
    elif problem == "version":
        docs[2] = (docs[2][0], {**docs[2][1], "version": 99})
        expected = "report version 99"
    else:
        docs, expected = [("whole.json", whole)], "not the report of a shard"
    with pytest.raises(ReportError, match=expected):
        merge(docs)


def test_output_paths_are_judged_before_anything_runs(tmp_path):
    (tmp_path / "file").write_text("")
    assert path_problem(str(tmp_path / "r.json"), "JSON report") is None
    assert "does not exist" in path_problem(str(tmp_path / "nope" / "r.json"), "JSON report")
    assert "is a directory" in path_problem(str(tmp_path), "JSON report")
    assert "not a directory" in path_problem(str(tmp_path / "file" / "r.xml"), "JUnit report")


def test_reports_are_written_whole(tmp_path):
    doc = _failed()
    write_reports(doc, str(tmp_path / "r.json"), str(tmp_path / "r.xml"))
    assert json.loads((tmp_path / "r.json").read_text()) == doc
    ET.parse(tmp_path / "r.xml")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "r.xml"]  # no temp files


@pytest.mark.parametrize(
    "replay,absent",
    [
        (Replay(), ["--examples", "--steps", "--batch", "--shrinks", "--mutant", "example-db"]),
        (Replay(profile="deep", examples=30, steps=20, shrinks=50, example_db="my db"), []),
        (Replay(no_example_db=True), ["--examples"]),
    ],
)
def test_a_replay_command_parses_back_to_the_same_run(replay, absent):
    cmd = replay.command(
        "outbox",
        12,
        batch=3 if replay.examples else 0,
        mutant="unfenced-complete" if replay.steps else None,
    )
    words = shlex.split(cmd)
    assert words[:2] == ["knownstate", "verify"]
    args = build_parser().parse_args(words[1:])
    assert (args.kinds, args.seed, args.profile) == (["outbox"], 12, replay.profile)
    assert (args.examples, args.steps, args.shrinks) == (
        replay.examples,
        replay.steps,
        replay.shrinks,
    )
    assert args.batch == (3 if replay.examples else 0)
    assert args.example_db == replay.example_db and args.no_example_db == replay.no_example_db
    assert args.mutant == (["unfenced-complete"] if replay.steps else None)  # --mutant repeats
    for flag in absent:
        assert flag not in cmd
