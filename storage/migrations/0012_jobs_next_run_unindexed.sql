-- jobs_tenant_due (tenant_id, next_run_at) was the herd warning's index until 0010 moved
-- that count to due_index; nothing reads it now. It made every move of a cron job's
-- next_run_at (each dispatch of each cron occurrence) a non-HOT update: a new index entry
-- in each of the table's indexes, GIN labels included. Without it such an update can be
-- HOT when its page has room, which a fill factor of 90 leaves on pages written from now.
-- Api processes of releases before 0010 count on it: upgrading from one, stop them first.
DROP INDEX jobs_tenant_due;
ALTER TABLE jobs SET (fillfactor = 90);
