"""Where the gateway's history reads go: a read replica fresh enough for the tenant, else
the primary (HERDWICK_READ_DATABASE_URL; docs/operations.md, "Read replicas").

The staleness rule: a read for a tenant goes to a replica only if that replica is known
to have every transaction that committed before the tenant's last acknowledged write,
and before `HERDWICK_READ_MAX_LAG_S` ago; otherwise the primary answers. So a tenant
always reads its own writes, through any gateway, right after their 201 or 200, and
what herdwick itself writes (executions, attempts) is at most the lag bound behind.

How, without a round trip to Postgres per read:

- each gateway samples the primary's WAL position and every replica's replay position
  every 0.1-0.2 s (storage/replicas.py), so it knows, for each replica, an instant
  (`fresh_at`) before which it misses no commit;
- every write of a tenant marks itself in Redis after its commit and before its
  answer (storage/write_marks.py); a read asks the mark's age (one PTTL), which says,
  by Redis's clock, how long ago the tenant last wrote;
- the read goes to a replica whose fresh_at is later than that write (and within the
  lag bound), else to the primary. A replica that fails the read, a Redis that does not
  answer within MARK_TIMEOUT_S, or no fresh replica: the primary.

A write whose mark Redis refuses answers only once the replicas have replayed it, or
once the lag bound has passed, after which no gateway reads from a replica that lacks
it: the rule holds then too, at the cost of that write's latency.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from aiohttp import web

from herdwick import logs, telemetry
from herdwick.config import Settings
from herdwick.errors import StorageUnavailable
from herdwick.gateway.context import CTX
from herdwick.storage.db import Database
from herdwick.storage.replicas import SAMPLE_INTERVAL_S, Replica, Replicas
from herdwick.storage.write_marks import MARK_TTL_MS, WriteMarks

log = logs.get("herdwick.gateway")

T = TypeVar("T")

# Redis answers a mark's SET or PTTL in well under a millisecond; one that takes longer
# than this is treated as not answering: a read goes to the primary, a write waits for
# the replicas.
MARK_TIMEOUT_S = 0.1
# The primary's positions are kept this much longer than the lag bound, so a replica
# within the bound always finds a sample it has replayed.
HISTORY_MARGIN_S = 1.0


class ReadRouter:
    """Chooses, per read, the server that answers it. Owned by the app (read_replicas)."""

    def __init__(self, primary: Database, replicas: Replicas, marks: WriteMarks, *,
                 max_lag_s: float, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._primary = primary
        self.replicas = replicas
        self._marks = marks
        self._max_lag_s = max_lag_s
        self._monotonic = monotonic
        self._turn = itertools.count()  # round robin over the fresh replicas

    async def run(self, tenant_id: uuid.UUID,
                  query: Callable[[Database], Awaitable[T]]) -> T:
        """`query` on the server this tenant's read may use; on the primary again if the
        replica fails it (a read changes nothing, so it is safe twice)."""
        replica, reason = await self._choose(tenant_id)
        if replica is None:
            telemetry.READS.labels("primary", reason).inc()
            return await query(self._primary)
        try:
            result = await query(replica.db)
        except StorageUnavailable as exc:
            self.replicas.set_down(replica, f"a read failed: {exc}")
            telemetry.READS.labels("primary", "replica_failed").inc()
            return await query(self._primary)
        telemetry.READS.labels(replica.name, "fresh").inc()
        return result

    async def _choose(self, tenant_id: uuid.UUID) -> tuple[Replica | None, str]:
        fresh = self.replicas.fresh_since(self._monotonic() - self._max_lag_s)
        if not fresh:
            return None, "no_replica"  # and no Redis call: nothing to choose between
        try:
            async with asyncio.timeout(MARK_TIMEOUT_S):
                age_s = await self._marks.age_s(tenant_id)
        except (StorageUnavailable, TimeoutError):
            return None, "redis"
        # The tenant's last write committed before its mark was set, which was at most
        # age_s before Redis answered; no mark: before the mark's whole lifetime ago.
        cutoff = self._monotonic() - (MARK_TTL_MS / 1000 if age_s is None else age_s)
        fresh = [r for r in fresh if r.up and r.fresh_at is not None and r.fresh_at >= cutoff]
        if not fresh:
            return None, "own_write"
        return fresh[next(self._turn) % len(fresh)], "fresh"

    async def wrote(self, tenant_id: uuid.UUID) -> None:
        """After a write of the tenant committed, before its answer: mark it. If Redis
        refuses, wait until the replicas have it, at most until every gateway would
        find them too far behind to read from (the lag bound and a sampling pass)."""
        committed = self._monotonic()
        try:
            async with asyncio.timeout(MARK_TIMEOUT_S):
                await self._marks.mark(tenant_id)
            return
        except (StorageUnavailable, TimeoutError) as exc:
            error = str(exc) or type(exc).__name__
        telemetry.WRITE_MARKS_FAILED.inc()
        caught_up = await self.replicas.wait_fresh(
            committed, self._max_lag_s + max(SAMPLE_INTERVAL_S) + HISTORY_MARGIN_S)
        log.warning("write_mark_failed", tenant_id=str(tenant_id), error=error,
                    waited_s=round(self._monotonic() - committed, 3), replicas_had_it=caught_up)


async def sample_forever(replicas: Replicas, monotonic: Callable[[], float]) -> None:
    """The sampler: one pass, then a jittered pause, until cancelled."""
    while True:
        try:
            await replicas.run_once(monotonic())
        except Exception:  # a pass that breaks must not end sampling: reads would go stale
            log.exception("replica_sampling_crashed")
        await asyncio.sleep(random.uniform(*SAMPLE_INTERVAL_S))


def read_replicas(settings: Settings, monotonic: Callable[[], float] = time.monotonic,
                  ) -> Callable[[web.Application], AsyncIterator[None]]:
    """The cleanup context that owns the replicas' pools and the sampler; it runs after the
    one that makes the app's Ctx, and gives it its ReadRouter. Without read URLs (or
    without Redis, which holds the write marks) every read stays on the primary."""

    async def replicas_context(app: web.Application) -> AsyncIterator[None]:
        ctx = app[CTX]
        urls = settings.read_database_urls
        if not urls or ctx.redis is None:
            if urls:
                log.warning("read_replicas_unused", why="no Redis for the write marks")
            yield
            return
        replicas = await Replicas.connect(
            ctx.db, urls, history_s=settings.read_max_lag_s + HISTORY_MARGIN_S,
            monotonic=monotonic)
        sampler = asyncio.create_task(sample_forever(replicas, monotonic),
                                      name="replica sampler")
        telemetry.watch(replicas)
        ctx.reads = ReadRouter(ctx.db, replicas, WriteMarks(ctx.redis, settings.key_prefix),
                               max_lag_s=settings.read_max_lag_s, monotonic=monotonic)
        log.info("read_replicas", replicas=[r.name for r in replicas.replicas],
                 max_lag_s=settings.read_max_lag_s)
        try:
            yield
        finally:
            ctx.reads = None
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
            telemetry.unwatch(replicas)
            await replicas.close()

    return replicas_context
