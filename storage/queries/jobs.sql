-- name: insert_jobs
-- Inserts a batch of jobs, their due_index rows and, when a key is given, the
-- idempotency record, as one statement (so one implicit transaction, one
-- round trip). inserted is false, and nothing is written, when the key is
-- already held by an unexpired record.
-- The jobs may be several requests' (the gateway coalesces concurrent submits of
-- a tenant): each herd second belongs to a request ($28, its index), and each
-- request's herd check is its own.
-- The herd check: for each second of $20 (the request's own jobs due in it are
-- $21), the tenant's occurrences already due then, counted by the
-- due_index_tenant_due index only as far as reaching $22 needs. Per request, the
-- second with the most and that most (herd_requests, herd_seconds, herd_totals).
-- Each second is counted once, however many requests check it (coalesced submits
-- building a herd all name its second): as far as the request with the fewest jobs
-- in it needs, and each request takes as much of that count as it would have counted.
-- The due index holds each job's next occurrence only: later cron fires are not in
-- it. With a key (one request) and its total reaching $22, the stored response is
-- $24 (the one with the herd warning) with that second's label from $23 written at
-- byte $25, else $4.
WITH checks AS (
    SELECT * FROM unnest($20::timestamptz[], $21::integer[], $23::text[], $28::integer[])
                  AS c(second, in_request, label, request)
), counted AS MATERIALIZED (  -- not inlined: a join must not count again for each request
    SELECT s.second, (
               SELECT count(*) FROM (
                   SELECT 1 FROM due_index
                   WHERE tenant_id = $1 AND execution_id IS NULL
                     AND next_run_at >= s.second AND next_run_at < s.second + interval '1 second'
                   LIMIT greatest($22 - s.fewest, 0)) x) AS waiting
    FROM (SELECT second, min(in_request) AS fewest FROM checks GROUP BY second) s
), herd AS (
    SELECT DISTINCT ON (c.request) c.request, c.second, c.label,
           c.in_request + least(n.waiting, greatest($22 - c.in_request, 0)) AS total
    FROM checks c JOIN counted n ON n.second = c.second
    ORDER BY c.request, total DESC, c.second
), idem AS (
    INSERT INTO idempotency_keys AS k
        (tenant_id, key, request_hash, status, response, created_at, expires_at)
    SELECT $1, $2, $3, 201,
           coalesce((SELECT overlay($24::bytea placing convert_to(label, 'UTF8') from $25)
                     FROM herd WHERE total >= $22), $4::bytea), $5, $6
    WHERE $2::text IS NOT NULL
    ON CONFLICT (tenant_id, key) DO UPDATE SET
        request_hash = EXCLUDED.request_hash, status = EXCLUDED.status,
        response = EXCLUDED.response, created_at = EXCLUDED.created_at,
        expires_at = EXCLUDED.expires_at
    WHERE k.expires_at <= EXCLUDED.created_at
    RETURNING 1
), go AS (
    SELECT ($2::text IS NULL OR EXISTS (SELECT 1 FROM idem)) AS ok
), new_jobs AS (
    INSERT INTO jobs (job_id, tenant_id, name, target_type, target_ref, pool, payload, schedule,
                      max_attempts, backoff_s, timeout_s, state, next_run_at, created_at, updated_at,
                      labels, dry_run)
    SELECT j.job_id, $1, j.name, j.target_type, j.target_ref, j.pool, j.payload::jsonb,
           j.schedule::jsonb, j.max_attempts, j.backoff_s, j.timeout_s, 'active', j.next_run_at, $5, $5,
           j.labels::jsonb, j.dry_run
    FROM unnest($7::uuid[], $8::text[], $9::text[], $10::text[], $11::text[], $12::text[],
                $13::text[], $14::integer[], $15::float8[], $16::integer[], $17::timestamptz[],
                $26::text[], $27::boolean[])
         AS j(job_id, name, target_type, target_ref, pool, payload, schedule,
              max_attempts, backoff_s, timeout_s, next_run_at, labels, dry_run)
    WHERE (SELECT ok FROM go)
    RETURNING 1
), live_change AS (  -- for a quota tenant's count (migration 0011); others keep none
    INSERT INTO quota_changes (tenant_id, delta)
    SELECT $1, n FROM (SELECT count(*) AS n FROM new_jobs) w
    WHERE n > 0 AND EXISTS (SELECT 1 FROM quota_counts WHERE tenant_id = $1)
), new_due AS (
    INSERT INTO due_index (shard_id, due_minute, next_run_at, job_id, tenant_id)
    SELECT d.shard_id, d.due_minute, d.next_run_at, d.job_id, $1
    FROM unnest($18::smallint[], $19::timestamptz[], $17::timestamptz[], $7::uuid[])
         AS d(shard_id, due_minute, next_run_at, job_id)
    WHERE (SELECT ok FROM go)
    RETURNING 1
)
SELECT (SELECT ok FROM go) AS inserted,
       (SELECT count(*) FROM new_jobs) AS jobs_written,
       (SELECT count(*) FROM new_due) AS due_written,
       (SELECT coalesce(array_agg(request ORDER BY request), '{}') FROM herd) AS herd_requests,
       (SELECT coalesce(array_agg(second ORDER BY request), '{}') FROM herd) AS herd_seconds,
       (SELECT coalesce(array_agg(total ORDER BY request), '{}') FROM herd) AS herd_totals;

-- name: get_idempotency
SELECT request_hash, status, response, expires_at
FROM idempotency_keys WHERE tenant_id = $1 AND key = $2;

-- name: delete_expired_idempotency
-- Retention: drops records past their expiry, at most $2 per call, oldest first: the
-- order makes every plan, the scheduler's generic one too, walk idempotency_keys_expiry
-- and stop, never scan a table of unexpired keys.
DELETE FROM idempotency_keys
WHERE ctid IN (SELECT ctid FROM idempotency_keys WHERE expires_at < $1
               ORDER BY expires_at LIMIT $2);

-- name: get_job
SELECT job_id, name, target_type, target_ref, payload::text AS payload, schedule::text AS schedule,
       max_attempts, backoff_s, timeout_s, labels::text AS labels, dry_run, state, next_run_at,
       created_at, updated_at, version
FROM jobs WHERE tenant_id = $1 AND job_id = $2;

-- name: lock_due_rows
-- Taken before the job row in a transition: the dispatcher locks due rows first too.
SELECT 1 FROM due_index WHERE job_id = $1 FOR UPDATE;

-- name: lock_job
-- The job row, locked for a state transition.
SELECT job_id, name, target_type, target_ref, payload::text AS payload, schedule::text AS schedule,
       max_attempts, backoff_s, timeout_s, labels::text AS labels, dry_run, state, next_run_at,
       created_at, updated_at, version
FROM jobs WHERE tenant_id = $1 AND job_id = $2
FOR UPDATE;

-- name: list_jobs
-- Newest first, keyset-paginated on job_id (UUIDv7, so creation order).
-- $2: state filter or NULL; $3: cursor (exclusive) or NULL; $5: text the name
-- holds, in any case, or NULL (the dashboard's search; no index serves it: the
-- tenant's jobs are read newest first until a page of them matches); $6: the
-- exact name or NULL (jobs_tenant_name_page); $7: labels the job must carry, as
-- {"<tenant_id>": {key: value, ...}} (JSON text) or NULL: the expression
-- jobs_tenant_labels indexes, so the GIN index finds this tenant's jobs with
-- every pair, and the planner picks it over the page index when it is selective.
SELECT job_id, name, target_type, target_ref, payload::text AS payload, schedule::text AS schedule,
       max_attempts, backoff_s, timeout_s, labels::text AS labels, dry_run, state, next_run_at,
       created_at, updated_at, version
FROM jobs
WHERE tenant_id = $1
  AND ($2::text IS NULL OR state = $2)
  AND ($3::uuid IS NULL OR job_id < $3)
  AND ($5::text IS NULL OR strpos(lower(name), lower($5)) > 0)
  AND ($6::text IS NULL OR name = $6)
  AND ($7::jsonb IS NULL OR jsonb_set('{}', ARRAY[tenant_id::text], labels) @> $7::jsonb)
ORDER BY job_id DESC
LIMIT $4;

-- name: set_job_state
-- A transition decided by the caller, who holds the row lock (lock_job). $6: the job
-- stops being live (a cancel): a quota tenant's count loses it.
WITH released AS (
    INSERT INTO quota_changes (tenant_id, delta)
    SELECT tenant_id, -1 FROM quota_counts WHERE $6 AND tenant_id = $1
)
UPDATE jobs SET state = $3, next_run_at = $4, version = version + 1, updated_at = $5
WHERE tenant_id = $1 AND job_id = $2
RETURNING job_id, name, target_type, target_ref, payload::text AS payload, schedule::text AS schedule,
          max_attempts, backoff_s, timeout_s, labels::text AS labels, dry_run, state, next_run_at,
       created_at, updated_at, version;

-- name: delete_due_occurrences
-- Takes a job's pending occurrences out of the due index (pause). Its retries
-- stay: dispatch parks them when they fall due (requeue_retries).
DELETE FROM due_index WHERE job_id = $1 AND execution_id IS NULL;

-- name: delete_due_all
-- Takes every due row of a job, retries included, parked or not, out of the
-- due index (cancel).
DELETE FROM due_index WHERE job_id = $1;

-- name: unpark_due_retries
-- Resume: the retries that dispatch parked while the job was paused go back
-- to their due minute (UTC, as storage.jobs.due_minute), so they run at their
-- retry time, or at the next load if it passed. Returns them for the notify.
UPDATE due_index SET due_minute = date_trunc('minute', next_run_at, 'UTC')
WHERE job_id = $1 AND due_minute = 'infinity'
RETURNING shard_id, next_run_at;

-- name: insert_due
INSERT INTO due_index (shard_id, due_minute, next_run_at, job_id, tenant_id)
VALUES ($1, $2, $3, $4, $5)
ON CONFLICT DO NOTHING;

-- name: insert_skipped
-- Resume: the occurrences that fell due while the job was paused and that its
-- misfire policy skips, recorded (once each) rather than silently lost.
INSERT INTO executions (execution_id, job_id, tenant_id, scheduled_for, attempt, state,
                        queued_at, finished_at)
SELECT s.execution_id, $2, $3, s.scheduled_for, 1, 'skipped', $5, $5
FROM unnest($1::uuid[], $4::timestamptz[]) AS s(execution_id, scheduled_for)
ON CONFLICT (job_id, scheduled_for) DO NOTHING;

-- name: take_due_occurrences
-- A schedule change: the job's pending occurrence leaves the due index (its
-- retries stay); returns what it took, so the caller knows one was pending.
DELETE FROM due_index WHERE job_id = $1 AND execution_id IS NULL
RETURNING next_run_at;

-- name: update_job
-- A PATCH, by a caller holding the row lock (lock_job): every patchable field
-- as validated, next_run_at only when the schedule changed ($13).
UPDATE jobs SET name = $3, target_type = $4, target_ref = $5, pool = $6, payload = $7::jsonb,
                schedule = $8::jsonb, max_attempts = $9, backoff_s = $10, timeout_s = $11,
                labels = $12::jsonb, next_run_at = CASE WHEN $13 THEN $14 ELSE next_run_at END,
                dry_run = $16, version = version + 1, updated_at = $15
WHERE tenant_id = $1 AND job_id = $2
RETURNING job_id, name, target_type, target_ref, payload::text AS payload, schedule::text AS schedule,
          max_attempts, backoff_s, timeout_s, labels::text AS labels, dry_run, state, next_run_at,
          created_at, updated_at, version;

-- name: insert_revision
INSERT INTO job_revisions (job_id, version, tenant_id, revised_at, revised_by, changes)
VALUES ($1, $2, $3, $4, $5, $6::jsonb);

-- name: job_revisions
-- A job's revisions, newest first, keyset-paginated on version ($3, exclusive).
SELECT version, revised_at, revised_by, changes::text AS changes
FROM job_revisions
WHERE job_id = $1 AND tenant_id = $2 AND ($3::integer IS NULL OR version < $3)
ORDER BY version DESC
LIMIT $4;
