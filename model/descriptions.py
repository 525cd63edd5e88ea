"""The three built-in durable run kinds, described as data (:class:`~.describe.RunKind`).

Each is its kind's contract, stated once: the models compute their ``CONTRACT`` (and its
transition table) from it, and ``specs/contract.md`` is generated from these descriptions. The
outbox is a claim/lease/fence/retry queue, so the generic model
(:mod:`knownstate.model.generic`) runs from its description alone and is checked against the
hand-written :mod:`knownstate.model.outbox`. The approved plan (steps, receipts per step) and
the branch reset (an external operation polled, leases in application time) keep their
hand-written models, driven by the table and contract their descriptions give.
"""

from __future__ import annotations

from .describe import Claim, Fence, Lease, Retry, RunKind

OUTBOX = RunKind(
    name="outbox",
    statuses=("pending", "processing", "sent", "failed", "dead"),
    initial="pending",
    owned=("processing",),
    terminal=("sent", "failed", "dead"),
    transitions=(
        "(new) -enqueue-> pending",
        "pending -claim-> processing",
        "processing -extend_lease-> processing",
        "processing -complete-> sent",
        "processing -fail_permanent-> failed",
        "processing -retry-> pending",
        "processing -give_up-> dead",
        "processing -reclaim-> pending",
        "processing -reclaim_dead-> dead",
    ),
    claim=Claim(how="FOR UPDATE SKIP LOCKED claim of due rows that bumps attempts"),
    lease=Lease(
        seconds="5m",
        taken_back_by=("reclaim", "reclaim_dead"),
        how="claim lease (default 5 min) stamped with the database's now()",
        reaper="reclaim_stale: processing rows whose lease lapsed go back to pending "
        "(dead at the limit)",
    ),
    fence=Fence(
        kind="attempt",
        how="terminal writes and lease extensions match attempts = <claimed attempt>",
    ),
    receipts="the delivery row itself",
    retry=Retry(
        max_attempts=3,
        base="1m",
        cap="1h",
        how="exponential backoff on next_attempt_at with a cap; dead after max attempts",
    ),
    external="at-least-once",
)

APPROVED_PLAN = RunKind(
    name="approved-plan",
    statuses=("pending", "approved", "executing", "executed", "failed", "expired", "rejected"),
    initial="pending",
    owned=("executing",),
    terminal=("executed", "failed", "expired", "rejected"),
    transitions=(
        "(new) -propose-> pending",
        "(new) -compensate-> pending",
        "pending -revise-> pending",
        "pending -approve-> approved",
        "pending -reject-> rejected",
        "pending -expire-> expired",
        "approved -expire-> expired",
        "approved -mark_executing-> executing",
        "executing -heartbeat-> executing",
        "executing -step_ok-> executing",
        "executing -last_step_ok-> executed",
        "executing -step_failed-> failed",
        "executing -mark_interrupted_if_stale-> failed",
    ),
    claim=Claim(
        how="mark_executing: the conditional approved -> executing; exactly one caller "
        "wins the claim token",
        skip_locked=False,
    ),
    lease=Lease(
        seconds="120s",
        taken_back_by=("mark_interrupted_if_stale",),
        how="120 s per-step heartbeat, stamped with the database's now() by the claim "
        "and by every step",
        reaper="none in the background: mark_interrupted_if_stale heals a stale "
        "executing run to failed on the next read (read, repeat, compensate)",
    ),
    fence=Fence(
        kind="row-lock",
        how="lock_executing: each step's transaction locks the run row and refuses "
        "unless it is still executing under the caller's token",
    ),
    receipts="agent_proposal_step, primary key (proposal_id, step_index), written in the step's "
    "own transaction together with the step's database effect",
    retry_prose="none: a failed step is a receipt and a new plan is a new proposal; undoing "
    "committed steps is a separate compensating proposal with its own receipts",
    external="none",
)

BRANCH_RESET = RunKind(
    name="branch-reset",
    statuses=("queued", "running", "succeeded", "failed", "canceled"),
    initial="queued",
    owned=("running",),
    terminal=("succeeded", "failed", "canceled"),
    transitions=(
        "(new) -request-> queued",
        "queued -start-> running",
        "running -poll_in_progress-> running",
        "running -poll_succeeded-> succeeded",
        "running -poll_failed-> failed",
        "running -cancel-> canceled",
        "running -reap-> failed",
    ),
    claim=Claim(
        how="one run in flight per branch (partial unique index over queued|running) + "
        "idempotency_key under a unique index: a repeated request with the same key "
        "returns the existing run",
        skip_locked=False,
    ),
    lease=Lease(
        seconds="10m",
        clock="application",
        taken_back_by=("reap",),
        how="lease_until = app_now + 600 s, stamped by start and by every in-progress "
        "poll; checked on every poll, and a poll that finds it lapsed writes nothing",
        reaper="dbops-reaper job: reap fails every running run whose lease lapsed, "
        "judged by the reaper's app clock",
    ),
    fence=Fence(
        kind="status",
        how="every transition out of running, and every lease extension, is guarded on "
        "status = 'running'",
    ),
    receipts="the external operation id and the observed operation statuses (op_statuses, "
    "dbops' neonOpStatuses) on the run row, written with the transition they cause",
    retry_prose="none: the external operation is polled, never re-issued",
    external="create-once-then-poll",
    external_key=True,
    idempotency_key="idempotency_key under a unique index: a repeated request with the same key "
    "gets the existing run",
    deviations=(
        "lease in application time, not database now(): each worker's clock judges the lease, "
        "so an app-clock skew of L - M or more (reaper ahead of the last poller; 540 s with the "
        "defaults) can reap a live run. Below that bound no live run is reaped. Accepted "
        "because the lease is generous and only guards crashes.",
        "the POST that creates the operation is at least once; the creation is exactly once "
        "because the operations API takes an idempotency key (the run id).",
    ),
)

BUILT_IN = (OUTBOX, APPROVED_PLAN, BRANCH_RESET)
"""In the order the contract table shows them."""
