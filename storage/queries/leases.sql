-- name: node_heartbeat
-- Registers a scheduler node or renews its heartbeat. Times: $2, else the database clock.
-- Returns the database's clock as the statement ran: the scheduler steers its own by it.
INSERT INTO scheduler_nodes (node_id, started_at, heartbeat_at, info)
VALUES ($1, coalesce($2, now()), coalesce($2, now()), $3::jsonb)
ON CONFLICT (node_id) DO UPDATE SET heartbeat_at = EXCLUDED.heartbeat_at
RETURNING clock_timestamp() AS db_now;

-- name: node_leave
DELETE FROM scheduler_nodes WHERE node_id = $1;

-- name: live_nodes
-- Nodes whose heartbeat is younger than $2 seconds.
SELECT node_id FROM scheduler_nodes
WHERE heartbeat_at > coalesce($1, now()) - make_interval(secs => $2)
ORDER BY node_id;

-- name: claim_shards
-- Takes up to $3 shards that are free or whose lease expired, bumping each
-- one's revision: the new fencing token. SKIP LOCKED lets racing nodes
-- split the free shards instead of queueing on them.
UPDATE shard_leases l SET owner = $1,
    lease_until = coalesce($4, now()) + make_interval(secs => $2),
    revision = l.revision + 1
WHERE l.shard_id IN (
    SELECT shard_id FROM shard_leases
    WHERE owner IS NULL OR lease_until <= coalesce($4, now())
    ORDER BY shard_id
    LIMIT $3
    FOR UPDATE SKIP LOCKED)
RETURNING l.shard_id, l.revision;

-- name: renew_shards
-- Extends the leases still held at the given revisions; a shard missing from
-- the result was lost and must be stepped down from at once.
UPDATE shard_leases l SET lease_until = coalesce($4, now()) + make_interval(secs => $2)
FROM unnest($3::smallint[], $5::bigint[]) AS mine(shard_id, revision)
WHERE l.shard_id = mine.shard_id AND l.revision = mine.revision AND l.owner = $1
  AND l.lease_until > coalesce($4, now())
RETURNING l.shard_id;

-- name: release_shards
-- Gives shards back (shutdown, rebalance) so another node can claim them at once.
UPDATE shard_leases l SET owner = NULL, lease_until = NULL
FROM unnest($2::smallint[], $3::bigint[]) AS mine(shard_id, revision)
WHERE l.shard_id = mine.shard_id AND l.revision = mine.revision AND l.owner = $1
RETURNING l.shard_id;
