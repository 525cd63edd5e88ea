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
when the bug lies in the schema, a schema); :data:`MUTANTS` wraps them for a kind's check with
:func:`knownstate.chaos.mutants.with_attrs`, for the engine's concurrent mode.

``python -m knownstate.chaos.race_mutants`` starts its own PostgreSQL and Toxiproxy and prints,
for every mutant and seed, whether it was caught, in how many seconds, and the length of the
shrunk schedule.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Hashable, Sequence

import psycopg
from hypothesis import HealthCheck, Phase, given, seed as hyp_seed, settings, strategies as st

from knownstate.impl import approved_plan as plan_impl
from knownstate.impl import branch_reset as reset_impl
from knownstate.impl import outbox as outbox_impl
from knownstate.impl.errors import boundary
from knownstate.model import approved_plan as plan_model
from knownstate.model import branch_reset as reset_model
from knownstate.model import outbox as outbox_model
from knownstate.model.contract import LostRace, Rejected, Won

from . import linearize
from .interleave import BlockResult, Op, ScheduledCalls, ScheduledConnection, Scheduler, history
from .mutants import CatalogueDrift, Mutant, sql_edit, with_attrs
from .opsapi import OpsApi

CLOCK_BASE = -86_400
"""Each example starts with the fake database clock a day behind real time and jumps from
there: under libfaketime a server clock *ahead* of real time delays its lock-wait timers (see
:mod:`knownstate.chaos.interleave`), so the offset must stay at or below zero."""

QUANTUM = 60
"""Model time is whole seconds; timestamps are read back to the nearest minute (exact while an
example lasts under half a minute), and every clock jump is a multiple of it."""


# ---------------------------------------------------------------------------------------
# The mutants: implementation variants.
# ---------------------------------------------------------------------------------------


class ClaimReadThenWrite(outbox_impl.OutboxStore):
    """The claim reads the due rows in one statement (no ``FOR UPDATE``) and writes each row by
    id in another, with ``attempts`` computed from what it read: a read-modify-write split
    across two statements without a row lock."""

    DUE = (
        "SELECT id, attempts, payload FROM outbox_delivery\n"
        "WHERE status = 'pending' AND next_attempt_at <= now() ORDER BY id LIMIT %(batch)s"
    )
    TAKE = (
        "UPDATE outbox_delivery SET status = 'processing', attempts = %(attempts)s,\n"
        "    lease_until = now() + make_interval(secs => %(lease)s)\n"
        "WHERE id = %(id)s RETURNING id, attempts, payload"
    )

    def begin_claim(self, conn: psycopg.Connection, batch: int) -> list:
        with boundary("outbox.claim"):
            due = conn.execute(self.DUE, {"batch": batch}).fetchall()
            claimed = []
            for id_, attempts, _payload in due:
                row = conn.execute(
                    self.TAKE, {"id": id_, "attempts": attempts + 1, "lease": self.config.lease}
                ).fetchone()
                claimed.append((outbox_model.Claim(row[0], row[1]), row[2]))
        return sorted(claimed, key=lambda c: c[0].id)


class CompleteReadsAttemptFirst(outbox_impl.OutboxStore):
    """The completion reads the row's status and attempt in one statement, checks the claim in
    Python, then writes ``sent`` guarded on the status alone: the attempts fence is in the read,
    not in the write."""

    READ = "SELECT status, attempts FROM outbox_delivery WHERE id = %(id)s"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.q = sql_edit(self.q, "complete", "AND attempts = %(attempt)s", "")

    def complete(self, conn: psycopg.Connection, c: outbox_model.Claim) -> Any:
        with boundary("outbox.complete"):
            row = conn.execute(self.READ, {"id": c.id}).fetchone()
            if row is None or row[0] != outbox_model.Status.PROCESSING or row[1] != c.attempt:
                conn.rollback()
                return LostRace("fenced")
        return super().complete(conn, c)


class CountBeforeLockWait(plan_impl.ApprovedPlanStore):
    """The 3a43514 class: the receipt count is a subquery of the locking statement. After a wait
    for the run lock, the locked row is the latest, but the subquery read the snapshot taken
    before the wait, so it misses the receipt of the step that held the lock."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.q = sql_edit(
            self.q,
            "lock_executing",
            "SELECT status, generation, steps FROM agent_proposal WHERE id = %(id)s "
            "FOR NO KEY UPDATE",
            "SELECT p.status, p.generation, p.steps,\n"
            "       (SELECT count(*) FROM agent_proposal_step s "
            "WHERE s.proposal_id = p.id)\n"
            "FROM agent_proposal p WHERE p.id = %(id)s FOR NO KEY UPDATE OF p",
        )

    def _steps_done(self, conn: psycopg.Connection, proposal_id: int, locked: tuple) -> int:
        return locked[3]


class HeartbeatOwnerReadFirst(plan_impl.ApprovedPlanStore):
    """The heartbeat checks the owner in one statement (status and claim token, read), then
    renews the lease with an update by id alone: nothing checks the owner at the write."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.q = sql_edit(
            self.q,
            "heartbeat",
            "WHERE id = %(id)s AND status = 'executing' AND generation = %(token)s",
            "WHERE id = %(id)s",
        )

    def heartbeat(self, conn: psycopg.Connection, proposal_id: int, token: int) -> Any:
        def body():
            row = conn.execute(self.q["run"], {"id": proposal_id}).fetchone()
            if row is None:
                return plan_model.no_proposal(proposal_id), False
            status, _failure, _compensates, generation = row
            refused = plan_model.fence("heartbeat", status, generation, token)
            if refused:
                return refused, False
            conn.execute(self.q["heartbeat"], {"id": proposal_id, "token": token})
            return Won(), True

        return self._transaction(conn, "heartbeat", body)


class RequestSelectThenInsert(reset_impl.BranchResetStore):
    """The idempotency check is a SELECT by key before the INSERT, and the key has no unique
    index (:data:`KEY_NOT_UNIQUE_SCHEMA`): two requests with one key both find nothing."""

    def request(self, conn: psycopg.Connection, branch: str, idempotency_key: str) -> Any:
        try:
            with boundary("branch-reset.request"):
                found = conn.execute(
                    self.q["find_by_key"], {"idempotency_key": idempotency_key}
                ).fetchone()
            if found is not None:
                conn.rollback()
                same = found[1] == branch
                return Won(found[0]) if same else Rejected(reset_model.KEY_REUSED)
            return super().request(conn, branch, idempotency_key)
        except BaseException:
            with contextlib.suppress(psycopg.Error):
                conn.rollback()
            raise


class StartReadsStatusFirst(reset_impl.BranchResetStore):
    """start reads the run's status in one statement and, seeing it queued, claims it by id in
    the next (the claim no longer guarded on status): two starts that both read 'queued' both
    win, the second after waiting for the first one's row lock."""

    READ = "SELECT status FROM branch_reset WHERE id = %(run_id)s"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.q = sql_edit(self.q, "claim", " AND status = 'queued'", "")

    def start(self, conn: psycopg.Connection, run_id: str) -> Any:
        try:
            with boundary("branch-reset.start"):
                row = conn.execute(self.READ, {"run_id": run_id}).fetchone()
                if row is None or row[0] != reset_model.Status.QUEUED:
                    outcome = self._miss(conn, run_id)
                    conn.rollback()
                    return outcome
        except BaseException:
            with contextlib.suppress(psycopg.Error):
                conn.rollback()
            raise
        return super().start(conn, run_id)


class CompensateUnlocked(plan_impl.ApprovedPlanStore):
    """compensate reads the run and looks for its compensation without the run's row lock
    (``lock_run`` without ``FOR NO KEY UPDATE``), then inserts one: a get-or-create outside the
    lock. Two compensations at once both find none, and the second insert hits the unique
    index (one compensation per run) instead of answering with the first one's."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.q = sql_edit(self.q, "lock_run", " FOR NO KEY UPDATE", "")


def _schema_edit(schema: str, old: str, new: str) -> str:
    if old not in schema:
        raise CatalogueDrift(f"race mutant edit of a schema: {old!r} not found")
    return schema.replace(old, new)


KEY_NOT_UNIQUE_SCHEMA = _schema_edit(
    reset_impl.SCHEMA,
    "CREATE UNIQUE INDEX branch_reset_idempotency_key",
    "CREATE INDEX branch_reset_idempotency_key",
)


@dataclass(frozen=True)
class Variant:
    """An implementation: the reference, or a mutant's store class and schema."""

    name: str
    store_class: type | None = None
    schema: str | None = None


REFERENCE = Variant("reference")


# ---------------------------------------------------------------------------------------
# Scenarios: the blocks that reach each race.
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """One operation: by ``worker``, on the model and on the implementation (a store)."""

    worker: str
    label: str
    model: Callable[[Any], Any]
    impl: Callable[[Any, psycopg.Connection], Any]


@dataclass(frozen=True)
class Scenario:
    """Setup operations run one after another, a clock jump, then ``block`` started together."""

    name: str
    kind: str
    schema: str
    tables: tuple[str, ...]
    new_model: Callable[[], Any]
    new_store: Callable[[type, str, Any], Any]
    """``new_store(store_class, worker, stand_in)``: the stand-in is None without one."""
    project: Callable[[psycopg.Connection, Callable[[datetime], int]], Any]
    project_model: Callable[[Any], Any]
    block: tuple[Call, ...]
    setup: tuple[Call, ...] = ()
    jump: int = 0
    fingerprint: Callable[[Any], Hashable] = linearize.default_fingerprint
    reference_store: type | None = None
    stand_in: type | None = None
    """An external service the operations call (a class with ``start``, ``stop``, ``reset``):
    the rig runs one, reset before each example; each call to it is a step of the block."""

    @property
    def workers(self) -> list[str]:
        return sorted({c.worker for c in self.setup + self.block})


OUTBOX_CONFIG = outbox_model.Config(
    lease=5 * QUANTUM, backoff_base=QUANTUM, backoff_cap=60 * QUANTUM, max_attempts=3
)
_CLAIM = outbox_model.Claim(1, 1)


def _outbox(
    name: str, block: tuple[Call, ...], setup: tuple[Call, ...] = (), jump: int = 0
) -> Scenario:
    return Scenario(
        name,
        "outbox",
        outbox_impl.SCHEMA,
        outbox_impl.TABLES,
        new_model=lambda: outbox_model.OutboxModel(OUTBOX_CONFIG),
        new_store=lambda cls, worker, _: cls(OUTBOX_CONFIG),
        project=outbox_impl.project,
        project_model=lambda m: m.state(),
        block=block,
        setup=setup,
        jump=jump,
        reference_store=outbox_impl.OutboxStore,
        fingerprint=lambda m: (m.now, m.state(), m._next_id),
    )


def _plan(name: str, block: tuple[Call, ...], setup: tuple[Call, ...], jump: int = 0) -> Scenario:
    return Scenario(
        name,
        "approved-plan",
        plan_impl.SCHEMA,
        plan_impl.TABLES,
        new_model=plan_model.ApprovedPlanModel,
        new_store=lambda cls, worker, _: cls(plan_model.HEARTBEAT_S),
        project=plan_impl.project,
        project_model=lambda m: m.state(),
        block=block,
        setup=setup,
        jump=jump,
        reference_store=plan_impl.ApprovedPlanStore,
        fingerprint=lambda m: (m.now, m.state()),
    )


RESET_EPOCH = datetime(2030, 1, 1, tzinfo=timezone.utc)
"""The branch-reset stores' application clock: model time zero, standing still."""


def _reset_store(cls: type, worker: str, api: Any) -> Any:
    # without a stand-in (requests only) nothing listens on port 9
    url = api.url if api is not None else "http://127.0.0.1:9"
    return cls(worker, url, lambda: RESET_EPOCH)


def _reset_project(conn: psycopg.Connection, _to_model_time: Any) -> Any:
    """The rows, their lease stamps (application time) as model seconds from RESET_EPOCH."""
    return reset_impl.project(conn, lambda ts: int((ts - RESET_EPOCH).total_seconds()))


def _reset(name: str, block: tuple[Call, ...], setup: tuple[Call, ...] = ()) -> Scenario:
    return Scenario(
        name,
        "branch-reset",
        reset_impl.SCHEMA,
        reset_impl.TABLES,
        new_model=reset_model.BranchResetModel,
        new_store=_reset_store,
        project=_reset_project,
        project_model=lambda m: m.rows(),
        block=block,
        setup=setup,
        reference_store=reset_impl.BranchResetStore,
        stand_in=OpsApi,
    )


_EXECUTING = (
    Call(
        "w0",
        "propose([credit a 5, credit a 7])",
        lambda m: m.propose(
            [
                {"op": "credit", "account": "a", "amount": 5},
                {"op": "credit", "account": "a", "amount": 7},
            ]
        ),
        lambda s, c: s.propose(
            c,
            [
                {"op": "credit", "account": "a", "amount": 5},
                {"op": "credit", "account": "a", "amount": 7},
            ],
        ),
    ),
    Call("w0", "approve(1)", lambda m: m.approve(1), lambda s, c: s.approve(c, 1)),
    Call(
        "w0",
        "mark_executing(1)",
        lambda m: m.mark_executing(1),
        lambda s, c: s.mark_executing(c, 1),
    ),
)

_EXECUTED = _EXECUTING + (
    Call(
        "w0",
        "run_step(1, 0, token=1)",
        lambda m: m.run_step(1, 0, 1),
        lambda s, c: s.run_step(c, 1, 0, 1),
    ),
    Call(
        "w0",
        "run_step(1, 1, token=1)",
        lambda m: m.run_step(1, 1, 1),
        lambda s, c: s.run_step(c, 1, 1, 1),
    ),
)


def _compensate(store: Any, conn: psycopg.Connection) -> Any:
    return store.compensate(conn, 1)


def _start(store: Any, conn: psycopg.Connection) -> Any:
    return store.start(conn, "a#1")


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        _outbox(
            "outbox: two claims of one due row",
            setup=(Call("w0", "enqueue(1)", lambda m: m.enqueue(1), lambda s, c: s.enqueue(c, 1)),),
            block=(
                Call("w0", "claim(batch=1)", lambda m: m.claim(1), lambda s, c: s.claim(c, 1)),
                Call("w1", "claim(batch=1)", lambda m: m.claim(1), lambda s, c: s.claim(c, 1)),
            ),
        ),
        _outbox(
            "outbox: a stale owner completes while the reaper and another worker move on",
            setup=(
                Call("w0", "enqueue(1)", lambda m: m.enqueue(1), lambda s, c: s.enqueue(c, 1)),
                Call("w0", "claim(batch=1)", lambda m: m.claim(1), lambda s, c: s.claim(c, 1)),
            ),
            jump=OUTBOX_CONFIG.lease,
            block=(
                Call(
                    "w0",
                    "complete(1, attempt=1)",
                    lambda m: m.complete(_CLAIM),
                    lambda s, c: s.complete(c, _CLAIM),
                ),
                Call(
                    "w1",
                    "reclaim_stale()",
                    lambda m: m.reclaim_stale(),
                    lambda s, c: s.reclaim_stale(c),
                ),
                Call("w2", "claim(batch=1)", lambda m: m.claim(1), lambda s, c: s.claim(c, 1)),
            ),
        ),
        _plan(
            "approved-plan: one step run twice at once",
            setup=_EXECUTING,
            block=(
                Call(
                    "w0",
                    "run_step(1, 0, token=1)",
                    lambda m: m.run_step(1, 0, 1),
                    lambda s, c: s.run_step(c, 1, 0, 1),
                ),
                Call(
                    "w1",
                    "run_step(1, 0, token=1)",
                    lambda m: m.run_step(1, 0, 1),
                    lambda s, c: s.run_step(c, 1, 0, 1),
                ),
            ),
        ),
        _plan(
            "approved-plan: a heartbeat races the lazy heal of its stale lease",
            setup=_EXECUTING,
            jump=plan_model.HEARTBEAT_S,
            block=(
                Call(
                    "w0",
                    "heartbeat(1, token=1)",
                    lambda m: m.heartbeat(1, 1),
                    lambda s, c: s.heartbeat(c, 1, 1),
                ),
                Call("w1", "read(1)", lambda m: m.read(1), lambda s, c: s.read(c, 1)),
            ),
        ),
        _plan(
            "approved-plan: two compensations of one finished run at once",
            setup=_EXECUTED,
            block=(
                Call("w0", "compensate(1)", lambda m: m.compensate(1), _compensate),
                Call("w1", "compensate(1)", lambda m: m.compensate(1), _compensate),
            ),
        ),
        _reset(
            "branch-reset: two starts of one queued run",
            setup=(
                Call(
                    "w0",
                    "request(a, key=k)",
                    lambda m: m.request("a", "k"),
                    lambda s, c: s.request(c, "a", "k"),
                ),
            ),
            block=(
                Call("w0", "start(a#1)", lambda m: m.start("a#1", "w0"), _start),
                Call("w1", "start(a#1)", lambda m: m.start("a#1", "w1"), _start),
            ),
        ),
        _reset(
            "branch-reset: one idempotency key for two branches at once",
            block=(
                Call(
                    "w0",
                    "request(b1, key=k)",
                    lambda m: m.request("b1", "k"),
                    lambda s, c: s.request(c, "b1", "k"),
                ),
                Call(
                    "w1",
                    "request(b2, key=k)",
                    lambda m: m.request("b2", "k"),
                    lambda s, c: s.request(c, "b2", "k"),
                ),
            ),
        ),
    )
}


@dataclass(frozen=True)
class RaceMutant:
    """A bug only a concurrent block reveals, the scenario that reaches it, and why the
    sequential mode misses it."""

    name: str
    kind: str
    invariant: str
    description: str
    variant: Variant
    scenario: str
    sequential_misses: str

    def mutant(self) -> Mutant:
        """The mutant for the kind's check (``store_class``, and ``schema`` when edited)."""
        attrs: dict[str, Any] = {"store_class": self.variant.store_class}
        if self.variant.schema is not None:
            attrs["schema"] = self.variant.schema
        return Mutant(self.name, self.kind, self.invariant, self.description, with_attrs(**attrs))


RACE_MUTANTS: tuple[RaceMutant, ...] = (
    RaceMutant(
        "claim-read-then-write",
        "outbox",
        "claim",
        "the claim SELECTs due rows without a row lock, then UPDATEs each by id with attempts + 1 "
        "computed from the read: two workers both claim the row, with the same attempt",
        Variant("claim-read-then-write", ClaimReadThenWrite),
        "outbox: two claims of one due row",
        "one claim after the other: the second one's SELECT already sees the row processing and "
        "claims nothing. Only w1's SELECT between w0's SELECT and w0's COMMIT reads it pending.",
    ),
    RaceMutant(
        "complete-reads-attempt-first",
        "outbox",
        "lease-fence",
        "the completion reads status and attempt in one statement, then writes 'sent' guarded on "
        "status alone: a stale owner completes the row another worker claimed since",
        Variant("complete-reads-attempt-first", CompleteReadsAttemptFirst),
        "outbox: a stale owner completes while the reaper and another worker move on",
        "in any order of whole operations the read sees the attempt the write will meet: the "
        "reclaim and the new claim (attempt 2) must both commit between w0's read and its write.",
    ),
    RaceMutant(
        "count-before-lock-wait",
        "approved-plan",
        "stable-step-identity",
        "the receipt count is a subquery of lock_executing (commit 3a43514): after waiting for the "
        "run lock it misses the receipt of the step that held it, and runs that step again",
        Variant("count-before-lock-wait", CountBeforeLockWait),
        "approved-plan: one step run twice at once",
        "run one after the other, the second run_step never waits for the lock, so its snapshot "
        "already holds the first one's receipt and it answers from it. Only a wait on the lock "
        "(w1 locking while w0 holds the run) leaves the subquery's snapshot behind.",
    ),
    RaceMutant(
        "heartbeat-owner-read-first",
        "approved-plan",
        "lease-fence",
        "the heartbeat reads status and token, then renews heartbeat_at by id alone: a stale "
        "owner renews the lease of a run a reader just failed as interrupted",
        Variant("heartbeat-owner-read-first", HeartbeatOwnerReadFirst),
        "approved-plan: a heartbeat races the lazy heal of its stale lease",
        "whole operations: a heartbeat after the heal reads 'failed' and refuses, one before it "
        "refreshes the lease so the heal spares the run. Only the heal committing between the "
        "heartbeat's read and its update shows the unfenced write.",
    ),
    RaceMutant(
        "compensate-outside-run-lock",
        "approved-plan",
        "conditional-transition",
        "compensate looks for the run's compensation and inserts one without holding the run's "
        "row lock: of two compensations at once, the second hits the unique index",
        Variant("compensate-outside-run-lock", CompensateUnlocked),
        "approved-plan: two compensations of one finished run at once",
        "run one after the other, the second compensation finds the first one's and answers with "
        "it. Only both looking before either inserts sends the second into the unique index.",
    ),
    RaceMutant(
        "start-reads-status-first",
        "branch-reset",
        "conditional-transition",
        "start reads the run's status, then claims it by id in a second statement: two starts "
        "that both read 'queued' both win",
        Variant("start-reads-status-first", StartReadsStatusFirst),
        "branch-reset: two starts of one queued run",
        "run one after the other, the second start reads 'running' and loses. Only both reads "
        "before the first claim commits let both claim the run.",
    ),
    RaceMutant(
        "idempotency-select-then-insert",
        "branch-reset",
        "claim",
        "the idempotency check is SELECT-by-key then INSERT, with no unique index on the key: two "
        "requests with one key for two branches both make a run",
        Variant("idempotency-select-then-insert", RequestSelectThenInsert, KEY_NOT_UNIQUE_SCHEMA),
        "branch-reset: one idempotency key for two branches at once",
        "the second request, run after the first committed, finds the key by its SELECT and "
        "refuses it as reused. Only both SELECTs before either INSERT commits find nothing.",
    ),
)

MUTANTS: dict[str, list[Mutant]] = {}
"""The race mutants per kind, as :class:`~knownstate.chaos.mutants.Mutant` for a kind's check.
Only the concurrent mode catches them: add them to a kind's catalogue together with it."""
for _rm in RACE_MUTANTS:
    MUTANTS.setdefault(_rm.kind, []).append(_rm.mutant())


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
                scenario = SCENARIOS[rm.scenario]
                for s in seeds:
                    got = hunt(rig, scenario, rm.variant, seed=s, max_examples=max_examples)
                    out(f"seed {s} {got.report()}")
                    ok = ok and got.caught
                ref = hunt(rig, scenario, REFERENCE, seed=seeds[0], max_examples=max_examples)
                out(f"seed {seeds[0]} reference on '{rm.scenario}': {ref.report()}")
                ok = ok and not ref.caught
        finally:
            rig.close()
    return ok


if __name__ == "__main__":  # pragma: no cover - a measurement, run by hand
    import sys

    sys.exit(0 if measure(names=sys.argv[1:] or None) else 1)
