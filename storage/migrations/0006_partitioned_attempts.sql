-- Retention drops whole days: execution_attempts becomes range-partitioned by day on
-- scheduled_for, with the same daily partitions as executions (execution_attempts_YYYYMMDD)
-- and a default one, so a day's attempts leave with its executions. A partitioned table's
-- unique keys must include its partition key: the key becomes (execution_id,
-- scheduled_for, attempt), and every ON CONFLICT names it. The existing rows move in this
-- migration's transaction (see docs/operations.md: stop the schedulers for it).
ALTER TABLE execution_attempts RENAME TO execution_attempts_unpartitioned;
ALTER INDEX execution_attempts_pkey RENAME TO execution_attempts_unpartitioned_pkey;

CREATE TABLE execution_attempts (
    execution_id   uuid NOT NULL,
    attempt        integer NOT NULL,
    scheduled_for  timestamptz NOT NULL,
    worker_id      text,
    started_at     timestamptz,
    finished_at    timestamptz,
    outcome        text CONSTRAINT execution_attempts_outcome_check CHECK (outcome IN
                     ('running', 'succeeded', 'failed', 'expired', 'canceled', 'deferred')),
    error          jsonb,
    PRIMARY KEY (execution_id, scheduled_for, attempt)
) PARTITION BY RANGE (scheduled_for);
CREATE TABLE execution_attempts_default PARTITION OF execution_attempts DEFAULT;

-- One attempts partition beside each executions partition, over the same range.
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) AS bound
             FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
             WHERE i.inhparent = 'executions'::regclass AND c.relname ~ '^executions_[0-9]{8}$'
    LOOP
        EXECUTE format('CREATE TABLE %I PARTITION OF execution_attempts %s',
                       'execution_attempts_' || substr(r.relname, length('executions_') + 1),
                       r.bound);
    END LOOP;
END;
$$;

INSERT INTO execution_attempts SELECT * FROM execution_attempts_unpartitioned;
DROP TABLE execution_attempts_unpartitioned;

-- Retention's check that a day holds no unfinished execution before it leaves: an index
-- of the few unfinished rows, so the check under the detach's lock is a probe, not a scan.
CREATE INDEX executions_open ON executions (scheduled_for)
    WHERE state IN ('queued', 'running', 'retry_wait');

-- The second version of the partition function: each day gets both tables' partitions.
-- For each missing one it creates the table, moves the rows its default partition caught
-- for that day into it (ATTACH would refuse otherwise), then attaches it. A day's table
-- that exists is left alone, attached or not: a table retention detached is finished by
-- retention, never put back here. Returns the days it created anything for. An advisory
-- lock serialises callers.
CREATE OR REPLACE FUNCTION herdwick_ensure_execution_partitions(p_from date, p_days integer)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    day date;
    parent text;
    part text;
    lo timestamptz;
    hi timestamptz;
    made boolean;
    created integer := 0;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('herdwick_execution_partitions'));
    FOR i IN 0 .. p_days - 1 LOOP
        day := p_from + i;
        lo := (day::text || ' 00:00:00+00')::timestamptz;
        hi := ((day + 1)::text || ' 00:00:00+00')::timestamptz;
        made := false;
        FOREACH parent IN ARRAY ARRAY['executions', 'execution_attempts'] LOOP
            part := parent || '_' || to_char(day, 'YYYYMMDD');
            CONTINUE WHEN to_regclass(part) IS NOT NULL;
            EXECUTE format('CREATE TABLE %I (LIKE %I INCLUDING DEFAULTS INCLUDING CONSTRAINTS)',
                           part, parent);
            EXECUTE format(
                'WITH moved AS (DELETE FROM %I WHERE scheduled_for >= %L AND scheduled_for < %L '
                'RETURNING *) INSERT INTO %I SELECT * FROM moved', parent || '_default', lo, hi, part);
            EXECUTE format('ALTER TABLE %I ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)',
                           parent, part, lo, hi);
            made := true;
        END LOOP;
        created := created + made::integer;
    END LOOP;
    RETURN created;
END;
$$;

-- Every archive retention made of a day's partitions, and where each stands: detached
-- (out of the application's reach, so it cannot change while it is archived), archived
-- (its objects are complete at url), dropped. `name` names the archive's two objects,
-- <name>.jsonl.gz and <name>.manifest.json: executions_YYYYMMDD, or executions_YYYYMMDD_N
-- for the Nth archive of a day whose rows arrived after its first was dropped (a past
-- runAt, a resumed job's skipped occurrences). `error` is why its last try failed.
CREATE TABLE retention_archives (
    name         text PRIMARY KEY,
    day          date NOT NULL,
    url          text,
    rows         bigint,
    attempts     bigint,
    bytes        bigint,
    sha256       text,
    detached_at  timestamptz,
    archived_at  timestamptz,
    dropped_at   timestamptz,
    error        text,
    failed_at    timestamptz
);
-- At most one archive of a day is under way: a rerun after a crash finds and finishes it.
CREATE UNIQUE INDEX retention_archives_pending ON retention_archives (day)
    WHERE dropped_at IS NULL;
