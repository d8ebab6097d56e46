-- Attempts a worker put off without trying them (an HTTP target's circuit breaker
-- open): they do not count against max_attempts, so an execution's attempt limit is
-- max_attempts + deferrals, and its history says which attempts were deferred.
ALTER TABLE executions ADD COLUMN deferrals integer NOT NULL DEFAULT 0;
ALTER TABLE execution_attempts DROP CONSTRAINT execution_attempts_outcome_check;
ALTER TABLE execution_attempts ADD CONSTRAINT execution_attempts_outcome_check
    CHECK (outcome IN ('running', 'succeeded', 'failed', 'expired', 'canceled', 'deferred'));
