-- enqueue --
-- A new delivery with the producer's event id, due at once. An id already taken returns no
-- row (refused by the primary key) and changes nothing.
INSERT INTO outbox_delivery (id, payload) VALUES (%(id)s, %(payload)s)
ON CONFLICT (id) DO NOTHING
RETURNING id

-- enqueue_generated --
-- A new delivery with an id from the sequence, due at once.
INSERT INTO outbox_delivery (payload) VALUES (%(payload)s) RETURNING id

-- claim_due --
-- Claim up to %(batch)s due deliveries. SKIP LOCKED: two workers never wait on each other and
-- never claim the same row. The claim bumps attempts (the owner's fence token) and stamps the
-- lease with the database clock, the same clock the reaper compares it with.
WITH due AS (
    SELECT id FROM outbox_delivery
    WHERE status = 'pending' AND next_attempt_at <= now()
    ORDER BY id
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
)
UPDATE outbox_delivery d
SET status = 'processing', attempts = d.attempts + 1,
    lease_until = now() + make_interval(secs => %(lease)s)
FROM due WHERE d.id = due.id
RETURNING d.id, d.attempts, d.payload

-- extend_lease --
-- Heartbeat: fenced on the claimed attempt, so a reclaimed row's old owner cannot extend it.
UPDATE outbox_delivery SET lease_until = now() + make_interval(secs => %(lease)s)
WHERE id = %(id)s AND status = 'processing' AND attempts = %(attempt)s
RETURNING id

-- complete --
-- Terminal write, fenced: matches only while this owner's attempt is still the row's attempt.
UPDATE outbox_delivery SET status = 'sent', lease_until = NULL, last_error = NULL
WHERE id = %(id)s AND status = 'processing' AND attempts = %(attempt)s
RETURNING status

-- fail --
-- A failed send, fenced like complete. Permanent: failed. Retryable: pending again with
-- exponential backoff on next_attempt_at, or dead once attempts reached the limit.
UPDATE outbox_delivery SET
    status = CASE WHEN %(permanent)s THEN 'failed'
                  WHEN attempts >= %(max_attempts)s THEN 'dead'
                  ELSE 'pending' END,
    next_attempt_at = CASE WHEN %(permanent)s OR attempts >= %(max_attempts)s THEN next_attempt_at
                           ELSE now() + make_interval(secs => least(%(cap)s, %(base)s * 2 ^ greatest(attempts - 1, 0)))
                      END,
    lease_until = NULL,
    last_error = %(error)s
WHERE id = %(id)s AND status = 'processing' AND attempts = %(attempt)s
RETURNING status

-- record_batch --
-- The outcomes of a worker's batch in one statement, one commit. Each row is fenced on its own
-- claimed attempt (d.attempts = b.attempt), so a stale row matches nothing — a lost race for
-- that row alone — and the others still commit. Per row, as complete and fail one by one: ok
-- is sent; permanent is failed; retryable is pending again after the backoff, or dead at the
-- attempt limit. The arrays come sorted by id, so two batches lock shared rows in one order.
UPDATE outbox_delivery d SET
    status = CASE WHEN b.result = 'ok' THEN 'sent'
                  WHEN b.result = 'permanent' THEN 'failed'
                  WHEN d.attempts >= %(max_attempts)s THEN 'dead'
                  ELSE 'pending' END,
    next_attempt_at = CASE WHEN b.result <> 'retryable' OR d.attempts >= %(max_attempts)s
                           THEN d.next_attempt_at
                           ELSE now() + make_interval(secs => least(%(cap)s,
                                    %(base)s * 2 ^ greatest(d.attempts - 1, 0)))
                      END,
    lease_until = NULL,
    last_error = b.error
FROM unnest(%(ids)s::bigint[], %(attempts)s::integer[], %(results)s::text[], %(errors)s::text[])
    AS b (id, attempt, result, error)
WHERE d.id = b.id AND d.status = 'processing' AND d.attempts = b.attempt
RETURNING d.id, d.status

-- reclaim_stale --
-- The reaper: processing rows whose lease lapsed (database clock) go back to pending, due now,
-- or to dead at the attempt limit. Terminal rows are never touched.
UPDATE outbox_delivery SET
    status = CASE WHEN attempts >= %(max_attempts)s THEN 'dead' ELSE 'pending' END,
    next_attempt_at = CASE WHEN attempts >= %(max_attempts)s THEN next_attempt_at ELSE now() END,
    lease_until = NULL,
    last_error = 'lease expired'
WHERE status = 'processing' AND lease_until <= now()
RETURNING id

-- project --
-- Every delivery, for the check's projection into the model's shape.
SELECT id, status, attempts, next_attempt_at, lease_until FROM outbox_delivery ORDER BY id
