"""The race mutants' implementation variants (:mod:`.race_mutants`): store classes (and a
schema) that are correct one operation at a time and wrong when transactions overlap."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import psycopg

from knownstate.impl import approved_plan as plan_impl
from knownstate.impl import branch_reset as reset_impl
from knownstate.impl import outbox as outbox_impl
from knownstate.impl.errors import boundary
from knownstate.model import approved_plan as plan_model
from knownstate.model import branch_reset as reset_model
from knownstate.model import outbox as outbox_model
from knownstate.model.contract import LostRace, Rejected, Won

from .mutants import CatalogueDrift, sql_edit


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
