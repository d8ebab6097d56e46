-- "Did my job run twice?" Each attempt keeps its lease's expiry as first granted,
-- and each execution the worker calls the fence refused from an attempt whose lease
-- lapsed or that a later attempt replaced: a possible duplicate side effect, as a
-- JSON array of {attempt, workerId, call, count, firstAt, lastAt} (NULL: none).
ALTER TABLE execution_attempts ADD COLUMN lease_until timestamptz;
ALTER TABLE executions ADD COLUMN stale_calls jsonb;
