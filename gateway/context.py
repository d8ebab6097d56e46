"""What every handler needs, held once per app under one AppKey."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from aiohttp import web

from gateway.auth import KeyCache
from gateway.submit import Network
from herdwick.clock import Clock
from herdwick.config import Settings
from storage.db import Database
from storage.jobs import NewJob


async def _nothing(jobs: list[NewJob]) -> None:
    return None


@dataclass
class Ctx:
    settings: Settings
    clock: Clock
    db: Database
    redis: aioredis.Redis | None
    http_allow: tuple[Network, ...]
    keys: KeyCache = field(default_factory=KeyCache)
    # Called after a submit commits; the scheduler tier hooks its near-due notify here.
    after_submit: Callable[[list[NewJob]], Awaitable[None]] = _nothing

    @staticmethod
    def of(request: web.Request) -> Ctx:
        return request.app[CTX]


CTX = web.AppKey("herdwick_ctx", Ctx)
