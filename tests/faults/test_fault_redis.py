"""Redis misbehaves mid-herd, on a server of the scenario's own: it restarts empty, fills up
to its maxmemory, or the network between the schedulers and it stalls.

docs/design.md: Redis may lose everything; Postgres may not. An empty Redis is
noticed by its missing epoch key and every unfinished execution is
republished as its next attempt; a full one refuses writes (noeviction), so
publishes and worker calls fail and are retried or swept, and nothing is
corrupted; a stalled link delays, and leases fenced in Redis keep any two
holders apart.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

import herdwick
from tests.faults.harness import LEASE_S, Stack
from tests.faults.redis_server import RedisServer
from tests.faults.stall_proxy import StallProxy

pytestmark = pytest.mark.slow

FULL_S = (2.0, 4.0)  # how long Redis stays at its maxmemory
FULL_HEADROOM_BYTES = 64 * 1024  # maxmemory: what it used when filled, plus this
REFUSED_S = 2.0  # how long Redis refuses a worker's report
STALL_S = (3.0, 5.0)  # how long the schedulers' link to Redis holds every byte


@pytest.fixture
async def redis_server() -> AsyncIterator[RedisServer]:
    server = await RedisServer.start()
    try:
        yield server
    finally:
        server.stop()


async def test_redis_restarted_empty_mid_herd(db_url, key_prefix, redis_server) -> None:
    async def restart_empty(stack: Stack) -> None:
        await redis_server.restart()

    async with Stack.up(db_url, redis_server.url, key_prefix, http=True) as stack:
        # Every unfinished execution is republished as its next attempt: the ones still
        # on the stream, never leased, leave a number no worker held (a gap).
        result = await stack.run("Redis restarted empty mid-herd", (0.2, 1.2), restart_empty,
                                 allow_gaps=True)
    result.assert_sound()


async def test_redis_at_maxmemory_with_noeviction(db_url, key_prefix, redis_server) -> None:
    """Submissions go through the api the whole time (the steady rate): they need Postgres
    only, so they keep their 201s; dispatch and the workers' calls are refused (OOM) while
    Redis is full, and everything catches up by itself once memory frees."""
    seen: dict[str, object] = {}
    admin = aioredis.from_url(redis_server.url)

    async def fill_redis(stack: Stack) -> None:
        used = (await admin.info("memory"))["used_memory"]
        await admin.config_set("maxmemory", used + FULL_HEADROOM_BYTES)
        await asyncio.sleep(stack.rng.uniform(*FULL_S))
        seen["oom errors"] = (await admin.info("errorstats")).get("errorstat_OOM", {})
        await admin.config_set("maxmemory", 0)

    try:
        async with Stack.up(db_url, redis_server.url, key_prefix, api=True) as stack:
            stack.steady_via_api = True
            result = await stack.run(
                "Redis at maxmemory (noeviction)", (0.2, 1.0), fill_redis,
                notes=lambda: {"OOM refusals": seen["oom errors"].get("count", 0),
                               "api answers": dict(stack.steady_statuses)})
    finally:
        await admin.aclose()
    assert seen["oom errors"], "Redis refused nothing: it was never full"
    assert set(stack.steady_statuses) == {201}, stack.steady_statuses
    result.assert_sound()


async def test_a_worker_resends_a_refused_report_while_its_lease_holds(
        key_prefix, redis_server) -> None:
    """A completion Redis refuses (full, noeviction) for longer than a few quick retries
    is sent again until it lands, not dropped: dropped, the attempt would run again once
    its lease lapsed."""
    from herdwick.storage import keys
    from herdwick.storage.hot import HotTier
    from tests.integration.test_worker import _events, make_execution

    pool = "emails"
    admin = aioredis.from_url(redis_server.url)
    hot = HotTier(admin, key_prefix)
    await hot.load_functions()
    execution = make_execution()
    assert await hot.publish({pool: [execution]}) == 1
    ran, release = asyncio.Event(), asyncio.Event()

    async def handler(ctx) -> dict:
        ran.set()
        await release.wait()
        return {"ok": True}

    worker = herdwick.Worker(redis_server.url, pool, 1, key_prefix=key_prefix, lease_s=30)
    worker.handler(handler)
    running = asyncio.create_task(worker.run())
    try:
        await asyncio.wait_for(ran.wait(), 10)
        await admin.config_set("maxmemory", 1)  # every write refused from here
        release.set()
        await asyncio.sleep(REFUSED_S)  # past the three quick tries (about 0.6 s)
        await admin.config_set("maxmemory", 0)
        events = keys.events_stream(key_prefix, pool)
        for _ in range(100):
            kinds = [e["type"] for _, f in await admin.xrange(events) for e in _events(f)]
            if "completed" in kinds:
                break
            await asyncio.sleep(0.1)
        assert kinds == ["leased", "completed"]
    finally:
        await asyncio.wait_for(worker.stop(), 10)
        await running
        await admin.aclose()


async def test_a_scheduler_whose_notify_subscription_drops_re_reads_its_near_rows(
        db_url, key_prefix, redis_server) -> None:
    """Notifies published while a node was not subscribed reached no shard: once it is
    subscribed again, each of its shards reads its near rows again at its next load."""
    from datetime import UTC, datetime

    from herdwick.actors.scheduler import Scheduler
    from herdwick.clock import ManualClock
    from herdwick.config import Settings

    admin = aioredis.from_url(redis_server.url)
    node = Scheduler(Settings(database_url=db_url, redis_url=redis_server.url,
                              key_prefix=key_prefix),
                     clock=ManualClock(datetime.now(UTC)), tick=False)
    await node.start()
    try:
        await asyncio.wait_for(node._subscribed.wait(), 10)
        shards = [node.shard(s) for s in sorted(node.shard_ids)]
        for shard in shards:
            shard.missed_notify = False
        assert await admin.client_kill_filter(_type="pubsub") == 1
        for _ in range(100):
            if all(shard.missed_notify for shard in shards):
                break
            await asyncio.sleep(0.1)
        assert shards and all(shard.missed_notify for shard in shards)
    finally:
        await node.stop()
        await admin.aclose()


async def test_a_network_stall_between_the_schedulers_and_redis(
        db_url, key_prefix, redis_server) -> None:
    proxy = StallProxy("127.0.0.1", redis_server.port)
    await proxy.start()
    stalled: dict[str, float] = {}

    async def stall(stack: Stack) -> None:
        stalled["s"] = round(stack.rng.uniform(*STALL_S), 1)
        proxy.stall()
        await asyncio.sleep(stalled["s"])
        proxy.resume()

    try:
        async with Stack.up(db_url, redis_server.url, key_prefix,
                            scheduler_redis_url=proxy.url) as stack:
            result = await stack.run("scheduler<->Redis stall", (0.2, 1.0), stall,
                                     allow_gaps=True, notes=lambda: {"stalled s": stalled["s"]})
    finally:
        await proxy.close()
    assert stalled["s"] < LEASE_S + 1
    result.assert_sound()
