"""All tiers together on a Redis Cluster: HTTP submit -> scheduler -> SDK worker -> Postgres."""

from tests.acceptance.test_end_to_end import (  # noqa: F401 - tests and fixtures, by name
    clock,
    test_a_job_runs_through_every_tier,
)
