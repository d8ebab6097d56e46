-- Issue 16: per-tenant durability. 'sync': the tenant's submits, and the dispatch
-- transactions that create or re-queue its executions, commit with synchronous_commit =
-- remote_apply (storage/queries/durability.sql), so their answer waits until every
-- synchronous standby has applied them. 'async': the server's own setting, unchanged.
ALTER TABLE tenants ADD COLUMN durability text NOT NULL DEFAULT 'async'
    CHECK (durability IN ('async', 'sync'));
