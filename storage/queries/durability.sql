-- name: commit_remote_apply
-- This transaction's COMMIT answers only once every synchronous standby has applied it
-- (a sync tenant's submits and dispatches). SET LOCAL: the setting ends with the
-- transaction, so the pooled connection goes back as it came (storage/db.py keeps no
-- session state on them).
SET LOCAL synchronous_commit = remote_apply;
