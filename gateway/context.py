"""What every handler needs, held once per app under one AppKey."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import redis.asyncio as aioredis
from aiohttp import web

from herdwick.clock import Clock
from herdwick.config import Settings
from herdwick.gateway.auth import KeyCache
from herdwick.gateway.coalesce import Coalescer
from herdwick.gateway.notify import Near
from herdwick.gateway.submit import Network
from herdwick.gateway.target_dns import TargetDns
from herdwick.storage.db import Database
from herdwick.storage.jobs import NewJob

if TYPE_CHECKING:  # gateway/reads.py imports CTX from here
    from herdwick.gateway.reads import ReadRouter

T = TypeVar("T")


async def _nothing(due: list[Near]) -> None:
    return None


async def _no_workers(pool: str, execution_ids: list[uuid.UUID]) -> None:
    return None


@dataclass
class Ctx:
    settings: Settings
    clock: Clock
    db: Database
    redis: aioredis.Redis | None
    http_allow: tuple[Network, ...]
    target_dns: TargetDns  # the submit-time lookups of http targets' names
    keys: KeyCache = field(default_factory=KeyCache)
    # Concurrent single submits of a tenant, one statement (gateway/coalesce.py): made by
    # __post_init__ on this context's database and clock.
    coalescer: Coalescer = field(init=False)
    # Called after a commit that made something due (submit, trigger, replay) with
    # (shard_id, job_id, due time): the near-due notify to the shard owners.
    notify_due: Callable[[list[Near]], Awaitable[None]] = _nothing

    async def after_submit(self, tenant_id: uuid.UUID, jobs: list[NewJob]) -> None:
        """After a submit commits: the near-due notify and, with read replicas, the write's
        mark, both to Redis, neither waiting for the other."""
        notify = self.notify_due([(j.shard_id, j.job_id, j.next_run_at, tenant_id, j.pool)
                                  for j in jobs])
        if self.reads is None:
            await notify
        else:
            await asyncio.gather(self.reads.wrote(tenant_id), notify)
    # Called after a cancel commits: tells the workers holding those executions (LEASE_LOST).
    cancel_running: Callable[[str, list[uuid.UUID]], Awaitable[None]] = _no_workers
    # Read replicas (gateway/reads.py): set by their cleanup context when configured.
    reads: ReadRouter | None = None

    async def read(self, tenant_id: uuid.UUID, query: Callable[[Database], Awaitable[T]]) -> T:
        """A history read of the tenant's: `query` on a replica that has the tenant's
        writes, or on the primary."""
        if self.reads is None:
            return await query(self.db)
        return await self.reads.run(tenant_id, query)

    async def wrote(self, tenant_id: uuid.UUID) -> None:
        """After a write of the tenant's commits, before its answer: what lets its next
        read, through any gateway, see it."""
        if self.reads is not None:
            await self.reads.wrote(tenant_id)

    def __post_init__(self) -> None:
        self.coalescer = Coalescer(self.db, self.clock)

    @staticmethod
    def of(request: web.Request) -> Ctx:
        return request.app[CTX]


CTX = web.AppKey("herdwick_ctx", Ctx)
