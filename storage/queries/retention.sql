-- Retention (storage/retention.py). `{day}` stands for a day's YYYYMMDD in the names of
-- its partitions, executions_{day} and execution_attempts_{day}: identifiers cannot be
-- parameters, so retention.py puts in the digits of a date, never text from elsewhere.

-- name: retention_lock
-- The retention lease: a session-level advisory lock on the connection that does the
-- whole pass, so every write of the pass dies with the lease. true: this session holds it.
SELECT pg_try_advisory_lock(hashtext('herdwick_retention'));

-- name: retention_unlock
SELECT pg_advisory_unlock(hashtext('herdwick_retention'));

-- name: retention_lock_timeout
-- How long a statement of this transaction waits for a table lock before it fails, so a
-- detach or drop waiting behind a long query never holds the queue behind it for long.
SELECT set_config('lock_timeout', $1::text || 'ms', true);

-- name: retention_partitions
-- The executions partitions still attached for a day before $1 (the first day kept),
-- with each one's executions and how many are unfinished (queued, running, retry_wait).
WITH parts AS (
    SELECT c.oid, to_date(substr(c.relname, length('executions_') + 1), 'YYYYMMDD') AS day
    FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
    WHERE i.inhparent = 'executions'::regclass AND c.relname ~ '^executions_[0-9]{8}$'
), counted AS (
    SELECT tableoid, count(*) AS executions,
           count(*) FILTER (WHERE state IN ('queued', 'running', 'retry_wait')) AS unfinished
    FROM executions WHERE scheduled_for < $1::date::timestamp AT TIME ZONE 'UTC'
    GROUP BY tableoid
)
SELECT p.day, coalesce(c.executions, 0) AS executions, coalesce(c.unfinished, 0) AS unfinished
FROM parts p LEFT JOIN counted c ON c.tableoid = p.oid
WHERE p.day < $1::date
ORDER BY p.day;

-- name: retention_default_days
-- Executions the default partition caught for days before $1 (a past runAt, a resumed
-- job's skipped occurrences, rows that arrived after their day was dropped), by day.
SELECT (scheduled_for AT TIME ZONE 'UTC')::date AS day, count(*) AS executions,
       count(*) FILTER (WHERE state IN ('queued', 'running', 'retry_wait')) AS unfinished
FROM executions_default
WHERE scheduled_for < $1::date::timestamp AT TIME ZONE 'UTC'
GROUP BY 1
ORDER BY 1;

-- name: retention_records
-- Every archive of these days ($1) so far, to name the next and to find one under way.
SELECT name, day, detached_at IS NOT NULL AS detached, dropped_at IS NOT NULL AS dropped
FROM retention_archives
WHERE day = ANY($1::date[])
ORDER BY day, name;

-- name: retention_pending
-- Archives a pass detached and did not drop (it crashed, or the archive or the drop
-- failed): their tables are out of the application's reach, waiting to be finished.
SELECT name, day FROM retention_archives
WHERE detached_at IS NOT NULL AND dropped_at IS NULL
ORDER BY day;

-- name: retention_claim
-- The record of an archive about to be tried; a rerun finds the one it left.
INSERT INTO retention_archives (name, day) VALUES ($1, $2)
ON CONFLICT (name) DO NOTHING;

-- name: retention_failed
-- Why the latest try of an archive failed (or why its day is kept for now).
UPDATE retention_archives SET error = $2, failed_at = $3 WHERE name = $1;

-- name: retention_detached
UPDATE retention_archives SET detached_at = $2 WHERE name = $1;

-- name: retention_archived
-- The archive's objects are complete at $2.
UPDATE retention_archives
SET url = $2, rows = $3, attempts = $4, bytes = $5, sha256 = $6, archived_at = $7,
    error = NULL, failed_at = NULL
WHERE name = $1;

-- name: retention_dropped
UPDATE retention_archives SET dropped_at = $2, error = NULL, failed_at = NULL
WHERE name = $1 AND dropped_at IS NULL;

-- name: retention_detach
-- Takes a day's two partitions out of their tables: nothing the application runs can
-- change them after this commits. Takes the parents' ACCESS EXCLUSIVE lock for a moment
-- (DETACH ... CONCURRENTLY is refused beside a default partition).
ALTER TABLE executions DETACH PARTITION executions_{day};
ALTER TABLE execution_attempts DETACH PARTITION execution_attempts_{day};

-- name: retention_unfinished
-- In the detach's transaction: the day's unfinished executions (the executions_open
-- index), any of which makes the detach roll back.
SELECT count(*) FROM executions_{day} WHERE state IN ('queued', 'running', 'retry_wait');

-- name: retention_day_rows
-- A detached day's executions, and how many of them are unfinished.
SELECT count(*) AS executions,
       count(*) FILTER (WHERE state IN ('queued', 'running', 'retry_wait')) AS unfinished
FROM executions_{day};

-- name: retention_export
-- A detached day's executions in a fixed order, each one JSON object: every column as
-- Postgres stores it, and `attempts`, its attempts in order (without the two columns
-- they share with it). `attempts` counts them.
SELECT (to_jsonb(e) || jsonb_build_object('attempts', a.list))::text AS line,
       a.n AS attempts
FROM executions_{day} e
CROSS JOIN LATERAL (
    SELECT coalesce(jsonb_agg(to_jsonb(x) - 'execution_id' - 'scheduled_for'
                              ORDER BY x.attempt), '[]'::jsonb) AS list,
           count(*) AS n
    FROM execution_attempts_{day} x
    WHERE x.execution_id = e.execution_id AND x.scheduled_for = e.scheduled_for
) a
ORDER BY e.scheduled_for, e.execution_id;

-- name: retention_attempt_rows
-- Every attempt row of the detached day, to prove the export carried each one.
SELECT count(*) FROM execution_attempts_{day};

-- name: retention_drop
-- The detached day's tables; they belong to no parent, so this locks nothing else.
DROP TABLE executions_{day}, execution_attempts_{day};
