"""The soak: its history judge on hand-made histories, its nemesis schedule, its timeline, and
real soaks (the reference passes, a mutant fails with an attributed violation, a part killed
from outside is exit 3, nothing is left running).

The hand-made histories are small and exact: a reference-shaped history of each kind passes,
and each rule of the judge is violated once by a variant of it (one row of the audit or one
record of a stand-in changed), and must be reported under the invariant it breaks, naming the
worker and the nemesis period around it.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from knownstate.chaos import faults, kinds, nemesis, soak, soakparts, soakworker, timeline
from knownstate.chaos.judge import judge
from knownstate.chaos.history import Audit, History, Op, Period, Proc
from knownstate.impl import outbox as outbox_impl
from knownstate.model.contract import INVARIANTS
from knownstate.model.outbox import Claim, Config
from polling import poll

T0 = 1_000_000.0


def op(
    ref: str,
    name: str,
    runs: dict,
    t0: float,
    t1: float | None = -1.0,
    out: str | None = "won",
    value=None,
    app_now: float | None = None,
) -> Op:
    end = t0 + 0.1 if t1 == -1.0 else t1
    return Op(
        ref,
        ref.split(".")[0],
        name,
        runs,
        T0 + t0,
        None if end is None else T0 + end,
        out if end is not None else None,
        value,
        app_now=None if app_now is None else T0 + app_now,
    )


def upd(i: int, table: str, ref: str | None, old: dict, new: dict, at: float = 0.0) -> Audit:
    return Audit(i, table, "UPDATE", ref, old, new, T0 + at)


def ins(i: int, table: str, ref: str | None, new: dict, at: float = 0.0) -> Audit:
    return Audit(i, table, "INSERT", ref, None, new, T0 + at)


def history(kind: str, records, audit, periods=(), **external) -> History:
    procs = sorted({o.proc for o in records})
    xid = 100
    for i, a in enumerate(audit):  # one transaction per operation, as its statements commit
        if not a.xid:
            xid += 0 if i and audit[i - 1].ref == a.ref and audit[i - 1].xid == xid else 1
            a.xid = xid
    return History(
        kind,
        1,
        T0,
        {"heartbeat_s": 3, "lease": 3},
        [Proc(p, 1, "worker", 0, T0) for p in procs],
        list(records),
        list(periods),
        list(audit),
        dict(external),
        quiet_from=T0 + 20,
    )


def judged(h: History):
    """The soak's judge on ``h``, with its kind's soak binding (from the registry)."""
    return judge(h, kinds.soak(h.kind))


def stop(proc: str, start: float, end: float) -> Period:
    return Period("worker-stall", proc, T0 + start, T0 + end)


# ---------------------------------------------------------------------------------------
# The outbox.
# ---------------------------------------------------------------------------------------


def delivery(status: str, attempts: int, lease: float | None = None) -> dict:
    return {
        "id": 1,
        "status": status,
        "attempts": attempts,
        "lease_until": None if lease is None else T0 + lease,
    }


def outbox_history(variant: str = "") -> History:
    """w0 claims delivery 1 and sends it, then stalls past its lease; the reaper takes the run
    back, w1 claims attempt 2, sends and completes it; w0 wakes and its complete is fenced."""
    ops = [
        op("p0.1:1", "enqueue", {"1": None}, 0.0),
        op("w0.1:1", "claim_batch", {"1": 1}, 1.0),
        op("w0.1:2", "send", {"1": 1}, 1.1, out="ok"),
        op("r0.1:1", "reclaim_stale", {}, 5.0, value=[1]),
        op("w1.1:1", "claim_batch", {"1": 2}, 5.2),
        op("w1.1:2", "send", {"1": 2}, 5.3, out="ok"),
        op("w1.1:3", "complete", {"1": 2}, 5.4),
        op("w0.1:3", "complete", {"1": 1}, 6.1, out="lost"),
    ]
    audit = [
        ins(1, "outbox_delivery", "p0.1:1", delivery("pending", 0)),
        upd(
            2,
            "outbox_delivery",
            "w0.1:1",
            delivery("pending", 0),
            delivery("processing", 1, 4),
            1.0,
        ),
        upd(
            3,
            "outbox_delivery",
            "r0.1:1",
            delivery("processing", 1, 4),
            delivery("pending", 1),
            5.0,
        ),
        upd(
            4,
            "outbox_delivery",
            "w1.1:1",
            delivery("pending", 1),
            delivery("processing", 2, 8),
            5.2,
        ),
        upd(5, "outbox_delivery", "w1.1:3", delivery("processing", 2, 8), delivery("sent", 2), 5.4),
    ]
    deliveries = [(T0 + 1.15, 1, 1, 200), (T0 + 5.35, 1, 2, 200)]
    if variant == "stale-complete-landed":  # w0's complete lands while w1 holds attempt 2
        audit[4] = upd(
            5, "outbox_delivery", "w0.1:3", delivery("processing", 2, 8), delivery("sent", 2), 6.1
        )
        ops[-1].out = "won"
    elif variant == "complete-of-a-pending-row":  # no status guard: the reclaimed row is completed
        audit[3:] = [
            upd(4, "outbox_delivery", "w0.1:3", delivery("pending", 1), delivery("sent", 1), 6.1)
        ]
        deliveries = deliveries[:1]
    elif variant == "reaper-touches-sent":
        audit.append(
            upd(6, "outbox_delivery", "r0.1:1", delivery("sent", 2), delivery("pending", 2), 7.0)
        )
    elif variant == "claim-without-bump":  # w1 claims attempt 1 again, and completes it
        for o in ops[4:7]:
            o.runs = {"1": 1}
        audit[3:] = [
            upd(
                4, "outbox_delivery", "w1.1:1", delivery("pending", 1), delivery("processing", 1, 8)
            )
        ]
        audit.append(
            upd(5, "outbox_delivery", "w1.1:3", delivery("processing", 1, 8), delivery("sent", 1))
        )
        deliveries[1] = (T0 + 5.35, 1, 1, 200)
    elif variant == "reclaim-of-a-live-lease":
        audit[2] = upd(
            3,
            "outbox_delivery",
            "r0.1:1",
            delivery("processing", 1, 9),
            delivery("pending", 1),
            5.0,
        )
    elif variant == "left-processing":
        audit = audit[:4]
    elif variant == "left-pending":
        audit = audit[:3]
    elif variant == "enqueue-won-never-committed":
        ops.append(op("p0.1:2", "enqueue", {"2": None}, 0.5))
    elif variant == "sent-never-reached-the-sink":
        deliveries = deliveries[:1]
    elif variant == "same-attempt-accepted-twice":
        deliveries = [(*d, ref) for d, ref in zip(deliveries, ("w0.1:2", "w1.1:2"), strict=True)]
        deliveries.append((T0 + 5.6, 1, 2, 200, "w0.1:4"))
    return history("outbox", ops, audit, [stop("w0", 1.2, 6.0)], deliveries=deliveries)


def test_reference_outbox_history_passes_and_its_duplicate_is_attributed_to_the_lapsed_lease():
    h = outbox_history()
    v = judged(h)
    assert v.passed, [f.line(T0) for f in v.findings]
    assert v.runs == v.terminal == 1
    (d,) = v.duplicates
    assert (d.run, d.owner, d.attempt, d.why) == ("1", "w0.1", 1, "lease lapsed, reclaimed")
    assert "r0.1 took it back at +5.0 s" in d.cause and "never recorded an outcome" not in d.cause
    assert [p.kind for p in d.periods] == ["worker-stall"] and d.periods[0].target == "w0"
    assert v.observed["lost race or fence refusal"] == 1


OUTBOX_RULES = [
    (
        "stale-complete-landed",
        "lease-fence",
        "w0.1 complete(1) carried attempt 1 and landed, but the row "
        "was at attempt 2: its lease had lapsed and r0.1 took the run back at +5.0 s, "
        "claimed by w1.1",
    ),
    (
        "complete-of-a-pending-row",
        "conditional-transition",
        "complete(1): run 1 moved pending -> sent",
    ),
    (
        "reaper-touches-sent",
        "terminal-answers-from-receipts",
        "r0.1 reclaim_stale(1): run 1 changed after it was terminal (sent) (sent -> pending)",
    ),
    (
        "claim-without-bump",
        "lease-fence",
        "w1.1 claim_batch(1): run 1 was claimed (pending -> processing) keeping fence token 1",
    ),
    (
        "reclaim-of-a-live-lease",
        "lease",
        "r0.1 reclaim_stale took 1 back while its lease was live (4.0 s left by the database "
        "clock)",
    ),
    ("left-processing", "lease", "still processing after the quiet period"),
    ("left-pending", "conditional-transition", "still pending after the quiet period"),
    (
        "enqueue-won-never-committed",
        "receipt-with-effect",
        "enqueue(2) answered won, but the run never committed",
    ),
    (
        "sent-never-reached-the-sink",
        "external-effect-semantics",
        "recorded 1 as sent under attempt 2, but the stand-in never accepted that attempt",
    ),
    (
        "same-attempt-accepted-twice",
        "lease-fence",
        "more than once under attempt 2 (sent by w1.1:2, w0.1:4)",
    ),
]


@pytest.mark.parametrize("variant, invariant, says", OUTBOX_RULES, ids=[r[0] for r in OUTBOX_RULES])
def test_each_outbox_rule_is_reported_under_the_invariant_it_breaks(variant, invariant, says):
    v = judged(outbox_history(variant))
    assert v.findings and v.findings[0].invariant == invariant, [f.line(T0) for f in v.findings]
    assert says in v.findings[0].message
    assert invariant in INVARIANTS
    if variant == "reaper-touches-sent":  # it also leaves the run pending: lost, reported too
        assert [f.invariant for f in v.findings][1:] == ["conditional-transition"]
    elif variant == "claim-without-bump":  # two workers then hold attempt 1: the sink says so
        assert "two workers held the same attempt" in v.findings[1].message
    else:
        assert len(v.findings) == 1, [f.line(T0) for f in v.findings]


def test_a_stale_write_is_attributed_to_the_nemesis_period_that_lapsed_its_lease():
    (f,) = judged(outbox_history("stale-complete-landed")).findings
    assert f.ref == "w0.1:3" and f.run == "1"
    assert [(p.kind, p.target) for p in f.periods] == [("worker-stall", "w0")]
    assert "worker-stall w0 +1.2..+6.0 s" in f.line(T0)


# ---------------------------------------------------------------------------------------
# The approved plan.
# ---------------------------------------------------------------------------------------

STEPS = [
    {"op": "credit", "account": "a", "amount": 5},
    {"op": "credit", "account": "b", "amount": 3},
]


def plan(status: str, generation: int = 0, hb: float | None = None) -> dict:
    return {
        "id": 1,
        "status": status,
        "steps": STEPS,
        "generation": generation,
        "heartbeat_at": None if hb is None else T0 + hb,
    }


def effect(i: int, ref: str, step: int, at: float) -> list[Audit]:
    return [
        ins(
            i,
            "demo_ledger",
            ref,
            {"proposal_id": 1, "step_index": step, "account": "ab"[step], "delta": (5, 3)[step]},
            at,
        ),
        ins(
            i + 1,
            "agent_proposal_step",
            ref,
            {"proposal_id": 1, "step_index": step, "ok": True},
            at,
        ),
    ]


def plan_history(variant: str = "") -> History:
    ops = [
        op("p0.1:1", "propose", {}, 0.0, value=1),
        op("p0.1:2", "approve", {"1": None}, 0.2),
        op("w0.1:1", "mark_executing", {"1": None}, 1.0, value=1),
        op("w0.1:2", "run_step", {"1": 1}, 1.2),
        op("w0.1:3", "run_step", {"1": 1}, 1.4),
        op("r0.1:1", "read", {"1": None}, 2.0),
    ]
    audit = [
        ins(1, "agent_proposal", "p0.1:1", plan("pending")),
        upd(2, "agent_proposal", "p0.1:2", plan("pending"), plan("approved"), 0.2),
        upd(3, "agent_proposal", "w0.1:1", plan("approved"), plan("executing", 1, 1.0), 1.0),
        *effect(4, "w0.1:2", 0, 1.2),
        upd(
            6, "agent_proposal", "w0.1:2", plan("executing", 1, 1.0), plan("executing", 1, 1.2), 1.2
        ),
        *effect(7, "w0.1:3", 1, 1.4),
        upd(
            9, "agent_proposal", "w0.1:3", plan("executing", 1, 1.2), plan("executed", 1, 1.4), 1.4
        ),
    ]
    if variant in ("step-after-heal-landed", "heal-of-a-live-run"):
        at = (
            9.0 if variant == "step-after-heal-landed" else 2.5
        )  # the heartbeat is 1.2 s old at 2.5
        ops[5] = op("r0.1:1", "read", {"1": None}, at)
        ops[4] = op("w0.1:3", "run_step", {"1": 1}, 9.5)
        audit[6:] = [
            upd(
                7, "agent_proposal", "r0.1:1", plan("executing", 1, 1.2), plan("failed", 1, 1.2), at
            )
        ]
        if variant == "step-after-heal-landed":  # no lock, no status check: the step lands anyway
            audit += effect(8, "w0.1:3", 1, 9.5)
    elif variant == "step-stalled-inside-its-transaction":
        # No lock: w0's second step wrote its effect, stalled before finish_step, the read healed
        # the run meanwhile, and w0's transaction committed after the heal. Audit ids are drawn
        # when a change is made; the transactions are ordered by when they committed.
        ops[5] = op("r0.1:1", "read", {"1": None}, 9.0)
        ops[4] = op("w0.1:3", "run_step", {"1": 1}, 1.4, 9.6)
        audit[6:] = [
            *effect(7, "w0.1:3", 1, 1.4),
            upd(
                9,
                "agent_proposal",
                "r0.1:1",
                plan("executing", 1, 1.2),
                plan("failed", 1, 1.2),
                9.0,
            ),
            upd(
                10,
                "agent_proposal",
                "w0.1:3",
                plan("failed", 1, 1.2),
                plan("executed", 1, 9.5),
                9.5,
            ),
        ]
        for a, xid in zip(audit[6:], (50, 50, 51, 50), strict=True):
            a.xid = xid
    elif variant == "heartbeat-after-heal-landed":
        # Held stopped past its heartbeat (a hold of the nemesis): the read healed the run to
        # failed, and the owner's heartbeat, unfenced, renewed the lease of a failed run.
        ops[5] = op("r0.1:1", "read", {"1": None}, 9.0)
        ops[4] = op("w0.1:3", "heartbeat", {"1": 1}, 9.5)
        audit[6:] = [
            upd(
                7,
                "agent_proposal",
                "r0.1:1",
                plan("executing", 1, 1.2),
                plan("failed", 1, 1.2),
                9.0,
            ),
            upd(8, "agent_proposal", "w0.1:3", plan("failed", 1, 1.2), plan("failed", 1, 9.5), 9.5),
        ]
    elif variant in ("next-step-refused", "step-wrote-another-step"):
        # Step identity a count of calls: w0's call for step 1 lost its connection before
        # anything committed; its retry, counted as call 2, asked the store for step 2.
        ops[3].args = {"step_index": 0}
        ops[4] = op("w0.1:3", "run_step", {"1": 1}, 1.4, out="conn-lost")
        ops[4].args = {"step_index": 1}
        ops.insert(
            5,
            op(
                "w0.1:4",
                "run_step",
                {"1": 1},
                1.6,
                out="rejected",
                value="run_step: step 2 out of order, step 1 is next",
            ),
        )
        ops[5].args = {"step_index": 1}
        if variant == "step-wrote-another-step":
            # Or: w0's call for step 0 committed, but its answer was lost; its retry of step 0,
            # counted as call 2, ran step 1 (as the next one) under the call for step 0.
            ops[3] = op("w0.1:2", "connect", {}, 1.2)
            ops[4] = op("w0.1:3", "run_step", {"1": 1}, 1.4, out="indeterminate")
            ops[5] = op("w0.1:4", "run_step", {"1": 1}, 1.6)
            ops[4].args = ops[5].args = {"step_index": 0}
            for a, ref in zip(audit[3:], ["w0.1:3"] * 3 + ["w0.1:4"] * 3, strict=True):
                a.ref = ref
        else:
            audit[6:] = [
                upd(
                    7,
                    "agent_proposal",
                    "r0.1:1",
                    plan("executing", 1, 1.2),
                    plan("failed", 1, 1.2),
                    9.0,
                )
            ]
            ops[6] = op("r0.1:1", "read", {"1": None}, 9.0)
    elif variant == "repeat-reexecutes":
        ops.append(op("r0.1:2", "repeat", {"1": None}, 3.0))
        audit += effect(10, "r0.1:2", 0, 3.0)[:1]
    elif variant == "effect-without-receipt":
        del audit[7]  # step 1's receipt
    return history("approved-plan", ops, audit, [stop("w0", 1.5, 9.4)] if "heal" in variant else [])


def test_reference_plan_history_passes():
    v = judged(plan_history())
    assert v.passed, [f.line(T0) for f in v.findings]
    assert v.runs == v.terminal == 1 and not v.duplicates


PLAN_RULES = [
    (
        "step-after-heal-landed",
        "lease-fence",
        "w0.1 run_step(1) carried token 1 and landed, but the run was failed under token 1: its "
        "lease had lapsed and r0.1 took the run back at +9.0 s",
    ),
    (
        "step-stalled-inside-its-transaction",
        "lease-fence",
        "w0.1 run_step(1) carried token 1 and landed, but the run was failed under token 1: its "
        "lease had lapsed and r0.1 took the run back at +9.0 s",
    ),
    (
        "heartbeat-after-heal-landed",
        "lease-fence",
        "w0.1 heartbeat(1) carried token 1 and landed, but the run was failed under token 1: its "
        "lease had lapsed and r0.1 took the run back at +9.0 s",
    ),
    (
        "heal-of-a-live-run",
        "lease",
        "r0.1 read took 1 back while its lease was live (1.7 s left by the database clock)",
    ),
    (
        "next-step-refused",
        "stable-step-identity",
        "w0.1 run_step(1, step 1) was refused (run_step: step 2 out of order, step 1 is next), "
        "but step 1 was the next of its payload (1 receipt(s) before it)",
    ),
    (
        "step-wrote-another-step",
        "stable-step-identity",
        "w0.1 run_step(1, step 0) wrote the effect of step 1",
    ),
    (
        "repeat-reexecutes",
        "terminal-answers-from-receipts",
        "r0.1 repeat(1): run 1 changed after it was terminal (executed)",
    ),
    ("effect-without-receipt", "receipt-with-effect", "run 1 step 1: 1 effect(s) but 0 receipt(s)"),
]


@pytest.mark.parametrize("variant, invariant, says", PLAN_RULES, ids=[r[0] for r in PLAN_RULES])
def test_each_plan_rule_is_reported_under_the_invariant_it_breaks(variant, invariant, says):
    v = judged(plan_history(variant))
    assert v.findings, "the judge missed it"
    assert v.findings[0].invariant == invariant, [f.line(T0) for f in v.findings]
    assert any(says in f.message for f in v.findings if f.invariant == invariant), [
        f.line(T0) for f in v.findings
    ]
    if variant in ("step-after-heal-landed", "heartbeat-after-heal-landed"):
        assert v.findings[0].periods and v.findings[0].periods[0].target == "w0"


def test_a_batched_record_names_each_row_it_writes_with_the_attempt_it_carries():
    from knownstate.model.outbox import OK, RETRYABLE, Claim, Report

    reports = [Report(Claim(7, 2), OK), Report(Claim(9, 1), RETRYABLE)]
    runs, _ = soakworker._fields({"self": None, "conn": None, "reports": reports, "errors": []})
    assert runs == {"7": 2, "9": 1}, "else the judge cannot fence a batch's stale row"


# ---------------------------------------------------------------------------------------
# The branch reset.
# ---------------------------------------------------------------------------------------


def reset(status: str, lease: float | None = None, op_id: str | None = None) -> dict:
    return {
        "id": "b0#1",
        "status": status,
        "lease_until": None if lease is None else T0 + lease,
        "external_op_id": op_id,
    }


def reset_history(variant: str = "") -> History:
    ops = [
        op("p0.1:1", "request", {}, 0.0, value="b0#1"),
        op("w0.1:1", "start", {"b0#1": None}, 1.0, 1.2, app_now=1.0),
        op("w0.1:2", "poll", {"b0#1": None}, 2.0, app_now=2.0),
    ]
    audit = [
        ins(1, "branch_reset", "p0.1:1", reset("queued")),
        upd(2, "branch_reset", "w0.1:1", reset("queued"), reset("running", 5), 1.0),
        upd(3, "branch_reset", "w0.1:1", reset("running", 5), reset("running", 5, "op-1"), 1.0),
        upd(
            4,
            "branch_reset",
            "w0.1:2",
            reset("running", 5, "op-1"),
            reset("succeeded", None, "op-1"),
            2.0,
        ),
    ]
    creates = [(T0 + 1.1, "b0#1", "b0#1", "op-1", True)]
    api_ops = [{"id": "op-1", "run_id": "b0#1", "status": "succeeded"}]
    if variant == "second-creation":
        creates.append((T0 + 2.05, "b0#1", "b0#1/1", "op-2", True))
    elif variant == "poll-after-its-lease-lapsed":
        ops[2] = op("w0.1:2", "poll", {"b0#1": None}, 6.0, app_now=6.0)
    elif variant == "reap-of-a-live-lease":
        ops.append(op("r0.1:1", "reap", {}, 3.0, app_now=3.0))
        audit[3] = upd(
            4,
            "branch_reset",
            "r0.1:1",
            reset("running", 5, "op-1"),
            reset("failed", None, "op-1"),
            3.0,
        )
    elif variant == "late-request-of-a-start-that-gave-up":
        # w1's start timed out waiting (its request slowed), w0's start created the operation,
        # then w1's request arrived: answered with the existing operation.
        ops.append(op("w1.1:1", "start", {"b0#1": None}, 0.2, 1.0, out="ext-failed"))
        creates = [
            (T0 + 1.1, "b0#1", "b0#1", "op-1", True, "w0.1:1"),
            (T0 + 1.15, "b0#1", "b0#1", "op-1", False, "w1.1:1"),
        ]
    elif variant == "dedup-after-a-killed-start":
        ops.append(op("w1.1:1", "start", {"b0#1": None}, 0.9, None))  # killed inside its start
        creates = [
            (T0 + 0.95, "b0#1", "b0#1", "op-1", True),
            (T0 + 1.1, "b0#1", "b0#1", "op-1", False),
        ]
    h = history(
        "branch-reset",
        ops,
        audit,
        [Period("process-kill", "w1", T0 + 0.97, T0 + 2.0)],
        creates=creates,
        **{"ops": api_ops},
    )
    for p in h.procs:
        if p.name == "w1" and variant == "dedup-after-a-killed-start":
            p.end, p.how = T0 + 0.97, "killed"
    return h


def test_reference_reset_history_passes():
    v = judged(reset_history())
    assert v.passed and not v.duplicates, [f.line(T0) for f in v.findings]


def test_a_late_create_request_is_attributed_to_the_start_that_sent_it():
    v = judged(reset_history("late-request-of-a-start-that-gave-up"))
    assert v.passed, [f.line(T0) for f in v.findings]
    (d,) = v.duplicates
    assert (d.owner, d.attempt) == ("w1.1", "w1.1:1")
    assert d.why == "late request of a start that ended ext-failed"
    assert d.t == T0 + 1.15


def test_a_deduplicated_create_is_attributed_to_the_start_that_died_after_it():
    v = judged(reset_history("dedup-after-a-killed-start"))
    assert v.passed, [f.line(T0) for f in v.findings]
    (d,) = v.duplicates
    assert (d.owner, d.attempt, d.why) == ("w1.1", "w1.1:1", "start died before COMMIT")
    assert [(p.kind, p.target) for p in d.periods] == [("process-kill", "w1")]


RESET_RULES = [
    (
        "second-creation",
        "external-effect-semantics",
        "run b0#1: external operation created 2 times (one is allowed): the second, operation "
        "op-2, was created during w0.1 poll(b0#1)",
    ),
    (
        "poll-after-its-lease-lapsed",
        "lease-fence",
        "w0.1 poll(b0#1) carried a lease lapsed by its own clock and landed (lease until +5.0 s, "
        "its clock read +6.0 s)",
    ),
    (
        "reap-of-a-live-lease",
        "lease",
        "r0.1 reap took b0#1 back while its lease was live (2.0 s left by the taker's clock)",
    ),
]


@pytest.mark.parametrize("variant, invariant, says", RESET_RULES, ids=[r[0] for r in RESET_RULES])
def test_each_reset_rule_is_reported_under_the_invariant_it_breaks(variant, invariant, says):
    v = judged(reset_history(variant))
    assert [f.invariant for f in v.findings] == [invariant], [f.line(T0) for f in v.findings]
    assert says in v.findings[0].message, v.findings[0].message


# ---------------------------------------------------------------------------------------
# Recorded soaks: what the hand-written judge said of them, the contract's judge says.
# ---------------------------------------------------------------------------------------

FIXTURES = Path(__file__).parent / "fixtures" / "soak"


def recorded(path: Path) -> tuple[History, dict]:
    """A 20 s soak recorded before the judge was rewritten (its connect operations left out),
    and the hand-written judge's verdict of it."""
    import gzip

    doc = json.loads(gzip.decompress(path.read_bytes()))
    h = doc["history"]
    ext = {k: [tuple(x) if isinstance(x, list) else x for x in v] for k, v in h["external"].items()}
    history = History(
        h["kind"],
        h["seed"],
        h["t0"],
        h["config"],
        [Proc(**p) for p in h["procs"]],
        [Op(**o) for o in h["ops"]],
        [Period(**p) for p in h["periods"]],
        [Audit(**a) for a in h["audit"]],
        ext,
        h["mutant"],
        h["quiet_from"],
    )
    return history, doc["judged by the hand-written judge"]


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("*.json.gz")), ids=lambda p: p.name[:-8])
def test_recorded_soaks_get_the_verdicts_the_hand_written_judge_gave(path):
    h, before = recorded(path)
    v = judged(h)
    assert v.passed == before["passed"], [f.line(h.t0) for f in v.findings[:5]]
    assert sorted({f.invariant for f in v.findings}) == before["invariants"]
    assert len(v.duplicates) == before["duplicates"]
    for f in v.findings:  # each attributed: a worker's operation, the nemesis around it
        assert f.run and (f.ref is None or f.ref.split(":")[0][0] in "pwr"), f.line(h.t0)


# ---------------------------------------------------------------------------------------
# The nemesis schedule and the timeline.
# ---------------------------------------------------------------------------------------

PROCS = ["w0", "w1", "w2", "p0", "r0"]


def test_the_schedule_is_a_function_of_the_seed():
    one = nemesis.schedule(7, 200, PROCS, 3.0, "sink", (503, 422))
    assert one == nemesis.schedule(7, 200, PROCS, 3.0, "sink", (503, 422))
    assert one != nemesis.schedule(8, 200, PROCS, 3.0, "sink", (503, 422))
    assert {f.kind for f in one} == set(faults.SOAK_FAULTS) <= set(faults.FAULTS)
    assert all(f.at < 199 for f in one)
    holds = [f for f in one if f.kind == "worker-hold"]
    assert all(f.target.startswith("w") for f in holds), "a hold aims at a worker's lease"
    assert {(f.param("runs"), f.param("resume")) for f in holds} == {
        (runs, resume) for runs in ("one", "any") for resume in ("reaped", "reclaimed")
    }, "every way a stale owner can meet its run is drawn"
    stalls = [f for f in one if f.kind == "worker-stall"]
    assert all(f.duration > 3.0 for f in stalls), "a stall must outlast the lease"
    process = [f for f in one if f.kind in nemesis.PROCESS_FAULTS]
    assert all(a.at + a.duration < b.at for a, b in zip(process, process[1:], strict=False)), (
        "one process fault at a time"
    )


def test_one_fault_vocabulary_for_the_check_the_nemesis_and_the_timeline():
    """Every fault name the code injects or counts is one of faults.FAULTS (a drift test: the
    names are literals in the rules of the check and its kinds), and the timeline has a colour
    for every fault of the soak's nemesis."""
    import re

    root = Path(faults.__file__).parent
    used = set()
    for path in [*root.glob("*.py"), *root.glob("kinds/*.py")]:
        text = path.read_text()
        used |= set(re.findall(r'\.fault\(\s*"([a-z0-9-]+)"', text))
        used |= set(re.findall(r'faults\["([a-z0-9-]+)"\]', text))
    assert used and used <= set(faults.FAULTS), sorted(used - set(faults.FAULTS))
    assert set(timeline.FAULT_COLOURS) == set(faults.SOAK_FAULTS)
    assert set(nemesis.PROCESS_FAULTS + nemesis.GLOBAL_FAULTS) == set(faults.SOAK_FAULTS)


def test_without_a_stand_in_nothing_is_refused_or_slowed():
    kinds = {f.kind for f in nemesis.schedule(3, 300, PROCS, 3.0, "")}
    assert not kinds & {"stand-in-refuses", "stand-in-slow"} and "db-crash" in kinds


def test_a_hold_waiting_for_another_owner_aims_only_at_runs_the_reaper_puts_back():
    """The outbox's reaper ends a run at its last attempt (``reclaim_dead``): a stale owner held
    on it until another worker claims it waits for nothing. Other kinds' tokens are no count."""
    from knownstate.chaos.judge import RunRow

    outbox = kinds.soak("outbox")
    last = outbox.max_attempts()
    assert last == 4
    assert outbox.claimed_again(RunRow("1", "processing", last - 1))
    assert not outbox.claimed_again(RunRow("1", "processing", last))
    reset = kinds.soak("branch-reset")
    assert reset.claimed_again(RunRow("1", reset.description.owned[0], 9))
    # a described kind: its description's own limit
    from knownstate.chaos.generic import kind
    from knownstate.chaos.kinds.outbox import OutboxAdapter
    from knownstate.chaos.soakgeneric import described
    from knownstate.model.describe import Retry

    two = outbox.description.model_copy(update={"retry": Retry(max_attempts=2, base="1m")})
    webhook_like = described(kind(two, OutboxAdapter))
    assert webhook_like.claimed_again(RunRow("1", "processing", 1))
    assert not webhook_like.claimed_again(RunRow("1", "processing", 2))


class ScriptedHolder:
    """The parts a hold looks at, scripted: w0 holds run ``r`` after its claim, between its
    transactions, and ``where`` is what the database says of it. Only the hold's logic is
    under test here; the soak's tests run it against real parts."""

    def __init__(self):
        self.where, self.stopped, self.looks, self.slow = "held", False, [], None

    def stop(self, proc):
        self.stopped = True

    def cont(self, proc):
        self.stopped = False

    def quiet(self, proc, within):
        return True

    def holds(self, proc, again=False):
        return {"r": ("t1", 2)}

    def writes_bound(self):
        return 3

    def taken(self, held):
        self.looks.append(time.time())
        return {run: self.where for run in held}

    def slow_others(self, proc, ms):
        self.slow = ms


def hold(resume: str, bound: float, ms: int = 0) -> nemesis.Fault:
    params = (("resume", resume), ("runs", "any"), ("after", 1), ("ms", ms))
    return nemesis.Fault(0.0, "worker-hold", "w0", bound, params)


def looked_after(parts: ScriptedHolder, when: float) -> bool:
    """Two looks began after ``when``. A look is pushed by the one before it, and events are
    carried out in the order they are due, so the second look came after everything due at
    ``when`` was carried out; and a look is only taken while the hold lasts."""
    return len([t for t in parts.looks if t > when]) >= 2


def test_a_hold_whose_runs_wait_for_a_new_owner_gets_its_bound_again_from_then():
    """Taken back and not yet claimed again when the bound comes (a slow machine, slow
    workers): the stale owner stays stopped until another worker holds the run, so its write
    meets the new owner, not a free row."""
    parts, f = ScriptedHolder(), hold("reclaimed", 3.0)
    t0 = time.time()
    n = nemesis.Nemesis([f], parts, t0).start()
    poll("the hold stops w0", lambda: parts.stopped and f in n.now_active())
    poll("half the bound passed", lambda: time.time() > t0 + f.duration / 2)
    parts.where = "free"  # its second bound is at least half a bound after its first
    poll("the hold outlasts its first bound", lambda: looked_after(parts, t0 + f.duration))
    assert not n.periods and parts.stopped
    parts.where = "reheld"
    poll("the hold ends", lambda: n.periods)
    assert not parts.stopped and n.periods[0].detail.endswith("resumed: r reheld")
    n.heal()


def test_a_hold_whose_runs_are_never_claimed_again_ends_at_its_second_bound():
    parts, f = ScriptedHolder(), hold("reclaimed", 0.3)
    n = nemesis.Nemesis([f], parts, time.time()).start()
    poll("the hold stops w0", lambda: parts.stopped and f in n.now_active())
    parts.where = "free"
    poll("the hold ends", lambda: n.periods)
    assert n.periods[0].detail.endswith("resumed: taken back, no new owner before the bound")
    assert not parts.stopped
    n.heal()


def test_the_others_stay_slow_after_a_hold_until_the_run_leaves_its_new_owners_hands():
    """Resumed because another worker holds its run, the stale owner's next write must meet
    that owner: the others' calls stay slow (its own never were) until the run is no longer
    held by another, by its write or the new owner's, not only until the moment it resumes."""
    parts, f = ScriptedHolder(), hold("reclaimed", 30.0, ms=600)
    n = nemesis.Nemesis([f], parts, time.time()).start()
    poll("the hold stops w0", lambda: parts.stopped and parts.slow == 600)
    parts.where = "reheld"
    poll("the hold ends", lambda: n.periods)
    assert not parts.stopped
    poll("two looks after it resumed", lambda: looked_after(parts, n.periods[0].end))
    assert parts.slow == 600
    parts.where = "done"
    poll("the others' calls are fast again", lambda: parts.slow is None)
    n.heal()


def test_the_timeline_is_one_self_contained_file(tmp_path):
    h = outbox_history("stale-complete-landed")
    v = judged(h)
    path = tmp_path / "t.html"
    timeline.write(str(path), h, v, title="soak outbox, seed 1")
    page = path.read_text()
    assert page.count("<svg") == 1 and "FAILED" in page
    for lane in ("p0", "w0", "w1", "r0"):
        assert f">{lane}</text>" in page
    assert "worker-stall w0 +1.2..+6.0 s" in page and "carried attempt 1 and landed" in page
    assert "delivery 1 accepted more than once" in page
    lowered = page.lower()
    for outside in ("<script", "src=", "href=", "@import", "url(", "https:"):
        assert outside not in lowered, outside
    assert lowered.count("http://") == 1  # the SVG namespace, which nothing fetches


# ---------------------------------------------------------------------------------------
# The worker side: each committed change names the operation that made it.
# ---------------------------------------------------------------------------------------


def test_each_committed_change_names_the_operation_and_token_that_made_it(knownstate_db, tmp_path):
    dsn = knownstate_db(outbox_impl.SCHEMA + soakparts.audit_ddl(("outbox_delivery",)))
    log = soakworker.OpLog(str(tmp_path / "w0.1.jsonl"), "w0", 1)
    store = soakworker.recording(outbox_impl.OutboxStore, log)(Config(lease=60))
    with soakworker.TaggedConnection.connect(dsn, autocommit=True, prepare_threshold=None) as conn:
        store.enqueue(conn, 7)
        ((claim, _),) = store.claim_batch(conn, 5)
        store.complete(conn, Claim(7, 5))  # a stale token: fenced, nothing committed
        store.complete(conn, claim)
        audit = conn.execute(
            "SELECT ref, old->>'attempts', new->>'status' FROM soak_audit ORDER BY id"
        ).fetchall()
        assert conn.tag == ""
    ops = soakparts.read_logs(tmp_path)
    assert [(o.ref, o.name, o.runs, o.out) for o in ops] == [
        ("w0.1:1", "enqueue", {"7": None}, "won"),
        ("w0.1:2", "claim_batch", {"7": 1}, "won"),
        ("w0.1:3", "complete", {"7": 5}, "lost"),
        ("w0.1:4", "complete", {"7": 1}, "won"),
    ]
    assert audit == [
        ("w0.1:1", None, "pending"),
        ("w0.1:2", "0", "processing"),
        ("w0.1:4", "1", "sent"),
    ]


def test_a_request_sent_during_an_operation_names_it_at_the_stand_in(tmp_path):
    log = soakworker.OpLog(str(tmp_path / "w1.2.jsonl"), "w1", 2)
    original = http.client.HTTPConnection.putrequest
    with soakparts.RecordingSink() as sink, soakworker.tagging_http(log):
        log.current = "w1.2:9"
        assert outbox_impl.send_to_sink(sink.url, Claim(4, 2)) == outbox_impl.OK
        log.current = None
        assert outbox_impl.send_to_sink(sink.url, Claim(5, 1)) == outbox_impl.OK
    assert http.client.HTTPConnection.putrequest is original
    assert [(d, a, ref) for _, d, a, _, ref in sink.timed] == [(4, 2, "w1.2:9"), (5, 1, None)]


# ---------------------------------------------------------------------------------------
# Real soaks.
# ---------------------------------------------------------------------------------------


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.slow
def test_a_short_soak_of_the_reference_passes_and_leaves_nothing_running():
    lines: list[str] = []
    r = soak.Soak("outbox", 10, seed=5, say=lines.append).run()
    assert r.passed, "\n".join(soak.summary_lines(r, None))
    h = r.history
    assert r.verdict.runs > 20 and r.verdict.runs == r.verdict.terminal
    assert r.quiet_end == "every run asked for is terminal"
    assert [(p.kind, p.target) for p in sorted(h.periods, key=lambda p: p.start)] == [
        (f.kind, f.target) for f in r.schedule
    ], "every planned fault was carried out and recorded"
    refs = h.by_ref()
    assert all(a.ref in refs for a in h.audit), "every committed change names a logged operation"
    for d in r.verdict.duplicates:
        assert d.owner in {f"{p.name}.{p.inc}" for p in h.procs}
    assert r.pids and all(_gone(pid) for pid in r.pids), [p for p in r.pids if not _gone(p)]


def _cli(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "knownstate.chaos.cli", "soak", *args],
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **kw,
    )


@pytest.mark.slow
def test_a_mutant_fails_the_soak_with_an_attributed_violation_and_reports(tmp_path):
    report = tmp_path / "r.json"
    p = _cli(
        "branch-reset",
        "--seconds",
        "6",
        "--seed",
        "3",
        "--mutant",
        "poll-reissues-operation",
        "--json",
        str(report),
        "--junit",
        str(tmp_path / "r.xml"),
    )
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, out + err  # as `verify --mutant`: caught, by its invariant
    assert "CAUGHT — mutant poll-reissues-operation" in out
    assert "external-effect-semantics: run b" in out and "created during w" in out
    assert (
        "replay: knownstate soak branch-reset --seconds 6 --seed 3 --mutant poll-reissues-operation"
        in out
    )
    data = json.loads(report.read_text())
    assert data["command"] == "soak" and data["runs"][0]["caught"] is True
    assert data["runs"][0]["invariants"] == ["external-effect-semantics"]
    assert data["soak"]["mutant"] == "poll-reissues-operation"
    first = data["soak"]["violations"][0]
    assert first["invariant"] == "external-effect-semantics" and first["operation"].startswith("w")
    assert ":" in first["operation"] and "poll(" in first["message"]
    assert 'failures="0"' in (tmp_path / "r.xml").read_text()  # a caught mutant is a good run
    page = (tmp_path / "r.timeline.html").read_text()
    assert "FAILED" in page and "<svg" in page


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def _workers(pid: int) -> list[int]:
    def is_worker(child: int) -> bool:
        try:
            return b"soakworker" in Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            return False

    return [c for c in _children(pid) if is_worker(c)]


@pytest.mark.slow
def test_a_worker_killed_from_outside_is_exit_3_and_ctrl_c_is_130_with_nothing_left():
    p = _cli("approved-plan", "--seconds", "60", "--seed", "4")
    victim = poll(
        "the soak's workers are running", lambda: len(_workers(p.pid)) == 5 and _workers(p.pid), 120
    )[0]
    started = _children(p.pid)
    os.kill(victim, signal.SIGKILL)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 3, out + err
    assert f"(pid {victim}) exited with code -9, and the harness did not kill it" in err
    assert len(err.strip().splitlines()) == 2  # one line, and that everything was stopped
    assert all(_gone(c) for c in started)

    p = _cli("approved-plan", "--seconds", "60", "--seed", "4")
    poll("the soak's workers are running", lambda: len(_workers(p.pid)) == 5, 120)
    started = _children(p.pid)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, out + err
    assert all(_gone(c) for c in started)


def test_a_failing_soaks_timeline_goes_beside_its_report_else_into_the_projects_folder(
    tmp_path, monkeypatch
):
    """Never into the current directory's top level, where it was left lying about."""
    from types import SimpleNamespace

    from knownstate.chaos.soakreport import default_timeline

    monkeypatch.chdir(tmp_path)
    alone = default_timeline(SimpleNamespace(json=None, junit=None), "outbox", 7)
    assert alone == ".knownstate/timelines/soak-outbox-7.html"
    assert (tmp_path / ".knownstate" / "timelines").is_dir()
    beside = default_timeline(SimpleNamespace(json="out/r.json", junit=None), "outbox", 7)
    assert beside == "out/r.timeline.html"
