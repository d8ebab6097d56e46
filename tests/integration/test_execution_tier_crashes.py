"""The execution tier's actors come back after a crash; and a crash that Redis can cause.

The supervisor restarts a crashed actor by calling its factory again; the
scheduler's factories build a new reaper, sweeper and event actor each time.
Redis being unreachable is StorageUnavailable, which the actors expect,
never a raw client error.
"""

from __future__ import annotations

import asyncio

import pytest

from herdwick.actors.base import Tick, sync
from herdwick.storage import keys
from herdwick.storage.hot import HotTier, ReadyExecution
from herdwick.storage.protocol import Protocol

POOL = "emails"


@pytest.mark.parametrize("name", ["events", "reaper", "sweeper"])
async def test_a_crashed_execution_tier_actor_is_replaced_by_a_new_one(
        schedulers, name, monkeypatch) -> None:
    node = await schedulers()
    crashed = getattr(node, name)

    async def boom(msg: object | None) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(crashed, "handle", boom)
    node._core.restarted.clear()
    await crashed.send(Tick())
    await asyncio.wait_for(node._core.restarted.wait(), 5)

    replacement = getattr(node, name)
    assert crashed.stopped and replacement is not crashed
    await replacement.send(Tick())
    await sync(replacement)
    assert not replacement.stopped


async def test_trim_ready_survives_the_last_pending_entry_acked_between_its_reads(
        redis_client, key_prefix, monkeypatch) -> None:
    hot = HotTier(redis_client, key_prefix)
    await hot.load_functions()
    await hot.publish({POOL: [ReadyExecution(
        execution_id="e1", attempt=1, job_id="j1", tenant_id="t1",
        scheduled_for="2026-12-02T12:00:00Z", payload="{}", timeout_seconds=30)]})
    stream = keys.ready_stream(key_prefix, POOL)
    [(_, [(entry_id, _)])] = await redis_client.xreadgroup(keys.WORKERS_GROUP, "w",
                                                           {stream: ">"}, count=1)
    real_xpending = redis_client.xpending

    async def acked_meanwhile(*args, **kwargs):
        await redis_client.xack(stream, keys.WORKERS_GROUP, entry_id)  # the worker leased it
        return await real_xpending(*args, **kwargs)

    monkeypatch.setattr(redis_client, "xpending", acked_meanwhile)
    assert isinstance(await Protocol(redis_client, key_prefix).trim_ready(POOL), int)


async def test_an_unreachable_redis_is_storage_unavailable() -> None:
    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    from herdwick.errors import StorageUnavailable

    client = aioredis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=1,
                            retry=Retry(NoBackoff(), 0))
    hot = HotTier(client, "hwt:nowhere")
    try:
        with pytest.raises(StorageUnavailable):
            await hot.pools()
        with pytest.raises(StorageUnavailable):
            await hot.ensure_group(POOL)
    finally:
        await client.aclose()
