"""Running a check: profiles, requirements, batches of examples, shrinking by a count.

A check counts what it *observed* — transitions of the kind's table, lost races, fence
rejections, reaps, indeterminate commits and how they resolved, duplicates — not only what it
injected. A profile runs until every required transition and event was observed a few times
and a minimum number of examples ran (:class:`Profile`); only when its count of examples runs
out first is the run vacuous, naming what is missing. Time never decides a verdict: a run that
outlasts the profile's safety net ends as the environment's failure (the machine was too slow).
Requirements that need what this database cannot do (a crash of a server the harness does not
own) are *not covered on this database*, never vacuous. (Hypothesis's ``target()`` was tried
for steering and left out: its optimisation pass and pareto front took more than half of a
run's time and reached nothing coverage did not.)
Failing examples are kept in an example database and replayed first on later runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, NoReturn

from hypothesis import HealthCheck, Phase, Verbosity, reject, settings
from hypothesis import seed as hyp_seed
from hypothesis.database import ExampleDatabase
from hypothesis.errors import Flaky, Unsatisfiable
from hypothesis.stateful import get_state_machine_test

from . import timings as timing
from .exampledb import GateDatabase, SaveOnly
from .harness import Env, EnvironmentFault, SchemaRefused, Stats, Workspace
from .shrink import SHRINKS, Shrinking, no_local_constants, shrink_budget
from .steps import Failure

if TYPE_CHECKING:
    from .engine import Engine


@dataclass(frozen=True)
class Requirement:
    """Something a run must observe: a transition of the table or an event, and what the
    database must be able to do for it to be reachable at all (``Env.capabilities()``:
    ``time-shift``, ``db-clock``, ``db-crash``)."""

    label: str
    what: str = "event"
    needs: frozenset[str] = frozenset()

    @property
    def key(self) -> str:
        return f"{self.what} {self.label}" if self.what == "transition" else self.label


def needs(label: str, *capabilities: str) -> Requirement:
    """A required event reachable only where the database can do ``capabilities``."""
    return Requirement(label, "event", frozenset(capabilities))


# ---------------------------------------------------------------------------------------
# Profiles: how long a run goes on.
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Profile:
    """A run goes on until every requirement was observed ``times_each`` times and at least
    ``min_examples`` examples ran; when ``max_examples`` ran first it stops, vacuous. Counts
    only: the same seed gives the same verdict on a fast machine and on a loaded one. A run
    still going after ``too_slow_s`` seconds ends as the environment's failure (exit 3: this
    machine was too slow for the profile), never as a verdict."""

    name: str
    min_examples: int
    max_examples: int
    steps: int
    times_each: int
    too_slow_s: float
    description: str


PROFILES = {
    "ci": Profile(
        "ci",
        25,
        1500,
        30,
        3,
        1800.0,
        "until every required transition and event was seen 3 times (25 examples at "
        "least, 1,500 at most per kind)",
    ),
    "deep": Profile(
        "deep",
        1000,
        100000,
        80,
        20,
        14400.0,
        "nightly depth: 1,000 examples at least and every requirement seen 20 "
        "times (100,000 at most per kind)",
    ),
}


# ---------------------------------------------------------------------------------------
# The state of one run of one kind (shared by its examples).
# ---------------------------------------------------------------------------------------


class GoalMet(KeyboardInterrupt):
    """Raised as an example starts once the run's goal is met: ends Hypothesis's batch at once.
    An interrupt is the one exception Hypothesis lets through without recording the example it
    stopped (any other would be recorded as an example that drew nothing, which contradicts the
    examples before it); :func:`_run_check` catches it before anything else could."""


@dataclass
class RunState:
    profile: Profile
    requirements: tuple[Requirement, ...]
    capabilities: frozenset[str]
    fixed_examples: int | None = None  # --examples: exactly this many, no coverage stop
    progress: Callable[["RunState"], None] | None = None
    stats: Stats = field(default_factory=Stats)
    failures: list[tuple[str, tuple[str, ...], list[str]]] = field(default_factory=list)
    last_trace: list[str] = field(default_factory=list)
    all_traces: list[list[str]] | None = None
    started: float = field(default_factory=time.monotonic)
    stopped: str = ""
    batch: int = 0
    allow_save: bool = False
    timings: timing.Timings | None = None  # --timings: where the run's time went
    shrinking: Shrinking = field(default_factory=Shrinking)
    target: str | None = None
    """--invariant: only a failure naming it ends the search and is shrunk; others are passed
    over (each kept in ``stats.shortest`` by the engine, the shortest in ``passed_over``)."""
    passed_over: tuple[str, tuple[str, ...], list[str]] | None = None
    learned: dict = field(default_factory=dict)
    """What a check learns of the implementation across a run's examples, for its coverage
    (never for a draw: a replay must draw the same): e.g. how many statements each of the
    document server's operations ran (:mod:`.kinds.document_blocks`)."""

    def failed(self, message: str, names: tuple[str, ...], trace: list[str]) -> NoReturn:
        """Record a failing example and fail it; once the run has failed, a failure that breaks
        none of the first one's invariants is no failing example of it: shrinking keeps to the
        bug it was given (:meth:`Shrinking.another_bug`). With a ``target``, a failure not
        naming it is passed over: the search goes on, as if the example had not been drawn."""
        if self.target and self.target not in names:
            if self.passed_over is None or _length(trace) < _length(self.passed_over[2]):
                self.passed_over = (message, names, list(trace))
            reject()
        if self.shrinking.another_bug(names):
            reject()
        if self.shrinking.broke is None:
            self.shrinking.broke = frozenset(names)
            self.shrinking.first_failure = time.monotonic() - self.started
        self.failures.append((message, names, list(trace)))
        self.allow_save = True
        raise Failure(message, names)

    def count(self, r: Requirement) -> int:
        if r.what == "transition":
            return sum(
                n for (s, e, t), n in self.stats.transitions.items() if f"{s} -{e}-> {t}" == r.label
            )
        return self.stats.events.get(r.label, 0)

    def reachable(self) -> list[Requirement]:
        return [r for r in self.requirements if r.needs <= self.capabilities]

    def not_covered(self) -> list[Requirement]:
        return [r for r in self.requirements if not r.needs <= self.capabilities]

    def missing(self, times: int = 1) -> list[Requirement]:
        return [r for r in self.reachable() if self.count(r) < times]

    def goal_met(self) -> str | None:
        """Before each example: why the run stops now (None: it goes on)."""
        examples = self.stats.examples
        p = self.profile
        if self.fixed_examples is not None:
            return f"{examples} examples ran, as asked"
        if examples >= p.min_examples and not self.missing(p.times_each):
            return f"every requirement observed {p.times_each}+ times after {examples} examples"
        if examples >= p.max_examples:
            return f"the profile's {p.max_examples} examples ran"
        return None

    def stop_before_example(self) -> None:
        """Before an example is made: a run whose goal is met stops here, not at the end of its
        batch (:class:`GoalMet`). Never while a failure is shrunk, nor with ``--examples``."""
        if self.fixed_examples is None and not self.failures and self.goal_met():
            raise GoalMet()

    def too_slow(self) -> str | None:
        """Between two batches: why this machine is too slow to go on (None: it is not). The
        environment's failure, never a verdict: the verdict is the counts'."""
        seconds, p = time.monotonic() - self.started, self.profile
        if self.fixed_examples is not None or seconds <= p.too_slow_s:
            return None
        return (
            f"this machine was too slow for the profile: {self.stats.examples} examples in "
            f"{seconds:.0f} s, past profile {p.name}'s safety net of {p.too_slow_s:.0f} s, "
            f"{len(self.missing(p.times_each))} requirement(s) still short of "
            f"{p.times_each}: rerun on a less loaded machine, or with --examples N (a count)"
        )


# ---------------------------------------------------------------------------------------
# Running a check.
# ---------------------------------------------------------------------------------------


@dataclass
class CheckResult:
    kind: str
    seed: int
    examples: int
    steps: int
    seconds: float
    stats: Stats
    profile: str = "ci"
    failure: str | None = None
    invariants: tuple[str, ...] = ()
    counterexample: list[str] = field(default_factory=list)
    vacuous: list[str] = field(default_factory=list)
    not_covered: list[str] = field(default_factory=list)
    unavailable: list[str] = field(default_factory=list)
    coverage: dict[str, int] = field(default_factory=dict)
    stopped: str = ""
    batch: int = 0
    timings: dict | None = None
    """With ``timings=True``: seconds per category of work (:mod:`.timings`), reported only."""
    shrinking: dict | None = None
    """A failed run's: time to its first failure, and its shrinking's replays and seconds."""
    not_applied: str = ""
    """A mutant's run in which the mutant found nothing to change: why (``Engine.not_applied``;
    its run was the reference's, so it is neither caught nor missed). "": it applied."""

    @property
    def passed(self) -> bool:
        return self.failure is None and not self.vacuous

    @property
    def status(self) -> str:
        return "passed" if self.passed else ("FAILED" if self.failure else "VACUOUS")

    @property
    def counterexample_steps(self) -> int:
        return sum(1 for line in self.counterexample if not line.startswith("  "))


def build_machine(
    machine: type[Engine], env: Env, seed: int, run: RunState, ws: Workspace
) -> type[Engine]:
    cls = type(machine.__name__, (machine,), {"env": env, "ws": ws, "run": run})
    return hyp_seed(seed)(cls)


BATCH = 20
"""Examples per batch. Hypothesis runs a batch; before each example the run checks its goal (and
stops mid-batch when it is met). Batch ``i`` of seed ``s`` always runs the same examples, so a
failure replays from its batch alone."""


def batch_seed(seed: int, batch: int) -> int:
    if batch == 0:
        return seed
    digest = hashlib.sha256(f"knownstate:{seed}:{batch}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def run_check(
    machine: type[Engine],
    env: Env,
    *,
    seed: int,
    profile: str | Profile = "ci",
    examples: int | None = None,
    steps: int | None = None,
    require_all: bool = True,
    progress: Callable[[RunState], None] | None = None,
    shrinks: int = SHRINKS,
    database: ExampleDatabase | None = None,
    database_key: str | None = None,
    traces: list[list[str]] | None = None,
    start_batch: int = 0,
    timings: bool = False,
    invariant: str | None = None,
) -> CheckResult:
    """Run one kind's check against the real parts. ``examples`` fixes the number of examples
    (one batch, no coverage stop); otherwise the profile directs the run, batch after batch from
    ``start_batch``. Raises EnvironmentFault when a real part dies, carrying what the run had
    done so far in its ``partial`` (a CheckResult; ``stopped`` says why). With ``timings``
    the result says where the run's time went (its ``timings``; never part of a verdict). With
    ``invariant`` the run looks for, and shrinks, a failure naming it (:attr:`RunState.target`);
    when none is found, the shortest other failure passed over is the verdict's, unshrunk."""
    with timing.collecting() if timings else contextlib.nullcontext() as collector:
        return _run_check(
            machine,
            env,
            seed=seed,
            profile=profile,
            examples=examples,
            steps=steps,
            require_all=require_all,
            progress=progress,
            shrinks=shrinks,
            database=database,
            database_key=database_key,
            traces=traces,
            start_batch=start_batch,
            collector=collector,
            invariant=invariant,
        )


def _run_check(
    machine: type[Engine],
    env: Env,
    *,
    seed: int,
    profile: str | Profile,
    examples: int | None,
    steps: int | None,
    require_all: bool,
    progress: Callable[[RunState], None] | None,
    shrinks: int,
    database: ExampleDatabase | None,
    database_key: str | None,
    traces: list[list[str]] | None,
    start_batch: int,
    collector: timing.Timings | None,
    invariant: str | None,
) -> CheckResult:
    prof = PROFILES[profile] if isinstance(profile, str) else profile
    run = RunState(
        prof,
        machine.requirements(),
        env.capabilities(),
        fixed_examples=examples,
        progress=progress,
        all_traces=traces,
        timings=collector,
        target=invariant,
    )
    try:
        ws = env.workspace(machine.kind, machine.schema)
    except SchemaRefused as e:
        return _result(machine, env, seed, run, prof, str(e), (), [])
    failure: str | None = None
    invariants: tuple[str, ...] = ()
    trace: list[str] = []
    run.batch = start_batch
    with no_local_constants(), shrink_budget(shrinks, run), contextlib.closing(ws):
        while True:
            cls = build_machine(machine, env, batch_seed(seed, run.batch), run, ws)
            db = None  # stored examples are replayed in the first batch; all batches save
            if database is not None:
                db = GateDatabase(database if run.batch == start_batch else SaveOnly(database), run)
            conf = settings(
                max_examples=examples or BATCH,
                stateful_step_count=steps or prof.steps,
                deadline=None,
                database=db,
                suppress_health_check=list(HealthCheck),
                verbosity=Verbosity.quiet,
                report_multiple_bugs=False,
                phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink),
            )
            test = get_state_machine_test(cls, settings=conf)
            key = database_key or f"knownstate:{machine.kind}"
            test.hypothesis.inner_test._hypothesis_internal_add_digest = key.encode()
            try:
                test()
            except (GoalMet, Unsatisfiable):  # Unsatisfiable: each example passed over (target)
                pass
            except EnvironmentFault as e:
                raise _interrupted(e, machine, env, seed, run, prof)
            except Exception as e:  # the check failed: the last run is Hypothesis's shrunk replay
                problem = env.health()
                if problem:
                    raise _interrupted(
                        EnvironmentFault(problem), machine, env, seed, run, prof
                    ) from None
                failure, invariants, trace = _failure_of(e, run)
                run.stopped = f"a failure in batch {run.batch}"
                break
            run.stopped = run.goal_met() or ""
            if run.stopped:
                break
            slow = run.too_slow()
            if slow:
                raise _interrupted(EnvironmentFault(slow), machine, env, seed, run, prof)
            run.batch += 1
    problem = env.health()
    if problem:
        raise _interrupted(EnvironmentFault(problem), machine, env, seed, run, prof)
    if failure is None and run.passed_over is not None:
        failure, invariants, trace = run.passed_over
        run.stopped += f"; no failure naming {run.target}: the shortest other one seen, unshrunk"
    result = _result(machine, env, seed, run, prof, failure, invariants, trace)
    if failure is None and require_all:
        result.vacuous = [
            f"{r.what} '{r.label}' (seen {run.count(r)} times)"
            if run.count(r)
            else f"{r.what} '{r.label}'"
            for r in run.missing(1)
        ]
    return result


def _interrupted(
    e: EnvironmentFault, machine: type[Engine], env: Env, seed: int, run: RunState, prof: Profile
) -> EnvironmentFault:
    """``e``, carrying what the run had done when the environment failed (its ``partial``).
    When a part died, the fault names it, whatever symptom raised ``e`` (a refused connection,
    a Toxiproxy call unanswered)."""
    problem = env.health()
    if problem and str(e) != problem:
        e = EnvironmentFault(problem)
    run.stopped = f"the environment failed in batch {run.batch}: {e}"
    if e.partial is None:
        e.partial = _result(machine, env, seed, run, prof, None, (), [])
    return e


def _result(
    machine: type[Engine],
    env: Env,
    seed: int,
    run: RunState,
    prof: Profile,
    failure: str | None,
    invariants: tuple[str, ...],
    trace: list[str],
) -> CheckResult:
    seconds = time.monotonic() - run.started
    return CheckResult(
        kind=machine.kind,
        seed=seed,
        examples=run.stats.examples,
        steps=run.stats.steps,
        seconds=seconds,
        stats=run.stats,
        profile=prof.name,
        failure=failure,
        invariants=invariants,
        counterexample=trace,
        batch=run.batch,
        unavailable=env.unavailable(),
        not_covered=[r.key for r in run.not_covered()],
        coverage={r.key: run.count(r) for r in run.reachable()},
        stopped=run.stopped,
        timings=None if run.timings is None else run.timings.as_dict(seconds, run.stats.steps),
        shrinking=run.shrinking.as_dict() if failure else None,
        not_applied=machine.not_applied(run.stats.events),
    )


def _length(trace: list[str]) -> tuple[int, int]:
    return sum(1 for line in trace if not line.startswith("  ")), len(trace)


def _shortest(run: RunState) -> tuple[str, tuple[str, ...], list[str]]:
    return min(run.failures, key=lambda f: _length(f[2]))


def _failure_of(e: BaseException, run: RunState) -> tuple[str, tuple[str, ...], list[str]]:
    flaky = isinstance(e, Flaky)  # Hypothesis's: a replay did not reproduce exactly
    if isinstance(e, BaseExceptionGroup):
        e = e.exceptions[0]
    if isinstance(e, Failure) and run.failures and run.failures[-1][0] == str(e):
        return run.failures[-1]
    if run.failures:  # shrinking stopped before its end: the shortest failure seen
        message, names, trace = _shortest(run)
        if flaky:
            message += "\n(shrinking stopped: a replay did not reproduce exactly)"
        elif not isinstance(e, Failure):  # not a replay's verdict: an error while replaying
            message += (
                f"\n(shrinking stopped: {_raised(e)} was raised while it replayed; this is the "
                "shortest failure seen before it)"
            )
        return message, names, trace
    if flaky:  # no failure: one example ran differently when Hypothesis ran it again
        return (
            "one example ran differently when run again, before any failure: what the "
            "implementation does depends on something outside the example (rows read back in "
            "the order they sit on disk, a query without ORDER BY; a clock of its own; state "
            "kept between examples); make it deterministic, then rerun the seed. "
            f"({_raised(e)})",
            (),
            list(run.last_trace),
        )
    return _raised(e), (), list(run.last_trace)


def _raised(e: BaseException) -> str:
    tb = traceback.extract_tb(e.__traceback__)
    where = f" at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno}" if tb else ""
    return f"{type(e).__name__}{where}: {e}"
