"""Housekeeping on timers: execution partitions ahead of need and expired idempotency keys
(hourly, on Tick), and the tenants' signing secrets copied to Redis (every few seconds,
on SyncSigning).

Every node runs it; each piece is safe concurrently (the partition function takes an
advisory lock, the delete is bounded and idempotent, the signing sync writes only what
differs from Postgres). The two cadences are two messages from two tickers, so the
signing sync never drags the hourly work along with it.
"""

from __future__ import annotations

from datetime import timedelta

import msgspec
import redis.asyncio as aioredis

from herdwick import logs
from herdwick.actors.base import Actor, Tick
from herdwick.clock import Clock
from herdwick.errors import StorageUnavailable
from herdwick.storage import maintenance as store
from herdwick.storage import signing
from herdwick.storage.db import Database

log = logs.get("herdwick.maintenance")

INTERVAL_S = 3600.0
# The http workers read the tenants' signing secrets from Redis only: an empty Redis
# (restart, flush) has them back, and a change the gateway failed to write through is
# there, within this long.
SIGNING_SYNC_S = 5.0
PARTITION_DAYS_AHEAD = 8
IDEMPOTENCY_DELETE_BATCH = 10_000


class SyncSigning(msgspec.Struct, frozen=True):
    """Copy every tenant's signing secrets from Postgres to Redis (every SIGNING_SYNC_S)."""


class Maintenance(Actor):
    name = "maintenance"

    def __init__(self, *, db: Database, clock: Clock, redis: aioredis.Redis,
                 key_prefix: str) -> None:
        super().__init__(clock=clock)
        self._db = db
        self._redis = redis
        self._key_prefix = key_prefix
        # Only this actor's loop touches it: so a Redis that stays away logs one warning,
        # not one every SIGNING_SYNC_S.
        self._signing_failing = False

    async def on_start(self) -> None:
        await self.run_once()
        await self.sync_signing()

    async def handle(self, msg: object | None) -> None:
        match msg:
            case Tick():
                await self.run_once()
            case SyncSigning():
                await self.sync_signing()

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

    async def sync_signing(self) -> signing.Synced | None:
        """One pass of the signing sync; None if Postgres or Redis was unavailable."""
        try:
            synced = await signing.sync_all(self._db, self._redis, self._key_prefix,
                                            self.clock.now())
        except StorageUnavailable as exc:
            if not self._signing_failing:
                log.warning("signing_sync_failed", error=str(exc))
            self._signing_failing = True
            return None
        if self._signing_failing:
            log.info("signing_sync_recovered")
        self._signing_failing = False
        if synced.written or synced.dropped:
            log.info("signing_synced", written=synced.written, dropped=synced.dropped)
        return synced
