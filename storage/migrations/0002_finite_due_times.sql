-- Earlier releases accepted a runAt of 0001-01-01T00:00:00Z, which asyncpg
-- stores as -infinity: no shard could load such a row. A time in the past
-- runs as soon as possible, so those rows become due at the epoch. (+infinity
-- was never reachable through the API; due_minute 'infinity' is the parking
-- mark of paused retries and stays.)
UPDATE jobs SET next_run_at = '1970-01-01T00:00:00Z'
WHERE next_run_at = '-infinity';

UPDATE due_index SET next_run_at = '1970-01-01T00:00:00Z',
                     due_minute = CASE WHEN due_minute = 'infinity' THEN due_minute
                                       ELSE '1970-01-01T00:00:00Z' END
WHERE next_run_at = '-infinity';
