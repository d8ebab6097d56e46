"""Tenant isolation through the real scheduler tier: bounded streams, shares, quotas.

Workers are played by `drain`, which reads and leases what a pool's stream
delivers (the leases are what make room on the stream, as real workers' do).
"""

from __future__ import annotations

import asyncio
import collections
import time

import pytest

from herdwick.actors.base import Actor, Tick
from herdwick.actors.fairqueue import FIRST_ROUND, ROUND_GATHER_S, FairQueue
from herdwick.actors.messages import Due, Handed, Ready, item
from herdwick.clock import to_us
from herdwick.storage import keys
from herdwick.storage.hot import HotTier
from herdwick.storage.protocol import Protocol
from herdwick.storage.tenants import TenantLimits
from tests.integration.conftest import make_job
from tests.integration.stack import advance

POOL = "emails"


async def submit_many(api, count: int, *, key: str | None = None, pool: str = POOL,
                      delay_s: float = 1) -> list[str]:
    jobs = [make_job(name=f"j{i}", target={"type": "queue", "ref": pool},
                     schedule={"delaySeconds": delay_s}) for i in range(count)]
    ids = []
    for start in range(0, count, 1000):
        resp = await api.client.post("/v1/jobs:batch", json={"jobs": jobs[start:start + 1000]},
                                     headers=api.auth(key))
        assert resp.status == 201, await resp.text()
        ids += [item["jobId"] for item in (await resp.json())["items"]]
    return ids


async def tenant(api, name: str, **limits) -> str:
    return (await api.create_tenant(name, **limits))["apiKey"]


async def undelivered(redis_client, key_prefix, pool: str = POOL) -> int:
    groups = await redis_client.xinfo_groups(keys.ready_stream(key_prefix, pool))
    [group] = [g for g in groups if g["name"] == keys.WORKERS_GROUP.encode()]
    return group["lag"]


async def drain(redis_client, key_prefix, count: int, pool: str = POOL) -> list[dict]:
    """Read up to `count` entries as a worker does and lease them; their fields."""
    stream = keys.ready_stream(key_prefix, pool)
    reply = await redis_client.xreadgroup(keys.WORKERS_GROUP, "drainer", {stream: ">"},
                                          count=count)
    entries = [(mid, {k.decode(): v.decode() for k, v in fields.items()})
               for _, batch in reply or [] for mid, fields in batch]
    if entries:
        protocol = Protocol(redis_client, key_prefix)
        leased = await protocol.lease_many(pool, "drainer", 30, [
            (f["execution_id"], int(f["attempt"])) for _, f in entries])
        assert all(until is not None for until in leased)
        await redis_client.xack(stream, keys.WORKERS_GROUP, *[mid for mid, _ in entries])
    return [f for _, f in entries]


async def counts(db) -> tuple[int, int]:
    async with db.connection() as conn:
        executions = await conn.fetchval("SELECT count(*) FROM executions")
        due = await conn.fetchval("SELECT count(*) FROM due_index")
    return executions, due


async def test_a_bounded_stream_stays_at_its_bound_while_postgres_holds_the_rest(
        api, schedulers, redis_client, key_prefix, clock, db) -> None:
    await submit_many(api, 200)
    node = await schedulers(ready_max="50")
    await advance(clock, 1, node)
    await node.settle()
    assert await undelivered(redis_client, key_prefix) == 50
    assert await counts(db) == (50, 150)  # the rest wait as due rows, durable

    seen: list[str] = []
    while len(seen) < 200:
        got = await drain(redis_client, key_prefix, 30)
        seen += [f["execution_id"] for f in got]
        await node.settle()
        assert await undelivered(redis_client, key_prefix) <= 50
    assert len(set(seen)) == 200  # each once
    assert await counts(db) == (200, 0)


async def test_a_pool_without_workers_backs_up_only_itself(
        api, schedulers, redis_client, key_prefix, clock, db) -> None:
    await submit_many(api, 100, pool="nobody-reads")
    await submit_many(api, 30, pool=POOL)
    node = await schedulers(ready_max="20")
    await advance(clock, 1, node)
    await node.settle()
    got = []
    for _ in range(3):
        got += await drain(redis_client, key_prefix, 100)
        await node.settle()
    assert len(got) == 30  # every job of the pool with a worker went out
    assert await undelivered(redis_client, key_prefix, "nobody-reads") == 20


async def _shares(api, schedulers, redis_client, key_prefix, clock, nodes: int) -> dict:
    weights = {"one": 1, "two": 2, "four": 4}
    owner = {}
    for name, weight in weights.items():
        key = await tenant(api, name, weight=weight)
        ids = await submit_many(api, 1500, key=key)
        owner.update(dict.fromkeys(ids, name))
    started = [await schedulers(node_id=f"node-{i}", ready_max="70") for i in range(nodes)]
    await advance(clock, 1, *started)
    taken: collections.Counter = collections.Counter()
    turn = 0
    while sum(taken.values()) < 1500:  # under contention: all three still have work
        turn += 1  # the nodes take turns at the stream's room, as their timers would
        for node in started[turn % nodes:] + started[:turn % nodes]:
            await node.settle(rounds=1)
        for fields in await drain(redis_client, key_prefix, 35):
            taken[owner[fields["job_id"]]] += 1
    return {name: taken[name] / sum(taken.values()) for name in weights}


async def test_weights_1_2_4_get_1_2_4_of_a_pool_s_dispatch(
        api, schedulers, redis_client, key_prefix, clock) -> None:
    got = await _shares(api, schedulers, redis_client, key_prefix, clock, nodes=1)
    assert got == pytest.approx({"one": 1 / 7, "two": 2 / 7, "four": 4 / 7}, rel=0.1)


async def test_two_schedulers_together_keep_the_shares(
        api, schedulers, redis_client, key_prefix, clock) -> None:
    got = await _shares(api, schedulers, redis_client, key_prefix, clock, nodes=2)
    assert got == pytest.approx({"one": 1 / 7, "two": 2 / 7, "four": 4 / 7}, rel=0.1)


async def test_a_tenant_s_new_weight_reaches_the_scheduler(api, schedulers, db) -> None:
    made = await api.create_tenant("grows", weight=1)
    node = await schedulers()
    assert node.limits[made["tenantId"]].weight == 1
    from tests.integration.gateway_client import ADMIN_TOKEN

    resp = await api.client.patch(f"/v1/tenants/{made['tenantId']}",
                                  json={"weight": 5, "dispatchRate": 10, "burst": 3},
                                  headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert resp.status == 200, await resp.text()
    assert await node.refresh_limits() >= 1
    limits = node.limits[made["tenantId"]]
    assert (limits.weight, limits.rate, limits.burst) == (5, 10, 3)


@pytest.mark.slow
async def test_two_schedulers_share_one_tenant_s_rate_quota(
        api, schedulers, redis_client, key_prefix, clock, db) -> None:
    """The quota's clock is the Redis server's: this one measures real time, a few seconds."""
    key = await tenant(api, "limited", dispatchRate=50, burst=10)
    await submit_many(api, 1000, key=key)
    nodes = [await schedulers(node_id=f"node-{i}") for i in range(2)]
    began = time.monotonic()  # the fair queues run on their own from the due moment on
    await advance(clock, 1, *nodes)
    published = 0
    while time.monotonic() - began < 3.0:
        for node in nodes:
            await node.settle(rounds=1)
        published += len(await drain(redis_client, key_prefix, 1000))
        await asyncio.sleep(0.05)  # real time must pass for tokens to refill
    # Until the last drain: on a busy machine the last pass ends well past the 3 s.
    elapsed = time.monotonic() - began
    allowed = 10 + 50 * elapsed  # the burst, then the rate
    # Never over the quota; under it only by what a busy machine (the suite's other
    # worker) costs two schedulers' passes.
    assert allowed * 0.75 <= published <= allowed * 1.1, (published, allowed)
    for node in nodes:  # the fair queues run on their own: stopped, the counts hold still
        await node.stop()
    executions, due = await counts(db)
    on_stream = await undelivered(redis_client, key_prefix)
    assert executions == published + on_stream and due == 1000 - executions  # durable


async def test_over_its_active_job_limit_a_tenant_gets_429(api) -> None:
    key = await tenant(api, "small", maxActiveJobs=2)
    for _ in range(2):
        assert (await api.submit(make_job(), key=key)).status == 201
    over = await api.submit(make_job(), key=key)
    assert over.status == 429
    assert int(over.headers["Retry-After"]) > 0


async def test_sync_tenants_work_goes_to_a_dispatcher_of_its_own_and_waits_when_it_is_behind(
        redis_client, key_prefix, clock) -> None:
    """A sync tenant's dispatch commits wait for the standbys, so its work goes in Dues of its
    own to a dispatcher of its own (the dispatchers here are bare mailboxes); when that one
    is behind, the tenant sits out and the others' work goes on."""
    hot = HotTier(redis_client, key_prefix)
    await hot.load_functions()
    general, for_sync = Actor(clock=clock), Actor(clock=clock, mailbox_size=1)
    queue = FairQueue(POOL, hot=hot, clock=clock, dispatchers=[general],
                      sync_dispatcher=for_sync, lag={},
                      limits={"careful": TenantLimits(sync=True)})
    due_us = to_us(clock.now())

    async def hand(tenant: str, first: int, count: int) -> None:
        items = [(tenant, item(due_us, 7, n)) for n in range(first, first + count)]
        await queue.handle(Ready(7, 1, items, Handed(count)))
        await queue.handle(Tick())  # a round now, not after ROUND_GATHER_S

    def dues(actor: Actor) -> list[Due]:
        taken = []
        while not actor.mailbox.empty():
            taken.append(actor.mailbox.get_nowait())
        return taken

    await hand("careful", 0, 3)
    await hand("casual", 100, 3)
    assert for_sync.mailbox.full()  # the careful tenant's Due, alone
    [casual] = dues(general)
    assert [k.job_id.int for k in casual.keys] == [100, 101, 102]

    await hand("careful", 3, 2)  # its dispatcher is behind: this waits in the queue
    await hand("casual", 103, 2)
    assert [k.job_id.int for d in dues(general) for k in d.keys] == [103, 104]
    assert queue.backlog == 2
    [careful] = dues(for_sync)
    assert [k.job_id.int for k in careful.keys] == [0, 1, 2]


async def test_a_few_due_items_wait_briefly_for_more_and_go_in_one_round(
        redis_client, key_prefix, clock) -> None:
    """Steady work falls due a few ms apart: it goes in one Due after ROUND_GATHER_S, not
    one a job; as much as a first round goes at once."""
    hot = HotTier(redis_client, key_prefix)
    await hot.load_functions()
    dispatcher = Actor(clock=clock)
    queue = FairQueue(POOL, hot=hot, clock=clock, dispatchers=[dispatcher], lag={}, limits={})
    due_us = to_us(clock.now())

    async def hand(first: int, count: int) -> None:
        items = [("t", item(due_us, 7, n)) for n in range(first, first + count)]
        await queue.handle(Ready(7, 1, items, Handed(count)))

    def dues() -> list[list[int]]:
        taken = []
        while not dispatcher.mailbox.empty():
            taken.append([k.job_id.int for k in dispatcher.mailbox.get_nowait().keys])
        return taken

    await hand(0, 1)
    await hand(1, 2)
    assert dues() == [] and 0 < queue.idle_timeout() <= ROUND_GATHER_S
    await asyncio.sleep(ROUND_GATHER_S)  # real time: the round waits by the monotonic clock
    await queue.handle(None)
    assert dues() == [[0, 1, 2]]

    await hand(100, FIRST_ROUND)
    assert dues() == [list(range(100, 100 + FIRST_ROUND))]
