-- Issue 15, living with jobs: labels to find them by, dry runs, and a revision for
-- every change a PATCH makes.

-- A job's labels: a string map (herdwick/model.py bounds it). The filter asks
-- "this tenant's jobs whose labels contain these pairs". A GIN index on labels alone
-- would answer with every tenant's jobs carrying a common pair (team:payments), to be
-- filtered by tenant afterwards; this one is on {"<tenant_id>": labels}, so with
-- jsonb_path_ops each key is the hash of (tenant, label key, value): one posting list
-- per tenant and pair, however many tenants share the pair. storage/queries/jobs.sql
-- list_jobs spells the same expression (jsonb_set is immutable; jsonb_build_object is not).
ALTER TABLE jobs ADD COLUMN labels jsonb NOT NULL DEFAULT '{}';
CREATE INDEX jobs_tenant_labels ON jobs
    USING gin (jsonb_set('{}', ARRAY[tenant_id::text], labels) jsonb_path_ops);
-- The name filter is exact: this index hands its matches over newest first.
CREATE INDEX jobs_tenant_name_page ON jobs (tenant_id, name, job_id DESC);

-- Dry runs: a job whose own flag, or its tenant's, is set records each occurrence it
-- would have dispatched as a 'dry_run' execution and publishes nothing.
ALTER TABLE jobs ADD COLUMN dry_run boolean NOT NULL DEFAULT false;
ALTER TABLE tenants ADD COLUMN dry_run boolean NOT NULL DEFAULT false;

-- The executions' states gain 'dry_run'. A daily partition was made with LIKE ...
-- INCLUDING CONSTRAINTS and then attached, so it holds a copy of the check of its own,
-- which dropping the parent's leaves behind: drop the parent's, then each copy left, then
-- add the new check to the parent, which adds it to every partition.
ALTER TABLE executions DROP CONSTRAINT executions_state_check;
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN SELECT c.conrelid::regclass AS rel
             FROM pg_constraint c
             WHERE c.conname = 'executions_state_check'
               AND c.conrelid IN (SELECT inhrelid FROM pg_inherits
                                  WHERE inhparent = 'executions'::regclass)
    LOOP
        EXECUTE format('ALTER TABLE %s DROP CONSTRAINT executions_state_check', r.rel);
    END LOOP;
END;
$$;
ALTER TABLE executions ADD CONSTRAINT executions_state_check CHECK (state IN
    ('queued', 'running', 'retry_wait', 'succeeded', 'dead', 'canceled', 'skipped', 'dry_run'));

-- Every PATCH of a job: who made it (an API key's fingerprint), when, and each field it
-- changed, before and after ({"name": {"before": ..., "after": ...}}). version is the
-- job's version the change made, so a job's revisions page on it.
CREATE TABLE job_revisions (
    job_id      uuid NOT NULL,
    version     integer NOT NULL,
    tenant_id   uuid NOT NULL,
    revised_at  timestamptz NOT NULL,
    revised_by  text NOT NULL,
    changes     jsonb NOT NULL,
    PRIMARY KEY (job_id, version)
);
