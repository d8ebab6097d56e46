"""The reaper: an expired lease is a failed attempt; and ready streams are kept trimmed.

So a poison job that kills its worker still ends in dead letters: hw_expire
turns each lapsed lease into an `expired` event (retry or dead, by the
job's max attempts), which the execution-event actor applies like any
failure. Every node may run it; hw_expire is atomic.
"""

from __future__ import annotations

from herdwick import logs
from herdwick.actors.base import Actor, Tick
from herdwick.clock import Clock
from herdwick.errors import StorageUnavailable
from herdwick.storage.hot import HotTier
from herdwick.storage.protocol import Protocol

log = logs.get("herdwick.reaper")

INTERVAL_S = 1.0
EXPIRE_BATCH = 1_000


class Reaper(Actor):
    name = "reaper"

    def __init__(self, *, hot: HotTier, protocol: Protocol, clock: Clock) -> None:
        super().__init__(clock=clock)
        self._hot = hot
        self._protocol = protocol
        self.expired = 0

    async def handle(self, msg: object | None) -> None:
        if isinstance(msg, Tick):
            await self.run_once()

    async def run_once(self) -> int:
        count = 0
        try:
            for pool in await self._hot.pools():
                while ids := await self._protocol.expire(pool, EXPIRE_BATCH):
                    count += len(ids)
                    if len(ids) < EXPIRE_BATCH:
                        break
                await self._protocol.trim_ready(pool)
        except StorageUnavailable as exc:
            log.warning("reaper_skipped", error=exc)
        if count:
            log.info("leases_expired", count=count)
        self.expired += count
        return count
