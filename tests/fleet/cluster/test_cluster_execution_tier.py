"""The execution tier's stories on a Redis Cluster: leases fenced by attempt, retries,
dead letters, cancel reaching a running worker."""

from tests.integration.test_execution_tier import (  # noqa: F401 - tests and fixtures, by name
    clock,
    protocol,
    test_a_poison_job_reaches_dead_letters_with_growing_gaps,
    test_cancel_while_running_tells_the_worker,
    test_redis_losing_everything_is_swept_at_once,
    test_the_gc_pause_story,
    test_the_sweeper_republishes_what_a_crash_left_unpublished,
)
