-- Branch reset (dbops/operations.ts): one row per requested reset of a database branch.
-- The statuses are knownstate.model.branch_reset.Status; a drift test compares the CHECK below.

CREATE TABLE branch_reset (
    -- '<branch>#<n>': n counts this branch's runs, so ids are deterministic and never reused.
    id              text PRIMARY KEY,
    branch          text NOT NULL,
    idempotency_key text NOT NULL,
    status          text NOT NULL DEFAULT 'queued'
                    CHECK (status IN ('queued', 'running', 'succeeded', 'failed', 'canceled')),
    -- The worker whose start won the claim.
    claimed_by      text,
    -- Receipts: the operation created at the operations API, and every status a poll observed
    -- (a new entry on each change; dbops' neonOpStatuses). Written with the transition they cause.
    external_op_id  text,
    op_statuses     text[] NOT NULL DEFAULT '{}',
    -- The lease, in APPLICATION time (the worker's clock), not now(): the recorded deviation.
    -- A run holds a lease exactly while it is running.
    lease_until     timestamptz,
    error           text,
    requested_at    timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT branch_reset_lease_while_running CHECK ((status = 'running') = (lease_until IS NOT NULL))
);

-- Claim, part 1: a repeated request with the same key finds this row instead of making another.
CREATE UNIQUE INDEX branch_reset_idempotency_key ON branch_reset (idempotency_key);

-- Claim, part 2: at most one run in flight per branch.
CREATE UNIQUE INDEX branch_reset_one_in_flight ON branch_reset (branch)
    WHERE status IN ('queued', 'running');

-- The reaper's scan: running runs by lease.
CREATE INDEX branch_reset_running_lease ON branch_reset (lease_until) WHERE status = 'running';
