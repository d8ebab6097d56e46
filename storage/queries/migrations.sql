-- name: migrations_lock
-- Serialises concurrent `herdwick migrate` runs (session-level advisory lock).
SELECT pg_advisory_lock(hashtext('herdwick_migrate'));

-- name: migrations_unlock
SELECT pg_advisory_unlock(hashtext('herdwick_migrate'));

-- name: migrations_table
-- The record of applied migrations; created by the runner itself.
CREATE TABLE IF NOT EXISTS schema_migrations (
    version     integer PRIMARY KEY,
    name        text NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now()
);

-- name: migrations_applied
SELECT version FROM schema_migrations ORDER BY version;

-- name: migrations_record
INSERT INTO schema_migrations (version, name) VALUES ($1, $2);

-- name: migrations_table_exists
SELECT to_regclass('schema_migrations') IS NOT NULL;

-- name: schema_version
-- The newest applied migration (NULL when none is).
SELECT max(version) FROM schema_migrations;

-- name: ensure_execution_partitions
-- Creates the daily executions partitions for [$1, $1 + $2 days).
SELECT herdwick_ensure_execution_partitions($1::date, $2::integer);
