-- name: job_executions
-- A job's executions, newest first, keyset-paginated on (scheduled_for, execution_id).
SELECT execution_id, job_id, scheduled_for, attempt, state, started_at, finished_at,
       error::text AS error
FROM executions
WHERE job_id = $1 AND tenant_id = $2
  AND ($3::timestamptz IS NULL OR (scheduled_for, execution_id) < ($3, $4::uuid))
ORDER BY scheduled_for DESC, execution_id DESC
LIMIT $5;

-- name: get_execution
SELECT execution_id, job_id, scheduled_for, attempt, state, queued_at, started_at, finished_at,
       error::text AS error, result::text AS result, stale_calls::text AS stale_calls
FROM executions WHERE execution_id = $1 AND tenant_id = $2;

-- name: execution_attempts
SELECT attempt, worker_id, started_at, finished_at, outcome, error::text AS error, lease_until
FROM execution_attempts WHERE execution_id = $1 AND scheduled_for = $2
ORDER BY attempt;

-- name: dead_letters
-- The tenant's dead executions, newest first (execution ids are UUIDv7).
SELECT execution_id, job_id, scheduled_for, attempt, state, started_at, finished_at,
       error::text AS error
FROM executions
WHERE tenant_id = $1 AND state = 'dead' AND ($2::uuid IS NULL OR execution_id < $2)
ORDER BY execution_id DESC
LIMIT $3;

-- name: lock_execution
SELECT e.execution_id, e.job_id, e.scheduled_for, e.attempt, e.state, j.state AS job_state,
       j.pool
FROM executions e JOIN jobs j USING (job_id)
WHERE e.execution_id = $1 AND e.tenant_id = $2
FOR UPDATE OF e;

-- name: requeue_execution
-- Replay or trigger: the execution waits in retry_wait for the due row that re-queues it.
UPDATE executions SET state = 'retry_wait', finished_at = NULL
WHERE execution_id = $1 AND scheduled_for = $2;

-- name: insert_execution
-- A trigger's execution; nothing (NULL) if the job already has one at that instant.
INSERT INTO executions (execution_id, job_id, tenant_id, scheduled_for, attempt, state, queued_at)
VALUES ($1, $2, $3, $4, $5, $6, $4)
ON CONFLICT (job_id, scheduled_for) DO NOTHING
RETURNING execution_id;

-- name: cancel_job_executions
-- A canceled job's unfinished executions; returns them so their workers can be told.
UPDATE executions e SET state = 'canceled', finished_at = coalesce($2, now()),
                        lease_owner = NULL, lease_until = NULL
WHERE e.job_id = $1 AND e.state IN ('queued', 'running', 'retry_wait')
RETURNING e.execution_id;
