"""What every handler needs, held once per app under one AppKey."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from aiohttp import web

from herdwick.clock import Clock
from herdwick.config import Settings
from herdwick.gateway.auth import KeyCache
from herdwick.gateway.notify import Near
from herdwick.gateway.submit import Network
from herdwick.gateway.target_dns import TargetDns
from herdwick.storage.db import Database
from herdwick.storage.jobs import NewJob


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
    # Called after a commit that made something due (submit, trigger, replay) with
    # (shard_id, job_id, due time): the near-due notify to the shard owners.
    notify_due: Callable[[list[Near]], Awaitable[None]] = _nothing

    async def after_submit(self, tenant_id: uuid.UUID, jobs: list[NewJob]) -> None:
        await self.notify_due([(j.shard_id, j.job_id, j.next_run_at, tenant_id, j.pool)
                               for j in jobs])
    # Called after a cancel commits: tells the workers holding those executions (LEASE_LOST).
    cancel_running: Callable[[str, list[uuid.UUID]], Awaitable[None]] = _no_workers

    @staticmethod
    def of(request: web.Request) -> Ctx:
        return request.app[CTX]


CTX = web.AppKey("herdwick_ctx", Ctx)
