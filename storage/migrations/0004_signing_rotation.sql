-- The signing secret a rotation replaced, and when it stops signing deliveries: during
-- that overlap every delivery carries a signature with each secret, so receivers can
-- switch to the new one at their own pace. Both NULL: no previous secret (a rotation
-- with no overlap, or none yet). A second rotation inside an overlap keeps only the
-- secret it replaced: two secrets at most ever sign.
ALTER TABLE tenants
    ADD COLUMN previous_signing_secret text,
    ADD COLUMN previous_secret_until timestamptz,
    ADD CONSTRAINT tenants_previous_secret_has_an_end
        CHECK ((previous_signing_secret IS NULL) = (previous_secret_until IS NULL));
