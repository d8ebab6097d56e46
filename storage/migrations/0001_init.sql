-- The whole data model of DESIGN.md. All times are UTC timestamptz.

CREATE TABLE tenants (
    tenant_id        uuid PRIMARY KEY,
    name             text NOT NULL,
    weight           integer NOT NULL DEFAULT 1 CHECK (weight >= 1),
    dispatch_rate    double precision CHECK (dispatch_rate > 0),   -- per second; NULL: unlimited
    max_active_jobs  integer CHECK (max_active_jobs >= 1),         -- NULL: unlimited
    signing_secret   text NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now()
);

-- Only hashes are stored: sha256 of the key, which carries >= 128 random bits.
CREATE TABLE api_keys (
    key_hash    bytea PRIMARY KEY,
    tenant_id   uuid NOT NULL REFERENCES tenants ON DELETE CASCADE,
    created_at  timestamptz NOT NULL DEFAULT now(),
    revoked_at  timestamptz
);
CREATE INDEX api_keys_tenant ON api_keys (tenant_id);

CREATE TABLE jobs (
    job_id           uuid PRIMARY KEY,                 -- UUIDv7: time-ordered, so keyset pages follow creation
    tenant_id        uuid NOT NULL REFERENCES tenants,
    name             text NOT NULL,
    target_type      text NOT NULL CHECK (target_type IN ('http', 'queue')),
    target_ref       text NOT NULL,
    pool             text NOT NULL,                    -- the worker pool: the queue ref, or 'http'
    payload          jsonb NOT NULL,
    schedule         jsonb NOT NULL,                   -- herdwick.model.Schedule, defaults filled in
    max_attempts     integer NOT NULL CHECK (max_attempts >= 1),
    backoff_s        double precision NOT NULL CHECK (backoff_s >= 0),
    timeout_s        integer NOT NULL CHECK (timeout_s >= 1),
    state            text NOT NULL CHECK (state IN ('active', 'paused', 'canceled', 'completed')),
    next_run_at      timestamptz,
    version          integer NOT NULL DEFAULT 1,
    created_at       timestamptz NOT NULL,
    updated_at       timestamptz NOT NULL
);
CREATE INDEX jobs_tenant_page ON jobs (tenant_id, job_id DESC);
CREATE INDEX jobs_tenant_state_page ON jobs (tenant_id, state, job_id DESC);
-- Answers "how many of this tenant's jobs fall due in this second" for the herd warning.
CREATE INDEX jobs_tenant_due ON jobs (tenant_id, next_run_at) WHERE state = 'active';

CREATE TABLE idempotency_keys (
    tenant_id     uuid NOT NULL REFERENCES tenants ON DELETE CASCADE,
    key           text NOT NULL,
    request_hash  bytea NOT NULL,
    status        integer NOT NULL,
    response      bytea NOT NULL,
    created_at    timestamptz NOT NULL,
    expires_at    timestamptz NOT NULL,
    PRIMARY KEY (tenant_id, key)
);
CREATE INDEX idempotency_keys_expiry ON idempotency_keys (expires_at);

-- What falls due when. One contiguous range scan per shard per load tick:
-- (shard_id, due_minute <= now + 1 min). execution_id, scheduled_for (its
-- partition key) and attempt are set for a retry of an existing execution
-- and NULL for a new occurrence.
CREATE TABLE due_index (
    shard_id      smallint NOT NULL CHECK (shard_id BETWEEN 0 AND 255),
    due_minute    timestamptz NOT NULL,
    next_run_at   timestamptz NOT NULL,
    job_id        uuid NOT NULL,
    execution_id  uuid,
    scheduled_for timestamptz,
    attempt       integer,
    PRIMARY KEY (shard_id, due_minute, next_run_at, job_id)
);
CREATE INDEX due_index_job ON due_index (job_id);

-- One row per occurrence, created once however often a scheduler retries:
-- unique (job_id, scheduled_for). Daily range partitions make retention a
-- partition drop; the default partition catches anything maintenance has not
-- reached yet, so no insert can fail for want of a partition.
CREATE TABLE executions (
    execution_id   uuid NOT NULL,
    job_id         uuid NOT NULL,
    tenant_id      uuid NOT NULL,
    scheduled_for  timestamptz NOT NULL,
    attempt        integer NOT NULL DEFAULT 1,
    state          text NOT NULL CHECK (state IN
                     ('queued', 'running', 'retry_wait', 'succeeded', 'dead', 'canceled', 'skipped')),
    lease_owner    text,
    lease_until    timestamptz,
    queued_at      timestamptz,
    started_at     timestamptz,
    finished_at    timestamptz,
    error          jsonb,
    result         jsonb,
    PRIMARY KEY (execution_id, scheduled_for),
    UNIQUE (job_id, scheduled_for)
) PARTITION BY RANGE (scheduled_for);
CREATE TABLE executions_default PARTITION OF executions DEFAULT;
CREATE INDEX executions_dead ON executions (tenant_id, execution_id DESC) WHERE state = 'dead';
-- The sweeper's scan: what Postgres thinks is queued or running, oldest first.
CREATE INDEX executions_unfinished ON executions (queued_at) WHERE state IN ('queued', 'running');

CREATE TABLE execution_attempts (
    execution_id   uuid NOT NULL,
    attempt        integer NOT NULL,
    scheduled_for  timestamptz NOT NULL,
    worker_id      text,
    started_at     timestamptz,
    finished_at    timestamptz,
    outcome        text CHECK (outcome IN ('running', 'succeeded', 'failed', 'expired', 'canceled')),
    error          jsonb,
    PRIMARY KEY (execution_id, attempt)
);

-- The fencing token of each shard: every dispatch transaction holds its row
-- FOR SHARE and checks owner and revision.
CREATE TABLE shard_leases (
    shard_id     smallint PRIMARY KEY CHECK (shard_id BETWEEN 0 AND 255),
    owner        text,
    lease_until  timestamptz,
    revision     bigint NOT NULL DEFAULT 0
);
INSERT INTO shard_leases (shard_id) SELECT generate_series(0, 255);

CREATE TABLE scheduler_nodes (
    node_id       text PRIMARY KEY,
    started_at    timestamptz NOT NULL,
    heartbeat_at  timestamptz NOT NULL,
    info          jsonb NOT NULL DEFAULT '{}'
);

-- Creates the daily executions partitions for [p_from, p_from + p_days),
-- moving any rows the default partition caught for a day into its new
-- partition first (ATTACH would refuse otherwise). Safe to call
-- concurrently: an advisory lock serialises callers.
CREATE FUNCTION herdwick_ensure_execution_partitions(p_from date, p_days integer)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    day date;
    part text;
    lo timestamptz;
    hi timestamptz;
    created integer := 0;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('herdwick_execution_partitions'));
    FOR i IN 0 .. p_days - 1 LOOP
        day := p_from + i;
        part := 'executions_' || to_char(day, 'YYYYMMDD');
        CONTINUE WHEN to_regclass(part) IS NOT NULL;
        lo := (day::text || ' 00:00:00+00')::timestamptz;
        hi := ((day + 1)::text || ' 00:00:00+00')::timestamptz;
        EXECUTE format('CREATE TABLE %I (LIKE executions INCLUDING DEFAULTS INCLUDING CONSTRAINTS)', part);
        EXECUTE format(
            'WITH moved AS (DELETE FROM executions_default WHERE scheduled_for >= %L AND scheduled_for < %L RETURNING *) '
            'INSERT INTO %I SELECT * FROM moved', lo, hi, part);
        EXECUTE format('ALTER TABLE executions ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)', part, lo, hi);
        created := created + 1;
    END LOOP;
    RETURN created;
END;
$$;

SELECT herdwick_ensure_execution_partitions((now() AT TIME ZONE 'UTC')::date - 1, 8);
