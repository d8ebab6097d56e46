-- A tenant's dispatch-rate burst (tokens its bucket holds; NULL: one second of its
-- rate), and when its settings last changed, so schedulers pick up changes within
-- seconds by reading only what changed.
ALTER TABLE tenants
    ADD COLUMN burst double precision CHECK (burst >= 1),
    ADD COLUMN updated_at timestamptz NOT NULL DEFAULT now();
CREATE INDEX tenants_updated ON tenants (updated_at);
