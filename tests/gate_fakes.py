"""Stand-ins for the engine in the fast report and CLI tests: real ``CheckResult`` and
``RunState`` objects with chosen outcomes, an ``Env`` that starts nothing, and an engine that
answers ``run_check`` from a table. What they exercise is the real report and CLI code."""

from __future__ import annotations

import contextlib
import json
from types import SimpleNamespace

import jsonschema_rs

from knownstate.chaos import kinds
from knownstate.chaos.check import PROFILES, CheckResult, RunState, Stats
from knownstate.chaos.report import schema

COUNTEREXAMPLE = [
    "enqueue(w0, id=1) -> Won(value=1)",
    "claim(w0, batch=3) -> Won(value=(Claim(id=1, attempt=0),))",
    "  (observed: the indeterminate step committed)",
]


def validate(doc: dict) -> None:
    """Raise unless ``doc`` is a report as the shipped JSON Schema describes it."""
    jsonschema_rs.validate(schema(), json.loads(json.dumps(doc)))


def stats(examples: int = 5, steps: int = 40) -> Stats:
    s = Stats(examples=examples, steps=steps, invariants_checked=steps * 9)
    s.faults.update({"db-crash": 2, "link-down": 1})
    s.events.update({"lost race": 3, "fence rejection": 1})
    s.transitions[("pending", "claim", "processing")] += 4
    return s


def result(
    kind: str = "outbox",
    seed: int = 1,
    *,
    failure: str | None = None,
    invariants: tuple[str, ...] = (),
    vacuous: tuple[str, ...] = (),
    not_covered: tuple[str, ...] = (),
    batch: int = 0,
    examples: int = 5,
    profile: str = "ci",
    stopped: str | None = None,
) -> CheckResult:
    return CheckResult(
        kind=kind,
        seed=seed,
        examples=examples,
        steps=examples * 8,
        seconds=1.5,
        stats=stats(examples, examples * 8),
        profile=profile,
        failure=failure,
        invariants=invariants,
        counterexample=list(COUNTEREXAMPLE) if failure else [],
        vacuous=list(vacuous),
        not_covered=list(not_covered),
        coverage={"event lost race": 3},
        batch=batch,
        shrinking=(
            {
                "first_failure_seconds": 0.4,
                "replays": 57,
                "steps_before": 14,
                "steps_after": 4,
                "seconds": 1.1,
            }
            if failure
            else None
        ),
        stopped=stopped
        or (
            f"a failure in batch {batch}"
            if failure
            else "every requirement observed 3+ times after 25 examples"
        ),
    )


def run_state(kind: str = "outbox", examples: int = 3) -> RunState:
    state = RunState(
        PROFILES["ci"], kinds.check(kind).requirements(), frozenset({"db-clock", "db-crash"})
    )
    state.stats = stats(examples, examples * 7)
    return state


class FakeEnv:
    """``Env`` without real parts; counts how often it was opened."""

    opened = 0

    def __init__(self):
        self.db = SimpleNamespace(describe=lambda: "fake PostgreSQL")
        self.toxiproxy = SimpleNamespace(url="http://fake-toxiproxy")

    def capabilities(self) -> frozenset[str]:
        return frozenset({"db-clock", "db-crash", "time-shift", "concurrency"})

    def stop_stand_ins(self) -> None:
        """Between two kinds: it started none."""

    @classmethod
    @contextlib.contextmanager
    def open(cls, dsn=None):
        cls.opened += 1
        yield cls()


class NeverStart:
    """``Env`` for tests in which nothing may start."""

    @classmethod
    def open(cls, dsn=None):
        raise AssertionError("real parts were started although the command line was refused")


class Engine:
    """Answers ``run_check`` with ``answer(kind, mutant_name, seed, state)`` — a CheckResult,
    or an exception to raise — after reporting progress once, as the engine does."""

    def __init__(self, answer):
        self.answer, self.calls = answer, []

    def __call__(self, machine, env, *, seed, progress=None, **kwargs):
        self.calls.append(
            SimpleNamespace(kind=machine.kind, mutant=machine.mutant, seed=seed, **kwargs)
        )
        state = run_state(machine.kind)
        if progress is not None:
            progress(state)
        return self.answer(machine.kind, machine.mutant, seed, state)


def machine_of(unit):
    """Stands in for ``cli._machine``: the engine double only needs the kind and the mutant."""
    return SimpleNamespace(kind=unit.kind, mutant=unit.mutant.name if unit.mutant else None)
