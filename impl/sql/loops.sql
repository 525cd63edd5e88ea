-- Named queries of the reference worker loops (knownstate.impl.loops): how a worker finds work.
-- They only read. Every write a loop makes is one of its kind's store operations, whose guard
-- decides: a run found here may be gone by the time the worker acts, and then it loses a race.

-- plans_ready --
-- Approved plans waiting for an executor, oldest first, with their number of steps (the frozen
-- payload's length: a step's identity is its position in it).
SELECT id, jsonb_array_length(steps) FROM agent_proposal
WHERE status = 'approved' ORDER BY id LIMIT %(n)s

-- plans_executing --
-- Runs some executor holds (or held, and died holding): a reader's read heals the stale ones.
SELECT id FROM agent_proposal WHERE status = 'executing' ORDER BY id LIMIT %(n)s

-- plans_finished --
-- The most recently created finished plans, which a repeated execute request may name again.
SELECT id FROM agent_proposal WHERE status IN ('executed', 'failed') ORDER BY id DESC LIMIT %(n)s

-- resets_queued --
-- Queued branch resets, in the order they were requested: any poller may start one.
SELECT id FROM branch_reset WHERE status = 'queued' ORDER BY requested_at, id LIMIT %(n)s

-- resets_mine --
-- The running resets this worker started: it polls its own, so a dead poller's runs wait for the
-- reaper (another poller would keep a dead owner's lease alive).
SELECT id FROM branch_reset WHERE status = 'running' AND claimed_by = %(worker)s ORDER BY id
