-- The approved-plan executor (knownstate.impl.approved_plan).
-- A proposal is a plan of steps; approval freezes `steps`, and a step is its position in it.
-- Every lease stamp is the database's now(); nothing here ever sees an application clock.

CREATE TABLE agent_proposal (
    id           bigint PRIMARY KEY,  -- gapless, from agent_proposal_ids: the model numbers runs 1, 2, 3...
    status       text NOT NULL DEFAULT 'pending'
                 CHECK (status IN ('pending', 'approved', 'executing', 'executed', 'failed', 'expired', 'rejected')),
    steps        jsonb NOT NULL CHECK (jsonb_typeof(steps) = 'array' AND jsonb_array_length(steps) > 0),
    compensates  bigint REFERENCES agent_proposal (id),  -- the run this one undoes
    generation   integer NOT NULL DEFAULT 0,  -- the claim token: 1 once markExecuting won
    heartbeat_at timestamptz,  -- the lease: stamped with now() by the claim and by every step
    failure      text,
    created_at   timestamptz NOT NULL DEFAULT now(),
    CHECK (status <> 'executing' OR heartbeat_at IS NOT NULL)  -- an executing run always has a lease
);

-- At most one compensation per run: a repeated compensate request finds it instead of adding one.
CREATE UNIQUE INDEX agent_proposal_one_compensation ON agent_proposal (compensates) WHERE compensates IS NOT NULL;

-- The receipts. The primary key is the step's identity: its position in the frozen payload.
CREATE TABLE agent_proposal_step (
    proposal_id  bigint NOT NULL REFERENCES agent_proposal (id),
    step_index   integer NOT NULL CHECK (step_index >= 0),
    ok           boolean NOT NULL,
    detail       text NOT NULL,
    committed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (proposal_id, step_index)
);

-- Gapless proposal ids. A sequence would leave a gap for every rolled-back insert; this row is
-- updated in the proposing transaction and rolls back with it. Recreated by the first proposal
-- after a TRUNCATE.
CREATE TABLE agent_proposal_ids (
    one  boolean PRIMARY KEY DEFAULT true CHECK (one),
    last bigint NOT NULL
);

-- The demo domain: what steps change, so "exactly once per step" is counted in the data.
CREATE TABLE demo_account (
    account text PRIMARY KEY,
    balance bigint NOT NULL CHECK (balance >= 0)
);

-- One row per committed effect, tagged with its step. Deliberately no unique key on
-- (proposal_id, step_index): a step applied twice must show up as two rows, not as an error.
CREATE TABLE demo_ledger (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    proposal_id bigint NOT NULL REFERENCES agent_proposal (id),
    step_index  integer NOT NULL,
    account     text NOT NULL REFERENCES demo_account (account),
    delta       bigint NOT NULL
);
