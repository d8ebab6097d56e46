-- name: dashboard_tenants
-- The tenants an overview shows, by name: every one for the admin ($1 NULL), else one.
SELECT tenant_id, name FROM tenants
WHERE $1::uuid IS NULL OR tenant_id = $1
ORDER BY name, tenant_id
LIMIT $2;

-- name: dashboard_hour
-- Per tenant, over the executions scheduled in [$1, $2) (the range keeps the scan to
-- the partitions of that span; skipped and dry-run occurrences never ran and are left
-- out): the
-- whole span's row (minute NULL) and one row a minute ($1 is a whole minute). $3: one
-- tenant or NULL for all. Lags in seconds, their percentiles over what has one:
-- queue lag is queued_at - scheduled_for of executions still on their first attempt
-- (a retry's queued_at is its own re-queue, which would count its backoff); start
-- lag is started_at - scheduled_for (the first attempt's lease grant; it is kept
-- over retries). Dead and succeeded count the executions in those states now.
WITH recent AS (
    SELECT tenant_id, date_bin('1 minute', scheduled_for, $1) AS minute, state,
           CASE WHEN attempt <= 1 THEN extract(epoch FROM queued_at - scheduled_for) END
               AS queue_lag_s,
           extract(epoch FROM started_at - scheduled_for) AS start_lag_s
    FROM executions
    WHERE scheduled_for >= $1 AND scheduled_for < $2 AND state NOT IN ('skipped', 'dry_run')
      AND ($3::uuid IS NULL OR tenant_id = $3)
)
SELECT tenant_id, minute, count(*) AS executions,
       count(*) FILTER (WHERE state = 'succeeded') AS succeeded,
       count(*) FILTER (WHERE state = 'dead') AS dead,
       count(*) FILTER (WHERE state = 'queued') AS queued,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY queue_lag_s) AS queue_lag_p50_s,
       percentile_cont(0.99) WITHIN GROUP (ORDER BY queue_lag_s) AS queue_lag_p99_s,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY start_lag_s) AS start_lag_p50_s,
       percentile_cont(0.99) WITHIN GROUP (ORDER BY start_lag_s) AS start_lag_p99_s
FROM recent
GROUP BY GROUPING SETS ((tenant_id), (tenant_id, minute))
ORDER BY tenant_id, minute NULLS FIRST;

-- name: dashboard_queue_moves
-- Queue depth over [$1, $2), as moves a minute: +1 in the minute an execution of the
-- span was queued, -1 in the minute it left the queue (its current attempt's lease
-- grant, else its finish: canceled or dead while queued). Summed in order they give
-- the depth at each minute's end (the caller counts a move outside the span in its
-- nearest minute). An execution keeps one queued_at, its current attempt's: the
-- waits of its earlier attempts are not kept, so they are not counted. $3: one
-- tenant or NULL.
WITH recent AS (
    SELECT e.tenant_id, e.queued_at, coalesce(a.started_at, e.finished_at) AS left_at
    FROM executions e
    LEFT JOIN execution_attempts a
      ON a.execution_id = e.execution_id AND a.attempt = e.attempt
     AND a.scheduled_for = e.scheduled_for
    WHERE e.scheduled_for >= $1 AND e.scheduled_for < $2
      AND e.state NOT IN ('skipped', 'dry_run')
      AND e.queued_at IS NOT NULL AND ($3::uuid IS NULL OR e.tenant_id = $3)
), moves AS (
    SELECT tenant_id, queued_at AS at, 1 AS delta FROM recent
    UNION ALL
    SELECT tenant_id, greatest(left_at, queued_at), -1 FROM recent WHERE left_at IS NOT NULL
)
SELECT tenant_id, date_bin('1 minute', at, $1) AS minute, sum(delta)::bigint AS delta
FROM moves
GROUP BY tenant_id, minute
ORDER BY tenant_id, minute;
