"""``verify --invariant NAME`` (issue 20): the option reaches the run, its replay command repeats
it, and a name the kind does not declare is refused before any server starts. The search
itself (pass over other failures, shrink the one naming NAME) is in ``tests/test_shrinking.py``.
Fast."""

from __future__ import annotations

import subprocess
import sys

from knownstate.chaos.report import Replay


def test_the_replay_command_repeats_the_invariant_looked_for():
    words = Replay(invariant="lease-fence").command("outbox", 3).split()
    assert words[words.index("--invariant") + 1] == "lease-fence"
    assert "--invariant" not in Replay().command("outbox", 3)


def test_an_invariant_the_kind_does_not_declare_is_refused_naming_its_invariants(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "knownstate.chaos.cli", "verify", "outbox"]
        + ["--invariant", "lease-fense", "--seed", "1"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--invariant lease-fense: kind outbox has no such invariant" in r.stderr
    assert "lease-fence" in r.stderr.split("choose from", 1)[1]
