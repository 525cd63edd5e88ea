"""Race mutants: bugs that only overlapping transactions reveal, and the blocks that catch them.

Theory of operation
-------------------

Every mutant here is correct when its operations run one after another. Each is a
read-then-write race: a value read in one statement and trusted in a later one, while another
transaction changes it in between. The sequential check runs every operation to its end before
the next starts, so between the read and the write nothing else ever happens and it passes them
all. A concurrent block (:mod:`knownstate.chaos.interleave`) starts two or three operations
together and lets a drawn schedule put another worker's statements between the read and the
write; the linearizability checker (:mod:`knownstate.chaos.linearize`) then finds that no order
of the operations explains their outcomes and rows.

A *scenario* is such a block: a few setup operations run one after another (on the model and on
the database, outcomes compared), an optional database clock jump, then the operations started
together, and the rows read back afterwards. :func:`run_example` runs one schedule of it;
:func:`hunt` lets Hypothesis draw schedules (seeded, shrunk) until the checker refuses one, and
:func:`sequential_schedules` runs the schedules the sequential mode has: each operation to its
end, in every order of the workers. A mutant is an implementation variant: a store class (and,
when the bug lies in the schema, a schema); it joins its kind's catalogue for the engine's
concurrent blocks (:meth:`~knownstate.chaos.races.RaceMutant.mutant`).

Each kind declares its race mutants, with their scenarios and variants, beside its other
mutants (``RACES``, :mod:`.races`); this module gathers them from the registry
(:data:`RACE_MUTANTS`) and runs scenarios on real parts.

``python -m knownstate.chaos.race_mutants`` starts its own PostgreSQL and Toxiproxy and prints,
for every mutant and seed, whether it was caught, in how many seconds, and the length of the
shrunk schedule.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable, Sequence

import psycopg
from hypothesis import HealthCheck, Phase, given, seed as hyp_seed, settings, strategies as st


from . import linearize
from .interleave import BlockResult, Op, ScheduledCalls, ScheduledConnection, Scheduler, history
from .races import QUANTUM, REFERENCE, RaceMutant, Scenario, Variant
from .races import Call as Call  # re-exported: a scenario's operations

CLOCK_BASE = -86_400
"""Each example starts with the fake database clock a day behind real time and jumps from
there: under libfaketime a server clock *ahead* of real time delays its lock-wait timers (see
:mod:`knownstate.chaos.interleave`), so the offset must stay at or below zero."""


def _declared() -> tuple[RaceMutant, ...]:
    """The built-in kinds' race mutants (each check module's ``RACES``), in the kinds' order."""
    from .kinds import built_in

    return tuple(r for e in built_in().values() for r in getattr(e.loaded, "RACES", ()))


RACE_MUTANTS: tuple[RaceMutant, ...] = _declared()
SCENARIOS: dict[str, Scenario] = {rm.scenario.name: rm.scenario for rm in RACE_MUTANTS}


def race_mutant(name: str) -> RaceMutant:
    for rm in RACE_MUTANTS:
        if rm.name == name:
            return rm
    raise KeyError(f"no race mutant {name!r}; there are {[rm.name for rm in RACE_MUTANTS]}")


# ---------------------------------------------------------------------------------------
# Running a scenario on real parts.
# ---------------------------------------------------------------------------------------


class SetupFailed(AssertionError):
    """A scenario's sequential setup did not answer as the model does."""


class Rig:
    """The real parts a scenario runs on: a PostgreSQL server (``db``: ``dsn(dbname, host,
    port)`` and ``clock``), a Toxiproxy client (one link per worker), a scheduler. Databases
    are created per schema and dropped by :meth:`close`."""

    def __init__(self, db: Any, toxiproxy: Any, prefix: str = "ksrace"):
        self.db, self.api, self.prefix = db, toxiproxy, prefix
        self.scheduler = Scheduler(db.dsn(), pause=bool(getattr(db, "owns_server", False)))
        self._dbs: dict[str, str] = {}
        self._admin: dict[str, psycopg.Connection] = {}
        self._workers: dict[tuple[str, str], ScheduledConnection] = {}
        self._serial = itertools.count(1)
        self._stand_ins: dict[type, Any] = {}

    def stand_in(self, cls: type) -> Any:
        """The rig's running instance of stand-in ``cls`` (started on first use)."""
        if cls not in self._stand_ins:
            self._stand_ins[cls] = cls().start()
        return self._stand_ins[cls]

    def database(self, schema: str) -> str:
        if schema not in self._dbs:
            name = f"{self.prefix}_{len(self._dbs)}"
            with psycopg.connect(self.db.dsn(), autocommit=True) as admin:
                admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
                admin.execute(f"CREATE DATABASE {name}")
            with psycopg.connect(self.db.dsn(name), autocommit=True) as conn:
                conn.execute(schema)
            self._dbs[schema] = name
        return self._dbs[schema]

    def admin(self, dbname: str) -> psycopg.Connection:
        conn = self._admin.get(dbname)
        if conn is None or conn.closed or conn.broken:
            conn = self._admin[dbname] = psycopg.connect(
                self.db.dsn(dbname), autocommit=True, application_name="knownstate-observer"
            )
        return conn

    def worker(self, dbname: str, name: str) -> ScheduledConnection:
        """``name``'s connection to ``dbname``, through its own Toxiproxy link."""
        conn = self._workers.get((dbname, name))
        if conn is None or conn.closed or conn.broken:
            link = self.api.link(f"{self.prefix}-{name}-pg", self.db.host, self.db.port)
            conn = ScheduledConnection.connect(
                self.db.dsn(dbname, host=link.host, port=link.port),
                connect_timeout=5,
                application_name=f"{self.prefix}-{name}-{next(self._serial)}",
            )
            self._workers[(dbname, name)] = conn
        return conn

    @staticmethod
    def release(conns: Any) -> None:
        """End every transaction left open on ``conns`` (rolled back; a connection that cannot
        roll back is closed, and the next example reconnects it)."""
        for conn in conns:
            if conn.closed or conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE:
                continue
            try:
                conn.rollback()
            except psycopg.Error:
                with contextlib.suppress(Exception):
                    conn.close()

    def close(self) -> None:
        self.scheduler.close()
        for part in self._stand_ins.values():
            part.stop()
        self._stand_ins.clear()
        for conn in [*self._workers.values(), *self._admin.values()]:
            with contextlib.suppress(Exception):
                conn.close()
        self._workers.clear()
        self._admin.clear()
        if getattr(self.db, "running", True):
            with (
                contextlib.suppress(psycopg.Error),
                psycopg.connect(self.db.dsn(), autocommit=True) as admin,
            ):
                for name in self._dbs.values():
                    admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        self._dbs.clear()


@dataclass
class Example:
    """One schedule of a scenario: what the block did, and the checker's verdict."""

    result: BlockResult
    verdict: linearize.Verdict

    def counterexample(self) -> list[str]:
        return list(self.result.trace) + self.verdict.explain()


def run_example(
    rig: Rig, scenario: Scenario, variant: Variant, choose: Callable[[list[str]], str]
) -> Example:
    """Reset the tables, run the setup, jump the clock, run the block with ``choose`` picking
    each step, read the rows back and judge the block by linearizability."""
    dbname = rig.database(variant.schema or scenario.schema)
    admin = rig.admin(dbname)
    admin.execute(f"TRUNCATE {', '.join(scenario.tables)} RESTART IDENTITY CASCADE")
    clock = getattr(rig.db, "clock", None)
    if scenario.jump and clock is None:
        raise SetupFailed(f"{scenario.name}: needs a database clock it can move (libfaketime)")
    if clock is not None:
        clock.reset()
        clock.jump(CLOCK_BASE)
    (t0,) = admin.execute("SELECT now()").fetchone()
    started = time.monotonic()

    def to_model_time(ts: datetime) -> int:
        seconds = (ts - t0).total_seconds()
        q = round(seconds / QUANTUM) * QUANTUM
        if abs(seconds - q) >= QUANTUM / 2 - 5:
            raise SetupFailed(
                f"{scenario.name}: the example ran {time.monotonic() - started:.0f}"
                " s, longer than the clock tolerance: the machine is too slow"
            )
        return int(q)

    model = scenario.new_model()
    store_class = variant.store_class or scenario.reference_store
    api = rig.stand_in(scenario.stand_in) if scenario.stand_in is not None else None
    if api is not None:
        api.reset()
    stores = {w: scenario.new_store(store_class, w, api) for w in scenario.workers}
    conns = {w: rig.worker(dbname, w) for w in scenario.workers}
    for w, store in stores.items():
        if api is not None and hasattr(store, "api"):
            store.api = ScheduledCalls(store.api, lambda w=w: conns[w], "operations API")
    try:
        for call in scenario.setup:
            expected = call.model(model)
            got = call.impl(stores[call.worker], conns[call.worker])
            if got != expected:
                raise SetupFailed(
                    f"{scenario.name}: setup {call.worker} {call.label} answered "
                    f"{got!r}, the model {expected!r}"
                )
        if scenario.jump:
            clock.jump(scenario.jump)
            model.advance(scenario.jump)
        ops = [
            Op(
                c.worker,
                c.label,
                conns[c.worker],
                (lambda call: lambda conn: call.impl(stores[call.worker], conn))(c),
            )
            for c in scenario.block
        ]
        result = rig.scheduler.run(ops, choose)
    finally:
        # an operation that raised outside the database may have left its transaction open,
        # holding locks the next example's TRUNCATE would wait on forever
        rig.release(conns.values())
    observed = scenario.project(admin, to_model_time)
    if clock is not None:
        clock.reset()
    hist = history(result, {c.worker: c.model for c in scenario.block})
    verdict = linearize.check(
        hist,
        model,
        fingerprint=scenario.fingerprint,
        final=linearize.FinalState(observed, scenario.project_model),
    )
    return Example(result, verdict)


def sequential_schedules(rig: Rig, scenario: Scenario, variant: Variant) -> list[Example]:
    """What the sequential mode can do: each operation to its end, one after another, in every
    order of the workers."""
    out = []
    for order in itertools.permutations([c.worker for c in scenario.block]):
        out.append(
            run_example(
                rig, scenario, variant, lambda options, order=order: min(options, key=order.index)
            )
        )
    return out


def every_schedule(
    rig: Rig, scenario: Scenario, variant: Variant, limit: int = 1000
) -> list[Example]:
    """Every schedule of the scenario, depth first over the choices (the scheduler is
    deterministic, so a prefix of choices replays): a small block is checked exhaustively.
    Raises when there are more than ``limit``."""
    out: list[Example] = []
    stack: list[tuple[int, ...]] = [()]
    while stack:
        prefix = stack.pop()
        taken: list[int] = []
        widths: list[int] = []

        def choose(options: list[str]) -> str:
            i = len(taken)
            k = prefix[i] if i < len(prefix) else 0
            taken.append(k)
            widths.append(len(options))
            return options[k]

        out.append(run_example(rig, scenario, variant, choose))
        if len(out) > limit:
            raise ValueError(f"{scenario.name}: more than {limit} schedules")
        for i in range(len(taken) - 1, len(prefix) - 1, -1):
            stack.extend(tuple(taken[:i]) + (k,) for k in range(widths[i] - 1, 0, -1))
    return out


@dataclass
class Hunt:
    """What a search over schedules found."""

    name: str
    caught: bool
    examples: int
    """Schedules run until the first refused one (when caught), else all of them."""
    seconds: float
    """Until the first refused schedule (when caught), else the whole search."""
    total_seconds: float
    """Including shrinking the refused schedule."""
    steps: int | None = None
    """Steps of the shrunk counterexample's schedule."""
    counterexample: list[str] = field(default_factory=list)

    def report(self) -> str:
        if not self.caught:
            return (
                f"{self.name}: not caught in {self.examples} schedules, {self.total_seconds:.1f} s"
            )
        return (
            f"{self.name}: caught after {self.examples} schedules, {self.seconds:.1f} s; "
            f"shrunk to {self.steps} steps ({self.total_seconds:.1f} s with shrinking)"
        )


def hunt(
    rig: Rig,
    scenario: Scenario,
    variant: Variant,
    *,
    seed: int = 0,
    max_examples: int = 100,
    shrink: bool = True,
) -> Hunt:
    """Let Hypothesis draw schedules of ``scenario`` (seeded) until the checker refuses one,
    then shrink it. ``caught`` is False when every schedule drawn was linearizable."""
    failures: list[Example] = []
    runs = [0]
    first: list[tuple[float, int]] = []  # (seconds, schedules) at the first refusal
    t0 = time.monotonic()

    @hyp_seed(seed)
    @settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
        phases=(Phase.generate, Phase.shrink) if shrink else (Phase.generate,),
    )
    @given(st.data())
    def schedule(data: Any) -> None:
        runs[0] += 1
        example = run_example(
            rig,
            scenario,
            variant,
            lambda options: data.draw(st.sampled_from(options), label="next"),
        )
        if not example.verdict.ok:
            if not first:
                first.append((time.monotonic() - t0, runs[0]))
            failures.append(example)
            raise AssertionError("\n".join(example.verdict.explain()))

    try:
        schedule()
    except AssertionError:
        pass
    total = time.monotonic() - t0
    if not failures:
        return Hunt(variant.name, False, runs[0], total, total)
    smallest = min(failures, key=lambda e: e.result.steps)
    seconds, schedules = first[0]
    return Hunt(
        variant.name,
        True,
        schedules,
        seconds,
        total,
        smallest.result.steps,
        smallest.counterexample(),
    )


# ---------------------------------------------------------------------------------------
# The figures: python -m knownstate.chaos.race_mutants
# ---------------------------------------------------------------------------------------


def measure(
    seeds: Sequence[int] = (0, 1, 2, 3, 4),
    max_examples: int = 200,
    names: Sequence[str] | None = None,
    out: Callable[[str], None] = print,
) -> bool:
    """Start PostgreSQL and Toxiproxy, hunt every race mutant (and the reference on the same
    seeds), print the figures. True when every mutant was caught on every seed and the
    reference never was."""
    from .cluster import PostgresCluster
    from .toxi import ToxiproxyServer

    ok = True
    with PostgresCluster() as pg, ToxiproxyServer() as tp:
        rig = Rig(pg, tp.client())
        try:
            for rm in RACE_MUTANTS:
                if names and rm.name not in names:
                    continue
                scenario = rm.scenario
                for s in seeds:
                    got = hunt(rig, scenario, rm.variant, seed=s, max_examples=max_examples)
                    out(f"seed {s} {got.report()}")
                    ok = ok and got.caught
                ref = hunt(rig, scenario, REFERENCE, seed=seeds[0], max_examples=max_examples)
                out(f"seed {seeds[0]} reference on '{scenario.name}': {ref.report()}")
                ok = ok and not ref.caught
        finally:
            rig.close()
    return ok


if __name__ == "__main__":  # pragma: no cover - a measurement, run by hand
    import sys

    sys.exit(0 if measure(names=sys.argv[1:] or None) else 1)
