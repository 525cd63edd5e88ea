-- Named queries of the approved-plan executor (knownstate.impl.approved_plan).
-- Every transition is a conditional UPDATE: the WHERE names the status it leaves, so exactly
-- one caller wins and a loser matches no row (a lost race, not an error). Lease stamps and
-- comparisons use now(), the database's clock.

-- next_proposal_id --
-- Allocate the next proposal id, gaplessly: the counter row is locked until this transaction
-- ends and rolls back with it, so a proposal that never committed never used a number.
INSERT INTO agent_proposal_ids AS ids (one, last) VALUES (true, 1)
ON CONFLICT (one) DO UPDATE SET last = ids.last + 1
RETURNING last

-- insert_proposal --
-- A new plan, pending. `compensates` links a compensating plan to the run it undoes.
INSERT INTO agent_proposal (id, status, steps, compensates)
VALUES (%(id)s, 'pending', %(steps)s, %(compensates)s)

-- revise --
-- Replace a plan's steps while it is pending. Approval froze them: afterwards nothing matches.
-- A compensation's steps come from receipts and are never revised.
UPDATE agent_proposal SET steps = %(steps)s
WHERE id = %(id)s AND status = 'pending' AND compensates IS NULL
RETURNING id

-- approve --
-- pending -> approved: the payload is frozen from here on.
UPDATE agent_proposal SET status = 'approved'
WHERE id = %(id)s AND status = 'pending'
RETURNING id

-- reject --
-- pending -> rejected.
UPDATE agent_proposal SET status = 'rejected'
WHERE id = %(id)s AND status = 'pending'
RETURNING id

-- expire --
-- pending | approved -> expired: a plan nobody approved or started in time. Racing the claim,
-- exactly one of the two matches.
UPDATE agent_proposal SET status = 'expired'
WHERE id = %(id)s AND status IN ('pending', 'approved')
RETURNING id

-- mark_executing --
-- The claim, approved -> executing: exactly one caller wins. It takes the claim token (the
-- generation) and starts the lease on the database clock.
UPDATE agent_proposal SET status = 'executing', generation = generation + 1, heartbeat_at = now()
WHERE id = %(id)s AND status = 'approved'
RETURNING generation

-- lock_executing --
-- The fence. Lock the run row for the rest of this step's transaction: a heal, a heartbeat or
-- another step of this run waits until we commit. The caller refuses unless the row says
-- executing under its token. NO KEY UPDATE is the lock our own UPDATEs of the row take: it
-- excludes every other writer of the run, not the foreign-key checks of receipt inserts. After
-- a wait it returns the row's latest version.
SELECT status, generation, steps FROM agent_proposal WHERE id = %(id)s FOR NO KEY UPDATE

-- steps_done --
-- How many steps have a receipt, so the next step's index. A statement of its own, run after
-- lock_executing: a subquery in the locking statement would read the snapshot taken before the
-- lock wait and miss the receipt of the step that held the lock.
SELECT count(*) FROM agent_proposal_step WHERE proposal_id = %(id)s

-- receipt --
-- The receipt of one step, to answer a step that already ran.
SELECT step_index, ok, detail FROM agent_proposal_step
WHERE proposal_id = %(id)s AND step_index = %(step_index)s

-- credit --
-- A credit step's effect: the balance and its ledger row, tagged with the step.
WITH account AS (
    INSERT INTO demo_account AS a (account, balance) VALUES (%(account)s, %(amount)s)
    ON CONFLICT (account) DO UPDATE SET balance = a.balance + excluded.balance
    RETURNING account
)
INSERT INTO demo_ledger (proposal_id, step_index, account, delta)
SELECT %(id)s, %(step_index)s, account, %(amount)s FROM account
RETURNING id

-- debit --
-- A debit step's effect, guarded: no row (and no effect) when the account holds less.
WITH account AS (
    UPDATE demo_account SET balance = balance - %(amount)s
    WHERE account = %(account)s AND balance >= %(amount)s
    RETURNING account
)
INSERT INTO demo_ledger (proposal_id, step_index, account, delta)
SELECT %(id)s, %(step_index)s, account, -%(amount)s FROM account
RETURNING id

-- insert_receipt --
-- The step's receipt, in the same transaction as its effect: both commit or neither does.
INSERT INTO agent_proposal_step (proposal_id, step_index, ok, detail)
VALUES (%(id)s, %(step_index)s, %(ok)s, %(detail)s)

-- finish_step --
-- Stamp the heartbeat with now() and take the step's transition: executing -> executing after
-- an ok step, -> executed after the last one, -> failed after one that was not ok.
UPDATE agent_proposal SET status = %(status)s, heartbeat_at = now(), failure = %(failure)s
WHERE id = %(id)s AND status = 'executing'
RETURNING id

-- heartbeat --
-- The owner renews its lease on the database clock; fenced like a step.
UPDATE agent_proposal SET heartbeat_at = now()
WHERE id = %(id)s AND status = 'executing' AND generation = %(token)s
RETURNING id

-- mark_interrupted_if_stale --
-- The lazy heal, run by every read: an executing run whose heartbeat is older than the lease
-- fails as interrupted. Both sides of the comparison are the database's clock.
UPDATE agent_proposal SET status = 'failed', failure = %(failure)s
WHERE id = %(id)s AND status = 'executing'
  AND heartbeat_at < now() - make_interval(secs => %(heartbeat_s)s)
RETURNING id

-- lock_run --
-- Lock a run to compensate it: two compensate requests for one run take turns, so the second
-- finds the first one's compensation.
SELECT status, steps FROM agent_proposal WHERE id = %(id)s FOR NO KEY UPDATE

-- run --
-- A run's row, as a reader sees it.
SELECT status, failure, compensates, generation FROM agent_proposal WHERE id = %(id)s

-- report --
-- A run as a reader sees it: its row and its receipts in step order, in one statement, so in
-- one snapshot (read one after the other, a reader could see a step's receipt but not the
-- status the same commit wrote).
SELECT p.status, p.failure,
       COALESCE((SELECT json_agg(json_build_array(s.step_index, s.ok, s.detail)
                                 ORDER BY s.step_index)
                 FROM agent_proposal_step s WHERE s.proposal_id = p.id), '[]')
FROM agent_proposal p WHERE p.id = %(id)s

-- receipts --
-- A run's receipts, in step order.
SELECT step_index, ok, detail FROM agent_proposal_step
WHERE proposal_id = %(id)s ORDER BY step_index

-- compensation_of --
-- The compensation already proposed for a run, if any.
SELECT id FROM agent_proposal WHERE compensates = %(id)s

-- project --
-- The projection: every run, receipt, balance and effect (duplicates included: the ledger has no
-- unique step key), in one statement, so in one snapshot and one round trip.
SELECT
  (SELECT coalesce(json_agg(json_build_array(id, status, steps, compensates, generation,
                                             extract(epoch FROM heartbeat_at), failure) ORDER BY id),
                   '[]') FROM agent_proposal),
  (SELECT coalesce(json_agg(json_build_array(proposal_id, step_index, ok, detail)
                            ORDER BY proposal_id, step_index), '[]') FROM agent_proposal_step),
  (SELECT coalesce(json_agg(json_build_array(account, balance) ORDER BY account), '[]')
   FROM demo_account),
  (SELECT coalesce(json_agg(json_build_array(proposal_id, step_index, account, delta)), '[]')
   FROM demo_ledger)

-- plans_ready --
-- The executor loop's read (PlanExecutor; a loop only reads: every write is a store operation
-- above, whose guard decides, so a plan found here may be gone when it acts, a lost race).
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
