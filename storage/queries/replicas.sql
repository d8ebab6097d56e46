-- name: primary_wal_position
-- Where the primary's WAL ends now, in bytes from the start of WAL (every transaction
-- committed before this was asked lies at or below it), and the timeline it is on (the
-- first 8 hex digits of its WAL file's name): a promotion starts a new one.
-- gateway/reads.py compares replicas' replay positions with these.
SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint AS position,
       ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::integer
           AS timeline;

-- name: replica_replay_position
-- How far a replica has replayed, in the same bytes. standby is false on a server out of
-- recovery (a promoted standby: it no longer follows the primary). streaming: it has a WAL
-- receiver, so it follows some primary; timeline is the one it receives, NULL unless the
-- role may read it (pg_read_all_stats, in pg_monitor).
SELECT pg_is_in_recovery() AS standby,
       (pg_last_wal_replay_lsn() - '0/0'::pg_lsn)::bigint AS replayed,
       EXISTS (SELECT 1 FROM pg_stat_wal_receiver) AS streaming,
       (SELECT received_tli FROM pg_stat_wal_receiver) AS timeline;
