"""The bounds a batch prunes the executions partitions by."""

from datetime import UTC, datetime

from herdwick.storage.jobs import time_span


def test_a_batch_s_span_is_its_earliest_and_latest_time() -> None:
    times = [datetime(2026, 12, 7, 10, tzinfo=UTC), datetime(2026, 12, 5, 23, tzinfo=UTC),
             datetime(2026, 12, 6, 1, tzinfo=UTC)]
    assert time_span(times) == (times[1], times[0])


def test_no_times_span_nothing_and_infinities_are_left_out() -> None:
    assert time_span([]) == (None, None)  # NULL bounds: no partition is set up
    finite = datetime(2026, 12, 7, tzinfo=UTC)
    assert time_span([datetime.max, finite, datetime.min]) == (finite, finite)  # asyncpg's
    assert time_span([datetime.max]) == (None, None)
