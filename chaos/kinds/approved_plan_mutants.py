"""The approved plan's mutant catalogue: realistic bugs, each caught by its check
(:mod:`.approved_plan`; see `knownstate mutants approved-plan`)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import psycopg

from knownstate.impl import approved_plan as impl
from knownstate.impl.errors import boundary
from knownstate.model import approved_plan as model
from knownstate.model.contract import Won

from ..mutants import Mutant, sql_edit, with_attrs
from ..races import Call, RaceMutant, Scenario, Variant

# ---------------------------------------------------------------------------------------
# Mutants: realistic bugs, each caught by this check (see `knownstate mutants approved-plan`).
# ---------------------------------------------------------------------------------------


_Q = impl.QUERIES


def _edit(name: str, old: str, new: str, *more: tuple[str, str, str]):
    queries = sql_edit(_Q, name, old, new)
    for n, o, w in more:
        queries = sql_edit(queries, n, o, w)
    return with_attrs(queries=queries)


class _ReceiptAfterEffect(impl.ApprovedPlanStore):
    """The step's effect commits in its own transaction; the receipt, the heartbeat and the
    transition follow in a second one. A worker that dies between them leaves an effect without
    a receipt."""

    def run_step(self, conn, proposal_id, step_index, token):
        def effect():
            answer, status, steps = self._step_begun(conn, proposal_id, step_index, token)
            if answer is not None:
                return answer, False
            ok = self._apply(conn, proposal_id, step_index, steps[step_index])
            return Won((ok, status, steps)), ok

        first = self._transaction(conn, "run_step.effect", effect)
        if not isinstance(first, Won) or isinstance(first.value, model.Receipt):
            return first
        ok, status, steps = first.value

        def record():
            receipt, _moved = self._step_recorded(conn, proposal_id, step_index, ok, status, steps)
            return Won(receipt), True

        return self._transaction(conn, "run_step.receipt", record)


class _CallCounter(impl.ApprovedPlanStore):
    """The executor numbers steps by counting its own run_step calls for the proposal: a call
    answered from a receipt, refused or lost still counts."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: dict[int, int] = {}

    def run_step(self, conn, proposal_id, step_index, token):
        counted = self.calls.get(proposal_id, 0)
        self.calls[proposal_id] = counted + 1
        return super().run_step(conn, proposal_id, counted, token)


class _RepeatReexecutes(impl.ApprovedPlanStore):
    """A repeated execute request on a finished plan replays its payload: every step's effect is
    applied again (the receipts are there already, so none is written)."""

    def _answered(self, conn, proposal_id, seen):
        from .approved_plan import FINISHED

        if seen.status not in FINISHED:
            return False
        _status, steps_json = conn.execute(self.q["lock_run"], {"id": proposal_id}).fetchone()
        for i, step in enumerate(impl._steps(steps_json)):
            self._apply(conn, proposal_id, i, step)
        return True


class _HealAppClock(impl.ApprovedPlanStore):
    """markInterruptedIfStale compares the heartbeat with the application's clock (the database's
    clock stamped it)."""

    def _heal(self, conn, proposal_id):
        q = sql_edit(
            self.q,
            "mark_interrupted_if_stale",
            "heartbeat_at < now() -",
            "heartbeat_at < %(app_now)s::timestamptz -",
        )["mark_interrupted_if_stale"]
        with boundary("approved-plan.heal"):
            row = conn.execute(
                q,
                {
                    "id": proposal_id,
                    "failure": model.INTERRUPTED,
                    "heartbeat_s": self.heartbeat_s,
                    "app_now": datetime.now(timezone.utc),
                },
            ).fetchone()
        return row is not None


MUTANTS = [
    Mutant(
        "receipt-after-effect",
        "approved-plan",
        "receipt-with-effect",
        "the step's effect commits first and its receipt in a second transaction",
        with_attrs(store_class=_ReceiptAfterEffect),
    ),
    Mutant(
        "step-index-call-counter",
        "approved-plan",
        "stable-step-identity",
        "the step index is a per-worker count of run_step calls, "
        "not the position in the frozen payload",
        with_attrs(store_class=_CallCounter),
    ),
    Mutant(
        "repeat-reexecutes",
        "approved-plan",
        "terminal-answers-from-receipts",
        "a repeat request on a finished plan replays its steps' effects",
        with_attrs(store_class=_RepeatReexecutes),
    ),
    Mutant(
        "no-lock-executing-fence",
        "approved-plan",
        "lease-fence",
        "a step neither locks the run "
        "nor checks that it is still executing under the caller's token",
        _edit(
            "lock_executing",
            "SELECT status, generation, steps FROM agent_proposal "
            "WHERE id = %(id)s FOR NO KEY UPDATE",
            "SELECT 'executing', generation, steps FROM agent_proposal WHERE id = %(id)s",
            ("finish_step", "WHERE id = %(id)s AND status = 'executing'", "WHERE id = %(id)s"),
        ),
    ),
    Mutant(
        "heal-ignores-heartbeat",
        "approved-plan",
        "lease",
        "markInterruptedIfStale fails every executing run it reads, live heartbeat or not",
        _edit(
            "mark_interrupted_if_stale",
            "\n  AND heartbeat_at < now() - make_interval(secs => %(heartbeat_s)s)",
            "",
        ),
    ),
    Mutant(
        "heal-app-clock",
        "approved-plan",
        "lease",
        "markInterruptedIfStale judges the heartbeat by the application clock, not the database's",
        with_attrs(store_class=_HealAppClock),
        needs=("db-clock",),
    ),
    Mutant(
        "unfenced-heartbeat",
        "approved-plan",
        "lease-fence",
        "the heartbeat renews the lease "
        "without checking the run is still executing under the token",
        _edit(
            "heartbeat",
            "WHERE id = %(id)s AND status = 'executing' AND generation = %(token)s",
            "WHERE id = %(id)s",
        ),
    ),
    Mutant(
        "unconditional-claim",
        "approved-plan",
        "conditional-transition",
        "markExecuting is not conditional on status = 'approved'",
        _edit("mark_executing", "WHERE id = %(id)s AND status = 'approved'", "WHERE id = %(id)s"),
    ),
    Mutant(
        "expire-executing",
        "approved-plan",
        "conditional-transition",
        "expire also takes a run that already started executing",
        _edit(
            "expire",
            "status IN ('pending', 'approved')",
            "status IN ('pending', 'approved', 'executing')",
        ),
    ),
    Mutant(
        "revise-after-approval",
        "approved-plan",
        "stable-step-identity",
        "approval does not freeze the payload: "
        "an approved or executing plan's steps can be replaced",
        _edit(
            "revise", "AND status = 'pending'", "AND status IN ('pending', 'approved', 'executing')"
        ),
    ),
    Mutant(
        "failed-step-continues",
        "approved-plan",
        "retry-policy",
        "a step that is not ok leaves the run executing (to be retried) instead of failing it",
        _edit(
            "finish_step",
            "SET status = %(status)s,",
            "SET status = CASE WHEN %(failure)s::text IS NULL THEN %(status)s ELSE status END,",
        ),
    ),
]

# ---------------------------------------------------------------------------------------
# Race mutants: read-then-write bugs only a concurrent block reaches (:mod:`..races`).
# ---------------------------------------------------------------------------------------


class CountBeforeLockWait(impl.ApprovedPlanStore):
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


class HeartbeatOwnerReadFirst(impl.ApprovedPlanStore):
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
                return model.no_proposal(proposal_id), False
            status, _failure, _compensates, generation = row
            refused = model.fence("heartbeat", status, generation, token)
            if refused:
                return refused, False
            conn.execute(self.q["heartbeat"], {"id": proposal_id, "token": token})
            return Won(), True

        return self._transaction(conn, "heartbeat", body)


class CompensateUnlocked(impl.ApprovedPlanStore):
    """compensate reads the run and looks for its compensation without the run's row lock
    (``lock_run`` without ``FOR NO KEY UPDATE``), then inserts one: a get-or-create outside the
    lock. Two compensations at once both find none, and the second insert hits the unique
    index (one compensation per run) instead of answering with the first one's."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.q = sql_edit(self.q, "lock_run", " FOR NO KEY UPDATE", "")


def _scenario(
    name: str, block: tuple[Call, ...], setup: tuple[Call, ...], jump: int = 0
) -> Scenario:
    return Scenario(
        name,
        "approved-plan",
        impl.SCHEMA,
        impl.TABLES,
        new_model=model.ApprovedPlanModel,
        new_store=lambda cls, worker, _: cls(model.HEARTBEAT_S),
        project=impl.project,
        project_model=lambda m: m.state(),
        block=block,
        setup=setup,
        jump=jump,
        reference_store=impl.ApprovedPlanStore,
        fingerprint=lambda m: (m.now, m.state()),
    )


def _steps() -> list[dict]:
    return [
        {"op": "credit", "account": "a", "amount": 5},
        {"op": "credit", "account": "a", "amount": 7},
    ]


def _run_step(worker: str, step: int) -> Call:
    return Call.alike(worker, f"run_step(1, {step}, token=1)", "run_step", 1, step, 1)


def _compensate(worker: str) -> Call:
    return Call.alike(worker, "compensate(1)", "compensate", 1)


_EXECUTING = (
    Call(
        "w0",
        "propose([credit a 5, credit a 7])",
        lambda m: m.propose(_steps()),
        lambda s, c: s.propose(c, _steps()),
    ),
    Call.alike("w0", "approve(1)", "approve", 1),
    Call.alike("w0", "mark_executing(1)", "mark_executing", 1),
)

RACES = (
    RaceMutant(
        "count-before-lock-wait",
        "approved-plan",
        "stable-step-identity",
        "the receipt count is a subquery of lock_executing (commit 3a43514): after waiting for the "
        "run lock it misses the receipt of the step that held it, and runs that step again",
        Variant("count-before-lock-wait", CountBeforeLockWait),
        _scenario(
            "approved-plan: one step run twice at once",
            setup=_EXECUTING,
            block=(_run_step("w0", 0), _run_step("w1", 0)),
        ),
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
        _scenario(
            "approved-plan: a heartbeat races the lazy heal of its stale lease",
            setup=_EXECUTING,
            jump=model.HEARTBEAT_S,
            block=(
                Call.alike("w0", "heartbeat(1, token=1)", "heartbeat", 1, 1),
                Call.alike("w1", "read(1)", "read", 1),
            ),
        ),
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
        _scenario(
            "approved-plan: two compensations of one finished run at once",
            setup=_EXECUTING + (_run_step("w0", 0), _run_step("w0", 1)),
            block=(_compensate("w0"), _compensate("w1")),
        ),
        "run one after the other, the second compensation finds the first one's and answers with "
        "it. Only both looking before either inserts sends the second into the unique index.",
    ),
)

MUTANTS += [r.mutant() for r in RACES]
