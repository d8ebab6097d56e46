"""Fixtures over real Postgres and Redis.

Each test gets its own database, cloned from a template migrated once per
session (CREATE DATABASE ... TEMPLATE), and its own Redis key prefix.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import asyncpg
import pytest
import redis.asyncio as aioredis

from herdwick.clock import ManualClock
from storage import migrate
from storage.db import Database
from tests.services import Services, with_database

T0 = datetime(2026, 12, 2, 12, 0, 0, tzinfo=UTC)


@pytest.fixture(scope="session")
async def services() -> AsyncIterator[Services]:
    found = await Services().find()
    try:
        yield found
    finally:
        found.stop()


@pytest.fixture(scope="session")
async def template_db(services: Services) -> AsyncIterator[str]:
    name = f"hw_tpl_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(services.admin_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        await migrate.apply(with_database(services.admin_dsn, name))
        yield name
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


class DatabaseFactory:
    """Clones the template ahead of need and drops used clones in the background.

    CREATE DATABASE costs ~0.5 s of server fsync; overlapping it with the
    tests' own awaits takes it off the critical path. Owned by the session
    fixture; tests only call take() and give_back().
    """

    READY = 3

    def __init__(self, admin_dsn: str, template: str) -> None:
        self._admin_dsn = admin_dsn
        self._template = template
        self._ready: asyncio.Queue[str] = asyncio.Queue(maxsize=self.READY)
        self._tasks: set[asyncio.Task] = set()
        self._producer = asyncio.create_task(self._produce())

    async def _sql(self, statement: str) -> None:
        admin = await asyncpg.connect(self._admin_dsn)
        try:
            await admin.execute(statement)
        finally:
            await admin.close()

    async def _produce(self) -> None:
        while True:
            name = f"hw_t_{uuid.uuid4().hex[:12]}"
            await self._sql(f'CREATE DATABASE "{name}" TEMPLATE "{self._template}"')
            await self._ready.put(name)

    async def take(self) -> str:
        return await asyncio.wait_for(self._ready.get(), timeout=60)

    def give_back(self, name: str) -> None:
        task = asyncio.create_task(self._sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        self._producer.cancel()
        await asyncio.gather(self._producer, return_exceptions=True)
        while not self._ready.empty():
            self.give_back(self._ready.get_nowait())
        await asyncio.gather(*self._tasks, return_exceptions=True)


@pytest.fixture(scope="session")
async def databases(services: Services, template_db: str) -> AsyncIterator[DatabaseFactory]:
    factory = DatabaseFactory(services.admin_dsn, template_db)
    try:
        yield factory
    finally:
        await factory.close()


@pytest.fixture
async def db_url(services: Services, databases: DatabaseFactory) -> AsyncIterator[str]:
    name = await databases.take()
    try:
        yield with_database(services.admin_dsn, name)
    finally:
        databases.give_back(name)


@pytest.fixture
async def db(db_url: str) -> AsyncIterator[Database]:
    database = await Database.connect(db_url, min_size=1, max_size=4)
    try:
        yield database
    finally:
        await database.close()


@pytest.fixture
def key_prefix() -> str:
    return f"hwt:{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def redis_client(services: Services, key_prefix: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.from_url(services.redis_url)
    try:
        yield client
    finally:
        keys = [k async for k in client.scan_iter(match=f"{key_prefix}:*", count=1000)]
        if keys:
            await client.delete(*keys)
        await client.aclose()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(T0)
