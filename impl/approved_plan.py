"""The approved-plan executor on PostgreSQL: the reference implementation of
:mod:`knownstate.model.approved_plan`.

Each method of :class:`ApprovedPlanStore` is one operation of the model, with the same
arguments after the connection and the same outcome values. Each is one transaction on the
given psycopg 3 connection (not in autocommit): its statements run inside
:func:`~knownstate.impl.errors.boundary`, then :func:`~knownstate.impl.errors.commit`. A
transition whose ``UPDATE ... WHERE status = <from>`` matches no row rolls back and returns
the model's ``LostRace``; a refusal by rule returns the model's ``Rejected``. The rules that
both sides must word the same way (the fence's verdict, a step index's validity, reasons) are
the model's own functions, so they are written once.

``run_step`` is the heart of it, one transaction::

    lock_executing  SELECT ... FOR NO KEY UPDATE, refuse unless executing under the caller's token
    steps_done      count the receipts (after the lock, so the count is current)
    credit | debit  the step's effect in the demo domain (nothing for a step that is not ok)
    insert_receipt  agent_proposal_step (proposal_id, step_index): commits with the effect
    finish_step     heartbeat_at = now(), and the step's transition
    COMMIT

SQL lives in ``sql/approved_plan_schema.sql`` and ``sql/approved_plan.sql``. The loops that run
plans as deployed, :class:`PlanExecutor` and :class:`PlanReader`, are at the end.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Callable, Iterable

import psycopg
from psycopg.types.json import Jsonb

from knownstate.impl.errors import KnownstateError, boundary, commit, rollback_quietly
from knownstate.impl.loops import StoreLoop
from knownstate.impl.queries import load, schema as _read_schema
from knownstate.model import approved_plan as m
from knownstate.model.contract import LostRace, Outcome, Rejected, Won

SCHEMA_FILE = "approved_plan_schema.sql"
SCHEMA = _read_schema(SCHEMA_FILE)
"""The DDL that creates this kind's tables in an empty database."""
QUERIES = load("approved_plan.sql")
"""The reference SQL, by name."""
TABLES = (
    "demo_ledger",
    "demo_account",
    "agent_proposal_step",
    "agent_proposal",
    "agent_proposal_ids",
)
"""Every table of this kind, for ``TRUNCATE ... RESTART IDENTITY`` between examples."""


def schema() -> str:
    """The DDL that creates this kind's tables in an empty database."""
    return SCHEMA


def _steps_json(steps: Iterable[m.Step]) -> Jsonb:
    return Jsonb([s.to_json() for s in steps])


def _steps(data: list) -> tuple[m.Step, ...]:
    return tuple(m.Step.from_json(d) for d in data)


class ApprovedPlanStore:
    """The operations of :class:`~knownstate.model.approved_plan.ApprovedPlanModel`, on PostgreSQL.
    ``queries`` defaults to the reference SQL; the mutant catalogue replaces some by name."""

    def __init__(self, heartbeat_s: int = m.HEARTBEAT_S, queries: dict[str, str] | None = None):
        self.heartbeat_s = heartbeat_s
        self.q = {**QUERIES, **(queries or {})}

    # -- one transaction per operation -------------------------------------------
    def _transaction(
        self, conn: psycopg.Connection, op: str, body: Callable[[], tuple[Outcome, bool]]
    ) -> Outcome:
        """Run ``body`` (which returns the outcome and whether it wrote anything) as one
        transaction: commit what was written, roll back what was not."""
        where = f"{m.KIND}.{op}"
        try:
            with boundary(where):
                outcome, wrote = body()
                if not wrote:
                    conn.rollback()
        except BaseException:
            rollback_quietly(conn)
            raise
        if wrote:
            commit(conn, where)
        return outcome

    def _why_not(self, conn: psycopg.Connection, proposal_id: int, event: str) -> Outcome:
        """A guarded UPDATE matched no row: either there is no such run, or someone moved it
        first."""
        row = conn.execute(self.q["run"], {"id": proposal_id}).fetchone()
        return m.no_proposal(proposal_id) if row is None else m.lost(event)

    def _conditional(self, conn: psycopg.Connection, proposal_id: int, event: str) -> Outcome:
        def body():
            if conn.execute(self.q[event], {"id": proposal_id}).fetchone() is not None:
                return Won(), True
            return self._why_not(conn, proposal_id, event), False

        return self._transaction(conn, event, body)

    def _insert(
        self, conn: psycopg.Connection, steps: tuple[m.Step, ...], compensates: int | None
    ) -> int:
        (pid,) = conn.execute(self.q["next_proposal_id"]).fetchone()
        conn.execute(
            self.q["insert_proposal"],
            {"id": pid, "steps": _steps_json(steps), "compensates": compensates},
        )
        return pid

    def _heal(self, conn: psycopg.Connection, proposal_id: int) -> bool:
        """mark_interrupted_if_stale; True when it failed a stale run (a write to commit)."""
        row = conn.execute(
            self.q["mark_interrupted_if_stale"],
            {"id": proposal_id, "failure": m.INTERRUPTED, "heartbeat_s": self.heartbeat_s},
        ).fetchone()
        return row is not None

    def _report(self, conn: psycopg.Connection, proposal_id: int) -> m.RunReport | None:
        row = conn.execute(self.q["report"], {"id": proposal_id}).fetchone()
        if row is None:
            return None
        status, failure, receipts = row
        return m.RunReport(
            proposal_id, m.Status(status), failure, tuple(m.Receipt(*r) for r in receipts)
        )

    # -- operations ----------------------------------------------------------------
    def propose(self, conn: psycopg.Connection, steps: Iterable) -> Outcome:
        parsed = m.parse_steps(steps)
        if isinstance(parsed, Rejected):
            return parsed
        return self._transaction(
            conn, "propose", lambda: (Won(self._insert(conn, parsed, None)), True)
        )

    def revise(self, conn: psycopg.Connection, proposal_id: int, steps: Iterable) -> Outcome:
        parsed = m.parse_steps(steps)
        if isinstance(parsed, Rejected):
            return parsed

        def body():
            if conn.execute(
                self.q["revise"], {"id": proposal_id, "steps": _steps_json(parsed)}
            ).fetchone():
                return Won(), True
            row = conn.execute(self.q["run"], {"id": proposal_id}).fetchone()
            if row is not None and row[2] is not None:
                return m.COMPENSATION_IS_FROZEN, False
            return self._why_not(conn, proposal_id, "revise"), False

        return self._transaction(conn, "revise", body)

    def approve(self, conn: psycopg.Connection, proposal_id: int) -> Outcome:
        return self._conditional(conn, proposal_id, "approve")

    def reject(self, conn: psycopg.Connection, proposal_id: int) -> Outcome:
        return self._conditional(conn, proposal_id, "reject")

    def expire(self, conn: psycopg.Connection, proposal_id: int) -> Outcome:
        return self._conditional(conn, proposal_id, "expire")

    def mark_executing(self, conn: psycopg.Connection, proposal_id: int) -> Outcome:
        """The claim. Won(token)."""

        def body():
            row = conn.execute(self.q["mark_executing"], {"id": proposal_id}).fetchone()
            if row is not None:
                return Won(row[0]), True
            return self._why_not(conn, proposal_id, "mark_executing"), False

        return self._transaction(conn, "mark_executing", body)

    def heartbeat(self, conn: psycopg.Connection, proposal_id: int, token: int) -> Outcome:
        def body():
            if (
                conn.execute(self.q["heartbeat"], {"id": proposal_id, "token": token}).fetchone()
                is not None
            ):
                return Won(), True
            row = conn.execute(self.q["run"], {"id": proposal_id}).fetchone()
            if row is None:
                return m.no_proposal(proposal_id), False
            status, _failure, _compensates, generation = row
            return (
                m.fence("heartbeat", status, generation, token)
                or LostRace("heartbeat: not executing")
            ), False

        return self._transaction(conn, "heartbeat", body)

    def run_step(
        self, conn: psycopg.Connection, proposal_id: int, step_index: int, token: int
    ) -> Outcome:
        """One step in one transaction: fence, effect, receipt, heartbeat, transition.
        Won(Receipt)."""

        def body():
            answer, status, steps = self._step_begun(conn, proposal_id, step_index, token)
            if answer is not None:
                return answer, False
            ok = self._apply(conn, proposal_id, step_index, steps[step_index])
            receipt, moved = self._step_recorded(conn, proposal_id, step_index, ok, status, steps)
            assert moved, "the locked run left executing inside its own step"
            return Won(receipt), True

        return self._transaction(conn, "run_step", body)

    def _step_begun(
        self, conn: psycopg.Connection, proposal_id: int, step_index: int, token: int
    ) -> tuple[Outcome | None, str, tuple[m.Step, ...]]:
        """The first seam of a step: lock the run, fence the token, place the step. Returns an
        answer when the step is not to run (refused, or answered from its receipt), else None
        with the run's status and its frozen steps."""
        row = conn.execute(self.q["lock_executing"], {"id": proposal_id}).fetchone()
        if row is None:
            return m.no_proposal(proposal_id), "", ()
        status, generation, steps_json = row[:3]
        refused = m.fence("run_step", status, generation, token)
        if refused:
            return refused, status, ()
        done = self._steps_done(conn, proposal_id, row)
        steps = _steps(steps_json)
        checked = m.check_step_index(steps, done, step_index)
        if checked is True:  # already ran: answer from its receipt
            r = conn.execute(
                self.q["receipt"], {"id": proposal_id, "step_index": step_index}
            ).fetchone()
            return Won(m.Receipt(*r)), status, steps
        return checked, status, steps

    def _step_recorded(
        self,
        conn: psycopg.Connection,
        proposal_id: int,
        step_index: int,
        ok: bool,
        status: str,
        steps: tuple[m.Step, ...],
    ) -> tuple[m.Receipt, bool]:
        """The last seam of a step, after its effect: its receipt and its transition (which
        stamps the heartbeat). Returns the receipt and whether the transition moved the run."""
        receipt = m.Receipt(step_index, ok, m.describe(steps[step_index], ok))
        conn.execute(
            self.q["insert_receipt"],
            {"id": proposal_id, "step_index": step_index, "ok": ok, "detail": receipt.detail},
        )
        target = m.TABLE.next(status, m.step_event(ok, step_index, len(steps)))
        finished = conn.execute(
            self.q["finish_step"],
            {
                "id": proposal_id,
                "status": target,
                "failure": None if ok else m.step_failure(step_index, receipt.detail),
            },
        ).fetchone()
        return receipt, finished is not None

    def _steps_done(self, conn: psycopg.Connection, proposal_id: int, locked: tuple) -> int:
        """How many steps have a receipt: a statement of its own, after ``lock_executing`` (whose
        row is ``locked``), so it reads a snapshot taken after any wait for the run lock."""
        (done,) = conn.execute(self.q["steps_done"], {"id": proposal_id}).fetchone()
        return done

    def _apply(
        self, conn: psycopg.Connection, proposal_id: int, step_index: int, step: m.Step
    ) -> bool:
        """The step's effect on the demo tables; False (and no effect) when the step is not ok."""
        if step.op == "fail":
            return False
        params = {
            "id": proposal_id,
            "step_index": step_index,
            "account": step.account,
            "amount": step.amount,
        }
        return conn.execute(self.q[step.op], params).fetchone() is not None

    def read(self, conn: psycopg.Connection, proposal_id: int) -> Outcome:
        """The run as seen, after the lazy heal. Won(RunReport)."""

        def body():
            healed = self._heal(conn, proposal_id)
            seen = self._report(conn, proposal_id)
            return (m.no_proposal(proposal_id) if seen is None else Won(seen)), healed

        return self._transaction(conn, "read", body)

    def repeat(self, conn: psycopg.Connection, proposal_id: int) -> Outcome:
        """An execute request arriving again: a terminal run answers from its receipts,
        Won(RunReport)."""

        def body():
            healed = self._heal(conn, proposal_id)
            seen = self._report(conn, proposal_id)
            if seen is None:
                return m.no_proposal(proposal_id), healed
            if seen.status not in m.TERMINAL:
                return m.not_terminal(seen.status), healed
            return Won(seen), self._answered(conn, proposal_id, seen) or healed

        return self._transaction(conn, "repeat", body)

    def _answered(self, conn: psycopg.Connection, proposal_id: int, seen: m.RunReport) -> bool:
        """The seam after a repeat found its run terminal: the answer is its receipts, nothing
        runs again. Returns whether it wrote (the reference never does)."""
        return False

    def compensate(self, conn: psycopg.Connection, proposal_id: int) -> Outcome:
        """Propose the run that undoes this one's committed steps. Won(compensation id)."""

        def body():
            healed = self._heal(conn, proposal_id)
            row = conn.execute(self.q["lock_run"], {"id": proposal_id}).fetchone()
            if row is None:
                return m.no_proposal(proposal_id), healed
            status, steps_json = row
            refused = m.compensation_refusal(status)
            if refused:
                return refused, healed
            existing = conn.execute(self.q["compensation_of"], {"id": proposal_id}).fetchone()
            if existing is not None:
                return Won(existing[0]), healed
            receipts = [
                m.Receipt(*r) for r in conn.execute(self.q["receipts"], {"id": proposal_id})
            ]
            steps = m.compensation_steps(_steps(steps_json), receipts)
            if not steps:
                return m.NOTHING_TO_COMPENSATE, healed
            return Won(self._insert(conn, steps, proposal_id)), True

        return self._transaction(conn, "compensate", body)


def project(conn: psycopg.Connection, to_model_time: Callable[[datetime], int]) -> m.PlanState:
    """Every row of this kind, in the model's state shape, read by one statement (one snapshot).
    ``to_model_time`` turns a database timestamp into model seconds (the check owns that
    mapping)."""
    with boundary(f"{m.KIND}.project"):
        try:
            runs, receipt_rows, balance_rows, ledger_rows = conn.execute(
                QUERIES["project"]
            ).fetchone()
        finally:
            if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                rollback_quietly(conn)
    receipts: dict[int, list[m.Receipt]] = {}
    for pid, step_index, ok, detail in receipt_rows:
        receipts.setdefault(pid, []).append(m.Receipt(step_index, ok, detail))
    proposals = tuple(
        m.Proposal(
            pid,
            m.Status(status),
            _steps(steps),
            compensates,
            generation,
            None if hb is None else to_model_time(datetime.fromtimestamp(hb, timezone.utc)),
            failure,
            tuple(receipts.get(pid, ())),
        )
        for pid, status, steps, compensates, generation, hb, failure in runs
    )
    balances = tuple((a, b) for a, b in balance_rows)
    ledger = tuple(sorted(m.LedgerEntry(*r) for r in ledger_rows))
    return m.PlanState(proposals, balances, ledger)


# ---------------------------------------------------------------------------------------
# The loops that run it, as deployed (the soak runs them as processes).
# ---------------------------------------------------------------------------------------


class PlanExecutor(StoreLoop):
    """The approved-plan executor, deployed: claims one approved plan (``mark_executing``, which
    hands out the claim token), then runs each step in payload order under the token (a step
    stamps the heartbeat itself; one step in three is a long one, which renews the heartbeat
    halfway). A step that loses its connection is retried *as the same step*: its identity is
    its position in the frozen payload, so a retry of a step that did commit is answered from
    its receipt. A fenced heartbeat or step (the run is no longer executing under this token)
    ends the run for this executor: somebody healed it, and nothing it does counts. ``pace``:
    seconds a step prepares (twice that for a long one, steps 2, 5, ...); ``retries``: how
    often one step is retried after lost connections before the executor gives the run up to
    the lazy heal."""

    queries = QUERIES
    idle, pace, batch, retries = 0.1, 0.1, 5, 30

    def run_once(self) -> int:
        for pid, n_steps in self.find("plans_ready", n=self.batch):
            claimed = self.store.mark_executing(self.conn(), pid)
            if isinstance(claimed, Won):
                self.stats.claimed += 1
                self.execute(pid, n_steps, claimed.value)
                return 1
            self.stats.fenced += 1
        return 0

    def execute(self, pid: int, n_steps: int, token: int) -> None:
        step, failures = 0, 0
        while step < n_steps:
            if self.stop.wait(self.pace):
                return
            try:
                if step % 3 == 2:  # a long step: renew the lease halfway through its preparation
                    beat = self.store.heartbeat(self.conn(), pid, token)
                    if not isinstance(beat, Won):
                        self.stats.fenced += 1
                        return
                    if self.stop.wait(self.pace):
                        return
                out = self.store.run_step(self.conn(), pid, step, token)
            except KnownstateError:
                self.stats.errors += 1
                self.drop()
                failures += 1
                if failures > self.retries:
                    return
                continue  # the same step again: a retry of a committed step finds its receipt
            if not isinstance(out, Won):
                self.stats.fenced += 1
                return
            self.stats.done += 1
            if not out.value.ok:
                return  # the run failed at this step: no step after it runs
            step += 1


class PlanReader(StoreLoop):
    """What reads runs: a status page polling the executing ones (each read heals a stale run,
    the approved plan's only reaper) and repeated execute requests on finished ones (answered
    from receipts)."""

    queries = QUERIES
    idle, repeats = 0.3, 2

    def run_once(self) -> int:
        for (pid,) in self.find("plans_executing", n=50):
            self.store.read(self.conn(), pid)
        for (pid,) in self.find("plans_finished", n=self.repeats):
            self.store.repeat(self.conn(), pid)
        return 0
