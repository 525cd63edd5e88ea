"""The command line as a user meets it: exit codes, reports on every exit, stable verdicts over
seeds, mutants caught or NOT CAUGHT, shards, memory across runs, real parts killed from outside.

Fast tests run ``main()`` in this process with the engine and the real parts replaced by
doubles (``gate_fakes``): argument checks, tables, reports of runs cut short, shards, merge.
Slow tests (marked) start ``knownstate`` in its own process with its own throwaway PostgreSQL
and Toxiproxy, as a CI job would.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from xml.etree import ElementTree as ET

import pytest
from gate_fakes import Engine, FakeEnv, NeverStart, machine_of, result, validate

from knownstate.chaos import cli, kinds, leftovers, memory, tools
from knownstate.chaos.check import PROFILES, EnvironmentFault, SaveOnly
from knownstate.chaos.mutants import Mutant
from knownstate.chaos.report import knownstate_version
from polling import poll

KNOWNSTATE = [sys.executable, "-m", "knownstate.chaos.cli"]
OUTBOX_MUTANTS = [m.name for m in kinds.mutants("outbox")]


# ---------------------------------------------------------------------------------------
# Fast: main() in this process, nothing real started.
# ---------------------------------------------------------------------------------------


@pytest.fixture
def gate(monkeypatch, tmp_path):
    """Run ``main(argv)`` against an engine double answering ``answer(kind, mutant, seed,
    state)``; returns (exit code, stdout, stderr, engine)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CI", "true")
    monkeypatch.setattr(cli, "Env", FakeEnv)
    monkeypatch.setattr(cli, "_machine", machine_of)

    def run(argv: list[str], answer=lambda kind, mutant, seed, state: result(kind, seed)):
        engine = Engine(answer)
        monkeypatch.setattr(cli, "run_check", engine)
        code = cli.main(argv)
        return code, engine

    return run


def _json(path) -> dict:
    doc = json.loads(Path(path).read_text())
    validate(doc)
    return doc


@pytest.mark.parametrize(
    "flag,path,problem",
    [
        ("--json", "missing-dir/r.json", "directory missing-dir does not exist"),
        ("--junit", ".", "is a directory"),
        ("--json", "r.json --junit r.json", "same file"),
        ("--example-db", "no/such/dir", "directory no/such does not exist"),
        ("--shard", "3/2", "give I/N"),
        ("--seeds", "0", "--seeds must be at least 1"),
        ("--jobs", "0", "--jobs must be at least 1"),
        ("--jobs", "2 --shard 1/2", "give --jobs or --shard"),
    ],
)
def test_a_bad_command_line_is_exit_2_with_one_line_before_anything_starts(
    monkeypatch, tmp_path, capsys, flag, path, problem
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "Env", NeverStart)
    args = ["verify", "outbox", "--seed", "1", flag, *shlex.split(path)]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and problem in err, err
    assert list(tmp_path.iterdir()) == [], "nothing may be created by a refused command line"


def test_shard_needs_a_seed_so_every_shard_runs_the_same_work(monkeypatch, capsys):
    monkeypatch.setattr(cli, "Env", NeverStart)
    assert cli.main(["verify", "--shard", "1/2", "--no-example-db"]) == 2
    assert "--shard needs --seed" in capsys.readouterr().err


def test_version_and_help_list_exit_codes_and_profiles(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert (
        e.value.code == 0
        and capsys.readouterr().out.strip() == f"knownstate {knownstate_version()}"
    )
    for argv in (["--help"], ["verify", "--help"], ["mutants", "--help"]):
        with pytest.raises(SystemExit):
            cli.main(argv)
        out = capsys.readouterr().out
        for code in ("0", "1", "2", "3", "130", "143"):
            assert re.search(rf"^  {code} +\S", out, re.M), (argv, code)
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    for name, profile in PROFILES.items():
        assert f"{name} {' '.join(profile.description.split())}" in out


def test_verify_seeds_prints_per_kind_passes_vacuous_and_failed_with_their_seeds(gate, capsys):
    def answer(kind, mutant, seed, state):
        if kind == "approved-plan" and seed == 11:
            return result(kind, seed, vacuous=("event 'reap'",))
        if kind == "approved-plan" and seed == 12:
            return result(kind, seed, failure="boom", invariants=("claim",))
        return result(kind, seed)

    code, engine = gate(
        ["verify", "outbox", "approved-plan", "--seed", "10", "--seeds", "3", "--json", "r.json"],
        answer,
    )
    out = capsys.readouterr().out
    assert code == 1
    assert sorted((c.kind, c.seed) for c in engine.calls) == sorted(
        (k, s) for k in ("outbox", "approved-plan") for s in (10, 11, 12)
    )
    rows = {
        line.split()[0]: line
        for line in out.splitlines()
        if line.startswith("  ") and line.split()[0] in ("outbox", "approved-plan")
    }
    assert rows["outbox"].split()[1:5] == ["3", "0", "0", "0"]
    assert rows["approved-plan"].split()[1:5] == ["1", "1", "1", "0"]
    assert "vacuous at seed 11" in rows["approved-plan"]
    assert "failed at seed 12" in rows["approved-plan"]
    doc = _json("r.json")
    assert doc["seeds"] == [10, 11, 12] and doc["outcome"] == "failed"


def test_summary_says_why_each_run_stopped_and_what_this_database_cannot_cover(gate, capsys):
    code, _ = gate(
        ["verify", "outbox", "--seed", "4"],
        lambda k, m, s, st: result(
            k, s, not_covered=("event 'db crash'",), stopped="the profile's 3000 examples ran"
        ),
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "  stopped: the profile's 3000 examples ran" in out
    assert "  not covered on this database: event 'db crash'" in out


def test_a_failure_prints_a_replay_command_that_parses_back_to_the_same_run(gate, capsys):
    code, _ = gate(
        ["verify", "outbox", "--seed", "8", "--steps", "20", "--profile", "deep"],
        lambda k, m, s, st: result(
            k, s, failure="f", invariants=("claim",), batch=6, profile="deep"
        ),
    )
    assert code == 1
    replay = re.search(r"replay: (.*)", capsys.readouterr().out).group(1)
    args = cli.build_parser().parse_args(shlex.split(replay)[1:])
    assert (args.kinds, args.seed, args.profile, args.batch, args.steps, args.examples) == (
        ["outbox"],
        8,
        "deep",
        6,
        20,
        None,
    )


def test_ci_progress_is_a_plain_line_naming_what_is_left_to_observe(gate, capsys):
    gate(["verify", "outbox", "branch-reset", "--seed", "2"])
    err = capsys.readouterr().err
    for kind in ("outbox", "branch-reset"):
        line = next(x for x in err.splitlines() if x.startswith(f"  {kind} seed 2:"))
        assert re.search(
            r"\d+ examples, \d+ steps, \d+ faults, \d+ requirements still to "
            "observe",
            line,
        ), line
    assert "\r" not in err and "\033" not in err


def _caught(kind, mutant, seed, state, at=None):
    declared = {m.name: m.invariant for m in kinds.mutants(kind)}
    if mutant and (at is None or seed in at.get(mutant, (seed,))):
        return result(kind, seed, failure="x", invariants=(declared[mutant],))
    return result(kind, seed)


def test_mutants_seeds_counts_catches_per_mutant_and_a_survivor_is_not_caught(gate, capsys):
    first, second, third = OUTBOX_MUTANTS[:3]

    def answer(kind, mutant, seed, state):
        if mutant == second and seed == 21:
            return result(kind, seed)  # survives this seed
        if mutant == third:  # fails, naming an invariant the mutant does not declare
            return result(kind, seed, failure="x", invariants=("not-the-declared-one",))
        return _caught(kind, mutant, seed, state)

    code, engine = gate(
        [
            "mutants",
            "outbox",
            "--seed",
            "20",
            "--seeds",
            "2",
            "--mutant",
            first,
            "--mutant",
            second,
            "--mutant",
            third,
            "--junit",
            "m.xml",
        ],
        answer,
    )
    out = capsys.readouterr().out
    assert code == 1
    assert all(c.database is None for c in engine.calls), "mutants measure seeds, no memory"
    rows = {
        line.split()[1]: line
        for line in out.splitlines()
        if line.startswith("  outbox ") and len(line.split()) > 3
    }
    assert " 2/2 " in rows[first] and "NOT CAUGHT" not in rows[first]
    assert "NOT CAUGHT 1/2" in rows[second] and "missed at seed 21" in rows[second]
    assert "NOT CAUGHT 0/2" in rows[third]
    assert "passes 2/2" in rows["(reference)"]
    verdict = out.strip().splitlines()[-2]
    assert verdict.startswith("knownstate mutants: FAILED") and "PASSED" not in out
    assert f"NOT CAUGHT: {second}, {third}" in verdict
    failures = [f.get("type") for f in ET.parse("m.xml").iter("failure")]
    assert failures == ["not-caught"] * 3


def test_mutants_pass_only_when_every_mutant_is_caught_at_every_seed(gate, capsys):
    code, _ = gate(["mutants", "outbox", "--seed", "3", "--seeds", "2"], _caught)
    out = capsys.readouterr().out
    assert code == 0 and "NOT CAUGHT" not in out
    assert f"knownstate mutants: PASSED — {len(OUTBOX_MUTANTS)}/{len(OUTBOX_MUTANTS)}" in out


IDLE = "its edit (pattern 'x') matched no statement the library sent for claim and nothing"


def _idle(kind, mutant, seed, state):
    """A mutant whose edit changed nothing in its run (it ran as the reference did)."""
    return replace(result(kind, seed), not_applied=IDLE if mutant else "")


@pytest.mark.parametrize(
    "caught,code,word", [(True, 0, "CAUGHT"), (False, 1, "NOT CAUGHT"), (None, 1, "NOT APPLICABLE")]
)
def test_verify_mutant_says_caught_or_not_caught(gate, capsys, caught, code, word):
    """Or NOT APPLICABLE, a mutant whose edit changed nothing: neither caught nor missed."""
    name = OUTBOX_MUTANTS[0]
    got, _ = gate(
        ["verify", "outbox", "--mutant", name, "--seed", "5", "--json", "r.json"],
        _idle if caught is None else lambda k, m, s, st: _caught(k, m if caught else None, s, st),
    )
    out = capsys.readouterr().out
    assert got == code
    assert out.strip().splitlines()[-2].startswith(f"knownstate verify: {word} — mutant {name}")
    assert "PASSED" not in out
    assert _json("r.json")["runs"][0]["caught"] is caught


def test_a_mutant_whose_edit_changed_nothing_is_not_applicable_in_every_report(gate, capsys):
    """Exit 1, as a catalogue that does not fit the code: never NOT CAUGHT, and never passed."""
    name = OUTBOX_MUTANTS[0]
    argv = ["mutants", "outbox", "--mutant", name, "--seed", "3", "--json", "r.json"]
    code, _ = gate([*argv, "--junit", "m.xml"], _idle)
    out = capsys.readouterr().out
    assert code == 1 and "NOT CAUGHT" not in out
    assert f"  outbox {name} seed 3: NOT APPLICABLE (1.5 s)\n    NOT APPLICABLE: {IDLE}: " in out
    table = ["outbox", name, "lease-fence", "NOT", "APPLICABLE"]
    [row] = [line for line in out.splitlines() if line.split()[:5] == table]
    assert row.endswith(f"   not applicable at seed 3: {IDLE}")
    verdict = out.strip().splitlines()[-2]
    assert verdict.startswith("knownstate mutants: FAILED — 0/1 mutants caught at every seed")
    assert f"; NOT APPLICABLE: {name}, " in verdict
    run = _json("r.json")["runs"][1]
    assert (run["status"], run["caught"], run["not_applicable"]) == ("not applicable", None, IDLE)
    failures = [f.get("type") for f in ET.parse("m.xml").iter("failure")]
    assert failures == ["not-applicable"]


def test_verify_refuses_two_mutants_and_names_the_command_that_runs_both(gate, capsys):
    """It took the last one only, silently."""
    a, b = OUTBOX_MUTANTS[:2]
    code, engine = gate(["verify", "outbox", "--mutant", a, "--mutant", b, "--seed", "5"])
    err = capsys.readouterr().err
    assert code == 2 and not engine.calls
    assert f"run knownstate mutants outbox --mutant {a} --mutant {b}" in err


def test_mutants_refuses_a_catalogue_with_problems(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "Env", NeverStart)
    bogus = Mutant("typo", "outbox", "retry-politeness", "declares no real invariant", lambda c: c)
    real = kinds.mutants
    monkeypatch.setattr(kinds, "mutants", lambda k: [*real(k), bogus])
    assert cli.main(["mutants", "outbox", "--seed", "1", "--json", "r.json"]) == 1
    captured = capsys.readouterr()
    assert "retry-politeness" in captured.err and "REFUSED" in captured.out
    doc = _json("r.json")
    assert doc["outcome"] == "failed" and "catalogue" in doc["message"]
    assert {r["status"] for r in doc["runs"]} == {"not run"}


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_writes_both_reports_with_what_finished(gate, capsys, sig, code):
    def answer(kind, mutant, seed, state):
        if kind == "approved-plan":
            state.stats.examples = 7
            signal.raise_signal(sig)
            raise AssertionError("the signal did not stop the run")
        return result(kind, seed)

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    got, _ = gate(
        [
            "verify",
            "outbox",
            "approved-plan",
            "branch-reset",
            "--seed",
            "1",
            "--json",
            "r.json",
            "--junit",
            "r.xml",
        ],
        answer,
    )
    assert got == code
    assert {s: signal.getsignal(s) for s in before} == before, "handlers must be restored"
    assert f"interrupted by {sig.name} during approved-plan seed 1" in capsys.readouterr().err
    doc = _json("r.json")
    assert [(r["kind"], r["status"]) for r in doc["runs"]] == [
        ("outbox", "passed"),
        ("approved-plan", "interrupted"),
        ("branch-reset", "not run"),
    ]
    assert doc["runs"][1]["examples"] == 7 and doc["signal"] == sig.name
    root = ET.parse("r.xml").getroot()
    assert (root.get("errors"), root.get("skipped"), root.get("failures")) == ("1", "1", "0")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the drop itself
def test_a_signal_whose_interrupt_python_dropped_stops_the_next_step(gate, capsys):
    """A handler's raise inside a destructor or a fork hook is printed and dropped by Python;
    the run must stop at its next step all the same, not run on to its end."""

    class Swallows:
        def __del__(self):
            signal.raise_signal(signal.SIGTERM)

    def answer(kind, mutant, seed, state):
        if kind == "approved-plan":
            Swallows()
            tools.raise_if_interrupted()  # what every step of a check does first
            raise AssertionError("the dropped interrupt did not stop the run")
        return result(kind, seed)

    got, _ = gate(["verify", "outbox", "approved-plan", "--seed", "1", "--json", "r.json"], answer)
    assert got == 143
    assert "interrupted by SIGTERM during approved-plan seed 1" in capsys.readouterr().err
    assert [r["status"] for r in _json("r.json")["runs"]] == ["passed", "interrupted"]


def test_a_signal_during_a_fork_is_held_and_delivered_after_it():
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGTERM, tools.on_signal)
    tools.reset_interrupt()
    try:
        with pytest.raises(tools.Interrupted) as stopped:
            with tools.deferred_signals():
                signal.raise_signal(signal.SIGTERM)
                held = True  # not interrupted inside the block
        assert held and stopped.value.signal == "SIGTERM"
        tools.interrupt_caught()
        signal.raise_signal(signal.SIGTERM)  # once caught, later signals wait for the reports
    finally:
        tools.reset_interrupt()
        for s, handler in before.items():
            signal.signal(s, handler)


def test_an_environment_fault_is_exit_3_with_reports_of_what_finished(gate, capsys):
    def answer(kind, mutant, seed, state):
        if kind == "approved-plan":
            raise EnvironmentFault("toxiproxy-server died, and not by the harness")
        return result(kind, seed, failure="a real bug", invariants=("claim",))

    code, _ = gate(
        [
            "verify",
            "outbox",
            "approved-plan",
            "--seed",
            "1",
            "--json",
            "r.json",
            "--junit",
            "r.xml",
        ],
        answer,
    )
    assert code == 3
    assert "toxiproxy-server died" in capsys.readouterr().err
    doc = _json("r.json")
    assert doc["outcome"] == "environment" and "toxiproxy" in doc["message"]
    assert [r["status"] for r in doc["runs"]] == ["failed", "environment"]
    assert ET.parse("r.xml").getroot().get("failures") == "1"


@pytest.mark.parametrize("command", [["verify", "--no-example-db"], ["mutants", "outbox"]])
def test_shards_together_run_exactly_the_work_of_one_run(command):
    parser = cli.build_parser()

    def plan_of(extra):
        args = parser.parse_args([*command, "--seed", "3", "--seeds", "3", *extra])
        args.argv = []
        return cli.plan(args, command[0])

    def key(u):
        return (u.index, u.kind, u.seed, u.mutant.name if u.mutant else None)

    whole = [key(u) for u in plan_of([]).units]
    for n in (1, 2, 3, 5, len(whole) + 2):
        parts = [[key(u) for u in plan_of(["--shard", f"{i}/{n}"]).units] for i in range(1, n + 1)]
        joined = sorted(k for part in parts for k in part)
        assert joined == sorted(whole), f"{n} shards"  # no run lost, none run twice
        assert max(map(len, parts)) - min(map(len, parts)) <= 1, "shards are balanced"


def test_report_merge_of_the_shards_is_the_report_of_the_whole_run(gate, capsys):
    def answer(kind, mutant, seed, state):
        return (
            result(kind, seed, failure="f", invariants=("claim",))
            if seed == 4
            else result(kind, seed)
        )

    common = ["verify", "--seed", "3", "--seeds", "2"]
    whole_code, _ = gate([*common, "--json", "whole.json"], answer)
    for i in (1, 2, 3):
        gate([*common, "--shard", f"{i}/3", "--json", f"s{i}.json"], answer)
    capsys.readouterr()
    merged = cli.main(
        ["report", "merge", "s3.json", "s1.json", "s2.json", "--json", "m.json", "--junit", "m.xml"]
    )
    whole, doc = _json("whole.json"), _json("m.json")
    assert merged == whole_code == 1
    assert doc["runs"] == whole["runs"] and doc["counts"] == whole["counts"]
    assert len(list(ET.parse("m.xml").iter("testcase"))) == len(whole["runs"])
    assert cli.main(["report", "merge", "s1.json", "s2.json"]) == 2
    assert "shard 3/3 missing" in capsys.readouterr().err


def test_the_example_database_is_keyed_by_kind_and_mutant_and_git_ignored(gate, tmp_path):
    _, engine = gate(["verify", "outbox", "--seed", "1"])
    [call] = engine.calls
    assert call.database_key == "knownstate:outbox" and call.database is not None
    assert (tmp_path / ".knownstate" / ".gitignore").read_text().splitlines()[-1] == "*"
    _, engine = gate(["verify", "outbox", "--seed", "1", "--mutant", OUTBOX_MUTANTS[0]])
    assert engine.calls[0].database_key == f"knownstate:outbox:mutant:{OUTBOX_MUTANTS[0]}"
    _, engine = gate(["verify", "outbox", "--seed", "1", "--no-example-db"])
    assert engine.calls[0].database is None


def test_one_seed_replays_stored_failures_and_several_seeds_only_keep_new_ones(tmp_path):
    mem = memory.Memory(str(tmp_path / "db"))
    keeping = mem.database(replay=False)
    keeping.save(b"k", b"failing example")
    assert list(keeping.fetch(b"k")) == [] and keeping.stored == 0
    replaying = mem.database(replay=True)
    assert list(replaying.fetch(b"k")) == [b"failing example"] and replaying.stored == 1
    assert list(replaying.fetch(b"k.secondary")) == [] and replaying.stored == 1
    assert isinstance(keeping.inner, SaveOnly)


# ---------------------------------------------------------------------------------------
# Slow: `knownstate` in its own process, with its own real parts.
# ---------------------------------------------------------------------------------------


def run(*args: str, cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "CI": "true"}
    env.pop("DATABASE_URL", None)
    return subprocess.run(
        [*KNOWNSTATE, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd
    )


def descendants(pid: int) -> list[int]:
    from knownstate.chaos.cluster import _descendants

    return _descendants(pid)


def _argv(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def exe(pid: int) -> str:
    return (_argv(pid) or [""])[0]


def reports(tmp_path: Path) -> tuple[dict, ET.Element]:
    return _json(tmp_path / "r.json"), ET.parse(tmp_path / "r.xml").getroot()


REPORTS = ("--json", "r.json", "--junit", "r.xml")


@pytest.mark.slow
def test_unknown_kind_is_a_usage_error_naming_the_kinds(tmp_path):
    r = run("verify", "no-such-kind", cwd=tmp_path)
    assert r.returncode == 2
    assert "unknown kind no-such-kind" in r.stderr and "outbox" in r.stderr


@pytest.mark.slow
def test_verify_outbox_passes_and_writes_both_reports(tmp_path):
    # seed 18 reaches coverage in 161 examples (seed 12, used before, in 863)
    r = run("verify", "outbox", "--seed", "18", *REPORTS, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "outbox: passed" in out and "seed 18" in out
    for line in (
        "faults injected:",
        "events observed:",
        "transitions observed:",
        "invariants checked:",
        "stopped: every requirement observed",
    ):
        assert line in out
    doc, xml = reports(tmp_path)
    assert (doc["outcome"], doc["exit_code"], doc["seed"]) == ("passed", 0, 18)
    kind = doc["runs"][0]
    assert kind["vacuous"] == [] and kind["events"]["fence rejection"] > 0
    assert kind["faults"]["db-crash"] > 0
    assert xml.get("failures") == "0" and xml.get("tests") == "1"


@pytest.mark.slow
def test_a_tiny_run_is_vacuous_and_reported_so(tmp_path):
    r = run(
        "verify", "outbox", "--seed", "1", "--examples", "2", "--steps", "5", *REPORTS, cwd=tmp_path
    )
    assert r.returncode == 1 and "outbox: VACUOUS" in r.stdout, r.stdout + r.stderr
    doc, xml = reports(tmp_path)
    assert doc["outcome"] == "vacuous" and doc["runs"][0]["vacuous"]
    assert [f.get("type") for f in xml.iter("failure")] == ["vacuous"]


def _trace(out: str) -> str:
    """The counterexample a run printed (not how long finding and shrinking it took)."""
    return out[out.index("counterexample (") : out.index("  found after")]


@pytest.mark.slow
def test_a_caught_mutant_shrinks_replays_and_is_replayed_first_from_the_example_database(tmp_path):
    args = (
        "verify",
        "outbox",
        "--mutant",
        "claim-without-bump",
        "--seed",
        "3",
        "--examples",
        "30",
        "--steps",
        "30",
    )
    first = run(*args, "--example-db", "db", *REPORTS, cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "knownstate verify: CAUGHT" in first.stdout and "NOT CAUGHT" not in first.stdout
    m = re.search(r"counterexample \((\d+) steps", first.stdout)
    assert m and int(m.group(1)) <= 15, first.stdout
    assert (
        "replay: knownstate verify outbox --seed 3 --profile ci --examples 30 --steps 30 "
        "--mutant claim-without-bump --example-db db"
    ) in first.stdout
    doc, _ = reports(tmp_path)
    assert doc["runs"][0]["caught"] and doc["runs"][0]["stored_examples"] == 0

    again = run(*args, "--no-example-db", cwd=tmp_path)
    assert _trace(again.stdout) == _trace(first.stdout), "a seed alone replays its failure"

    later = run(
        "verify",
        "outbox",
        "--mutant",
        "claim-without-bump",
        "--seed",
        "99",
        "--examples",
        "1",
        "--steps",
        "30",
        "--example-db",
        "db",
        *REPORTS,
        cwd=tmp_path,
    )
    assert later.returncode == 0, later.stdout + later.stderr
    assert "replayed first: 1 stored failing example(s)" in later.stdout
    assert _trace(later.stdout) == _trace(first.stdout)
    doc, _ = reports(tmp_path)
    assert doc["runs"][0]["stored_examples"] == 1 and doc["runs"][0]["examples"] <= 3, (
        "the stored failure is the first example run, not found again by searching"
    )


@pytest.mark.slow
def test_a_mutant_a_run_cannot_reach_is_not_caught_and_fails_the_command(tmp_path):
    # One step per example cannot break the lease fence: enqueue, claim, stall, reclaim and
    # complete are needed. The verdict is NOT CAUGHT by construction, whatever the seed.
    tiny = ("--examples", "1", "--steps", "1")
    r = run(
        "mutants",
        "outbox",
        "--mutant",
        "unfenced-complete",
        "--seeds",
        "2",
        "--seed",
        "7",
        *tiny,
        *REPORTS,
        cwd=tmp_path,
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert "NOT CAUGHT 0/2" in r.stdout and "PASSED" not in r.stdout
    doc, xml = reports(tmp_path)
    assert doc["outcome"] == "failed"
    assert [(x["mutant"] or {}).get("name") for x in doc["runs"]] == [
        None,
        None,
        "unfenced-complete",
        "unfenced-complete",
    ]
    assert [f.get("type") for f in xml.iter("failure")] == ["not-caught", "not-caught"]
    one = run(
        "verify",
        "outbox",
        "--mutant",
        "unfenced-complete",
        "--seed",
        "7",
        *tiny,
        "--no-example-db",
        cwd=tmp_path,
    )
    assert one.returncode == 1 and "knownstate verify: NOT CAUGHT" in one.stdout


def _start_verify(tmp_path: Path, *kinds_: str):
    env = {**os.environ, "CI": "true"}
    env.pop("DATABASE_URL", None)
    err = open(tmp_path / "stderr", "w")
    proc = subprocess.Popen(
        [
            *KNOWNSTATE,
            "verify",
            *kinds_,
            "--examples",
            "100000",
            "--steps",
            "20",
            "--seed",
            "1",
            *REPORTS,
        ],
        stdout=subprocess.PIPE,
        stderr=err,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    err.close()
    first = f"  {kinds_[0]} seed 1:"
    poll("the first progress line", lambda: first in (tmp_path / "stderr").read_text(), 120)
    return proc


def _ends_cleanly(proc, tmp_path: Path, expected_code: int, message: str, started=()):
    started = [*started, *descendants(proc.pid)]
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    err = (tmp_path / "stderr").read_text()
    assert proc.returncode == expected_code, out + err
    assert message in err, err
    leftover = [p for p in set(started) if os.path.exists(f"/proc/{p}") and exe(p)]
    assert leftover == [], f"processes left behind: {[exe(p) for p in leftover]}"
    return reports(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_stops_everything_and_writes_both_reports(tmp_path, sig, code):
    proc = _start_verify(tmp_path, "outbox", "document-session")
    proc.send_signal(sig)
    doc, xml = _ends_cleanly(proc, tmp_path, code, f"interrupted by {sig.name}")
    assert (doc["outcome"], doc["signal"]) == ("interrupted", sig.name)
    current, never = doc["runs"]
    assert current["status"] == "interrupted" and current["examples"] >= 1
    assert never["status"] == "not run"
    assert [e.get("type") for e in xml.iter("error")] == ["interrupted"]
    assert [s.get("type") for s in xml.iter("skipped")] == ["not-run"]


@pytest.mark.slow
def test_jobs_run_the_same_runs_side_by_side_into_one_report(tmp_path):
    """--jobs 2: each run in a process of its own with its own servers, and the same runs,
    verdicts, examples and steps as one after another; each run's lines printed together."""
    common = ("verify", "outbox", "branch-reset", "approved-plan", "--seed", "2")
    common += ("--examples", "6", "--no-example-db")
    one = run(*common, "--json", "one.json", cwd=tmp_path)
    two = run(*common, "--jobs", "2", *REPORTS, cwd=tmp_path)
    assert one.returncode == two.returncode == 1, two.stdout + two.stderr  # 6 examples: vacuous
    doc, xml = reports(tmp_path)
    same = ("index", "kind", "seed", "status", "examples", "steps", "faults", "events")
    assert [{k: r[k] for k in same} for r in doc["runs"]] == [
        {k: r[k] for k in same} for r in _json(tmp_path / "one.json")["runs"]
    ]
    assert doc["shard"] is None and "--jobs" in doc["argv"]
    assert len(list(xml.iter("testcase"))) == 3
    assert "2 processes side by side" in two.stdout
    assert len(re.findall(r"shard [12]/2 on throwaway PostgreSQL", two.stdout)) == 2
    lines = two.stdout.splitlines()
    for kind in ("outbox", "branch-reset", "approved-plan"):  # a run's lines are together
        first = next(i for i, line in enumerate(lines) if line.startswith(f"{kind}: VACUOUS"))
        last = next(i for i in range(first, len(lines)) if lines[i].startswith("  (a gate"))
        assert all(line.startswith("  ") for line in lines[first + 1 : last]), two.stdout
    assert two.stdout.strip().splitlines()[-2].startswith("knownstate verify: VACUOUS — 0/3")


@pytest.mark.slow
def test_jobs_stop_every_shard_on_a_signal_and_report_it(tmp_path):
    """Each shard's run in progress is reported interrupted; the run no shard took yet (the
    kind with the fewest requirements is handed out last), not run."""
    proc = _start_verify(tmp_path, "outbox", "branch-reset", "approved-plan", "--jobs", "2")
    err = tmp_path / "stderr"
    poll("both shards run", lambda: "approved-plan seed 1:" in err.read_text(), 120)
    started = descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    doc, xml = _ends_cleanly(proc, tmp_path, 143, "interrupted by SIGTERM", started)
    assert (doc["outcome"], doc["signal"]) == ("interrupted", "SIGTERM")
    assert [(r["kind"], r["status"]) for r in doc["runs"]] == [
        ("outbox", "interrupted"),
        ("branch-reset", "not run"),
        ("approved-plan", "interrupted"),
    ]
    assert [s.get("type") for s in xml.iter("skipped")] == ["not-run"]


@pytest.mark.slow
def test_jobs_shards_end_with_a_parent_killed_outright(tmp_path):
    """SIGKILL of the parent (which can then stop nothing): its shards stop anyway, each with its
    servers, instead of running their endless runs on alone; the folder of their reports is
    removed by the next run's sweep."""
    proc = _start_verify(tmp_path, "outbox", "branch-reset", "--jobs", "2")
    err = tmp_path / "stderr"
    poll("both shards run", lambda: "branch-reset seed 1:" in err.read_text(), 120)
    started = descendants(proc.pid)
    argv = next(a for a in map(_argv, started) if "--part" in a)  # a shard's: its report's path
    folder = Path(argv[len(argv) - argv[::-1].index("--junit")]).parent  # its own, the last
    proc.kill()
    proc.wait()
    left = lambda: [p for p in started if os.path.exists(f"/proc/{p}") and exe(p)]  # noqa: E731
    try:
        poll("nothing the shards started is left running", lambda: not left(), 120)
    finally:  # without the fix the shards run on: stopped here, not left to the machine
        for pid in left():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
    leftovers.sweep()  # as every run does when it starts a cluster
    assert not folder.exists()


@pytest.mark.slow
def test_jobs_a_free_shard_takes_the_next_run_while_another_is_still_busy(tmp_path):
    """--jobs 2 over a run that never ends (the reference, 100,000 examples) and two that end
    soon (two mutants, caught unshrunk): the shard that is free takes both. Dealt round-robin,
    the second mutant (the plan's third run) waited behind the reference forever."""
    env = {**os.environ, "CI": "true"}
    env.pop("DATABASE_URL", None)
    out = tmp_path / "stdout"
    with open(out, "w") as stdout, open(tmp_path / "stderr", "w") as stderr:
        proc = subprocess.Popen(
            [
                *KNOWNSTATE,
                "mutants",
                "branch-reset",
                "--mutant",
                "one-in-flight-missing",
                "--mutant",
                "reaper-ignores-lease",
                "--examples",
                "100000",
                "--shrinks",
                "0",
                "--seed",
                "1",
                "--jobs",
                "2",
                *REPORTS,
            ],
            stdout=stdout,
            stderr=stderr,
            text=True,
            env=env,
            cwd=tmp_path,
        )
    try:
        caught = ("one-in-flight-missing seed 1: CAUGHT", "reaper-ignores-lease seed 1: CAUGHT")
        poll(
            "both mutants caught beside the endless reference",
            lambda: all(line in out.read_text() for line in caught),
            180,
        )
    finally:  # also when the poll fails: SIGTERM stops the shards (SIGKILL would orphan them)
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=120)
        proc.kill()
    assert proc.returncode == 143, out.read_text()
    doc, _ = reports(tmp_path)
    assert [
        (r["mutant"] and r["mutant"]["name"], r["status"], r["caught"]) for r in doc["runs"]
    ] == [
        (None, "interrupted", None),
        ("one-in-flight-missing", "failed", True),
        ("reaper-ignores-lease", "failed", True),
    ]


def _killed_from_outside(tmp_path: Path, part: str, message: str):
    proc = _start_verify(tmp_path, "outbox")
    started = descendants(proc.pid)
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        # The check crashes and restarts PostgreSQL itself: a kill that lands on a postmaster
        # the harness is already replacing is not noticed, so kill the current one until
        # verify ends.
        victims = [p for p in descendants(proc.pid) if exe(p).endswith(part)]
        started += victims
        for victim in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
    doc, xml = _ends_cleanly(proc, tmp_path, 3, message, started)
    assert doc["outcome"] == "environment" and doc["exit_code"] == 3
    assert doc["runs"][0]["status"] == "environment" and doc["runs"][0]["failure"] is None
    assert xml.get("failures") == "0" and xml.get("errors") == "1"


@pytest.mark.slow
def test_toxiproxy_killed_from_outside_is_exit_3_with_reports(tmp_path):
    _killed_from_outside(tmp_path, "toxiproxy-server", "toxiproxy")


@pytest.mark.slow
def test_postgres_killed_from_outside_is_exit_3_with_reports(tmp_path):
    _killed_from_outside(tmp_path, "postgres", "PostgreSQL")


def test_the_readme_states_the_profiles_as_they_are():
    readme = " ".join((Path(__file__).parents[1] / "README.md").read_text().split())
    for name, p in PROFILES.items():
        assert (
            f"every requirement {p.times_each} times, at least {p.min_examples:,} examples, "
            f"at most {p.max_examples:,} per kind"
        ) in readme, name


def test_a_github_artifact_is_replayed_read_only_beside_the_local_database(tmp_path):
    from hypothesis.database import (
        DirectoryBasedExampleDatabase,
        GitHubArtifactDatabase,
        MultiplexedDatabase,
        ReadOnlyDatabase,
    )

    mem = memory.Memory(str(tmp_path / "db"), memory.parse_github("acme/shop"))
    both = mem.database(replay=True).inner
    assert isinstance(both, MultiplexedDatabase)
    local, shared = both._wrapped
    assert isinstance(local, DirectoryBasedExampleDatabase)
    assert isinstance(shared, ReadOnlyDatabase)
    github = shared._wrapped
    assert isinstance(github, GitHubArtifactDatabase)
    assert (github.owner, github.repo, github.artifact_name) == ("acme", "shop", memory.ARTIFACT)
    keeping = mem.database(replay=False).inner
    assert isinstance(keeping, SaveOnly) and isinstance(
        keeping.inner, DirectoryBasedExampleDatabase
    )
    assert memory.parse_github("acme/shop:nightly") == ("acme", "shop", "nightly")
    for bad in ("acme", "/shop", "acme/shop/x"):
        with pytest.raises(ValueError, match="OWNER/REPO"):
            memory.parse_github(bad)


@pytest.mark.parametrize("tty,ci", [(True, None), (True, "true"), (False, None)])
def test_progress_is_a_live_line_on_a_terminal_and_plain_lines_elsewhere(monkeypatch, tty, ci):
    import io

    from gate_fakes import run_state

    class Stream(io.StringIO):
        def isatty(self):
            return tty

    if ci:
        monkeypatch.setenv("CI", ci)
    else:
        monkeypatch.delenv("CI", raising=False)
    stream = Stream()
    report = cli.Report("verify", [], "ci", [1], [], 0)
    state = run_state("outbox", examples=3)
    progress = cli.Progress("outbox seed 1", report, stream)
    progress(state)
    progress.done()
    text = stream.getvalue()
    assert report.state is state, "the run in progress is known to the report"
    assert "outbox seed 1: 3 examples, 21 steps, 3 faults" in text
    if tty and not ci:
        assert text.startswith("\r\033[K") and "\n" not in text
    else:
        assert text.endswith("requirements still to observe\n") or "observe: " in text
        assert "\r" not in text and "\033" not in text
