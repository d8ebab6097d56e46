"""Postgres going away: 503 with Retry-After, nothing half-written, recovery after."""

from __future__ import annotations

import asyncpg

from tests.integration.conftest import make_job
from tests.integration.gateway_client import ADMIN_TOKEN, start_client
from tests.proxy import Proxy


async def test_storage_down_is_503_and_writes_nothing(db_url, services, key_prefix,
                                                      clock) -> None:
    proxy = Proxy(db_url)
    await proxy.start()
    client = await start_client(proxy.dsn(), services.redis_url, key_prefix, clock)
    try:
        made = await client.post("/v1/tenants", json={"name": "t"},
                                 headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        key = (await made.json())["apiKey"]
        auth = {"Authorization": f"Bearer {key}"}
        assert (await client.post("/v1/jobs", json=make_job(), headers=auth)).status == 201

        await proxy.cut()
        for _ in range(3):  # dead pooled connections, then refused new ones
            resp = await client.post("/v1/jobs", json=make_job(name="lost"), headers=auth)
            assert resp.status == 503
            assert int(resp.headers["Retry-After"]) > 0
            assert (await resp.json())["type"].endswith("/storage-unavailable")
        batch = await client.post("/v1/jobs:batch", json={"jobs": [make_job()] * 3},
                                  headers=auth)
        assert batch.status == 503
        ready = await client.get("/readyz")
        assert ready.status == 503

        await proxy.restore()
        again = await client.post("/v1/jobs", json=make_job(name="after"), headers=auth)
        assert again.status == 201
    finally:
        await client.close()
        await proxy.close()

    conn = await asyncpg.connect(db_url)
    try:
        names = sorted(r["name"] for r in await conn.fetch("SELECT name FROM jobs"))
        assert names == ["after", "nightly-report"]
        assert await conn.fetchval("SELECT count(*) FROM due_index") == 2
    finally:
        await conn.close()
