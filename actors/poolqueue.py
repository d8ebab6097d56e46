"""A pool's queue: committed executions wait here until they are on the pool's ready stream.

The policy today is plain FIFO in batches; the fair-queue issue replaces
`take` (which executions go next) with weighted fair queuing per tenant.
Dispatch lag - publish time minus scheduled_for - is recorded per tenant.
"""

from __future__ import annotations

import asyncio
import collections

from herdwick import logs
from herdwick.actors.base import Actor
from herdwick.actors.messages import Publish
from herdwick.actors.shard import to_us
from herdwick.clock import Clock
from herdwick.errors import StorageUnavailable
from herdwick.metrics import Histogram
from herdwick.storage.hot import HotTier, ReadyExecution

log = logs.get("herdwick.poolqueue")

PUBLISH_BATCH = 2_000
PUBLISH_RETRIES_S = (0.05, 0.2, 1.0, 2.0)


class PoolQueue(Actor):
    """Owns its backlog and lag histograms; only its run loop touches them."""

    def __init__(self, pool: str, *, hot: HotTier, clock: Clock,
                 lag: dict[str, Histogram]) -> None:
        super().__init__(clock=clock)
        self.name = f"pool-{pool}"
        self.pool = pool
        self._hot = hot
        self._backlog: collections.deque[tuple[ReadyExecution, int]] = collections.deque()
        # Shared with the scheduler for reporting: written here only, read by reporters.
        self.lag = lag
        self.published = 0

    async def handle(self, msg: object | None) -> None:
        for m in [msg, *self.drain_until_sync(10_000)]:
            if isinstance(m, Publish):
                self._backlog.extend(zip(m.items, m.scheduled_us, strict=True))
        while self._backlog:
            await self._publish(self.take(PUBLISH_BATCH))

    def take(self, limit: int) -> list[tuple[ReadyExecution, int]]:
        """The next executions to publish: the policy seam (FIFO today)."""
        count = min(limit, len(self._backlog))
        return [self._backlog.popleft() for _ in range(count)]

    async def _publish(self, batch: list[tuple[ReadyExecution, int]]) -> None:
        items = [item for item, _ in batch]
        for delay in (*PUBLISH_RETRIES_S, None):
            try:
                await self._hot.publish({self.pool: items})
                break
            except StorageUnavailable as exc:
                if delay is None:
                    # Committed in Postgres, not in Redis: the sweeper republishes these.
                    log.error("publish_dropped", pool=self.pool, count=len(items), error=exc)
                    return
                await asyncio.sleep(delay)
        now_us = to_us(self.clock.now())
        for item, scheduled_us in batch:
            hist = self.lag.get(item.tenant_id)
            if hist is None:
                hist = self.lag[item.tenant_id] = Histogram()
            hist.observe((now_us - scheduled_us) / 1e6)
        self.published += len(batch)
