"""`herdwick scheduler` whose clock can be put a few seconds off while it runs.

Every scheduler component reads time through herdwick.clock (a SteeredClock
over the wall clock), and the CLI offers no way to skew it, so this launcher
wraps it: SIGUSR1 moves the wall clock that module sees (and SystemClock) by
$HW_FAULT_SKEW_S seconds (once), then the real `herdwick scheduler` runs as it
would. Postgres (shard leases) and Redis
(worker leases) keep their own clocks, as they do in production.

    python -m tests.faults.skewed_scheduler scheduler
"""

from __future__ import annotations

import os
import signal
import sys
from datetime import UTC, datetime, timedelta

from herdwick import cli, clock

SKEW_ENV = "HW_FAULT_SKEW_S"

_skew = timedelta(0)  # written by the signal handler, read by every now()


def _skewed_now(self: clock.SystemClock) -> datetime:
    return datetime.now(UTC) + _skew


class _SkewedDatetime(datetime):
    """herdwick.clock's wall clock, skewed: what SteeredClock reads before its first
    reading of Postgres's clock."""

    @classmethod
    def now(cls, tz=None) -> datetime:  # type: ignore[override]
        return datetime.now(tz) + _skew


def _apply_skew(signum: int, frame: object) -> None:
    global _skew
    _skew = timedelta(seconds=float(os.environ.get(SKEW_ENV, "0")))


if __name__ == "__main__":
    clock.SystemClock.now = _skewed_now  # type: ignore[method-assign]
    clock.datetime = _SkewedDatetime  # type: ignore[misc]
    signal.signal(signal.SIGUSR1, _apply_skew)
    sys.exit(cli.main())
