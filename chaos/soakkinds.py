"""Each kind's soak binding: how the soak's judge reads its rows.

The soak's judge (:mod:`knownstate.chaos.judge`) is the same for every kind; what differs is
data and a few small functions, and they live here, one :class:`SoakKind` per kind.

How the judge reads a kind: each committed row version as a run (:class:`~.judge.RunRow`: key,
status, fence token, lease) or as a step's receipt or effect (:class:`~.judge.StepRow`); a run as
the contract's :class:`~knownstate.model.contract.RunView`; which operations write as the run's
owner, take a run back, create one.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from datetime import datetime
from typing import Any

from knownstate.model.contract import Contract, RunView, StepView
from knownstate.model.describe import RunKind

from . import effects
from .history import Audit
from .judge import Judging, Replay, RunRow, StepRow


def ts(value: Any) -> float | None:
    """A timestamp from a row (ISO text from to_jsonb, a datetime, or epoch seconds)."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, datetime):
        return value.timestamp()
    return datetime.fromisoformat(str(value)).timestamp()


def queue_view(contract: Contract):
    """A queued run's view: its status and fence token (the claimed attempt; without one,
    whether it is owned). Its single step is judged with its external effect (:mod:`.effects`)."""

    def view(row: RunRow, counts: Counter) -> RunView:
        token = row.token if isinstance(row.token, int) else int(row.status in contract.owned)
        return RunView(run_id=row.key, status=row.status, fence_token=token)

    return view


# ---------------------------------------------------------------------------------------
# The binding.
# ---------------------------------------------------------------------------------------


class SoakKind:
    """A kind's soak binding. A subclass sets the class attributes and :meth:`judging`."""

    name: str = ""
    description: RunKind

    def judging(self, config: dict) -> Judging:
        raise NotImplementedError

    def _judging(self, contract: Contract, **kw) -> Judging:
        d = self.description
        return Judging(
            contract=contract,
            fence=d.fence.kind,
            app_clock_lease=d.lease is not None and d.lease.clock == "application",
            **kw,
        )


def _contract(name: str) -> Contract:
    from . import kinds

    return kinds.check(name).contract


def _built_in(name: str) -> RunKind:
    from knownstate.model.descriptions import BUILT_IN

    return next(d for d in BUILT_IN if d.name == name)


# ---------------------------------------------------------------------------------------
# The outbox.
# ---------------------------------------------------------------------------------------


class OutboxSoak(SoakKind):
    name = "outbox"

    def __init__(self) -> None:
        self.description = _built_in(self.name)

    def judging(self, config: dict) -> Judging:
        contract = _contract(self.name)

        def row(a: Audit, old: bool) -> RunRow | None:
            r = a.old if old else a.new
            if a.table != "outbox_delivery" or r is None:
                return None
            return RunRow(str(r["id"]), r["status"], r["attempts"], ts(r.get("lease_until")))

        return self._judging(
            contract,
            row=row,
            view=queue_view(contract),
            owner_writes=frozenset({"complete", "fail", "record_batch", "extend_lease"}),
            heartbeats=frozenset({"extend_lease"}),
            take_backs=frozenset({"reclaim_stale"}),
            creations=frozenset({"enqueue"}),
            done="sent",
            extras=(effects.at_least_once,),
        )


# ---------------------------------------------------------------------------------------
# The approved plan.
# ---------------------------------------------------------------------------------------


class PlanSoak(SoakKind):
    name = "approved-plan"

    def __init__(self) -> None:
        self.description = _built_in(self.name)

    def judging(self, config: dict) -> Judging:
        contract, heartbeat_s = _contract(self.name), config["heartbeat_s"]

        def row(a: Audit, old: bool) -> RunRow | StepRow | None:
            r = a.old if old else a.new
            if r is None:
                return None
            if a.table == "agent_proposal":
                beat = ts(r.get("heartbeat_at"))
                lease = None if beat is None else beat + heartbeat_s
                steps = {"steps": len(r.get("steps") or ())}
                return RunRow(str(r["id"]), r["status"], r["generation"], lease, steps)
            if a.table == "agent_proposal_step":
                what = "receipt" if r["ok"] else "failed"
                return StepRow(str(r["proposal_id"]), str(r["step_index"]), what)
            if a.table == "demo_ledger":
                return StepRow(str(r["proposal_id"]), str(r["step_index"]), "effect")
            return None

        def view(row: RunRow, counts: Counter) -> RunView:
            ids = sorted({step for step, _ in counts}, key=int)
            return RunView(
                run_id=row.key,
                status=row.status,
                fence_token=row.token,
                steps={
                    s: StepView(
                        receipts=counts[(s, "receipt")],
                        effects=counts[(s, "effect")],
                        failed=counts[(s, "failed")],
                    )
                    for s in ids
                },
                valid_step_ids=frozenset(str(i) for i in range(row.extra.get("steps", 0))),
            )

        return self._judging(
            contract,
            row=row,
            view=view,
            owner_writes=frozenset({"run_step", "heartbeat"}),
            heartbeats=frozenset({"heartbeat"}),
            take_backs=frozenset({"read", "repeat", "compensate"}),
            creations=frozenset({"propose"}),
            done="executed",
            token_noun="token",
            extras=(_next_step_refused, _receipts_in_order),
        )


def _next_step_refused(r: Replay) -> None:
    """A step is its position in the frozen payload: a run_step asked for the next step (as
    many receipts committed as its index, all by its own executor's earlier operations: only
    the holder of the run's token writes them, one operation after another) is never refused."""
    receipts: dict[str, list] = defaultdict(list)
    for a in r.h.audit:
        if a.table == "agent_proposal_step" and a.op == "INSERT" and a.ref in r.ops:
            receipts[str(a.row["proposal_id"])].append(r.ops[a.ref])
    for o in r.h.ops:
        asked = o.args.get("step_index")
        if o.name != "run_step" or o.out != "rejected" or type(asked) is not int:
            continue
        for run in o.runs:
            done = sum(1 for w in receipts.get(run, []) if w.inc == o.inc and w.t0 < o.t0)
            row = r.rows.get(run)
            if row is not None and asked == done < row.extra.get("steps", 0):
                r.finding(
                    "stable-step-identity",
                    f"{o.inc} run_step({run}, step {asked}) was refused ({o.value}), but "
                    f"step {asked} was the next of its payload ({done} receipt(s) before it)",
                    run,
                    t=o.t1 if o.t1 is not None else o.t0,
                    ref=o.ref,
                )


def _receipts_in_order(r: Replay) -> None:
    """Receipts are a prefix of the payload; an executed plan has every one, each ok."""
    for run, row in r.rows.items():
        counts = r.steps[run]
        got = sorted(
            {int(s) for (s, what), n in counts.items() if n and what in ("receipt", "failed")}
        )
        if got != list(range(len(got))):
            r.finding(
                "stable-step-identity",
                f"plan {run} has receipts for steps {got}: not a prefix of its payload",
                run,
            )
        ok = sum(1 for (s, what), n in counts.items() if n and what == "receipt")
        if row.status == r.k.done and (ok != row.extra.get("steps") or len(got) != ok):
            r.finding(
                "receipt-with-effect",
                f"plan {run} is {row.status} with {ok} ok receipt(s) for "
                f"{row.extra.get('steps')} step(s)",
                run,
            )


# ---------------------------------------------------------------------------------------
# The branch reset.
# ---------------------------------------------------------------------------------------


class ResetSoak(SoakKind):
    name = "branch-reset"

    def __init__(self) -> None:
        self.description = _built_in(self.name)

    def judging(self, config: dict) -> Judging:
        contract = _contract(self.name)

        def row(a: Audit, old: bool) -> RunRow | None:
            r = a.old if old else a.new
            if a.table != "branch_reset" or r is None:
                return None
            extra = {"op_id": r.get("external_op_id")}
            lease = ts(r.get("lease_until"))
            return RunRow(str(r["id"]), r["status"], r.get("claimed_by"), lease, extra)

        return self._judging(
            contract,
            row=row,
            view=queue_view(contract),
            owner_writes=frozenset({"poll"}),
            take_backs=frozenset({"reap"}),
            creations=frozenset({"request"}),
            done="succeeded",
            token_noun="owner",
            extras=(effects.create_once,),
        )
