-- A tenant with max_active_jobs had every submit count its active and paused jobs
-- (41 ms of Postgres at 200,000 of them, under the tenant's quota lock). Such a tenant
-- now has its live-job count in quota_counts. Each statement that writes its jobs, or
-- ends them (a one-off completed, a job canceled), appends the difference to
-- quota_changes, which takes no lock a submit or another completion waits for; the
-- quota check, under the tenant's quota lock, folds the committed changes into the count
-- and reads one row. Tenants without a quota have no row and append nothing.
-- Processes of the release before, still running while an upgrade rolls, append nothing:
-- setting a tenant's maxActiveJobs (PATCH /v1/tenants/{id}) counts it afresh.
CREATE TABLE quota_counts (
    tenant_id uuid PRIMARY KEY REFERENCES tenants,
    live      bigint NOT NULL
);
CREATE TABLE quota_changes (
    tenant_id uuid NOT NULL,
    delta     integer NOT NULL
);
CREATE INDEX quota_changes_tenant ON quota_changes (tenant_id);
INSERT INTO quota_counts (tenant_id, live)
SELECT t.tenant_id, (SELECT count(*) FROM jobs j
                     WHERE j.tenant_id = t.tenant_id AND j.state IN ('active', 'paused'))
FROM tenants t
WHERE t.max_active_jobs IS NOT NULL;
