"""Gateway fixtures: a client on a real socket and a tenant with an API key."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import pytest
from aiohttp.test_utils import TestClient

from herdwick.actors.scheduler import Scheduler
from herdwick.config import Settings
from tests.integration.gateway_client import ADMIN_TOKEN, start_client


@dataclass
class Api:
    client: TestClient
    key: str
    tenant_id: str

    def auth(self, key: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {key or self.key}"}

    async def create_tenant(self, name: str = "acme", **extra) -> dict:
        resp = await self.client.post("/v1/tenants", json={"name": name, **extra},
                                      headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        assert resp.status == 201, await resp.text()
        return await resp.json()

    async def submit(self, body: dict, key: str | None = None, **headers):
        return await self.client.post("/v1/jobs", json=body, headers={**self.auth(key), **headers})


def make_job(**overrides) -> dict:
    """A valid submission; override any top-level field."""
    body = {"name": "nightly-report", "target": {"type": "queue", "ref": "emails"},
            "payload": {"to": "a@example.com"}, "schedule": {"delaySeconds": 30}}
    body.update(overrides)
    return body


@asynccontextmanager
async def tenant_api(db_url: str, redis_url: str, key_prefix: str, clock,
                     **settings) -> AsyncIterator[Api]:
    """A gateway on a real socket, and a tenant of it with its API key."""
    client = await start_client(db_url, redis_url, key_prefix, clock, **settings)
    try:
        holder = Api(client=client, key="", tenant_id="")
        tenant = await holder.create_tenant()
        holder.key, holder.tenant_id = tenant["apiKey"], tenant["tenantId"]
        yield holder
    finally:
        await client.close()


@pytest.fixture
async def api(db_url, services, key_prefix, clock) -> AsyncIterator[Api]:
    async with tenant_api(db_url, services.redis_url, key_prefix, clock) as holder:
        yield holder


@pytest.fixture
async def schedulers(db, redis_client, key_prefix, clock) -> AsyncIterator[list]:
    """A factory of scheduler nodes sharing the test's database, Redis prefix and clock."""
    started: list[Scheduler] = []

    async def start(node_id: str | None = None, **settings) -> Scheduler:
        node = Scheduler(Settings(key_prefix=key_prefix, **settings), clock=clock, db=db,
                         redis=redis_client, node_id=node_id or f"node-{len(started)}",
                         tick=False)
        started.append(node)
        return await node.start()

    try:
        yield start
    finally:
        for node in started:
            if not getattr(node, "crashed", False):
                await node.stop()


async def waiting_on_a_lock(db) -> None:
    """Until some statement of this database waits on a lock. Postgres signals nothing
    a test could await, so this polls its view of waits, bounded."""
    async with asyncio.timeout(10):
        while True:
            async with db.connection() as conn:
                if await conn.fetchval(
                        "SELECT count(*) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND wait_event_type = 'Lock'"):
                    return
            await asyncio.sleep(0.01)
