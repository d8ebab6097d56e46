"""Fixtures over real Postgres and Redis.

Each test gets its own database, cloned from a template migrated once per
session (CREATE DATABASE ... TEMPLATE), and its own Redis key prefix.
"""

from __future__ import annotations

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


@pytest.fixture
async def db_url(services: Services, template_db: str) -> AsyncIterator[str]:
    name = f"hw_t_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(services.admin_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"')
        yield with_database(services.admin_dsn, name)
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


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
