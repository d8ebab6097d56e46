-- name: load_due
-- A shard's due rows up to the horizon $2 (overdue included), in index order: the
-- keys, and the tenant and pool the fair queue orders them by (the dispatch fetches
-- the rest). Rows of due minutes up to $4, which an earlier load read, are read again
-- only when due by the near edge $3, and as keys alone (tenant_id NULL): the shard
-- holds nearly all of them already and looks up the jobs of the few it does not
-- (job_classes), which a herd's re-reads would otherwise join row by row. $3 NULL
-- reads none of them again: the bound on due_minute (never after next_run_at) ends
-- that scan before it starts. The earliest time as $4 reads everything. Two index
-- range scans, merged in order.
(SELECT d.due_minute, d.next_run_at, d.job_id, NULL::uuid AS tenant_id, NULL::text AS pool
 FROM due_index d
 WHERE d.shard_id = $1 AND d.due_minute <= least($2::timestamptz, $4::timestamptz)
   AND d.due_minute <= $3::timestamptz AND d.next_run_at <= $3::timestamptz
 ORDER BY d.due_minute, d.next_run_at, d.job_id)
UNION ALL
(SELECT d.due_minute, d.next_run_at, d.job_id, j.tenant_id, j.pool
 FROM due_index d JOIN jobs j ON j.job_id = d.job_id
 WHERE d.shard_id = $1 AND d.due_minute > $4 AND d.due_minute <= $2
 ORDER BY d.due_minute, d.next_run_at, d.job_id)
ORDER BY due_minute, next_run_at, job_id
LIMIT $5;

-- name: job_classes
-- The tenant and pool of these jobs: for the due rows a load read as keys alone that
-- its shard did not hold (a retry's, a cron successor's, one whose notify was lost).
SELECT job_id, tenant_id, pool FROM jobs WHERE job_id = ANY($1::uuid[]);

-- name: claim_due
-- Step 1 of a dispatch transaction. Holds the lease row of every shard in the
-- batch FOR SHARE and keeps only those still ours at our revision (fencing:
-- a node whose lease was taken writes nothing for that shard, however long
-- it was paused). Then deletes the due rows of the held shards - the delete
-- is the claim: a row already gone (paused, canceled, dispatched) is not
-- dispatched - and returns each claimed row with what dispatch needs of its job
-- (dry_run: the job's flag or its tenant's; sync: its tenant's durability is sync, so
-- this transaction must commit with remote_apply).
-- Always returns at least one row, whose `held` lists the held shards.
WITH held AS (
    SELECT l.shard_id
    FROM shard_leases l
    JOIN unnest($2::smallint[], $3::bigint[]) AS mine(shard_id, revision)
      ON l.shard_id = mine.shard_id AND l.revision = mine.revision
    WHERE l.owner = $1 AND l.lease_until > coalesce($4, now())
    FOR SHARE OF l
), claimed AS (
    DELETE FROM due_index d
    USING unnest($5::smallint[], $6::timestamptz[], $7::timestamptz[], $8::uuid[])
          AS e(shard_id, due_minute, next_run_at, job_id)
    WHERE d.shard_id = e.shard_id AND d.due_minute = e.due_minute
      AND d.next_run_at = e.next_run_at AND d.job_id = e.job_id
      AND e.shard_id IN (SELECT shard_id FROM held)
    RETURNING d.shard_id, d.next_run_at, d.job_id, d.execution_id, d.scheduled_for, d.attempt
)
SELECT (SELECT coalesce(array_agg(shard_id), '{}') FROM held) AS held,
       c.shard_id, c.next_run_at, c.job_id, c.execution_id, c.scheduled_for, c.attempt,
       j.tenant_id, j.pool, j.payload::text AS payload, j.schedule::text AS schedule,
       j.timeout_s, j.state, j.max_attempts, j.backoff_s,
       CASE WHEN j.target_type = 'http' THEN j.target_ref ELSE '' END AS target,
       j.dry_run OR t.dry_run AS dry_run, t.durability = 'sync' AS sync
FROM (SELECT 1) AS one
LEFT JOIN (claimed c JOIN jobs j ON j.job_id = c.job_id
           JOIN tenants t ON t.tenant_id = j.tenant_id) ON true;

-- name: finish_dispatch
-- Step 2, same transaction: creates the occurrences' executions (once per
-- (job_id, scheduled_for), however often a batch is retried; skipped ones are
-- recorded, not lost), inserts each cron job's next due row and moves
-- jobs.next_run_at. Returns one row: how many executions this call created and,
-- only when that is fewer than it was given (a batch replayed after a commit whose
-- outcome was lost), the ids of the queued ones among them; otherwise every queued
-- one given is new, and the caller knows them (sparing a row to decode for each).
-- A dry run's occurrence is recorded as a finished 'dry_run' execution
-- (queued_at and finished_at: when it would have been published) and published
-- never; a one-off dry run is completed by its occurrence. Nothing here reads
-- executions by key (the insert routes each row to its partition), so the plan
-- sets up no executions partition: a batch's retries go through requeue_retries.
WITH new_exec AS (
    INSERT INTO executions (execution_id, job_id, tenant_id, scheduled_for, attempt, state,
                            queued_at, finished_at)
    SELECT x.execution_id, x.job_id, x.tenant_id, x.scheduled_for, 1, x.state, coalesce($1, now()),
           CASE WHEN x.state IN ('skipped', 'dry_run') THEN coalesce($1, now()) END
    FROM unnest($2::uuid[], $3::uuid[], $4::uuid[], $5::timestamptz[], $6::text[])
         AS x(execution_id, job_id, tenant_id, scheduled_for, state)
    ON CONFLICT (job_id, scheduled_for) DO NOTHING
    RETURNING execution_id, job_id, scheduled_for, attempt, state
), dry_one_offs AS (
    UPDATE jobs j SET state = 'completed', next_run_at = NULL, version = version + 1,
                      updated_at = coalesce($1, now())
    FROM new_exec x
    WHERE x.state = 'dry_run' AND j.job_id = x.job_id AND j.next_run_at = x.scheduled_for
      AND j.state = 'active' AND j.schedule->>'cron' IS NULL
    RETURNING j.tenant_id
), released AS (
    INSERT INTO quota_changes (tenant_id, delta)  -- a quota tenant's: one probe a tenant
    SELECT c.tenant_id, -c.n
    FROM (SELECT tenant_id, count(*) AS n FROM dry_one_offs GROUP BY tenant_id) c
    JOIN quota_counts USING (tenant_id)
), next_due AS (
    INSERT INTO due_index (shard_id, due_minute, next_run_at, job_id, tenant_id)
    SELECT * FROM unnest($7::smallint[], $8::timestamptz[], $9::timestamptz[], $10::uuid[],
                         $13::uuid[])
    ON CONFLICT DO NOTHING
), job_next AS (
    UPDATE jobs j SET next_run_at = n.next_run_at, updated_at = coalesce($1, now())
    FROM unnest($11::uuid[], $12::timestamptz[]) AS n(job_id, next_run_at)
    WHERE j.job_id = n.job_id AND j.state = 'active'
)
SELECT CASE WHEN (SELECT count(*) FROM new_exec) < cardinality($2::uuid[])
            THEN (SELECT coalesce(array_agg(execution_id), '{}') FROM new_exec
                  WHERE state = 'queued') END AS queued;

-- name: requeue_retries
-- Step 2 too, for the batch's rows of existing executions (retries, replays,
-- triggers), when it has any: a statement of its own because joining executions by
-- key sets up every day's partition on each call (a month of them with history kept
-- hot), which most batches need not pay. $2-$7: the rows (execution, its scheduled
-- time, the attempt due, shard, due time, job). Re-queues each execution still
-- waiting for this attempt and returns it with the attempts it had deferred (which
-- raise its attempt limit). A retry of a paused job is not re-queued: its row goes
-- back into the due index parked (due_minute 'infinity', beyond every load's range)
-- for resume to restore (unpark_due_retries); the execution stays in retry_wait. A
-- trigger's first attempt runs whatever the pause. An execution of a canceled job (one
-- a replay or trigger racing the cancel left waiting) is canceled, never run. The
-- job's state is read here, not in claim_due: claim_due's snapshot predates a pause or
-- cancel it waited for on the due row's lock; this statement's does not.
WITH retry AS (
    -- each claimed row of an execution still waiting for this attempt, and its fate
    SELECT r.*, CASE WHEN j.state = 'canceled' THEN 'cancel'
                     WHEN j.state = 'paused' AND r.attempt > 1 THEN 'park'
                     ELSE 'run' END AS fate
    FROM unnest($2::uuid[], $3::timestamptz[], $4::integer[], $5::smallint[],
                $6::timestamptz[], $7::uuid[])
         AS r(execution_id, scheduled_for, attempt, shard_id, next_run_at, job_id)
    JOIN jobs j ON j.job_id = r.job_id
    JOIN executions e ON e.execution_id = r.execution_id AND e.scheduled_for = r.scheduled_for
    -- IS TRUE: found by key. Stated plainly, the state lets the planner probe
    -- executions_open (scheduled_for) instead, trusting it to be small, and read every
    -- open execution of the second for each row: a herd's retries all share theirs.
    WHERE (e.state = 'retry_wait') IS TRUE AND e.attempt = r.attempt - 1
), retried AS (
    UPDATE executions e SET state = 'queued', attempt = r.attempt, queued_at = coalesce($1, now())
    FROM retry r
    WHERE e.execution_id = r.execution_id AND e.scheduled_for = r.scheduled_for
      AND (e.state = 'retry_wait') IS TRUE AND e.attempt = r.attempt - 1 AND r.fate = 'run'
    RETURNING e.execution_id, e.job_id, e.scheduled_for, e.attempt, e.deferrals
), dropped AS (
    UPDATE executions e SET state = 'canceled', finished_at = coalesce($1, now())
    FROM retry r
    WHERE e.execution_id = r.execution_id AND e.scheduled_for = r.scheduled_for
      AND (e.state = 'retry_wait') IS TRUE AND e.attempt = r.attempt - 1 AND r.fate = 'cancel'
), parked AS (
    INSERT INTO due_index (shard_id, due_minute, next_run_at, job_id, execution_id,
                           scheduled_for, attempt)
    SELECT shard_id, 'infinity', next_run_at, job_id, execution_id, scheduled_for, attempt
    FROM retry WHERE fate = 'park'
    ON CONFLICT DO NOTHING
)
SELECT execution_id, job_id, scheduled_for, attempt, deferrals FROM retried;

-- name: replace_previous
-- Overlap replace: a new occurrence supersedes the job's unfinished earlier
-- ones. Returns them, so their workers are told (hw_cancel -> LEASE_LOST). Found
-- through (job_id, scheduled_for), after plan_by_key: the state stated plainly would
-- let the planner take executions_open's range of earlier times for each job instead.
UPDATE executions e SET state = 'canceled', finished_at = coalesce($3, now()),
                        lease_owner = NULL, lease_until = NULL
FROM unnest($1::uuid[], $2::timestamptz[]) AS r(job_id, scheduled_for)
WHERE e.job_id = r.job_id AND e.scheduled_for < r.scheduled_for
  AND (e.state IN ('queued', 'running', 'retry_wait')) IS TRUE
RETURNING e.execution_id, e.job_id;

-- name: fail_claimed
-- Due rows that a dispatch transaction claimed but could not process (a stored
-- schedule that no longer evaluates, a value Postgres refuses): each is
-- recorded, not retried for ever. A new occurrence becomes a dead execution
-- carrying the error ($7, JSON), at its due time when that is a finite time,
-- else at $1; a retry's execution goes dead with it. A one-off job is then
-- completed if the row was its scheduled occurrence (a new one, or a retry of
-- the execution at its next_run_at; not a trigger's); a cron job keeps its state but has no next run until it is
-- changed or resumed (its dead execution says why).
WITH f AS (
    SELECT * FROM unnest($2::uuid[], $3::uuid[], $4::timestamptz[], $5::uuid[], $6::uuid[],
                         $7::text[])
         AS f(job_id, execution_id, scheduled_for, new_execution_id, tenant_id, error)
), dead_new AS (
    INSERT INTO executions (execution_id, job_id, tenant_id, scheduled_for, attempt, state,
                            queued_at, finished_at, error)
    SELECT new_execution_id, job_id, tenant_id,
           CASE WHEN isfinite(scheduled_for) THEN scheduled_for ELSE coalesce($1, now()) END,
           1, 'dead', coalesce($1, now()), coalesce($1, now()), error::jsonb
    FROM f WHERE execution_id IS NULL
    ON CONFLICT (job_id, scheduled_for) DO NOTHING
    RETURNING job_id
), dead_retry AS (
    UPDATE executions e SET state = 'dead', finished_at = coalesce($1, now()),
                            error = f.error::jsonb
    FROM f
    WHERE e.execution_id = f.execution_id AND e.scheduled_for = f.scheduled_for
      AND (e.state = 'retry_wait') IS TRUE  -- by key, as in requeue_retries
    RETURNING e.job_id
), one_offs AS (
    -- a join, not `IN (SELECT ... = j.next_run_at)`: that subquery, correlated, was run
    -- for every active job of the database; a job several rows name is updated once
    UPDATE jobs j SET state = 'completed', next_run_at = NULL, version = version + 1,
                      updated_at = coalesce($1, now())
    FROM f
    WHERE j.job_id = f.job_id AND (f.execution_id IS NULL OR f.scheduled_for = j.next_run_at)
      AND j.state = 'active' AND j.schedule->>'cron' IS NULL
    RETURNING j.tenant_id
), released AS (
    INSERT INTO quota_changes (tenant_id, delta)  -- a quota tenant's: one probe a tenant
    SELECT c.tenant_id, -c.n
    FROM (SELECT tenant_id, count(*) AS n FROM one_offs GROUP BY tenant_id) c
    JOIN quota_counts USING (tenant_id)
), crons AS (
    UPDATE jobs SET next_run_at = NULL, updated_at = coalesce($1, now())
    WHERE job_id IN (SELECT job_id FROM f WHERE execution_id IS NULL)
      AND state = 'active' AND schedule->>'cron' IS NOT NULL
)
SELECT (SELECT count(*) FROM dead_new) + (SELECT count(*) FROM dead_retry) AS recorded;
