"""The command line as a user meets it: reports, replay, exit codes, and real parts killed from outside.

Slow: each test starts `knownstate` in its own process with its own throwaway PostgreSQL and
Toxiproxy, as a CI job would.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

KNOWNSTATE = [sys.executable, "-m", "knownstate.chaos.cli"]


def run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "CI": "true"}
    env.pop("DATABASE_URL", None)
    return subprocess.run([*KNOWNSTATE, *args], capture_output=True, text=True, timeout=timeout, env=env)


def descendants(pid: int) -> list[int]:
    from knownstate.chaos.cluster import _descendants

    return _descendants(pid)


def exe(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except OSError:
        return ""


def poll(predicate, deadline_s: float, what: str):
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_unknown_kind_is_a_usage_error_naming_the_kinds():
    r = run("verify", "no-such-kind")
    assert r.returncode == 2
    assert "unknown kind no-such-kind" in r.stderr and "outbox" in r.stderr


def test_verify_outbox_reports_and_writes_junit_and_json(tmp_path):
    r = run("verify", "outbox", "--seed", "12", "--json", str(tmp_path / "r.json"), "--junit", str(tmp_path / "r.xml"))
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "outbox: passed" in out and "seed 12" in out
    for line in ("faults injected:", "events observed:", "transitions observed:", "invariants checked:"):
        assert line in out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["passed"] and report["seed"] == 12
    kind = report["kinds"][0]
    assert kind["vacuous"] == [] and kind["events"]["fence rejection"] > 0 and kind["faults"]["db-crash"] > 0
    assert 'failures="0"' in (tmp_path / "r.xml").read_text()


def test_a_seeded_bug_shrinks_to_a_short_readable_replayable_counterexample():
    args = ("verify", "outbox", "--mutant", "claim-without-bump", "--seed", "3", "--examples", "30", "--steps", "30")
    first = run(*args)
    assert first.returncode == 1, first.stdout + first.stderr
    m = re.search(r"counterexample \((\d+) steps", first.stdout)
    assert m and int(m.group(1)) <= 15, first.stdout
    assert ("replay: knownstate verify outbox --seed 3 --profile ci --examples 30 --steps 30 "
            "--mutant claim-without-bump") in first.stdout
    again = run(*args)
    trace = lambda out: out[out.index("counterexample"):out.index("replay:")]  # noqa: E731
    assert trace(again.stdout) == trace(first.stdout), "the same seed must replay the same counterexample"


def _start_verify():
    env = {**os.environ, "CI": "true"}
    env.pop("DATABASE_URL", None)
    proc = subprocess.Popen([*KNOWNSTATE, "verify", "outbox", "--examples", "100000", "--seed", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    poll(lambda: any(exe(p).endswith("toxiproxy-server") for p in descendants(proc.pid))
         and any(exe(p).endswith("postgres") for p in descendants(proc.pid)), 60, "verify to start its servers")
    return proc


def _ends_cleanly(proc, expected_code: int, message: str):
    started = descendants(proc.pid)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == expected_code, out + err
    assert message in err, err
    leftover = [p for p in started if os.path.exists(f"/proc/{p}") and exe(p)]
    assert leftover == [], f"processes left behind: {[exe(p) for p in leftover]}"


def test_toxiproxy_killed_from_outside_ends_verify_with_a_clear_message():
    proc = _start_verify()
    toxi = next(p for p in descendants(proc.pid) if exe(p).endswith("toxiproxy-server"))
    os.kill(toxi, signal.SIGKILL)
    _ends_cleanly(proc, 3, "toxiproxy")


def test_postgres_killed_from_outside_ends_verify_with_a_clear_message():
    proc = _start_verify()
    postmaster = next(p for p in descendants(proc.pid) if exe(p).endswith("postgres"))
    os.kill(postmaster, signal.SIGKILL)
    _ends_cleanly(proc, 3, "PostgreSQL")


def test_ctrl_c_stops_everything():
    proc = _start_verify()
    proc.send_signal(signal.SIGINT)
    _ends_cleanly(proc, 130, "interrupted")
