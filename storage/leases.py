"""Scheduler nodes and shard leases: registration, claim, renew, release.

`now` is None in production (the database's clock: one clock every node
agrees on) and a fake instant in tests.
"""

from __future__ import annotations

from datetime import datetime

import msgspec

from herdwick.storage.db import Database
from herdwick.storage.sql import q


class Lease(msgspec.Struct, frozen=True):
    shard_id: int
    revision: int


async def heartbeat(db: Database, node_id: str, now: datetime | None,
                    info: str = "{}") -> datetime:
    """Registers or renews the node; returns the database's clock as it did."""
    async with db.connection() as conn:
        return await conn.fetchval(q("node_heartbeat"), node_id, now, info)


async def leave(db: Database, node_id: str) -> None:
    async with db.connection() as conn:
        await conn.execute(q("node_leave"), node_id)


async def live_nodes(db: Database, now: datetime | None, ttl_s: float) -> list[str]:
    async with db.connection() as conn:
        return [r["node_id"] for r in await conn.fetch(q("live_nodes"), now, ttl_s)]


async def claim(db: Database, node_id: str, count: int, lease_s: float,
                now: datetime | None) -> list[Lease]:
    if count <= 0:
        return []
    async with db.connection() as conn:
        rows = await conn.fetch(q("claim_shards"), node_id, lease_s, count, now)
    leases = [Lease(r["shard_id"], r["revision"]) for r in rows]
    return sorted(leases, key=lambda lease: lease.shard_id)


async def renew(db: Database, node_id: str, leases: list[Lease], lease_s: float,
                now: datetime | None) -> set[int]:
    """The shards still held; the rest were lost."""
    if not leases:
        return set()
    async with db.connection() as conn:
        rows = await conn.fetch(q("renew_shards"), node_id, lease_s,
                                [lease.shard_id for lease in leases], now,
                                [lease.revision for lease in leases])
    return {r["shard_id"] for r in rows}


async def release(db: Database, node_id: str, leases: list[Lease]) -> set[int]:
    if not leases:
        return set()
    async with db.connection() as conn:
        rows = await conn.fetch(q("release_shards"), node_id,
                                [lease.shard_id for lease in leases],
                                [lease.revision for lease in leases])
    return {r["shard_id"] for r in rows}
