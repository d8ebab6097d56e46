"""Each tenant's last write, marked in Redis, so that any gateway can tell whether a
replica already has it (gateway/reads.py).

After a tenant's write commits (a submit, a PATCH, a pause, ...), the gateway that made it
SETs `P:{t.<tenant_id>}:wrote` with a time to live of MARK_TTL_MS, before it answers. A
gateway about to read for that tenant asks PTTL: MARK_TTL_MS less what is left is how long
ago the last write was marked, measured by the Redis server's clock alone, so no two
gateways' clocks need agree. No key means no write for MARK_TTL_MS (the replicas are trusted
over less: config.MAX_READ_LAG_S).
"""

from __future__ import annotations

import uuid

import redis.asyncio as aioredis
from redis.exceptions import RedisClusterException, RedisError

from herdwick import telemetry
from herdwick.errors import StorageUnavailable
from herdwick.storage import keys

MARK_TTL_MS = 60_000
# PTTL counts whole milliseconds: a mark may be up to this much younger than it says.
MARK_ROUNDING_S = 0.001
# A cluster client raises RedisClusterException, not a RedisError, when no node answers.
_UNAVAILABLE = (RedisError, RedisClusterException, OSError)


class WriteMarks:
    """Marks and ages of tenants' last writes, under one key prefix."""

    def __init__(self, redis: aioredis.Redis, prefix: str) -> None:
        self._redis = redis
        self._prefix = prefix

    async def mark(self, tenant_id: uuid.UUID) -> None:
        """The tenant wrote just now: one SET, whose TTL starts again at MARK_TTL_MS."""
        try:
            with telemetry.timed_redis("write_mark"):
                await self._redis.set(keys.tenant_wrote(self._prefix, str(tenant_id)), b"1",
                                      px=MARK_TTL_MS)
        except _UNAVAILABLE as exc:
            raise StorageUnavailable(f"redis refused the write mark: {exc}") from exc

    async def age_s(self, tenant_id: uuid.UUID) -> float | None:
        """Seconds since the tenant's last mark, at most; None when it has none."""
        try:
            with telemetry.timed_redis("write_mark_age"):
                left_ms = await self._redis.pttl(keys.tenant_wrote(self._prefix,
                                                                   str(tenant_id)))
        except _UNAVAILABLE as exc:
            raise StorageUnavailable(f"redis did not answer for the write mark: {exc}") from exc
        if left_ms == -2:  # no key
            return None
        if left_ms < 0:  # a key without a TTL, which no gateway sets: as if written now
            return 0.0
        return max(0, MARK_TTL_MS - left_ms) / 1000 - MARK_ROUNDING_S
