"""A tenant's maxActiveJobs reads a kept count (migration 0011), not a count of its jobs.

Every way a job starts or stops being live must move the count exactly as the jobs move:
each story here ends by comparing the kept count with the jobs themselves.
"""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from herdwick.clock import ManualClock
from herdwick.errors import QuotaExceeded, StorageUnavailable
from herdwick.model import TenantPatch, TenantSpec
from herdwick.storage.jobs import NewJob, Transition, insert_jobs, transition_job
from herdwick.storage.protocol import Protocol
from herdwick.storage.sql import q
from herdwick.storage.tenants import create_tenant, get_tenant, patch_tenant
from tests.integration.conftest import Api, make_job
from tests.integration.stack import advance, queue_job, ready, submit, sweep_after_redis_lost

POOL = "emails"


@pytest.fixture
def clock() -> ManualClock:  # leases and retries go by the Redis server's clock
    return ManualClock(datetime.now(UTC).replace(microsecond=0))


async def counted(db, tenant_id: uuid.UUID) -> tuple[int | None, int]:
    """(the kept count, its changes folded as a submit folds them; the live jobs)."""
    async with db.transaction() as conn:
        kept = await conn.fetchval(q("quota_live"), tenant_id)
        live = await conn.fetchval(q("count_live_jobs"), tenant_id)
    return kept, live


async def limited(api: Api, quota: int) -> tuple[str, uuid.UUID]:
    made = await api.create_tenant("limited", maxActiveJobs=quota)
    return made["apiKey"], uuid.UUID(made["tenantId"])


async def test_the_count_follows_every_way_a_job_stops_being_live(
        api, schedulers, redis_client, key_prefix, clock, db) -> None:
    key, tenant_id = await limited(api, 5)
    ok = await submit(api, key, name="ok", schedule={"delaySeconds": 1})
    bad = await submit(api, key, name="bad", schedule={"delaySeconds": 1})
    await submit(api, key, name="dry", schedule={"delaySeconds": 1}, dryRun=True)
    paused = await submit(api, key, name="paused", schedule={"cron": "0 0 * * *"})
    await submit(api, key, name="kept", schedule={"cron": "0 0 * * *"})
    assert (await api.submit(make_job(), key=key)).status == 429
    assert await counted(db, tenant_id) == (5, 5)

    resp = await api.client.post(f"/v1/jobs/{paused['jobId']}:pause", headers=api.auth(key))
    assert resp.status == 200, await resp.text()
    assert await counted(db, tenant_id) == (5, 5)  # paused still counts
    resp = await api.client.delete(f"/v1/jobs/{paused['jobId']}", headers=api.auth(key))
    assert resp.status == 204, await resp.text()
    assert await counted(db, tenant_id) == (4, 4)

    node = await schedulers()
    await advance(clock, 1, node)
    await node.settle()  # the dry one-off completes as it is dispatched
    assert await counted(db, tenant_id) == (3, 3)
    protocol = Protocol(redis_client, key_prefix)
    runs = {e["job_id"]: e["execution_id"] for e in await ready(redis_client, key_prefix)}
    await protocol.lease(POOL, "w", 30, runs[ok["jobId"]], 1)
    await protocol.complete(POOL, runs[ok["jobId"]], 1, "w", "{}")
    await protocol.lease(POOL, "w", 30, runs[bad["jobId"]], 1)
    await protocol.fail(POOL, runs[bad["jobId"]], 1, "w", '{"message": "no"}', False)
    await node.settle_events()
    assert await counted(db, tenant_id) == (1, 1)

    for i in range(4):
        await submit(api, key, name=f"more{i}")
    assert (await api.submit(make_job(), key=key)).status == 429
    assert await counted(db, tenant_id) == (5, 5)


async def test_rows_the_dispatcher_and_the_sweeper_give_up_on_leave_the_count(
        api, schedulers, redis_client, key_prefix, clock, db) -> None:
    """fail_claimed (a due row that cannot be dispatched) and fail_executions (an execution
    the sweeper cannot republish) complete one-offs too."""
    key, tenant_id = await limited(api, 5)
    unloadable = await submit(api, key, name="unloadable", schedule={"delaySeconds": 1})
    async with db.connection() as conn:
        await conn.execute("UPDATE due_index SET next_run_at = '-infinity', "
                           "due_minute = '-infinity' WHERE job_id = $1", unloadable["jobId"])
    node = await schedulers()
    await advance(clock, 1, node)
    await node.settle()
    assert await counted(db, tenant_id) == (0, 0)

    unsweepable = await submit(api, key, name="unsweepable", schedule={"delaySeconds": 1})
    await advance(clock, 1, node)
    await node.settle()
    async with db.connection() as conn:
        await conn.execute("UPDATE executions SET scheduled_for = '-infinity' WHERE job_id = $1",
                           unsweepable["jobId"])
    await sweep_after_redis_lost(node, redis_client, key_prefix, clock)
    async with db.connection() as conn:
        error = await conn.fetchval("SELECT error::text FROM executions WHERE job_id = $1",
                                    unsweepable["jobId"])
    assert json.loads(error)["type"] == "UnpublishableExecution"
    assert await counted(db, tenant_id) == (0, 0)


def one_job(now: datetime) -> list[NewJob]:
    return [queue_job(now + timedelta(hours=1), now)]


async def test_setting_a_quota_counts_the_jobs_already_there_and_lifting_it_forgets(
        db, clock) -> None:
    now = clock.now()
    tenant_id = (await create_tenant(db, TenantSpec(name="t"), now)).tenant_id
    for _ in range(3):
        await insert_jobs(db, tenant_id, one_job(now), now=now)
    assert (await counted(db, tenant_id))[0] is None  # no quota, no count kept

    await patch_tenant(db, tenant_id, TenantPatch(max_active_jobs=4))
    assert await counted(db, tenant_id) == (3, 3)
    await insert_jobs(db, tenant_id, one_job(now), now=now, max_active_jobs=4)
    with pytest.raises(QuotaExceeded):
        await insert_jobs(db, tenant_id, one_job(now), now=now, max_active_jobs=4)

    await patch_tenant(db, tenant_id, TenantPatch(max_active_jobs=None))
    assert (await counted(db, tenant_id))[0] is None
    # A key cached before the quota was lifted still carries it: the jobs are counted.
    with pytest.raises(QuotaExceeded):
        await insert_jobs(db, tenant_id, one_job(now), now=now, max_active_jobs=4)


async def test_setting_a_quota_waits_for_a_job_ending_in_flight(db, clock) -> None:
    """A cancel not yet committed when the quota is set: the count must not hold the job,
    nor lose it if the cancel rolls back. The recount waits for the cancel's transaction."""
    now = clock.now()
    tenant_id = (await create_tenant(db, TenantSpec(name="t"), now)).tenant_id
    await insert_jobs(db, tenant_id, one_job(now), now=now)
    async with db.connection() as conn:
        job_id = await conn.fetchval("SELECT job_id FROM jobs WHERE tenant_id = $1", tenant_id)
    async with db.connection() as canceling:
        cancel = canceling.transaction()
        await cancel.start()
        await canceling.fetchrow(q("set_job_state"), tenant_id, job_id, "canceled", None, now,
                                 True)
        setting = asyncio.create_task(patch_tenant(db, tenant_id, TenantPatch(max_active_jobs=9)))
        await waiting_on_a_lock(db)
        assert not setting.done()
        await cancel.commit()
        await setting
    assert await counted(db, tenant_id) == (0, 0)


async def test_setting_a_quota_gives_up_on_a_transaction_that_stays_in_the_way(
        db, clock) -> None:
    """The recount's lock holds every submit and completion back while it waits, so it
    waits 200 ms at a time; past its deadline the PATCH is 503 and changes nothing."""
    now = clock.now()
    tenant_id = (await create_tenant(db, TenantSpec(name="t"), now)).tenant_id
    await insert_jobs(db, tenant_id, one_job(now), now=now)
    other = (await create_tenant(db, TenantSpec(name="other"), now)).tenant_id
    async with db.connection() as conn:
        job_id = await conn.fetchval("SELECT job_id FROM jobs WHERE tenant_id = $1", tenant_id)
    async with db.connection() as slow:
        held = slow.transaction()
        await held.start()  # a cancel whose commit is slow
        await slow.fetchrow(q("set_job_state"), tenant_id, job_id, "canceled", None, now, True)
        setting = asyncio.create_task(
            patch_tenant(db, tenant_id, TenantPatch(max_active_jobs=9), within_s=3))
        await waiting_on_a_lock(db)
        # Another tenant's submit waits out one try at most, not the PATCH's deadline.
        await insert_jobs(db, other, one_job(now), now=now)
        assert not setting.done()
        with pytest.raises(StorageUnavailable, match="nothing was changed"):
            await setting
        await held.rollback()
    assert (await get_tenant(db, tenant_id)).max_active_jobs is None
    assert (await counted(db, tenant_id))[0] is None
    await patch_tenant(db, tenant_id, TenantPatch(max_active_jobs=9))
    assert await counted(db, tenant_id) == (1, 1)


async def test_lifting_a_quota_takes_turns_with_a_submits_quota_check(db, clock) -> None:
    """Lifting deletes the count row and then the changes; a submit's check deletes the
    changes and then updates the count row. Held at the count row together, the two
    deadlocked (seen in CI) until lifting took the submits' quota lock first."""
    now = clock.now()
    spec = TenantSpec(name="t", max_active_jobs=9)
    tenant_id = (await create_tenant(db, spec, now)).tenant_id
    await insert_jobs(db, tenant_id, one_job(now), now=now, max_active_jobs=9)  # a change
    async with db.connection() as holder:
        held = holder.transaction()
        await held.start()
        await holder.execute("SELECT 1 FROM quota_counts WHERE tenant_id = $1 FOR UPDATE",
                             tenant_id)
        lifting = asyncio.create_task(
            patch_tenant(db, tenant_id, TenantPatch(max_active_jobs=None)))
        await waiting_on_a_lock(db)
        submitting = asyncio.create_task(
            insert_jobs(db, tenant_id, one_job(now), now=now, max_active_jobs=9))
        await waiting_on_a_lock(db, backends=2)
        await held.commit()
        await asyncio.gather(lifting, submitting)
    assert (await counted(db, tenant_id))[0] is None
    async with db.connection() as conn:
        assert await conn.fetchval(q("count_live_jobs"), tenant_id) == 2


async def waiting_on_a_lock(db, *, backends: int = 1) -> None:
    """Until that many other backends of this database wait on a heavyweight lock."""
    async with db.connection() as conn:
        for _ in range(500):
            if await conn.fetchval("SELECT count(DISTINCT pid) FROM pg_locks l "
                                   "JOIN pg_stat_activity a USING (pid) WHERE NOT l.granted "
                                   "AND a.datname = current_database()") >= backends:
                return
            await asyncio.sleep(0.01)
    raise AssertionError(f"fewer than {backends} backends waited on a lock")


async def test_the_count_holds_through_submits_cancels_and_quota_changes_at_once(
        db, clock) -> None:
    """Submits and cancels on a few connections while the quota is set and lifted again
    and again: the kept count ends where the jobs are. The last change is a set, with
    submits and cancels after it, and no recount at the end, so what the last recount
    or anything after it missed shows. (Without the recount's lock this failed 1 run in
    12; test_setting_a_quota_waits_for_a_job_ending_in_flight holds that race open.)"""
    now = clock.now()
    spec = TenantSpec(name="busy", max_active_jobs=1_000_000)
    tenant_id = (await create_tenant(db, spec, now)).tenant_id
    rng = random.Random(20261207)
    cancel = Transition(state="canceled", next_run_at=None, clear_due="all",
                        cancel_executions=True)
    quotas_done = asyncio.Event()

    async def until_after_quotas(step) -> None:
        after = 0
        while after < 10:
            await step()
            after += quotas_done.is_set()

    async def submit() -> None:
        await insert_jobs(db, tenant_id, [queue_job(now + timedelta(hours=1), now)
                                          for _ in range(rng.randint(1, 5))],
                          now=now, max_active_jobs=1_000_000)

    async def cancel_one() -> None:
        async with db.connection() as conn:
            job_id = await conn.fetchval(
                "SELECT job_id FROM jobs WHERE tenant_id = $1 AND state = 'active' "
                "ORDER BY random() LIMIT 1", tenant_id)
        if job_id is not None:
            await transition_job(db, tenant_id, job_id, now,
                                 lambda job, _: cancel if job.state == "active" else None)

    async def quotas() -> None:
        for i in range(24):
            quota = None if i % 4 == 1 else 1_000_000
            await patch_tenant(db, tenant_id, TenantPatch(max_active_jobs=quota))
        quotas_done.set()

    await asyncio.gather(until_after_quotas(submit), until_after_quotas(submit),
                         until_after_quotas(cancel_one), until_after_quotas(cancel_one),
                         quotas())
    kept, live = await counted(db, tenant_id)
    assert kept == live > 0
