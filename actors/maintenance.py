"""Housekeeping on a slow timer: execution partitions ahead of need, expired idempotency keys.

Every node runs it; both statements are safe concurrently (the partition
function takes an advisory lock, the delete is bounded and idempotent).
"""

from __future__ import annotations

from datetime import timedelta

from herdwick import logs
from herdwick.actors.base import Actor, Tick
from herdwick.clock import Clock
from herdwick.errors import StorageUnavailable
from herdwick.storage import maintenance as store
from herdwick.storage.db import Database

log = logs.get("herdwick.maintenance")

INTERVAL_S = 3600.0
PARTITION_DAYS_AHEAD = 8
IDEMPOTENCY_DELETE_BATCH = 10_000


class Maintenance(Actor):
    name = "maintenance"

    def __init__(self, *, db: Database, clock: Clock) -> None:
        super().__init__(clock=clock)
        self._db = db

    async def on_start(self) -> None:
        await self.run_once()

    async def handle(self, msg: object | None) -> None:
        if isinstance(msg, Tick):
            await self.run_once()

    async def run_once(self) -> None:
        now = self.clock.now()
        try:
            created = await store.ensure_partitions(self._db, (now - timedelta(days=1)).date(),
                                                    PARTITION_DAYS_AHEAD + 1)
            expired = await store.delete_expired_idempotency(self._db, now,
                                                             IDEMPOTENCY_DELETE_BATCH)
        except StorageUnavailable as exc:
            log.warning("maintenance_skipped", error=exc)
            return
        if created or expired:
            log.info("maintenance", partitions_created=created, idempotency_deleted=expired)
