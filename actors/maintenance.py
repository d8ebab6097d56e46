"""Housekeeping on timers: execution partitions ahead of need and expired idempotency keys
(hourly, on Tick), the tenants' signing secrets copied to Redis (every few seconds, on
SyncSigning), and retention: old days archived and dropped (on Retain).

Every node runs it; each piece is safe concurrently (the partition function takes an
advisory lock, the delete is bounded and idempotent, the signing sync writes only what
differs from Postgres, and a retention pass runs only on the node that gets the
retention lease). The cadences are messages from their own tickers, so the signing sync
never drags the hourly work along with it. A retention pass may take minutes (a day's
archive is compressed and uploaded), so it runs in a task this actor owns, one at a
time, and the mailbox goes on being served meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import timedelta

import msgspec
import redis.asyncio as aioredis

from herdwick import logs
from herdwick.actors.base import Actor, Tick
from herdwick.clock import Clock
from herdwick.errors import StorageUnavailable
from herdwick.storage import maintenance as store
from herdwick.storage import retention as retention_store
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
# A pass that finds nothing due is a lock and two small queries, so it can run often:
# a node restarted more often than hourly still gets to it.
RETENTION_INTERVAL_S = 900.0


class SyncSigning(msgspec.Struct, frozen=True):
    """Copy every tenant's signing secrets from Postgres to Redis (every SIGNING_SYNC_S)."""


class Retain(msgspec.Struct, frozen=True):
    """Run a retention pass, unless one is under way (every RETENTION_INTERVAL_S)."""


class Maintenance(Actor):
    name = "maintenance"

    def __init__(self, *, db: Database, clock: Clock, redis: aioredis.Redis,
                 key_prefix: str,
                 retention: retention_store.RetentionPolicy | None = None) -> None:
        super().__init__(clock=clock)
        self._db = db
        self._redis = redis
        self._key_prefix = key_prefix
        # Only this actor's loop touches it: so a Redis that stays away logs one warning,
        # not one every SIGNING_SYNC_S.
        self._signing_failing = False
        self._retention = retention
        # The pass under way: started and cancelled by this actor's loop alone.
        self._retaining: asyncio.Task | None = None
        # Written by the pass's task when it ends; read by tests.
        self.last_retention: retention_store.PassReport | None = None
        # Test signal: awaited after each step of each day a pass retires.
        self.retention_step: Callable[[str, retention_store.Day], Awaitable[None]] | None = None

    async def on_start(self) -> None:
        await self.run_once()
        await self.sync_signing()

    async def handle(self, msg: object | None) -> None:
        match msg:
            case Tick():
                await self.run_once()
            case SyncSigning():
                await self.sync_signing()
            case Retain():
                self._start_retention()

    async def quiesce(self) -> None:
        if self._retaining is not None:
            await asyncio.wait({self._retaining})

    async def on_stop(self) -> None:
        # A pass stopped midway leaves its day detached or archived, never half dropped:
        # the next pass, here or on another node, finishes it from its record.
        if self._retaining is not None and not self._retaining.done():
            self._retaining.cancel()
            await asyncio.wait({self._retaining})

    def _start_retention(self) -> None:
        if self._retention is None or (self._retaining and not self._retaining.done()):
            return
        self._retaining = asyncio.create_task(self.retain_once(), name="retention")

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

    async def retain_once(self) -> retention_store.PassReport | None:
        """One retention pass; None if Postgres was unavailable or the pass failed."""
        assert self._retention is not None
        try:
            report = await retention_store.run_pass(
                self._db, self._retention, self.clock.now(), on_step=self.retention_step)
        except StorageUnavailable as exc:
            log.warning("retention_skipped", error=str(exc))
            return None
        except Exception:  # in a task no one awaits at once: said here, or never
            log.exception("retention_crashed")
            return None
        self.last_retention = report
        return report

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
