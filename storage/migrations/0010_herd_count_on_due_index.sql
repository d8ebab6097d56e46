-- The herd warning counts a tenant's pending occurrences in one second on the due index,
-- not on jobs. Both counts are index-only scans that must still visit the table for each
-- entry on a page the visibility map does not mark all-visible, which every page inserted
-- since the last vacuum is: on jobs (400-byte rows with their payloads, more than shared
-- buffers hold) that was a page read, and often a write, for each job counted;
-- due_index rows are 80 bytes and stay in memory.
-- tenant_id is set on the rows of occurrences (execution_id NULL), the ones counted; a
-- retry's row leaves it NULL. jobs_tenant_due stays for now: the api processes of the
-- release before count on it while an upgrade rolls (migrations only add); a later
-- release drops it. Occurrence rows those processes write meanwhile carry no tenant:
-- the herd warning does not count them.
ALTER TABLE due_index ADD COLUMN tenant_id uuid;
UPDATE due_index d SET tenant_id = j.tenant_id
FROM jobs j
WHERE j.job_id = d.job_id AND d.execution_id IS NULL;
CREATE INDEX due_index_tenant_due ON due_index (tenant_id, next_run_at)
    WHERE execution_id IS NULL;
