"""What the gateway tells the hot tier after a commit.

After a submit, trigger, replay or resume: the shard owners, about jobs due
before their next load.
After a cancel: the workers holding its executions (LEASE_LOST on their next call).
Both are best effort; Postgres already holds the truth.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

from herdwick import logs
from herdwick.actors.shard import ANNOUNCE_S
from herdwick.clock import Clock
from herdwick.errors import StorageUnavailable
from herdwick.redis_client import REDIS_ERRORS
from herdwick.storage.hot import HotTier, NotifyMessage
from herdwick.storage.protocol import Protocol

log = logs.get("herdwick.gateway")

# A row due this soon may fall in a minute its shard's loads read already: unless
# announced, it would wait for the shard's periodic re-read (actors/shard.py).
NEAR_DUE = timedelta(seconds=ANNOUNCE_S)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
# What became due: (shard id, job id, due time, tenant id, pool).
Near = tuple[int, uuid.UUID, datetime, uuid.UUID, str]


def _us(when: datetime) -> int:
    delta = when - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def notifier(hot: HotTier, clock: Clock):
    """`notify(due)` for (shard_id, job_id, due time, tenant_id, pool); only the near-due
    are sent."""
    async def notify(due: list[Near]) -> None:
        horizon = clock.now() + NEAR_DUE
        near = [NotifyMessage(shard, str(job_id), _us(when), str(tenant), pool)
                for shard, job_id, when, tenant, pool in due if when <= horizon]
        try:
            await hot.notify(near)
        except (*REDIS_ERRORS, OSError) as exc:
            # Committed already; the shard's next load picks it up.
            log.warning("notify_failed", count=len(near), error=exc)
    return notify


def canceller(protocol: Protocol):
    async def cancel_running(pool: str, execution_ids) -> None:
        try:
            for execution_id in execution_ids:
                await protocol.cancel(pool, str(execution_id))
        except (StorageUnavailable, *REDIS_ERRORS, OSError) as exc:
            # Postgres has them canceled: their events are fenced out, and the
            # worker learns at its lease's end at the latest.
            log.warning("cancel_notify_failed", pool=pool, error=exc)
    return cancel_running
