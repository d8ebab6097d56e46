"""After a submit commits: tell the shard owners about jobs due before their next load."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

from redis.exceptions import RedisError

from herdwick.clock import Clock
from storage.hot import HotTier, NotifyMessage
from storage.jobs import NewJob

log = logging.getLogger("herdwick.gateway")

# A little more than the shards' load interval, so nothing due before the next
# load waits for the one after it.
NEAR_DUE = timedelta(seconds=5)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _us(when: datetime) -> int:
    delta = when - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def notifier(hot: HotTier, clock: Clock):
    async def after_submit(jobs: list[NewJob]) -> None:
        horizon = clock.now() + NEAR_DUE
        near = [NotifyMessage(j.shard_id, str(j.job_id), _us(j.next_run_at))
                for j in jobs if j.next_run_at <= horizon]
        try:
            await hot.notify(near)
        except (RedisError, OSError) as exc:
            # The job is committed; the shard's next load picks it up.
            log.warning("event=notify_failed count=%d error=%s", len(near), exc)
    return after_submit
