"""The scheduler tier over real Postgres and Redis, with time moved by hand."""

from __future__ import annotations

import asyncio
import uuid
from datetime import datetime, timedelta

import pytest

from herdwick.actors.base import sync
from herdwick.actors.scheduler import Scheduler
from herdwick.config import Settings
from herdwick.ids import shard_of
from tests.conftest import T0
from tests.integration.conftest import make_job
from tests.integration.stack import advance, ready, submit, tick


async def test_a_one_off_is_published_when_due_and_not_before(api, schedulers, redis_client,
                                                               key_prefix, clock, db) -> None:
    job = await submit(api, schedule={"delaySeconds": 30})
    node = await schedulers()
    await node.settle()
    assert await ready(redis_client, key_prefix) == []

    await advance(clock, 30, node)
    await node.settle()
    [entry] = await ready(redis_client, key_prefix)
    assert entry["job_id"] == job["jobId"]
    assert entry["tenant_id"] == api.tenant_id
    assert entry["attempt"] == "1"
    assert entry["scheduled_for"] == job["nextRunAt"]
    assert entry["idempotency_key"] == f"{job['jobId']}:{job['nextRunAt']}"
    assert entry["payload"] == '{"to": "a@example.com"}'
    assert entry["timeout_seconds"] == "300"
    async with db.connection() as conn:
        execution = await conn.fetchrow("SELECT * FROM executions WHERE job_id = $1",
                                        job["jobId"])
        assert execution["state"] == "queued"
        assert str(execution["execution_id"]) == entry["execution_id"]
        assert await conn.fetchval("SELECT count(*) FROM due_index") == 0
    assert node.lag[api.tenant_id].total == 1

    await advance(clock, 60, node)
    await node.settle()
    assert len(await ready(redis_client, key_prefix)) == 1


async def test_the_scheduler_plans_its_statements_once_and_still_dispatches(
        api, db_url, services, redis_client, key_prefix, clock, db) -> None:
    job = await submit(api, schedule={"delaySeconds": 30})
    node = Scheduler(Settings(database_url=db_url, redis_url=services.redis_url,
                              key_prefix=key_prefix),
                     clock=clock, redis=redis_client, node_id="own-pool", tick=False)
    await node.start()
    try:
        async with node.db.connection() as conn:
            assert await conn.fetchval("SHOW plan_cache_mode") == "force_generic_plan"
        async with db.connection() as conn:  # any other pool: Postgres's own choice
            assert await conn.fetchval("SHOW plan_cache_mode") == "auto"
        await node.settle()
        await advance(clock, 30, node)
        await node.settle()
        [entry] = await ready(redis_client, key_prefix)
        assert entry["job_id"] == job["jobId"]
    finally:
        await node.stop()


async def test_work_handed_over_before_it_is_due_waits_in_the_fair_queue_until_due(
        api, schedulers, redis_client, key_prefix, clock) -> None:
    from herdwick.actors.shard import PREPARE_S

    await submit(api, schedule={"delaySeconds": 30})
    node = await schedulers()
    await node.settle()
    await advance(clock, 30 - PREPARE_S / 2, node)  # within the hand-over's lead
    await node.settle()
    [queue] = node._pools.values()
    assert queue.backlog == 1  # handed over already
    assert await ready(redis_client, key_prefix) == []  # and not one microsecond early
    clock.advance(PREPARE_S / 2 - 0.000_001)
    await node.settle()
    assert await ready(redis_client, key_prefix) == []
    clock.advance(0.000_001)
    await node.settle()
    assert len(await ready(redis_client, key_prefix)) == 1
    assert queue.backlog == 0


async def test_a_cron_job_queues_each_occurrence_and_its_successor(api, schedulers, redis_client,
                                                                    key_prefix, clock, db) -> None:
    job = await submit(api, schedule={"cron": "*/5 * * * *"})
    assert job["nextRunAt"] == "2026-12-02T12:05:00Z"
    node = await schedulers()
    for _ in range(2):
        await advance(clock, 5 * 60, node)
        await node.settle()
    entries = await ready(redis_client, key_prefix)
    assert [e["scheduled_for"] for e in entries] == ["2026-12-02T12:05:00Z",
                                                     "2026-12-02T12:10:00Z"]
    async with db.connection() as conn:
        due = await conn.fetch("SELECT next_run_at FROM due_index WHERE job_id = $1",
                               job["jobId"])
        next_run = await conn.fetchval("SELECT next_run_at FROM jobs WHERE job_id = $1",
                                       job["jobId"])
    assert [r["next_run_at"] for r in due] == [T0 + timedelta(minutes=15)]
    assert next_run == T0 + timedelta(minutes=15)


async def test_a_cron_successor_is_in_its_shard_s_heap_as_its_dispatch_commits(
        api, schedulers, redis_client, key_prefix, clock) -> None:
    # Dispatched 30 s late, the occurrence's successor (12:02) falls in a minute the
    # shard's first load read already, and not within NEAR_S: no load reads it now.
    from herdwick.actors import shard as shards
    from herdwick.clock import to_us

    job = await submit(api, schedule={"cron": "* * * * *"})
    job_id = uuid.UUID(job["jobId"])
    clock.advance(90)
    node = await schedulers()
    await node.settle()
    [entry] = await ready(redis_client, key_prefix)
    assert entry["scheduled_for"] == "2026-12-02T12:01:00Z"
    shard = node.shard(shard_of(job_id))
    await sync(shard)  # the dispatch's announcement came after the shard's last Tick
    successor = shards.entry(to_us(T0 + timedelta(minutes=2)), job_id.int)
    assert successor in shard._members


async def test_a_shard_reads_its_near_rows_again_at_the_load_after_its_first(
        schedulers, clock) -> None:
    """A notify published between a shard's first read and its first message (a shard
    moving in from another node) reached neither: the next load reads near rows again."""
    from herdwick.actors.shard import LOAD_INTERVAL_S

    node = await schedulers()
    await node.sync_notifies()  # subscribed, which marks every shard too: now nothing will
    shards = [node.shard(s) for s in sorted(node.shard_ids)]
    assert shards and all(s.missed_notify for s in shards)
    await advance(clock, LOAD_INTERVAL_S, node)
    await node.settle()
    assert not any(s.missed_notify for s in shards)


async def test_a_notify_dropped_by_a_full_mailbox_marks_its_shard(schedulers, clock) -> None:
    from herdwick.actors.base import Tick
    from herdwick.actors.messages import NotifyDue

    node = await schedulers()
    shard_id = min(node.shard_ids)
    shard = node.shard(shard_id)
    shard.missed_notify = False
    while shard.try_send(Tick()):  # no await: the actor cannot drain it meanwhile
        pass
    node._wake(shard_id, NotifyDue([(uuid.uuid4().int, 0, "t", "emails")]))
    assert shard.missed_notify


async def test_paused_and_canceled_jobs_never_dispatch(api, schedulers, redis_client,
                                                       key_prefix, clock, db) -> None:
    paused = await submit(api, name="paused", schedule={"delaySeconds": 10})
    canceled = await submit(api, name="canceled", schedule={"cron": "* * * * *"})
    node = await schedulers()
    await node.settle()  # both are in their shards' heaps now
    await api.client.post(f"/v1/jobs/{paused['jobId']}:pause", headers=api.auth())
    await api.client.delete(f"/v1/jobs/{canceled['jobId']}", headers=api.auth())
    await advance(clock, 120, node)
    await node.settle()
    assert await ready(redis_client, key_prefix) == []
    async with db.connection() as conn:
        assert await conn.fetchval("SELECT count(*) FROM executions") == 0


@pytest.mark.parametrize(("misfire", "queued", "skipped"), [("skip", 1, 9), ("catch_up", 10, 0)])
async def test_overdue_cron_after_downtime_follows_the_misfire_policy(
        api, schedulers, redis_client, key_prefix, clock, db, misfire, queued, skipped) -> None:
    job = await submit(api, schedule={"cron": "* * * * *", "misfire": misfire})
    clock.advance(10 * 60)  # down from 12:00 to 12:10: 12:01 .. 12:10 were due
    node = await schedulers()
    await node.settle()
    entries = await ready(redis_client, key_prefix)
    assert len(entries) == queued
    assert entries[-1]["scheduled_for"] == "2026-12-02T12:10:00Z"
    async with db.connection() as conn:
        states = dict(await conn.fetch(
            "SELECT state, count(*) FROM executions WHERE job_id = $1 GROUP BY state",
            job["jobId"]))
        nxt = await conn.fetchval("SELECT next_run_at FROM due_index WHERE job_id = $1",
                                  job["jobId"])
    assert states.get("queued", 0) == queued and states.get("skipped", 0) == skipped
    assert nxt == T0 + timedelta(minutes=11)


async def test_nodes_share_the_shards_and_rebalance(schedulers, clock) -> None:
    a = await schedulers("a")
    assert len(a.shard_ids) == 256
    b = await schedulers("b")
    await tick(a, b)  # a sees two nodes and gives back half; b claims them
    await tick(b)
    assert len(a.shard_ids) == len(b.shard_ids) == 128
    assert not a.shard_ids & b.shard_ids
    c = await schedulers("c")
    for _ in range(3):
        await tick(a, b, c)
    sizes = sorted(len(n.shard_ids) for n in (a, b, c))
    assert sizes == [85, 85, 86]
    assert len(a.shard_ids | b.shard_ids | c.shard_ids) == 256


async def test_a_dead_nodes_shards_are_taken_over_and_nothing_is_lost(
        api, schedulers, redis_client, key_prefix, clock) -> None:
    a = await schedulers("a")
    b = await schedulers("b")
    await tick(a, b)
    await tick(b)
    jobs = [await submit(api, name=f"j{i}", schedule={"delaySeconds": 5}) for i in range(40)]
    on_b = [j for j in jobs if shard_of(_uuid(j["jobId"])) in b.shard_ids]
    assert on_b, "some jobs land on b's shards"

    b.crash()
    b.crashed = True
    await advance(clock, 5, a)
    await a.settle()
    assert len(await ready(redis_client, key_prefix)) == len(jobs) - len(on_b)

    await advance(clock, 12, a)  # past b's lease and node heartbeat
    await tick(a)
    assert len(a.shard_ids) == 256
    await a.settle()
    published = await ready(redis_client, key_prefix)
    assert sorted(e["job_id"] for e in published) == sorted(j["jobId"] for j in jobs)


async def test_a_stale_revision_is_fenced_out(api, schedulers, redis_client, key_prefix,
                                              clock, db) -> None:
    job = await submit(api, schedule={"delaySeconds": 2})
    shard = shard_of(_uuid(job["jobId"]))
    node = await schedulers()
    await node.settle()
    # A simulated pause: while this node sleeps, its lease on the shard is taken over.
    async with db.connection() as conn:
        await conn.execute("UPDATE shard_leases SET owner = 'thief', revision = revision + 1 "
                           "WHERE shard_id = $1", shard)
    clock.advance(2)
    await node.settle()
    assert await ready(redis_client, key_prefix) == []
    async with db.connection() as conn:
        assert await conn.fetchval("SELECT count(*) FROM executions") == 0
        assert await conn.fetchval("SELECT count(*) FROM due_index") == 1
    await sync(node.coordinator)
    assert shard not in node.shard_ids


async def test_notify_puts_a_near_due_job_in_the_heap_before_the_next_load(
        api, schedulers, redis_client, key_prefix, clock) -> None:
    node = await schedulers()
    await node.settle()
    job = await submit(api, schedule={"delaySeconds": 1})
    shard = node.shard(shard_of(_uuid(job["jobId"])))
    await asyncio.wait_for(shard.notified.wait(), timeout=5)
    clock.advance(1)  # the next load is 2 s after the last one: only the notify can help
    await node.settle()
    [entry] = await ready(redis_client, key_prefix)
    assert entry["job_id"] == job["jobId"]
    assert node.lag[api.tenant_id].max_s <= 1.0


def _uuid(text: str):
    import uuid

    return uuid.UUID(text)


async def test_a_clean_stop_hands_the_shards_over_at_once(schedulers, clock) -> None:
    a = await schedulers("a")
    b = await schedulers("b")
    await tick(a, b)
    await tick(b)
    assert len(b.shard_ids) == 128
    await a.stop()
    a.crashed = True  # already stopped: the fixture must not stop it twice
    await tick(b)  # no lease expiry to wait for: a released its shards and left
    assert len(b.shard_ids) == 256


async def test_maintenance_creates_partitions_ahead_and_drops_expired_keys(
        api, schedulers, clock, db) -> None:
    await api.submit(make_job(), **{"Idempotency-Key": "old"})
    clock.advance(30 * 24 * 3600)  # a month on: the key expired, new days need partitions
    node = await schedulers()
    await sync(node.maintenance)
    day = clock.now().date()
    async with db.connection() as conn:
        for offset in range(-1, 8):
            name = f"executions_{(day + timedelta(days=offset)):%Y%m%d}"
            assert await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", name), name
        assert await conn.fetchval("SELECT count(*) FROM idempotency_keys") == 0


class _HeldQueues:
    """Takes what a shard hands over and keeps it unsettled, like fair queues with a backlog."""

    def __init__(self) -> None:
        self.readies: list = []
        self.pools: list[str] = []

    async def hand(self, pool: str, ready) -> None:
        self.readies.append(ready)
        self.pools.append(pool)


async def test_a_shard_defers_its_loads_while_its_work_waits_in_the_fair_queue(
        api, clock, db) -> None:
    from herdwick.actors.base import Tick
    from herdwick.actors.shard import (
        DEFER_AT,
        DEFER_POLL_S,
        LOAD_INTERVAL_S,
        MAX_DEFER_S,
        ShardActor,
    )

    async def due_row(seconds: float) -> None:
        job = await submit(api, schedule={"delaySeconds": seconds})  # from the test's clock
        async with db.connection() as conn:  # into shard 7, where the actor under test is
            await conn.execute("UPDATE due_index SET shard_id = 7 WHERE job_id = $1",
                               uuid.UUID(job["jobId"]))

    queues = _HeldQueues()
    shard = ShardActor(7, 1, db=db, hand=queues.hand, reject=None, clock=clock)
    await due_row(1)
    await shard.load(clock.now())
    clock.advance(1)
    await shard.handle(Tick())
    [held] = queues.readies
    assert held.handed.remaining == 1 and len(shard.heap) == 0

    # The rows below come without a notify, as if it was dropped: the load that reads
    # them is the one under test.
    await due_row(9)  # a few items waiting (steady work) do not defer a load
    shard.mark_missed()
    clock.advance(LOAD_INTERVAL_S)
    await shard.handle(Tick())
    assert len(shard.heap) == 1

    held.handed.remaining = DEFER_AT  # as many as a herd's: the next load is deferred
    await due_row(9)
    shard.mark_missed()
    clock.advance(LOAD_INTERVAL_S)
    await shard.handle(Tick())
    assert len(shard.heap) == 1
    held.handed.remaining = 0  # dispatched: the shard loads at its next poll
    clock.advance(DEFER_POLL_S)
    await shard.handle(Tick())
    assert len(shard.heap) == 2

    clock.advance(60)
    await shard.handle(Tick())  # pops both rows; this work never settles
    assert len(queues.readies) == 2 and len(shard.heap) == 0
    queues.readies[1].handed.remaining = DEFER_AT
    await due_row(9)
    shard.mark_missed()
    clock.advance(LOAD_INTERVAL_S)
    await shard.handle(Tick())
    assert len(shard.heap) == 0
    clock.advance(MAX_DEFER_S)  # a batch that never settles defers loads only so long
    await shard.handle(Tick())
    assert len(shard.heap) == 1


async def test_a_row_without_a_notify_is_read_again_at_the_periodic_re_read(
        api, clock, db) -> None:
    """Every writer announces a near-due row, so a load does not read again what an
    earlier one read; a row whose notify was lost is read (as a key) once due within
    NEAR_S, at the re-read every NEAR_REREAD_S, before it falls due."""
    from herdwick.actors.base import Tick
    from herdwick.actors.shard import LOAD_INTERVAL_S, NEAR_REREAD_S, NEAR_S, ShardActor

    queues = _HeldQueues()
    shard = ShardActor(7, 1, db=db, hand=queues.hand, reject=None, clock=clock)
    assert await shard.load(clock.now()) == 0
    job = await submit(api, schedule={"delaySeconds": 30})  # no notify reaches this actor
    async with db.connection() as conn:
        await conn.execute("UPDATE due_index SET shard_id = 7 WHERE job_id = $1",
                           uuid.UUID(job["jobId"]))
    clock.advance(LOAD_INTERVAL_S)
    assert await shard.load(clock.now()) == 0  # its minute was read: not again
    clock.advance(30 - LOAD_INTERVAL_S - NEAR_S)  # due within NEAR_S, a re-read due too
    assert 30 - NEAR_S >= NEAR_REREAD_S
    assert await shard.load(clock.now()) == 1
    assert len(shard.heap) == 1 and not queues.readies
    # Read as a key alone, it went in with its job's tenant and pool, looked up.
    clock.advance(NEAR_S)
    await shard.handle(Tick())
    [ready] = queues.readies
    assert queues.pools == ["emails"]
    assert [tenant for tenant, _ in ready.items] == [api.tenant_id]


async def test_a_dropped_notify_makes_the_next_load_read_the_near_rows_again(
        api, clock, db) -> None:
    from herdwick.actors.shard import LOAD_INTERVAL_S, NEAR_S, ShardActor

    shard = ShardActor(7, 1, db=db, hand=_HeldQueues().hand, reject=None, clock=clock)
    assert await shard.load(clock.now()) == 0
    job = await submit(api, schedule={"delaySeconds": NEAR_S - 1})
    async with db.connection() as conn:
        await conn.execute("UPDATE due_index SET shard_id = 7 WHERE job_id = $1",
                           uuid.UUID(job["jobId"]))
    clock.advance(LOAD_INTERVAL_S)
    assert await shard.load(clock.now()) == 0  # no re-read due, and no loss known
    shard.mark_missed()  # as the scheduler marks a shard whose notify it dropped
    clock.advance(LOAD_INTERVAL_S)
    assert await shard.load(clock.now()) == 1
    assert not shard.missed_notify


async def test_a_node_s_shards_load_spread_over_the_load_interval(clock, db) -> None:
    """After its first load each shard loads again at its own point of the interval (set
    by its id): a node's loads never come all at once."""
    from herdwick.actors.shard import LOAD_INTERVAL_S, ShardActor

    shards = [ShardActor(shard_id, 1, db=db, hand=_HeldQueues().hand, reject=None,
                         clock=clock) for shard_id in (0, 127, 255)]
    for shard in shards:
        await shard.on_start()
    waits = [shard.idle_timeout() for shard in shards]
    assert 0 < waits[0] < waits[1] < waits[2] == LOAD_INTERVAL_S
    assert waits[0] < LOAD_INTERVAL_S / 100
    assert abs(waits[1] - LOAD_INTERVAL_S / 2) < LOAD_INTERVAL_S / 100


def _record_loads(monkeypatch, clock) -> list[tuple[datetime, datetime | None]]:
    """Each shard load from now on, as (the clock's time, its near edge: None when it
    does not read near rows again); the loads themselves run as ever."""
    from herdwick.storage import dispatch as store

    loads: list[tuple[datetime, datetime | None]] = []
    real_load_due = store.load_due

    async def recorded(db, shard_id, horizon, near=None, *rest):
        loads.append((clock.now(), near))
        return await real_load_due(db, shard_id, horizon, near, *rest)

    monkeypatch.setattr(store, "load_due", recorded)
    return loads


async def test_an_idle_shard_loads_only_when_a_load_can_find_something(
        api, clock, db, monkeypatch) -> None:
    """Every near-due row is announced, so a shard reads again only to re-read its near
    rows (every NEAR_REREAD_S) and when the next minute enters its horizon (once a
    minute): not every LOAD_INTERVAL_S."""
    from herdwick.actors import shard as shards
    from herdwick.actors.base import Tick

    loads = _record_loads(monkeypatch, clock)
    shard = shards.ShardActor(7, 1, db=db, hand=_HeldQueues().hand, reject=None,
                              clock=clock)
    await shard.on_start()
    clock.advance(shard.idle_timeout())
    await shard.handle(Tick())  # the re-read after the first load
    assert len(loads) == 2 and shard.idle_timeout() == shards.NEAR_REREAD_S
    # A row due beyond ANNOUNCE_S (so not announced), in the minute after those read:
    # the load that reaches its minute reads it.
    job = await submit(api, schedule={"delaySeconds": shards.ANNOUNCE_S + 10})
    async with db.connection() as conn:
        await conn.execute("UPDATE due_index SET shard_id = 7 WHERE job_id = $1",
                           uuid.UUID(job["jobId"]))
    for _ in range(40):  # ticks every LOAD_INTERVAL_S up to the next minute
        clock.advance(shards.LOAD_INTERVAL_S)
        await shard.handle(Tick())
        if shard.heap:
            break
    assert len(shard.heap) == 1
    times = [at for at, _ in loads]
    minute_load = T0 + timedelta(minutes=1)
    assert minute_load <= times[-1] < minute_load + timedelta(seconds=shards.LOAD_INTERVAL_S)
    # In between, only the re-reads: one every NEAR_REREAD_S.
    between = times[2:-1]
    assert len(between) == 60 // shards.NEAR_REREAD_S - 1
    assert all((b - a).total_seconds() >= shards.NEAR_REREAD_S
               for a, b in zip(times[1:], between, strict=False))


async def test_only_a_lapsed_hand_over_makes_a_load_read_near_rows_again(
        clock, db, monkeypatch) -> None:
    """A batch the fair queues settled is forgotten; one with items left past
    HANDED_TTL_S (lost on the way) is why the next load reads the near rows again."""
    from herdwick.actors import shard as shards
    from herdwick.actors.messages import Handed
    from herdwick.clock import to_us

    loads = _record_loads(monkeypatch, clock)
    shard = shards.ShardActor(7, 1, db=db, hand=_HeldQueues().hand, reject=None,
                              clock=clock)
    await shard.load(clock.now())  # the first load re-reads: nothing was read before
    now_us = to_us(clock.now())
    shard._handed = {1: Handed(0, now_us)}  # settled
    clock.advance(shards.LOAD_INTERVAL_S)
    await shard.load(clock.now())
    assert loads[-1][1] is None and shard._handed == {}
    shard._handed = {2: Handed(1, now_us)}  # never settled
    clock.advance(shards.HANDED_TTL_S)
    await shard.load(clock.now())
    assert loads[-1][1] is not None and shard._handed == {}


async def test_a_re_read_key_whose_job_is_gone_is_passed_over(api, clock, db) -> None:
    """A due row read again as a key alone, whose job no longer exists, has no tenant or
    pool to queue it by: the load goes on without it, as its first read (a join) did."""
    from herdwick.actors.shard import LOAD_INTERVAL_S, NEAR_S, ShardActor
    from herdwick.storage.jobs import due_minute

    shard = ShardActor(7, 1, db=db, hand=_HeldQueues().hand, reject=None, clock=clock)
    assert await shard.load(clock.now()) == 0
    due = clock.now() + timedelta(seconds=NEAR_S - 1)
    async with db.connection() as conn:
        await conn.execute("INSERT INTO due_index (shard_id, due_minute, next_run_at, job_id)"
                           " VALUES (7, $1, $2, $3)", due_minute(due), due, uuid.uuid4())
    shard.mark_missed()  # so this load reads the row again
    clock.advance(LOAD_INTERVAL_S)
    assert await shard.load(clock.now()) == 0
    assert shard.heap == [] and not shard.missed_notify


async def test_work_whose_hand_over_was_lost_is_handed_again(api, clock, db) -> None:
    """A hand-over that never settles (a dispatch that died with its batch) holds its rows
    back for HANDED_TTL_S, not for good: then the shard loads and hands them again."""
    from herdwick.actors.base import Tick
    from herdwick.actors.shard import HANDED_TTL_S, LOAD_INTERVAL_S, ShardActor

    job = await submit(api, schedule={"delaySeconds": 1})
    async with db.connection() as conn:
        await conn.execute("UPDATE due_index SET shard_id = 7 WHERE job_id = $1",
                           uuid.UUID(job["jobId"]))
    queues = _HeldQueues()
    shard = ShardActor(7, 1, db=db, hand=queues.hand, reject=None, clock=clock)
    await shard.load(clock.now())
    clock.advance(1)
    await shard.handle(Tick())
    assert len(queues.readies) == 1  # handed over, and lost on the way: never settled
    clock.advance(LOAD_INTERVAL_S)
    await shard.handle(Tick())
    assert len(queues.readies) == 1  # its row is still due, but held back
    clock.advance(HANDED_TTL_S)
    await shard.handle(Tick())
    assert len(queues.readies) == 2
    again = queues.readies[1].items
    assert [work for _, work in again] == [work for _, work in queues.readies[0].items]


async def dispatcher_without_postgres(db_url: str, clock, publish):
    """A dispatch actor on a pool that is closed: every call fails as an unreachable
    Postgres does. Nothing may be fenced."""
    from herdwick.actors import dispatcher as dispatching
    from herdwick.storage.db import Database

    gone = await Database.connect(db_url)
    await gone.close()

    async def lease_lost(lost) -> None:
        raise AssertionError("nothing was fenced")

    return dispatching.DispatchActor(db=gone, node_id="n", clock=clock, publish=publish,
                                     lease_lost=lease_lost)


async def test_a_dispatch_that_fails_settles_every_batch_it_had_drained(
        db_url, clock, monkeypatch) -> None:
    """Postgres goes away mid-batch: the work in hand and all that was drained behind it
    goes back to its fair queues, none of it left unsettled."""
    from herdwick.actors import dispatcher as dispatching
    from herdwick.actors.messages import Due
    from herdwick.storage.dispatch import DueKey

    monkeypatch.setattr(dispatching, "MAX_BATCH_KEYS", 1)  # each Due its own transaction
    settled: list = []

    async def publish(pool: str, publish) -> None:
        settled.extend(publish.dues)

    actor = await dispatcher_without_postgres(db_url, clock, publish)
    dues = [Due("emails", {7: 1}, [DueKey(7, clock.now(), uuid.uuid4())], [i], 1)
            for i in range(3)]
    for due in dues[1:]:
        actor.try_send(due)  # what waits in the mailbox behind the first
    with pytest.raises(Exception):  # noqa: B017 - whatever the driver raises, it goes on up
        await actor.handle(dues[0])
    assert sorted(d.items[0] for d in settled) == [0, 1, 2]


async def test_a_dispatch_whose_commit_answer_was_lost_publishes_what_it_committed(
        api, schedulers, redis_client, key_prefix, clock, db, monkeypatch) -> None:
    """The connection dies after Postgres took the COMMIT: the rows are gone from due_index
    and the executions queued, but the dispatcher saw only an error. It publishes them as
    they are (attempt 1) once Postgres answers, not after the sweeper's grace."""
    from herdwick.errors import StorageUnavailable
    from herdwick.storage import dispatch as store

    real = store.dispatch
    lost: list[int] = []

    async def commit_then_lose_the_answer(*args, **kwargs):
        result = await real(*args, **kwargs)
        if not lost and result.queued:
            lost.append(len(result.queued))
            raise StorageUnavailable("postgres unavailable: the answer to COMMIT was lost")
        return result

    monkeypatch.setattr(store, "dispatch", commit_then_lose_the_answer)
    job = await submit(api, schedule={"delaySeconds": 30})
    node = await schedulers()
    await node.settle()
    await advance(clock, 30, node)
    for _ in range(50):  # the dispatcher's restart backoff runs on real time
        await node.settle()
        if await ready(redis_client, key_prefix):
            break
        await asyncio.sleep(0.05)
    assert lost == [1]
    [entry] = await ready(redis_client, key_prefix)
    assert (entry["job_id"], entry["attempt"]) == (job["jobId"], "1")
    assert sum(d.resolved for d in node.dispatchers) == 1
    async with db.connection() as conn:
        execution = await conn.fetchrow("SELECT * FROM executions WHERE job_id = $1",
                                        job["jobId"])
        assert (execution["state"], execution["attempt"]) == ("queued", 1)
        assert str(execution["execution_id"]) == entry["execution_id"]
        assert await conn.fetchval("SELECT count(*) FROM due_index") == 0
    await advance(clock, 60, node)  # nothing more is in doubt: published once
    await node.settle()
    assert len(await ready(redis_client, key_prefix)) == 1


async def test_work_in_doubt_waits_for_postgres_and_what_did_not_commit_is_not_published(
        db_url, clock) -> None:
    """While Postgres is away the doubt stays (each idle pass asks again and fails); a
    batch that never committed has no queued execution, so nothing is published."""
    from herdwick.actors import dispatcher as dispatching
    from herdwick.actors.messages import Due
    from herdwick.storage.db import Database
    from herdwick.storage.dispatch import DueKey

    published: list = []

    async def publish(pool: str, publish) -> None:
        published.extend(publish.items)

    actor = await dispatcher_without_postgres(db_url, clock, publish)
    due = Due("emails", {7: 1}, [DueKey(7, clock.now(), uuid.uuid4())], [0], 1)
    with pytest.raises(Exception):  # noqa: B017 - whatever the driver raises, it goes on up
        await actor.handle(due)
    assert actor.idle_timeout() == dispatching.IN_DOUBT_RETRY_S
    with pytest.raises(Exception):  # noqa: B017
        await actor.handle(None)
    assert actor.idle_timeout() == dispatching.IN_DOUBT_RETRY_S  # still in doubt
    actor._db = await Database.connect(db_url)  # Postgres is back
    try:
        await actor.handle(None)
    finally:
        await actor._db.close()
    assert actor.idle_timeout() is None
    assert published == [] and actor.resolved == 0
