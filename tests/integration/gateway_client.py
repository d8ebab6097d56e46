"""A test client for the gateway on a real socket, over the test's own database."""

from __future__ import annotations

from aiohttp.test_utils import TestClient, TestServer

from herdwick.config import Settings
from herdwick.gateway.app import create_app
from herdwick.ssrf import Resolve

ADMIN_TOKEN = "test-admin-token-0123456789"


async def start_client(db_url: str, redis_url: str, key_prefix: str, clock, *,
                       resolve: Resolve | None = None, **settings) -> TestClient:
    """resolve answers the gateway's lookups of http targets' names (default getaddrinfo)."""
    settings = {"admin_token": ADMIN_TOKEN, **settings}
    cfg = Settings(database_url=db_url, redis_url=redis_url, key_prefix=key_prefix, **settings)
    client = TestClient(TestServer(create_app(cfg, clock=clock, resolve=resolve)))
    await client.start_server()
    return client
