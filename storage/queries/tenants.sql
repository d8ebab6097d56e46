-- name: create_tenant
-- Inserts a tenant and its first API key (hash only) in one statement; with a quota,
-- its live-job count (none yet).
WITH t AS (
    INSERT INTO tenants (tenant_id, name, weight, dispatch_rate, max_active_jobs, signing_secret,
                         created_at, updated_at, burst, dry_run, durability)
    VALUES ($1, $2, $3, $4, $5, $6, $8, $8, $9, $10, $11)
    RETURNING tenant_id, max_active_jobs
), counted AS (
    INSERT INTO quota_counts (tenant_id, live)
    SELECT tenant_id, 0 FROM t WHERE max_active_jobs IS NOT NULL
)
INSERT INTO api_keys (key_hash, tenant_id, created_at)
SELECT $7, tenant_id, $8 FROM t;

-- name: tenant_by_key
-- Resolves an API key's hash to its tenant; revoked keys resolve to nothing.
SELECT k.key_hash, t.tenant_id, t.max_active_jobs, t.durability
FROM api_keys k JOIN tenants t USING (tenant_id)
WHERE k.key_hash = $1 AND k.revoked_at IS NULL;

-- name: get_tenant
SELECT tenant_id, name, weight, dispatch_rate, burst, max_active_jobs, dry_run, durability,
       created_at, updated_at
FROM tenants WHERE tenant_id = $1;

-- name: patch_tenant
-- Sets the fields whose "set" flag is true; returns the tenant as it now is.
-- updated_at moves (by at least a microsecond), so schedulers see the change.
UPDATE tenants SET
    weight          = CASE WHEN $2 THEN $3 ELSE weight END,
    dispatch_rate   = CASE WHEN $4 THEN $5 ELSE dispatch_rate END,
    max_active_jobs = CASE WHEN $6 THEN $7 ELSE max_active_jobs END,
    burst           = CASE WHEN $8 THEN $9 ELSE burst END,
    dry_run         = CASE WHEN $10 THEN $11 ELSE dry_run END,
    durability      = CASE WHEN $12 THEN $13 ELSE durability END,
    updated_at      = greatest(clock_timestamp(), updated_at + interval '1 microsecond')
WHERE tenant_id = $1
RETURNING tenant_id, name, weight, dispatch_rate, burst, max_active_jobs, dry_run, durability,
          created_at, updated_at;

-- name: tenant_limits_since
-- What the schedulers' fair queues need of each tenant, changed after $1 (all when NULL):
-- its share, its quota, and its durability (sync tenants' work is dispatched apart).
SELECT tenant_id, weight, dispatch_rate, burst, durability, updated_at
FROM tenants WHERE $1::timestamptz IS NULL OR updated_at > $1
ORDER BY updated_at;

-- name: rotate_signing_secret
-- $2 becomes the current secret; the one it replaces keeps signing until $3 (NULL: no
-- overlap, it stops at once). SET reads the row as it was, so a rotation inside an
-- overlap drops the older previous secret. Returns the secrets as they now are.
UPDATE tenants SET
    signing_secret          = $2,
    previous_signing_secret = CASE WHEN $3::timestamptz IS NULL THEN NULL ELSE signing_secret END,
    previous_secret_until   = $3
WHERE tenant_id = $1
RETURNING tenant_id, signing_secret, previous_signing_secret, previous_secret_until;

-- name: tenant_signing_secrets
-- Every tenant's signing secrets, for the http workers' copy in Redis; a previous
-- secret whose overlap had ended by $1 is left out.
SELECT tenant_id, signing_secret,
       CASE WHEN previous_secret_until > $1 THEN previous_signing_secret END
           AS previous_signing_secret,
       CASE WHEN previous_secret_until > $1 THEN previous_secret_until END
           AS previous_secret_until
FROM tenants;

-- name: tenant_quota_lock
-- Serialises the submits of one quota-limited tenant for this transaction, so
-- the active-job count below cannot be raced past the limit.
SELECT pg_advisory_xact_lock(hashtextextended($1::uuid::text, 0));

-- name: count_live_jobs
-- Jobs that still count against max_active_jobs: active or paused.
SELECT count(*) FROM jobs WHERE tenant_id = $1 AND state IN ('active', 'paused');

-- name: quota_live
-- The quota check, under the tenant's quota lock: the changes committed so far are
-- folded into its live-job count, which it returns (changes still in flight are not
-- visible, nor are the jobs they wrote or finished). No row: the tenant keeps no count.
WITH folded AS (
    DELETE FROM quota_changes WHERE tenant_id = $1 RETURNING delta
)
UPDATE quota_counts SET live = live + (SELECT coalesce(sum(delta), 0) FROM folded)
WHERE tenant_id = $1
RETURNING live;

-- name: quota_changes_lock
-- Setting a quota counts afresh. This waits for every transaction that has written a
-- change (every statement that writes or finishes a job names the table) and holds new
-- ones back until the commit, so the count sees exactly the jobs the changes account for.
-- Self-exclusive, so two such transactions take turns. Asked for 200 ms at most (the
-- caller tries again): while it waits, the submits and completions behind it wait too.
SET LOCAL lock_timeout = '200ms';
LOCK TABLE quota_changes IN SHARE ROW EXCLUSIVE MODE;

-- name: quota_recount
WITH dropped AS (
    DELETE FROM quota_changes WHERE tenant_id = $1
)
INSERT INTO quota_counts (tenant_id, live)
SELECT $1, count(*) FROM jobs WHERE tenant_id = $1 AND state IN ('active', 'paused')
ON CONFLICT (tenant_id) DO UPDATE SET live = EXCLUDED.live;

-- name: quota_forget
-- The quota lifted: the count and its changes go (a change in flight may still land;
-- the next recount drops it).
WITH dropped AS (
    DELETE FROM quota_changes WHERE tenant_id = $1
)
DELETE FROM quota_counts WHERE tenant_id = $1;

-- name: tenant_by_name
-- The oldest tenant of that name (names are labels, not unique).
SELECT tenant_id FROM tenants WHERE name = $1 ORDER BY created_at, tenant_id LIMIT 1;

-- name: insert_api_key
INSERT INTO api_keys (key_hash, tenant_id, created_at) VALUES ($1, $2, $3);
