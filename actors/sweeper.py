"""The sweeper: executions Postgres has as queued or running but the hot tier does not.

That happens when a scheduler died between its commit and its publish, or
Redis came back empty. Each such execution is republished with attempt + 1,
which fences out any worker still holding the old attempt. A missing epoch
key means Redis lost its data: then functions are reloaded, the pools of
unfinished work get their consumer group and pool-set entry back, and
everything unfinished is swept at once, not only what is older than the
grace period. Not at once, though: the workers first send their recent completions
again (hw_recover), those whose events Redis lost before Postgres had them, so that
they are recorded rather than run again; the sweep of everything waits
RECOVERY_GRACE_S for that, as long as there is anything unfinished to sweep.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta

from herdwick import logs
from herdwick.actors.base import Actor, Tick
from herdwick.actors.executions import GROUP as EVENTS_GROUP
from herdwick.actors.messages import Publish
from herdwick.clock import Clock, to_us
from herdwick.errors import StorageUnavailable, row_error
from herdwick.storage import sweep as store
from herdwick.storage.db import Database
from herdwick.storage.hot import HotTier

log = logs.get("herdwick.sweeper")

INTERVAL_S = 10.0
# A fresh execution may be between commit and publish this long (milliseconds, normally;
# seconds on a stalled link). Sweeping one too soon only costs it an attempt number:
# hw_publish drops the late attempt. Too late, and a dead scheduler's last dispatch waits.
GRACE_S = 10.0
SWEEP_BATCH = 5_000
# Redis keeps a finished execution's hot state 60 s (lua/herdwick.lua TERMINAL_TTL_MS):
# rows are judged only when their pool's events are applied up to well inside that.
EVENTS_SETTLED_S = 30.0
# Workers look for a new epoch every second (herdwick/worker.py EPOCH_POLL_S): time for
# them to see it and send their completions again, before what is unfinished is re-run.
RECOVERY_GRACE_S = 3.0


class Sweeper(Actor):
    name = "sweeper"

    def __init__(self, *, db: Database, hot: HotTier, clock: Clock, publish,
                 db_now: bool = False, recovery_grace_s: float = RECOVERY_GRACE_S) -> None:
        super().__init__(clock=clock)
        self._db = db
        self._hot = hot
        self._publish = publish
        self._db_now = db_now
        self._recovery_grace_s = recovery_grace_s
        self._lost_at: datetime | None = None  # when Redis was found empty, until swept
        self.republished = 0

    def idle_timeout(self) -> float | None:
        if self._lost_at is None:
            return None  # Ticks drive it
        waited = (self.clock.now() - self._lost_at).total_seconds()
        return max(0.0, self._recovery_grace_s - waited)

    async def on_start(self) -> None:
        await self.run_once()

    async def handle(self, msg: object | None) -> None:
        if isinstance(msg, Tick) or (msg is None and self._lost_at is not None):
            await self.run_once()

    async def run_once(self) -> int:
        try:
            now = self.clock.now()
            # A new value each time: a worker tells a loss by the epoch changing.
            if await self._hot.ensure_epoch(uuid.uuid4().hex):
                await self._hot.load_functions()
                self._hot.forget_groups()
                self._lost_at = now
            else:  # a cluster node new to the slots, say, may lack the library
                await self._hot.ensure_functions()
            if self._lost_at is not None:
                return await self._after_loss(now)
            return await self._sweep(now - timedelta(seconds=GRACE_S), everything=False)
        except StorageUnavailable as exc:
            log.warning("sweep_skipped", error=exc)
            return 0

    async def _after_loss(self, now: datetime) -> int:
        """Everything unfinished from before the loss, once the workers had their chance
        to send their completions again (or at once when there is nothing to wait for)."""
        waited = (now - self._lost_at).total_seconds()
        if waited < self._recovery_grace_s:
            rows = await store.unfinished(self._db, self._lost_at, SWEEP_BATCH)
            if rows:
                await self._restore_pools(rows)  # their outcomes must be read meanwhile
                log.info("sweep_awaits_recovery", seconds=self._recovery_grace_s - waited)
                return 0
        lost_at, self._lost_at = self._lost_at, None
        return await self._sweep(lost_at, everything=True)

    async def _restore_pools(self, rows: list[store.Unfinished]) -> None:
        """Work published into the empty Redis before the loss was seen went out under a
        stale group cache: no consumer group, and its pool missing from the pool set, so
        the event actor and the reaper would never look at it again."""
        for pool in sorted({r.pool for r in rows}):
            await self._hot.ensure_group(pool)

    async def _sweep(self, cutoff: datetime, everything: bool) -> int:
        now = self.clock.now()
        rows = await store.unfinished(self._db, cutoff, SWEEP_BATCH)
        if not rows:
            return 0
        if everything:
            await self._restore_pools(rows)
        else:
            rows = await self._settled_pools_only(rows)
        hot = await self._hot.hot_attempts([(r.pool, str(r.execution_id)) for r in rows])
        missing = [r for r, attempt in zip(rows, hot, strict=True)
                   if attempt is None or attempt < r.attempt]
        missing = await self._drop_unpublishable(missing, now)
        if not missing:
            return 0
        bumped = await store.bump(self._db, missing, None if self._db_now else now)
        by_pool: dict[str, list] = {}
        for row in missing:
            if row.execution_id in bumped:
                by_pool.setdefault(row.pool, []).append((row, bumped[row.execution_id]))
        for pool, items in by_pool.items():
            await self._publish(pool, Publish(
                [store.ready(row, attempt) for row, attempt in items],
                [to_us(row.scheduled_for) for row, _ in items]))
        count = sum(len(v) for v in by_pool.values())
        log.warning("executions_republished", count=count, everything=everything)
        self.republished += count
        return count


    async def _settled_pools_only(self, rows: list[store.Unfinished]) -> list[store.Unfinished]:
        """The rows of pools whose events are applied up to EVENTS_SETTLED_S ago.

        A finished execution's hot state lives a minute (lua: TERMINAL_TTL_MS); if
        its `completed` event still waits, Postgres has it running, Redis has
        nothing, and it would look lost. While a pool's event backlog is older than
        that, its rows wait for the next pass.
        """
        kept = []
        for pool in sorted({r.pool for r in rows}):
            behind_ms = await self._hot.events_behind_ms(pool, EVENTS_GROUP)
            if behind_ms > EVENTS_SETTLED_S * 1000:
                log.warning("sweep_deferred", pool=pool, events_behind_s=behind_ms / 1000)
                continue
            kept += [r for r in rows if r.pool == pool]
        return kept

    async def _drop_unpublishable(self, rows: list[store.Unfinished],
                                  now: datetime) -> list[store.Unfinished]:
        """Rows that cannot go on a stream (no finite scheduled_for) end dead, with why."""
        bad = [r for r in rows if r.scheduled_for.tzinfo is None]  # asyncpg's infinities
        if not bad:
            return rows
        for row in bad:
            log.error("row_rejected", execution_id=row.execution_id, job_id=row.job_id,
                      tenant_id=row.tenant_id, reason="scheduled_for is not a finite time")
        await store.fail(self._db, bad, row_error("UnpublishableExecution",
                                                  "its scheduled_for is not a finite time"),
                         None if self._db_now else now)
        return [r for r in rows if r.scheduled_for.tzinfo is not None]

