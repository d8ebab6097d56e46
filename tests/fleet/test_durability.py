"""Per-tenant durability against a primary with a synchronous standby whose replay is
paused (tests/fleet/postgres_pair.py: synchronous_standby_names = '*', the server's
default synchronous_commit = local).

A sync tenant's submits, single and batch, and the dispatch transactions that create its
executions, commit with remote_apply: they wait until the standby has applied them.
An async tenant's do not wait, on the same server at the same moment, and no other
tenant's dispatch waits behind a sync tenant's. A sync submit that outlasts its statement
timeout answers 503 having committed on the primary alone: its Idempotency-Key finds it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg
import pytest
from aiohttp.test_utils import TestClient, TestServer

from herdwick.actors.base import Tick, sync
from herdwick.actors.scheduler import Scheduler
from herdwick.config import Settings
from herdwick.gateway.app import create_app
from herdwick.storage.db import Database
from tests.integration.conftest import make_job
from tests.integration.gateway_client import ADMIN_TOKEN
from tests.integration.stack import advance, ready

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("fleet")]

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
WAITS_S = 1.0  # a submit still unanswered this long after an async one answered: it waits
ANSWERS_S = 0.5  # what a submit that does not wait for the standby takes at most here


@asynccontextmanager
async def gateway(dsn: str, redis_url: str, prefix: str, clock, *,
                  command_timeout_s: float | None = None) -> AsyncIterator[TestClient]:
    settings = Settings(database_url=dsn, redis_url=redis_url, key_prefix=prefix,
                        admin_token=ADMIN_TOKEN)
    db = None
    if command_timeout_s is not None:
        db = await Database.connect(dsn, max_size=4, command_timeout_s=command_timeout_s)
    client = TestClient(TestServer(create_app(settings, clock=clock, db=db)))
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()
        if db is not None:
            await db.close()


async def key_of(client: TestClient, name: str, durability: str) -> dict[str, str]:
    made = await client.post("/v1/tenants", json={"name": name, "durability": durability},
                             headers=ADMIN)
    assert made.status == 201, await made.text()
    return {"Authorization": f"Bearer {(await made.json())['apiKey']}"}


async def timed_submit(client: TestClient, auth: dict[str, str], path: str = "/v1/jobs",
                       body: dict | None = None, **headers) -> tuple[int, float]:
    began = time.monotonic()
    resp = await client.post(path, json=body or make_job(), headers={**auth, **headers})
    await resp.read()
    return resp.status, time.monotonic() - began


async def test_a_sync_tenants_submits_wait_for_the_standby_and_an_async_ones_do_not(
        sync_pair, services, key_prefix, clock) -> None:
    async with gateway(sync_pair.primary_dsn, services.redis_url, key_prefix,
                       clock) as client:
        careful = await key_of(client, "careful", "sync")
        casual = await key_of(client, "casual", "async")
        status, took_s = await timed_submit(client, careful)  # replay running: it answers
        assert status == 201

        await sync_pair.pause_replay()
        single = asyncio.create_task(timed_submit(client, careful))
        batch = asyncio.create_task(timed_submit(
            client, careful, "/v1/jobs:batch", {"jobs": [make_job(), make_job()]}))
        status, took_s = await timed_submit(client, casual)
        assert (status, took_s < ANSWERS_S) == (201, True), took_s
        status, took_s = await timed_submit(client, casual, "/v1/jobs:batch",
                                            {"jobs": [make_job(), make_job()]})
        assert (status, took_s < ANSWERS_S) == (201, True), took_s
        await asyncio.sleep(WAITS_S)
        assert not single.done() and not batch.done()

        resumed = time.monotonic()
        await sync_pair.resume_replay()
        assert [status for status, _ in await asyncio.gather(single, batch)] == [201, 201]
        assert time.monotonic() - resumed < 5.0

    await sync_pair.caught_up()
    standby = await asyncpg.connect(sync_pair.standby_dsn)
    try:  # every accepted job is on the standby: 4 of the careful tenant's, 3 of the other's
        assert await standby.fetchval("SELECT count(*) FROM jobs") == 7
    finally:
        await standby.close()


async def test_a_sync_submit_past_its_timeout_is_503_and_its_key_finds_what_it_committed(
        sync_pair, services, key_prefix, clock) -> None:
    async with gateway(sync_pair.primary_dsn, services.redis_url, key_prefix, clock,
                       command_timeout_s=1.0) as client:
        careful = await key_of(client, "careful", "sync")
        await sync_pair.pause_replay()
        status, took_s = await timed_submit(client, careful, **{"Idempotency-Key": "k-1"})
        assert status == 503 and took_s >= 1.0
        # The COMMIT had been written on the primary; only the wait was cut short.
        primary = await asyncpg.connect(sync_pair.primary_dsn)
        try:
            assert await primary.fetchval("SELECT count(*) FROM jobs") == 1
        finally:
            await primary.close()

        await sync_pair.resume_replay()
        again = await client.post("/v1/jobs", json=make_job(),
                                  headers={**careful, "Idempotency-Key": "k-1"})
        assert again.status == 201
        assert again.headers.get("Idempotent-Replayed") == "true"


async def test_a_sync_tenants_dispatch_waits_for_the_standby_and_no_one_elses_does(
        sync_pair, services, redis_client, key_prefix, clock) -> None:
    async with gateway(sync_pair.primary_dsn, services.redis_url, key_prefix,
                       clock) as client:
        careful = await key_of(client, "careful", "sync")
        casual = await key_of(client, "casual", "async")
        for auth, name in ((careful, "careful-job"), (casual, "casual-job")):
            resp = await client.post("/v1/jobs", json=make_job(name=name), headers=auth)
            assert resp.status == 201, await resp.text()

    db = await Database.connect(sync_pair.primary_dsn, max_size=8)
    node = Scheduler(Settings(key_prefix=key_prefix), clock=clock, db=db, redis=redis_client,
                     node_id="sync-test", tick=False)
    try:
        await node.start()
        general, sync_dispatcher = node.dispatchers[:-1], node.dispatchers[-1]
        await sync_pair.pause_replay()
        await advance(clock, 30, node)  # both jobs fall due
        for shard in node.shard_ids:
            actor = node.shard(shard)
            await actor.send(Tick())
            await sync(actor)
        queue = node._pools["emails"]
        for _ in range(3):  # rounds of the fair queue, through the dispatchers that answer
            await queue.send(Tick())
            await sync(queue)
            for actor in general:
                await sync(actor)
        await sync(queue)

        # The async tenant's execution is committed and on the stream; the sync tenant's
        # transaction waits for the standby, so no one sees its execution yet.
        assert [e["payload"] for e in await ready(redis_client, key_prefix)] == [
            '{"to": "a@example.com"}']
        names = await _executed(db)
        assert names == ["casual-job"]

        await sync_pair.resume_replay()
        await asyncio.wait_for(sync(sync_dispatcher), 5.0)
        await sync(queue)
        assert await _executed(db) == ["careful-job", "casual-job"]
        assert len(await ready(redis_client, key_prefix)) == 2
    finally:
        await node.stop()
        await db.close()


async def _executed(db: Database) -> list[str]:
    async with db.connection() as conn:
        return [r["name"] for r in await conn.fetch(
            "SELECT j.name FROM executions e JOIN jobs j USING (job_id) ORDER BY j.name")]


async def test_a_sync_dispatch_past_its_timeout_is_published_once_known_committed(
        sync_pair, services, redis_client, key_prefix, clock) -> None:
    """The standby does not answer: the sync tenant's dispatch transaction outlasts its
    statement timeout (1 s here, 10 s by default). Its COMMIT was written on the primary;
    the dispatcher keeps the batch in doubt, finds the execution committed, and publishes
    it, once (storage/dispatch's in-doubt path), with the standby still paused."""
    async with gateway(sync_pair.primary_dsn, services.redis_url, key_prefix,
                       clock) as client:
        careful = await key_of(client, "careful", "sync")
        resp = await client.post("/v1/jobs", json=make_job(name="careful-job"), headers=careful)
        assert resp.status == 201, await resp.text()

    db = await Database.connect(sync_pair.primary_dsn, max_size=8, command_timeout_s=1.0)
    node = Scheduler(Settings(key_prefix=key_prefix), clock=clock, db=db, redis=redis_client,
                     node_id="sync-timeout", tick=False)
    try:
        await node.start()
        sync_dispatcher = node.dispatchers[-1]
        await sync_pair.pause_replay()
        await advance(clock, 30, node)
        for shard in node.shard_ids:
            actor = node.shard(shard)
            await actor.send(Tick())
            await sync(actor)
        queue = node._pools["emails"]
        await queue.send(Tick())
        await sync(queue)
        deadline = time.monotonic() + 10
        while not (entries := await ready(redis_client, key_prefix)):
            assert time.monotonic() < deadline, "the in-doubt dispatch was never published"
            await queue.send(Tick())
            await sync(queue)
            await asyncio.sleep(0.1)
        assert len(entries) == 1 and sync_dispatcher.resolved == 1
        assert await _executed(db) == ["careful-job"]
        await sync_pair.resume_replay()
    finally:
        await node.stop()
        await db.close()
