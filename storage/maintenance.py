"""Retention and partition upkeep."""

from __future__ import annotations

from datetime import date, datetime

from herdwick.storage.db import Database
from herdwick.storage.sql import q


async def ensure_partitions(db: Database, first_day: date, days: int) -> int:
    async with db.connection() as conn:
        return await conn.fetchval(q("ensure_execution_partitions"), first_day, days)


async def delete_expired_idempotency(db: Database, now: datetime, limit: int) -> int:
    async with db.connection() as conn:
        status = await conn.execute(q("delete_expired_idempotency"), now, limit)
    return int(status.split()[-1])
