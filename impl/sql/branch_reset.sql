-- request --
-- A new queued run for %(branch)s, numbered after the branch's existing runs. ON CONFLICT DO NOTHING
-- with no target: both unique indexes (the idempotency key, one in flight per branch) are arbiters.
-- No row returned means one of them already holds: the caller reads find_by_key to tell which.
INSERT INTO branch_reset (id, branch, idempotency_key)
SELECT %(branch)s || '#' || (count(*) + 1), %(branch)s, %(idempotency_key)s
  FROM branch_reset
 WHERE branch = %(branch)s
ON CONFLICT DO NOTHING
RETURNING id

-- find_by_key --
-- The run an idempotency key already names (answers a repeated request).
SELECT id, branch FROM branch_reset WHERE idempotency_key = %(idempotency_key)s

-- run_status --
-- Why a guarded write matched no row: the run's status now, or no row at all.
SELECT status FROM branch_reset WHERE id = %(run_id)s

-- claim --
-- queued -> running. Guarded on queued, so exactly one start wins; the row stays locked until
-- COMMIT, through the HTTP create, so a concurrent start waits and then loses.
-- The lease is stamped in the worker's application time (%(lease_until)s).
UPDATE branch_reset
   SET status = 'running', claimed_by = %(worker)s, lease_until = %(lease_until)s, updated_at = now()
 WHERE id = %(run_id)s AND status = 'queued'
RETURNING branch

-- record_operation --
-- Receipt of the create, in the claim's transaction: the operation id and its first status.
-- Guarded on running (the fence), though the claim's row lock already holds it.
UPDATE branch_reset
   SET external_op_id = %(op_id)s, op_statuses = ARRAY[%(op_status)s]::text[], updated_at = now()
 WHERE id = %(run_id)s AND status = 'running'
RETURNING id

-- poll_target --
-- What a poll needs before asking the operations API: status, lease, operation id.
SELECT status, lease_until, external_op_id FROM branch_reset WHERE id = %(run_id)s

-- record_poll --
-- Record the observed operation status (appended only when it changed) and take the poll's
-- transition: extend the lease (still in progress) or end the run. The fence: still running, the
-- lease not lapsed by this worker's application clock, and the operation the poll asked about.
UPDATE branch_reset
   SET status = %(status)s,
       op_statuses = CASE WHEN op_statuses[cardinality(op_statuses)] IS NOT DISTINCT FROM %(observed)s
                          THEN op_statuses ELSE op_statuses || %(observed)s::text END,
       lease_until = %(lease_until)s,
       error = %(error)s,
       updated_at = now()
 WHERE id = %(run_id)s AND status = 'running' AND lease_until > %(app_now)s
   AND external_op_id = %(op_id)s
RETURNING status

-- cancel --
-- running -> canceled. Guarded on running; the external operation is left alone.
UPDATE branch_reset
   SET status = 'canceled', lease_until = NULL, updated_at = now()
 WHERE id = %(run_id)s AND status = 'running'
RETURNING id

-- reap --
-- The dbops-reaper: fail every running run whose lease lapsed by the reaper's application clock.
UPDATE branch_reset
   SET status = 'failed', error = %(error)s, lease_until = NULL, updated_at = now()
 WHERE status = 'running' AND lease_until <= %(app_now)s
RETURNING id

-- project --
-- Every row, for the model-vs-implementation comparison.
SELECT id, branch, idempotency_key, status, claimed_by, external_op_id, op_statuses, lease_until, error
  FROM branch_reset
 ORDER BY id

-- resets_queued --
-- The poller loop's read (ResetPoller; a loop only reads: every write is a store operation above,
-- whose guard decides). Queued branch resets, in the order they were requested: any poller may
-- start one.
SELECT id FROM branch_reset WHERE status = 'queued' ORDER BY requested_at, id LIMIT %(n)s

-- resets_mine --
-- The running resets this worker started: it polls its own, so a dead poller's runs wait for the
-- reaper (another poller would keep a dead owner's lease alive).
SELECT id FROM branch_reset WHERE status = 'running' AND claimed_by = %(worker)s ORDER BY id
