"""The environment is never a bug, and a bug is never the environment.

- A driver error raised by the client itself (a query missing a parameter, no SQLSTATE, the
  connection alive) is the implementation's: the check fails naming the error. So does an
  implementation that calls such an error a lost connection.
- A server restarted between two runs, or restarting on its own after one of its backends died
  (refusing connections until its recovery ends), is waited for: no fault of the next run.
- A real part that dies without the harness killing it ends the run as the environment's fault
  (``EnvironmentFault``, exit 3) naming the part, whatever Hypothesis was doing: generating (the
  death shows first as a failed observation), replaying or shrinking a failure it found, or
  reporting a Flaky error. The exception carries what the run had done (``partial``).
- Slow: SIGKILL from outside of the postmaster, of Toxiproxy and of a stand-in, ten times each
  at random moments of a ``knownstate verify`` run: exit 3 every time, the message names the
  part, and nothing the run started is left running.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import psycopg
import pytest
from hypothesis.errors import FlakyStrategyDefinition
from polling import poll

from knownstate.chaos.cluster import PostgresCluster
from knownstate.chaos.check import CheckResult, EnvironmentFault, run_check
from knownstate.chaos.harness import Env
from knownstate.chaos.kinds.outbox import OutboxCheck
from knownstate.impl import errors
from knownstate.impl import outbox as impl
from knownstate.model.contract import Won

KNOWNSTATE = [sys.executable, "-m", "knownstate.chaos.cli"]


# ---------------------------------------------------------------------------------------
# A bug is never the environment.
# ---------------------------------------------------------------------------------------


class _MissingParameter(impl.OutboxStore):
    """The reaper's query is called without its parameter: psycopg refuses it before sending."""

    def reclaim_stale(self, conn):
        rows = self._one_tx(conn, "reclaim_stale", self.q["reclaim_stale"], {})
        return Won(tuple(sorted(r[0] for r in rows)))


class _CallsItLost(impl.OutboxStore):
    """The same bug, and an error boundary that calls every driver error a lost connection."""

    def reclaim_stale(self, conn):
        try:
            return _MissingParameter.reclaim_stale(self, conn)
        except errors.ClientError as e:
            raise errors.ConnectionLost(e.detail) from None


@pytest.mark.parametrize("store", [_MissingParameter, _CallsItLost])
def test_a_client_side_driver_error_is_a_failure_naming_it_not_a_lost_connection(
    knownstate_env, store
):
    check = type("BuggyOutbox", (OutboxCheck,), {"store_class": store})
    r = run_check(
        check, knownstate_env, examples=10, steps=10, seed=5, require_all=False, shrinks=3
    )
    assert r.failure is not None, "the bug passed the gate"
    assert "query parameter missing: max_attempts" in r.failure, r.failure
    if store is _MissingParameter:
        assert "the driver refused the implementation's call" in r.failure
    else:
        assert "reported a lost connection" in r.failure and "healthy link" in r.failure
    assert r.failure.startswith("reclaim_stale(w"), r.failure  # the step, named


def test_a_server_restarted_between_two_runs_is_no_fault_of_the_next(
    knownstate_env, knownstate_cluster
):
    """A suite sharing one Env (the plugin's fixture) may restart the server between two runs:
    the connection the Env kept from the first is dead, and the next run starts all the same."""
    if not knownstate_env.can_crash:
        pytest.skip("the harness does not own this database server")
    knownstate_env.admin().execute("select 1")  # a connection kept from a run before
    knownstate_cluster.crash()
    knownstate_cluster.restart()
    ws = knownstate_env.workspace("restarted-between-runs", "create table t (x int)")
    assert knownstate_env.query(f"select count(*) from {ws.name}.t") == [(0,)]


def test_a_server_recovering_from_its_own_restart_is_waited_for_not_a_fault(knownstate_toxiproxy):
    """One backend dies abnormally (here SIGKILL): PostgreSQL ends every session and restarts on
    its own, refusing connections ("the database system is in recovery mode") until it has.
    The check's next connection waits for it, as for a restart between two runs. (Another
    backend, stopped, holds the restart back: the postmaster SIGKILLs it after 5 s.)"""
    with PostgresCluster(faketime=False) as db:
        env = Env(db, knownstate_toxiproxy)
        try:
            env.admin().execute("select 1")
            doomed, stuck = (psycopg.connect(db.dsn(), autocommit=True) for _ in range(2))
            os.kill(stuck.info.backend_pid, signal.SIGSTOP)
            os.kill(doomed.info.backend_pid, signal.SIGKILL)
            poll("the server refuses connections while it restarts", lambda: _refused(db.dsn()))
            ws = env.workspace("after-its-own-restart", "create table t (x int)")
            assert env.query(f"select count(*) from {ws.name}.t") == [(0,)]
            assert db.running and env.health() is None
            doomed.close()
            stuck.close()
        finally:
            env.close()


def _refused(dsn: str) -> bool:
    try:
        psycopg.connect(dsn, connect_timeout=5).close()
        return False
    except psycopg.OperationalError as e:
        return "the database system is in recovery mode" in str(e)


# ---------------------------------------------------------------------------------------
# The environment is never a bug: parts killed inside one run, in this process.
# ---------------------------------------------------------------------------------------


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def _ended_by_the_environment(check: type[OutboxCheck], names: str) -> EnvironmentFault:
    with Env.open() as env:
        with pytest.raises(EnvironmentFault) as info:
            run_check(check, env, examples=30, steps=30, seed=7, require_all=False, shrinks=50)
    e = info.value
    assert names in str(e), str(e)
    assert isinstance(e.partial, CheckResult) and e.partial.examples >= 1
    assert e.partial.kind == "outbox" and "the environment failed" in e.partial.stopped
    return e


class _WrongClaim(impl.OutboxStore):
    """An answer the model never gives: a failure at the first claim, which Hypothesis shrinks."""

    def claim_batch(self, conn, batch):
        return [
            (replace(c, attempt=c.attempt + 1000), p) for c, p in super().claim_batch(conn, batch)
        ]


def test_a_part_killed_while_hypothesis_shrinks_or_replays_ends_the_run_naming_it():
    class KilledWhileShrinking(OutboxCheck):
        store_class = _WrongClaim

        def __init__(self):
            if self.run.failures and "receiver" in self.env.stand_ins:
                _kill(self.env.stand_ins["receiver"].pid)  # the next run after a failure: a replay
            super().__init__()

    _ended_by_the_environment(KilledWhileShrinking, "receiver stand-in")


def test_a_death_seen_first_as_a_failed_observation_ends_the_run_naming_it():
    class KilledWhileGenerating(OutboxCheck):
        def _call_out(self, w, key, answer):
            super()._call_out(w, key, answer)
            if self.run.stats.examples >= 2:
                _kill(self.env.stand_ins["receiver"].pid)  # the next observation reads it

    _ended_by_the_environment(KilledWhileGenerating, "receiver stand-in")


def test_a_death_reported_first_as_a_hypothesis_flaky_error_ends_the_run_naming_it():
    class KilledAndFlaky(OutboxCheck):
        def do(self, w, action):
            if action.op == "reclaim_stale" and self.run.stats.examples >= 2:
                os.kill(self.env.toxiproxy._proc.pid, signal.SIGKILL)
                raise FlakyStrategyDefinition("what Hypothesis says when a replay differs")
            return super().do(w, action)

    _ended_by_the_environment(KilledAndFlaky, "toxiproxy-server")


def test_a_death_seen_first_as_a_refused_connection_ends_the_run_naming_the_part():
    class KilledBeforeConnecting(OutboxCheck):
        def do(self, w, action):
            if action.op == "reclaim_stale" and self.run.stats.examples >= 2:
                os.kill(self.env.toxiproxy._proc.pid, signal.SIGKILL)
                worker = self.workers[w]
                worker.abandon()
                worker.ready()  # a new connection through its link: refused, not naming why
            return super().do(w, action)

    _ended_by_the_environment(KilledBeforeConnecting, "toxiproxy-server")


# ---------------------------------------------------------------------------------------
# Slow: SIGKILL from outside at random moments of `knownstate verify`.
# ---------------------------------------------------------------------------------------

PARTS = {
    # part: (how to recognise its process, what the message names, kinds a run checks)
    "postmaster": (
        lambda cmd: (
            cmd[0].endswith("/postgres")
            and "-D" in cmd
            and any(a.startswith("listen_addresses=") for a in cmd)
        ),
        "PostgreSQL",
        ["outbox", "approved-plan", "branch-reset", "document-session"],
    ),
    "toxiproxy": (
        lambda cmd: cmd[0].endswith("toxiproxy-server"),
        "toxiproxy-server",
        ["outbox", "approved-plan", "branch-reset", "document-session"],
    ),
    "stand-in": (
        lambda cmd: "knownstate.chaos.standin_child" in cmd,
        "stand-in",
        ["outbox", "branch-reset"],
    ),
}


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return [""]


def _started(pid: int) -> str | None:
    """The process's start time (with its pid, an identity that survives pid reuse)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except OSError:
        return None


def _tree(pid: int) -> dict[int, str | None]:
    from knownstate.chaos.cluster import _descendants

    return {p: _started(p) for p in _descendants(pid)}


def _find(root: int, recognise) -> int | None:
    return next((p for p in _tree(root) if recognise(_cmdline(p))), None)


@pytest.mark.slow
@pytest.mark.parametrize("part", sorted(PARTS))
def test_a_real_part_killed_from_outside_ends_verify_with_exit_3_naming_it(part):
    recognise, named, kinds = PARTS[part]
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    for attempt in range(10):
        kind = kinds[attempt % len(kinds)]
        env = {**os.environ, "CI": "true"}
        env.pop("DATABASE_URL", None)
        proc = subprocess.Popen(
            [
                *KNOWNSTATE,
                "verify",
                kind,
                "--examples",
                "100000",
                "--seed",
                str(attempt),
                "--no-example-db",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        where = f"{part} #{attempt} ({kind}, moments drawn from seed {seed})"
        try:
            poll(f"the {part} of {where} starts", lambda: _find(proc.pid, recognise), 180)
            # a random moment, whatever it is the verdict is the same; the first two fall while
            # the run starts its parts and sets up its workspace (a window of a few milliseconds)
            pause = (0.0, rng.uniform(0, 0.3))[attempt] if attempt < 2 else rng.uniform(0, 4)
            time.sleep(pause)
            seen = _tree(proc.pid)
            killed: set[int] = set()
            deadline = time.monotonic() + 180
            while proc.poll() is None and time.monotonic() < deadline:
                victim = _find(proc.pid, recognise)
                if victim is not None and victim not in killed:
                    # A postmaster the harness restarted after its own crash (which a kill that
                    # landed in that instant merges with) is killed again.
                    try:
                        os.kill(victim, signal.SIGKILL)
                        killed.add(victim)
                    except ProcessLookupError:
                        pass
                seen.update(_tree(proc.pid))
                time.sleep(0.02)
            out, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
            proc.wait()
        assert killed, f"{where}: the {part} was never seen"
        assert proc.returncode == 3, f"{where}, {pause:.2f}s in: exit {proc.returncode}\n{out}{err}"
        assert named in err, err
        assert "Traceback" not in err and "counterexample" not in out, out + err
        poll(
            f"nothing of {where} is left running",
            lambda: not [p for p, t in seen.items() if t is not None and _started(p) == t],
            30,
        )
