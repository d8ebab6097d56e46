"""The worker SDK on a Redis Cluster: its blocking reader holds a connection to the node
serving its pool's slot."""

from tests.integration.test_worker import (  # noqa: F401 - tests and fixtures, by name
    pool,
    test_a_message_whose_reader_died_is_claimed,
    test_a_returned_value_completes_the_attempt,
    test_a_worker_that_stalled_past_its_lease_says_so_to_redis,
    test_concurrency_bounds_handlers_and_reads,
    test_graceful_shutdown_lets_in_flight_work_finish,
    test_lease_lost_cancels_the_handler_and_reports_nothing,
)
