"""The approved plan's mutant catalogue: realistic bugs, each caught by its check
(:mod:`.approved_plan`; see `knownstate mutants approved-plan`)."""

from __future__ import annotations

from datetime import datetime, timezone

from knownstate.impl import approved_plan as impl
from knownstate.impl.errors import boundary
from knownstate.model import approved_plan as model
from knownstate.model.contract import Won

from .. import race_mutants
from ..mutants import Mutant, sql_edit, with_attrs

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
            row = conn.execute(self.q["lock_executing"], {"id": proposal_id}).fetchone()
            if row is None:
                return model.no_proposal(proposal_id), False
            status, generation, steps_json = row
            refused = model.fence("run_step", status, generation, token)
            if refused:
                return refused, False
            (done,) = conn.execute(self.q["steps_done"], {"id": proposal_id}).fetchone()
            steps = impl._steps(steps_json)
            checked = model.check_step_index(steps, done, step_index)
            if checked is True:
                r = conn.execute(
                    self.q["receipt"], {"id": proposal_id, "step_index": step_index}
                ).fetchone()
                return Won(model.Receipt(*r)), False
            if checked is not None:
                return checked, False
            ok = self._apply(conn, proposal_id, step_index, steps[step_index])
            return Won((ok, status, steps)), ok

        first = self._transaction(conn, "run_step.effect", effect)
        if not isinstance(first, Won) or isinstance(first.value, model.Receipt):
            return first
        ok, status, steps = first.value
        step = steps[step_index]
        receipt = model.Receipt(step_index, ok, model.describe(step, ok))

        def record():
            conn.execute(
                self.q["insert_receipt"],
                {"id": proposal_id, "step_index": step_index, "ok": ok, "detail": receipt.detail},
            )
            conn.execute(
                self.q["finish_step"],
                {
                    "id": proposal_id,
                    "status": model.TABLE.next(
                        status, model.step_event(ok, step_index, len(steps))
                    ),
                    "failure": None if ok else model.step_failure(step_index, receipt.detail),
                },
            )
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

    def repeat(self, conn, proposal_id):
        def body():
            healed = self._heal(conn, proposal_id)
            seen = self._report(conn, proposal_id)
            if seen is None:
                return model.no_proposal(proposal_id), healed
            if seen.status not in model.TERMINAL:
                return model.not_terminal(seen.status), healed
            from .approved_plan import FINISHED

            if seen.status not in FINISHED:
                return Won(seen), healed
            _status, steps_json = conn.execute(self.q["lock_run"], {"id": proposal_id}).fetchone()
            for i, step in enumerate(impl._steps(steps_json)):
                self._apply(conn, proposal_id, i, step)
            return Won(seen), True

        return self._transaction(conn, "repeat", body)


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

# The read-then-write races only a concurrent block reaches (``knownstate.chaos.race_mutants``).

MUTANTS += race_mutants.MUTANTS["approved-plan"]
