"""Finds the Postgres and Redis the suite runs against, or starts throwaway ones.

Order: HERDWICK_TEST_DATABASE_URL / HERDWICK_TEST_REDIS_URL; else the servers
on 127.0.0.1:5432 / 6379 (user postgres, then root); else embedded servers
from the `embedded` extra. HERDWICK_TEST_EMBEDDED=1 skips the local servers,
to exercise the fallback on a machine that has them.
"""

from __future__ import annotations

import asyncio
import os
import urllib.parse
from pathlib import Path

import asyncpg
import redis.asyncio as aioredis

from herdwick import redis_client

LOCAL_POSTGRES = ("postgresql://postgres@127.0.0.1:5432/postgres",
                  "postgresql://root@127.0.0.1:5432/postgres")
LOCAL_REDIS = "redis://127.0.0.1:6379/0"
FORCE_EMBEDDED = os.environ.get("HERDWICK_TEST_EMBEDDED") == "1"


def with_database(dsn: str, database: str) -> str:
    parts = urllib.parse.urlsplit(dsn)
    return urllib.parse.urlunsplit(parts._replace(path="/" + database))


async def _postgres_answers(dsn: str) -> bool:
    try:
        conn = await asyncpg.connect(dsn, timeout=3)
    except (OSError, asyncpg.PostgresError, TimeoutError):
        return False
    await conn.close()
    return True


async def _redis_answers(url: str) -> bool:
    client = redis_client.connect(url, socket_connect_timeout=2)
    try:
        return bool(await client.ping())
    except (OSError, aioredis.RedisError):
        return False
    finally:
        await client.aclose()


# A stable place, so a killed run's Postgres is adopted by the next run, not leaked.
EMBEDDED_DIR = Path(__file__).resolve().parent.parent / ".herdwick" / "test-services"


class Services:
    """The admin DSN and Redis URL in use, and whatever we started to get them."""

    def __init__(self) -> None:
        self.admin_dsn = ""
        self.redis_url = ""
        self._started: list = []

    def _scratch(self) -> Path:
        EMBEDDED_DIR.mkdir(parents=True, exist_ok=True)
        return EMBEDDED_DIR

    async def find(self) -> Services:
        self.admin_dsn = await self._find_postgres()
        self.redis_url = await self._find_redis()
        return self

    async def _find_postgres(self) -> str:
        given = os.environ.get("HERDWICK_TEST_DATABASE_URL")
        if given:
            return given
        for dsn in () if FORCE_EMBEDDED else LOCAL_POSTGRES:
            if await _postgres_answers(dsn):
                return dsn
        from herdwick.embedded import start_postgres

        server = await asyncio.to_thread(start_postgres, self._scratch())
        self._started.append(server)
        return server.dsn

    async def _find_redis(self) -> str:
        given = os.environ.get("HERDWICK_TEST_REDIS_URL")
        if given:
            return given
        if not FORCE_EMBEDDED and await _redis_answers(LOCAL_REDIS):
            return LOCAL_REDIS
        from herdwick.embedded import start_redis

        # On this thread, not a worker's: the child's die-with-parent signal is
        # tied to the thread that started it. It takes about 50 ms.
        server = start_redis(self._scratch())
        self._started.append(server)
        return server.url

    def stop(self) -> None:
        for server in reversed(self._started):
            server.stop()
