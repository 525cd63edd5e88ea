"""The race mutants' scenarios (:mod:`.race_mutants`): the blocks that reach each race,
with their sequential setup."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable, Hashable

import psycopg

from knownstate.impl import approved_plan as plan_impl
from knownstate.impl import branch_reset as reset_impl
from knownstate.impl import outbox as outbox_impl
from knownstate.model import approved_plan as plan_model
from knownstate.model import branch_reset as reset_model
from knownstate.model import outbox as outbox_model

from . import linearize
from .opsapi import OpsApi

QUANTUM = 60
"""Model time is whole seconds; timestamps are read back to the nearest minute (exact while an
example lasts under half a minute), and every clock jump is a multiple of it."""


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
