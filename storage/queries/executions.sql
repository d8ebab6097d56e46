-- name: apply_events
-- The event actor's batch in one statement (one round trip): each
-- execution's final state in the batch (collapsed in Python, since one
-- statement may touch a row once), fenced by attempt and only ever moved
-- forward, so a replayed or stale event changes nothing; one row per
-- attempt; a retry's due row; one-offs whose scheduled occurrence finished
-- are completed (an execution at the job's next_run_at: a trigger's extra
-- execution, at another instant, leaves the job active and its occurrence due). A
-- finished occurrence of a forbid-overlap cron job is left out unless $24
-- (its successor is computed in Python, in one transaction with its
-- update): `forbid` lists those jobs, `finished` the jobs whose execution
-- this statement finished. $25 counts the deferred attempts among each
-- execution's events (they raise its attempt limit by one each). $26: each
-- attempt's lease expiry as first granted (heartbeats extend it in Redis only).
WITH u AS (  -- times arrive as Redis milliseconds
    SELECT execution_id, scheduled_for, attempt, state, lease_owner,
           to_timestamp(lease_until_ms / 1000.0) AS lease_until,
           to_timestamp(started_ms / 1000.0) AS started_at,
           to_timestamp(finished_ms / 1000.0) AS finished_at,
           result, error, job_id, retry_shard, retry_minute, retry_at, deferrals
    FROM unnest($1::uuid[], $2::timestamptz[], $3::integer[], $4::text[], $5::text[],
                $6::bigint[], $7::bigint[], $8::bigint[], $9::text[], $10::text[], $11::uuid[],
                $12::smallint[], $13::timestamptz[], $14::timestamptz[], $25::integer[])
         AS u(execution_id, scheduled_for, attempt, state, lease_owner, lease_until_ms,
              started_ms, finished_ms, result, error, job_id, retry_shard, retry_minute,
              retry_at, deferrals)
), forbid AS (
    SELECT j.job_id FROM jobs j
    WHERE j.job_id IN (SELECT job_id FROM u WHERE state IN ('succeeded', 'dead'))
      AND j.state = 'active' AND j.schedule->>'overlap' = 'forbid'
), moved AS (
    UPDATE executions e SET
        state = u.state,
        attempt = u.attempt,
        lease_owner = coalesce(u.lease_owner, e.lease_owner),
        lease_until = CASE WHEN u.state = 'running' THEN u.lease_until END,
        started_at = coalesce(e.started_at, u.started_at),
        finished_at = CASE WHEN u.state IN ('succeeded', 'dead') THEN u.finished_at END,
        result = coalesce(u.result::jsonb, e.result),
        error = coalesce(u.error::jsonb, e.error),
        deferrals = e.deferrals + u.deferrals
    FROM u
    WHERE e.execution_id = u.execution_id AND e.scheduled_for = u.scheduled_for
      AND (e.attempt = u.attempt
           -- A success the sweeper bumped past: Redis had lost the attempt, then took a
           -- worker's completion of it again (hw_recover) before the bump's publish, which
           -- it therefore refused (hw_publish publishes nothing after a done attempt).
           -- The later attempt never ran; the success stands.
           OR (u.state = 'succeeded' AND e.state = 'queued' AND e.attempt > u.attempt))
      -- IS TRUE keeps the partial indexes on state (executions_unfinished, _open) out of
      -- this join: with their predicate in the WHERE, the planner, trusting statistics
      -- from a quiet hour (or none: a new partition), took every unfinished row of the
      -- day (a herd's tens of thousands) to sort or hash for each batch of a thousand.
      AND (e.state IN ('queued', 'running')) IS TRUE
      AND NOT (e.state = 'running' AND u.state = 'running')
      AND ($24 OR NOT (u.state IN ('succeeded', 'dead')
                       AND u.job_id IN (SELECT job_id FROM forbid)))
    RETURNING e.execution_id, e.job_id, u.state, u.retry_shard, u.retry_minute, u.retry_at,
              e.scheduled_for, e.attempt
), attempts AS (
    -- A `leased` event may be applied after its execution moved on to a later
    -- attempt (another node applied the later events first): that attempt is
    -- over, and is recorded so, not left running for good.
    INSERT INTO execution_attempts AS a (execution_id, attempt, scheduled_for, worker_id,
                                         started_at, finished_at, outcome, error, lease_until)
    SELECT execution_id, attempt, scheduled_for, worker_id, to_timestamp(started_ms / 1000.0),
           CASE WHEN superseded THEN coalesce($23, now())
                ELSE to_timestamp(finished_ms / 1000.0) END,
           CASE WHEN superseded THEN 'expired' ELSE outcome END,
           CASE WHEN superseded
                THEN '{"type": "Superseded", "message": "a later attempt replaced this one"}'
                ELSE error END,
           to_timestamp(lease_until_ms / 1000.0)
    FROM (SELECT r.*, r.outcome = 'running' AND EXISTS (
                     SELECT 1 FROM executions e
                     WHERE e.execution_id = r.execution_id AND e.scheduled_for = r.scheduled_for
                       AND e.attempt > r.attempt) AS superseded
          FROM unnest($15::uuid[], $16::integer[], $17::timestamptz[], $18::text[],
                      $19::bigint[], $20::bigint[], $21::text[], $22::text[]::jsonb[],
                      $26::bigint[])
               AS r(execution_id, attempt, scheduled_for, worker_id, started_ms, finished_ms,
                    outcome, error, lease_until_ms)) s
    ON CONFLICT (execution_id, scheduled_for, attempt) DO UPDATE SET
        worker_id = coalesce(a.worker_id, EXCLUDED.worker_id),
        started_at = coalesce(a.started_at, EXCLUDED.started_at),
        finished_at = coalesce(EXCLUDED.finished_at, a.finished_at),
        outcome = CASE WHEN a.error->>'type' = 'HotStateLost'
                            AND EXCLUDED.outcome = 'succeeded' THEN 'succeeded'
                       WHEN a.outcome IN ('succeeded', 'failed', 'expired', 'canceled',
                                          'deferred')
                       THEN a.outcome ELSE EXCLUDED.outcome END,
        -- The sweeper's guess (HotStateLost) gives way to the completion it missed.
        error = CASE WHEN a.error->>'type' = 'HotStateLost' AND EXCLUDED.outcome = 'succeeded'
                     THEN NULL ELSE coalesce(EXCLUDED.error, a.error) END,
        lease_until = coalesce(a.lease_until, EXCLUDED.lease_until)
), retries AS (
    INSERT INTO due_index (shard_id, due_minute, next_run_at, job_id, execution_id,
                           scheduled_for, attempt)
    SELECT retry_shard, retry_minute, retry_at, job_id, execution_id, scheduled_for, attempt + 1
    FROM moved WHERE state = 'retry_wait'
    ON CONFLICT DO NOTHING
    RETURNING 1
), completed AS (
    UPDATE jobs j SET state = 'completed', next_run_at = NULL, version = version + 1,
                      updated_at = coalesce($23, now())
    FROM (SELECT DISTINCT job_id, scheduled_for FROM moved
          WHERE state IN ('succeeded', 'dead')) m
    WHERE j.job_id = m.job_id AND j.next_run_at = m.scheduled_for
      AND j.state = 'active' AND j.schedule->>'cron' IS NULL
    RETURNING j.tenant_id
), released AS (
    INSERT INTO quota_changes (tenant_id, delta)  -- a quota tenant's: one probe a tenant
    SELECT c.tenant_id, -c.n
    FROM (SELECT tenant_id, count(*) AS n FROM completed GROUP BY tenant_id) c
    JOIN quota_counts USING (tenant_id)
)
SELECT (SELECT count(*) FROM moved) AS changed,
       (SELECT count(*) FROM retries) AS retries,
       (SELECT count(*) FROM completed) AS completed,
       (SELECT coalesce(array_agg(job_id), '{}') FROM forbid) AS forbid,
       (SELECT coalesce(array_agg(job_id), '{}') FROM moved
        WHERE state IN ('succeeded', 'dead')) AS finished;

-- name: plan_by_key
-- In the transaction of a statement that finds a batch's executions by key (apply_events,
-- requeue_retries, replace_previous, fail_claimed, the sweeper's bump_attempts and
-- fail_executions, the stale calls' lock and write), before it: each execution, job and
-- attempt it touches is found by its key, one index probe a row, whatever the
-- statistics say (Database.transaction(by_key=True) runs it first). The planner
-- otherwise prices a thousand probes above one scan of the day's partition (or of what
-- stale statistics call a handful of unfinished rows), which makes a batch cost grow
-- with the day's executions rather than with the batch.
SET LOCAL enable_hashjoin = off; SET LOCAL enable_mergejoin = off; SET LOCAL enable_seqscan = off;

-- name: insert_retry_due
-- An execution's next attempt (a replay, a trigger) comes back through the due index;
-- so does a forbid-overlap job's next occurrence (no execution), with its tenant, whom
-- the herd check counts it for.
INSERT INTO due_index (shard_id, due_minute, next_run_at, job_id, execution_id, scheduled_for,
                       attempt, tenant_id)
SELECT u.*, CASE WHEN u.execution_id IS NULL
                 THEN (SELECT j.tenant_id FROM jobs j WHERE j.job_id = u.job_id) END
FROM unnest($1::smallint[], $2::timestamptz[], $3::timestamptz[], $4::uuid[],
            $5::uuid[], $6::timestamptz[], $7::integer[])
     AS u(shard_id, due_minute, next_run_at, job_id, execution_id, scheduled_for, attempt)
ON CONFLICT DO NOTHING;

-- name: forbid_successors
-- Cron jobs with overlap forbid whose occurrence just finished: their next
-- occurrence is due now that nothing of theirs runs.
SELECT job_id, schedule::text AS schedule, tenant_id, pool FROM jobs
WHERE job_id = ANY($1::uuid[]) AND state = 'active' AND schedule->>'overlap' = 'forbid';

-- name: unfinished_executions
-- Sweeper: executions Postgres thinks are queued or running, queued at or before $1.
SELECT e.execution_id, e.job_id, e.tenant_id, e.scheduled_for, e.attempt, e.state,
       j.pool, j.payload::text AS payload, j.timeout_s, j.max_attempts + e.deferrals AS max_attempts,
       j.backoff_s, CASE WHEN j.target_type = 'http' THEN j.target_ref ELSE '' END AS target
FROM executions e JOIN jobs j USING (job_id)
WHERE e.state IN ('queued', 'running') AND e.queued_at <= $1
ORDER BY e.queued_at
LIMIT $2;

-- name: queued_of_jobs
-- Dispatch, after a transaction whose outcome it could not learn (the connection died
-- around its COMMIT): these jobs' executions queued since $2, to publish as they are.
SELECT e.execution_id, e.job_id, e.tenant_id, e.scheduled_for, e.attempt, e.state,
       j.pool, j.payload::text AS payload, j.timeout_s, j.max_attempts + e.deferrals AS max_attempts,
       j.backoff_s, CASE WHEN j.target_type = 'http' THEN j.target_ref ELSE '' END AS target
FROM executions e JOIN jobs j USING (job_id)
WHERE e.job_id = ANY($1::uuid[]) AND e.state = 'queued' AND e.queued_at >= $2;

-- name: bump_attempts
-- Sweeper: republish with attempt + 1, which fences out any worker still
-- holding the old attempt. Guarded so a concurrent event wins. The old
-- attempt's history row, if it was leased, ends as expired: its worker can
-- no longer report it, so it would otherwise stay running for good.
WITH bumped AS (
    UPDATE executions e SET attempt = e.attempt + 1, state = 'queued',
                            queued_at = coalesce($4, now()), lease_owner = NULL, lease_until = NULL
    FROM unnest($1::uuid[], $2::timestamptz[], $3::integer[])
         AS b(execution_id, scheduled_for, attempt)
    WHERE e.execution_id = b.execution_id AND e.scheduled_for = b.scheduled_for
      AND e.attempt = b.attempt AND (e.state IN ('queued', 'running')) IS TRUE  -- by key
    RETURNING e.execution_id, e.scheduled_for, e.attempt
), closed AS (
    UPDATE execution_attempts a
    SET outcome = 'expired', finished_at = coalesce($4, now()),
        error = '{"type": "HotStateLost", "message": "Redis lost the attempt; republished as the next"}'
    FROM bumped
    WHERE a.execution_id = bumped.execution_id AND a.scheduled_for = bumped.scheduled_for
      AND a.attempt = bumped.attempt - 1
      AND a.outcome = 'running'
)
SELECT execution_id, attempt FROM bumped;

-- name: fail_executions
-- Executions an actor could not process (the sweeper could not republish one,
-- say): dead with the error $4 (JSON), fenced by attempt, and a one-off job
-- completed when this was its scheduled occurrence (not a trigger's), so the
-- row stops coming back and its owner can read why.
WITH failed AS (
    UPDATE executions e SET state = 'dead', finished_at = coalesce($5, now()),
                            error = $4::jsonb, lease_owner = NULL, lease_until = NULL
    FROM unnest($1::uuid[], $2::timestamptz[], $3::integer[])
         AS f(execution_id, scheduled_for, attempt)
    WHERE e.execution_id = f.execution_id AND e.scheduled_for = f.scheduled_for
      AND e.attempt = f.attempt AND (e.state IN ('queued', 'running')) IS TRUE  -- by key
    RETURNING e.job_id, e.scheduled_for
), completed AS (
    UPDATE jobs j SET state = 'completed', next_run_at = NULL, version = version + 1,
                      updated_at = coalesce($5, now())
    FROM (SELECT DISTINCT job_id, scheduled_for FROM failed) f
    WHERE j.job_id = f.job_id AND j.state = 'active' AND j.schedule->>'cron' IS NULL
      -- a time that is not finite is no trigger's, and most likely why it failed
      AND (j.next_run_at = f.scheduled_for OR NOT isfinite(f.scheduled_for))
    RETURNING j.tenant_id
), released AS (
    INSERT INTO quota_changes (tenant_id, delta)  -- a quota tenant's: one probe a tenant
    SELECT c.tenant_id, -c.n
    FROM (SELECT tenant_id, count(*) AS n FROM completed GROUP BY tenant_id) c
    JOIN quota_counts USING (tenant_id)
)
SELECT count(*) FROM failed;

-- name: lock_stale_calls
-- The executions that stale worker calls name (a lapsed or replaced attempt's late
-- heartbeat, complete or fail), locked for the merge of what they already record.
-- scheduled_for is NULL when Redis no longer knew the execution.
SELECT e.execution_id, e.scheduled_for, e.tenant_id, e.attempt, e.stale_calls::text AS stale_calls
FROM executions e
JOIN unnest($1::uuid[], $2::timestamptz[]) AS s(execution_id, scheduled_for)
  ON e.execution_id = s.execution_id
 AND (s.scheduled_for IS NULL OR e.scheduled_for = s.scheduled_for)
FOR UPDATE OF e;

-- name: write_stale_calls
UPDATE executions e SET stale_calls = s.stale_calls::jsonb
FROM unnest($1::uuid[], $2::timestamptz[], $3::text[]) AS s(execution_id, scheduled_for, stale_calls)
WHERE e.execution_id = s.execution_id AND e.scheduled_for = s.scheduled_for;
