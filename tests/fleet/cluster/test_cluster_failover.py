"""A primary of the cluster fails over under a running worker.

Redis replicates asynchronously, so a failover can lose the last writes the
old primary acknowledged: a worker's completion among them, which would then
run again once its lease lapsed. The worker notices that another server
process serves its pool's slot (its run_id changed) and sends its recent
completions again (hw_recover), as it does when Redis restarts empty.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

import herdwick
from herdwick import redis_client
from herdwick.storage import keys
from herdwick.storage.hot import HotTier
from tests.fleet.redis_cluster import LocalCluster
from tests.integration.test_worker import POOL, Pool, make_execution, running

pytestmark = pytest.mark.slow


async def completed(pool: Pool, execution_id: str, timeout_s: float = 15.0) -> dict:
    """The execution's `completed` event, read through the failover (a read may meet the
    dead node until the client has the new map of the slots)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        with contextlib.suppress(*redis_client.REDIS_ERRORS):
            found = [e for e in await pool.events(execution_id) if e["type"] == "completed"]
            if found:
                return found[0]
        await asyncio.sleep(0.1)
    raise AssertionError(f"no completed event for {execution_id} within {timeout_s} s")


async def test_a_completion_a_failover_lost_is_sent_again_not_run_again(
        own_cluster: LocalCluster, key_prefix: str) -> None:
    client = redis_client.connect(own_cluster.url)
    try:
        pool = Pool(client, key_prefix, own_cluster.url)
        await pool.hot.load_functions()
        await client.set(keys.epoch_key(key_prefix), "e1")
        worker = pool.worker(lease_s=30)
        runs = []

        @worker.handler
        async def handle(ctx: herdwick.Context) -> None:
            runs.append(ctx.execution_id)

        execution = make_execution()
        hot = keys.hot_state(key_prefix, POOL, execution.execution_id)
        async with running(worker):
            await pool.publish(execution)
            await pool.next_event("completed", execution.execution_id)
            # What the replica will have when it takes over: the lease, not the
            # completion (written on the primary, replicated, before the kill).
            await client.hset(hot, mapping={"state": "leased", "lease_owner": worker.worker_id,
                                             "lease_until": "9999999999999"})
            await client.delete(pool.events_key)
            serving = await own_cluster.primary_of(pool.ready)
            took_s = await own_cluster.kill(serving)
            done = await completed(pool, execution.execution_id)
        assert done["recovered"] == "1", done
        assert await client.hget(hot, "state") == b"done"
        assert runs == [execution.execution_id]  # recorded, not run again
        assert took_s < 15
        # The new primary has the library (replicated with the data): publishing works.
        again = make_execution()
        assert await HotTier(client, key_prefix).publish({POOL: [again]}) == 1
    finally:
        await client.aclose()


async def test_a_primary_without_the_library_gets_it_from_the_next_sweep(
        local_cluster: LocalCluster, key_prefix: str) -> None:
    """A node that joins the cluster (a resharding gives it slots) has no functions: a
    scheduler's sweep loads them on every primary that lacks them, and only there."""
    from herdwick.storage.hot import LIBRARY_VERSION

    client = redis_client.connect(local_cluster.url)
    try:
        hot = HotTier(client, key_prefix)
        await hot.load_functions()
        assert await hot.ensure_functions() == 0  # all there: nothing loaded
        bare = client.get_primaries()[1]
        await client.execute_command("FUNCTION", "DELETE", "herdwick", target_nodes=bare)
        assert await hot.ensure_functions() == 1
        versions = [await client.execute_command("FCALL", "hw_version", 0, target_nodes=node)
                    for node in client.get_primaries()]
        assert versions == [str(LIBRARY_VERSION).encode()] * 3
    finally:
        await client.aclose()
