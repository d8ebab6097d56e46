"""A steady background of jobs, inserted and announced as the gateway does near-due submits."""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from herdwick.clock import to_us
from herdwick.loadtest.jobs import JobFactory, TenantRef
from herdwick.storage.db import Database
from herdwick.storage.hot import HotTier, NotifyMessage
from herdwick.storage.jobs import NewJob, insert_jobs

TICK_S = 0.1

Expect = Callable[[TenantRef, list[NewJob]], None]


class Background:
    """Steady jobs: every tick, rate x tick jobs due `delay_s` later, their due times evenly
    spaced, the tenants and pools in turn; inserted per tenant and notified as the
    gateway notifies near-due submissions. Paced on an absolute schedule.

    `expect` hears of each tick's jobs before they are inserted (the herd's stream
    watch). Its run task writes `made` and `late_max_s`; the run reads them after.
    """

    def __init__(self, rate: float, duration_s: float, delay_s: float, db: Database,
                 hot: HotTier, tenants: list[TenantRef], factory: JobFactory,
                 expect: Expect | None = None) -> None:
        self._rate, self._duration_s, self._delay_s = rate, duration_s, delay_s
        self._db, self._hot, self._tenants, self._factory = db, hot, tenants, factory
        self._expect = expect
        self.made = 0
        self.late_max_s = 0.0  # how far the inserts fell behind their schedule
        self.last_due: datetime | None = None  # of the last job made

    async def run(self) -> None:
        start_perf, start_wall = time.perf_counter(), datetime.now(UTC)
        ticks = max(1, round(self._duration_s / TICK_S))
        for k in range(ticks):
            await asyncio.sleep(max(0.0, start_perf + k * TICK_S - time.perf_counter()))
            self.late_max_s = max(self.late_max_s, time.perf_counter() - start_perf - k * TICK_S)
            due0 = start_wall + timedelta(seconds=self._delay_s + k * TICK_S)
            await self._tick(due0, self._count(k + 1) - self._count(k))

    def _count(self, ticks: int) -> int:
        return round(self._rate * TICK_S * ticks)

    async def _tick(self, due0: datetime, count: int) -> None:
        now = datetime.now(UTC)
        per_tenant: dict[int, list[NewJob]] = collections.defaultdict(list)
        for j in range(count):
            due = due0 + timedelta(seconds=TICK_S * j / count)
            per_tenant[(self.made + j) % len(self._tenants)].append(
                self._factory.make(self.made + j, due, now))
        self.made += count
        if count:
            self.last_due = due0 + timedelta(seconds=TICK_S * (count - 1) / count)
        if self._expect is not None:
            for t, jobs in per_tenant.items():
                self._expect(self._tenants[t], jobs)
        await asyncio.gather(*(self._insert(self._tenants[t], jobs)
                               for t, jobs in per_tenant.items()))

    async def _insert(self, tenant: TenantRef, jobs: list[NewJob]) -> None:
        await insert_jobs(self._db, tenant.tenant_id, jobs, now=datetime.now(UTC))
        # All are due within the gateway's NEAR_DUE, so it would announce every one; a
        # shard queues a notified job only if it names the tenant and pool, as the
        # gateway's do.
        tenant_id = str(tenant.tenant_id)
        await self._hot.notify([NotifyMessage(j.shard_id, str(j.job_id), to_us(j.next_run_at),
                                              tenant_id, j.pool) for j in jobs])
