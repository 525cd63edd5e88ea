"""The worked example, end to end: ``examples/webhook-kind`` installed with pip as the separate
package it is, found through the ``knownstate.kinds`` entry point, checked by the gate.

Its webhook queue (asyncio: psycopg's AsyncConnection and httpx) passes; its deliberately
unfenced variant, named with ``--kind``, is caught on each of five seeds, naming lease-fence,
with a counterexample of at most ten steps and a replay command that finds it again; and the
package's own test suite passes through knownstate's pytest plugin.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "webhook-kind"
UNFENCED = "webhook_kind.unfenced:UnfencedWebhookKind"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> dict[str, str]:
    """The example pip-installed into a folder of its own (the environment's knownstate is
    the one it uses), and the environment that puts it on the path."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(EXAMPLE),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    assert (target / "webhook_kind" / "binding.py").exists()
    return {**os.environ, "PYTHONPATH": str(target), "CI": "1"}


def knownstate(env, *args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "knownstate.chaos.cli", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=1200,
    )


def test_the_installed_kind_is_found_through_its_entry_point_and_passes(site, tmp_path):
    report = tmp_path / "r.json"
    # the CI profile: until every requirement was observed (a count, whatever the load)
    run = knownstate(site, "verify", "webhook", "--seed", "1", "--json", str(report))
    assert run.returncode == 0, run.stdout + run.stderr
    kind = json.loads(report.read_text())["runs"][0]
    assert kind["kind"] == "webhook" and kind["status"] == "passed" and kind["ok"]
    assert kind["events"]["stale complete on a re-claimed run"] >= 3
    assert kind["events"]["skip locked"] >= 3 and kind["events"]["indeterminate commit"] >= 3


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_the_unfenced_variant_is_caught_naming_lease_fence(site, tmp_path, seed):
    run = knownstate(
        site,
        "verify",
        "--kind",
        UNFENCED,
        "--seed",
        str(seed),
        "--examples",
        "300",
        "--no-example-db",
        cwd=tmp_path,
    )
    out = run.stdout
    assert run.returncode == 1, out + run.stderr
    # the fence is named first (caught in a concurrent block, where the stale owner's write
    # races the reaper and the new claim, the failure also names what those two guarantee)
    assert re.search(r"failure: invariant violated: lease-fence[:,] ", out), out
    steps = int(re.search(r"counterexample \((\d+) steps", out).group(1))
    assert steps <= 15, out  # the gate's bound for a shrunk counterexample
    replay = re.search(r"replay: knownstate (verify .*)", out).group(1).split()
    assert replay[1:3] == ["--kind", UNFENCED]
    if seed == 5:  # the printed command finds the kind again, and the same counterexample
        # (at the seed caught soonest: a replay runs the whole search again)
        again = knownstate(site, *replay, cwd=tmp_path)
        assert again.returncode == 1 and f"counterexample ({steps} steps" in again.stdout


def test_the_examples_own_tests_pass_through_the_pytest_plugin(site):
    """Its mutant test, in the package's own pytest run (the reference passing is the entry
    point test's; the same check)."""
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--knownstate-seed",
            "2",
            "-k",
            "catches",
            "tests",
        ],
        cwd=EXAMPLE,
        env=site,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout + run.stderr


# ---------------------------------------------------------------------------------------
# The soak: the same described kind as OS processes under a nemesis.
# ---------------------------------------------------------------------------------------

BINDING = "webhook_kind.binding:WebhookKind"


def test_a_soak_of_the_described_kind_passes(site, tmp_path):
    """``knownstate soak --kind``: the webhook queue's workers, reaper and producer as processes
    running its description's loop through its adapter, under the nemesis; nothing violated."""
    report = tmp_path / "r.json"
    run = knownstate(
        site,
        "soak",
        "--kind",
        BINDING,
        "--seconds",
        "30",
        "--seed",
        "1",
        "--json",
        str(report),
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "webhook: passed" in run.stdout and "every run asked for is terminal" in run.stdout
    soak = json.loads(report.read_text())["soak"]
    assert soak["kind"] == "webhook" and not soak["violations"]
    assert {p["kind"] for p in soak["periods"]} >= {"process-kill", "worker-hold"}
    events = json.loads(report.read_text())["runs"][0]["events"]
    assert events["claim"] > 100 and events["lapsed lease taken back"] > 0, events


@pytest.mark.parametrize("seed", [2, 4])
def test_a_soak_catches_the_unfenced_variant_with_an_attributed_violation(site, tmp_path, seed):
    """The stale owner's write lands on the run another worker claimed again: lease-fence,
    naming the worker, its operation, the attempt it carried, who took the run back and who
    claimed it, and the hold that stopped it."""
    run = knownstate(
        site, "soak", "--kind", UNFENCED, "--seconds", "30", "--seed", str(seed), cwd=tmp_path
    )
    out = run.stdout
    assert run.returncode == 1, out + run.stderr
    found = re.search(r"    (lease-fence: (w\d\.\d) \w+\(\d+\) carried attempt (\d) .*)", out)
    assert found, out
    line = found.group(1)
    assert "landed, but the row was at attempt" in line and "took the run back at" in line
    assert "claimed by w" in line and "[nemesis: " in line, line
    assert f"replay: knownstate soak --kind {UNFENCED} --seconds 30 --seed {seed}" in out
