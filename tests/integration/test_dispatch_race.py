"""Concurrent dispatchers racing on the same due rows: exactly one execution per occurrence.

And a dispatcher racing a pause: a retry it claimed behind the pause's lock is held, not run.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from datetime import timedelta

from herdwick.actors.dispatcher import plan
from herdwick.ids import shard_of
from herdwick.storage import dispatch, executions, leases
from herdwick.storage.dispatch import DueKey
from herdwick.storage.executions import ExecutionUpdate
from herdwick.storage.sql import q
from tests.conftest import T0
from tests.integration.conftest import Api, make_job, waiting_on_a_lock

SCENARIOS = 12


async def _submit_herd(api: Api, count: int) -> list[dict]:
    jobs = []
    for i in range(count):
        schedule = ({"cron": "*/5 * * * *"} if i % 3 == 0 else
                    {"runAt": (T0 + timedelta(seconds=i % 7)).isoformat()})
        jobs.append(make_job(name=f"r{i}", schedule=schedule))
    resp = await api.client.post("/v1/jobs:batch", json={"jobs": jobs}, headers=api.auth())
    assert resp.status == 201, await resp.text()
    return (await resp.json())["items"]


async def _racer(db, revisions, keys, rng: random.Random, now) -> int:
    await asyncio.sleep(rng.random() * 0.01)
    result = await dispatch.dispatch(db, "racer", revisions, keys, now,
                                     lambda claimed: plan(claimed, now))
    return len(result.queued)


async def test_racing_dispatchers_create_one_execution_per_occurrence(api: Api, db) -> None:
    items = await _submit_herd(api, 60)
    now = T0 + timedelta(minutes=5)
    held = await leases.claim(db, "racer", 256, 3600, now - timedelta(seconds=1))
    revisions = {lease.shard_id: lease.revision for lease in held}
    async with db.connection() as conn:
        rows = await conn.fetch("SELECT shard_id, next_run_at, job_id FROM due_index")
    all_keys = [DueKey(r["shard_id"], r["next_run_at"], r["job_id"]) for r in rows]
    assert len(all_keys) == 60

    queued_total = 0
    rng = random.Random(20261202)
    pending = list(all_keys)
    for _ in range(SCENARIOS):
        if not pending:
            break
        # Several dispatchers, each with a random, overlapping, shuffled share of the rows.
        sample = rng.sample(pending, k=min(len(pending), rng.randint(3, 15)))
        racers, taken = [], set()
        for _ in range(rng.randint(2, 5)):
            mine = rng.sample(sample, k=rng.randint(1, len(sample)))
            rng.shuffle(mine)
            taken.update(mine)
            racers.append(_racer(db, revisions, mine, rng, now))
        queued_total += sum(await asyncio.gather(*racers))
        pending = [k for k in pending if k not in taken]
    # Whatever no scenario drew goes in one last pass.
    queued_total += await _racer(db, revisions, pending, rng, now)

    async with db.connection() as conn:
        per_occurrence = await conn.fetch(
            "SELECT job_id, scheduled_for, count(*) AS n FROM executions "
            "GROUP BY job_id, scheduled_for")
        successors = await conn.fetch("SELECT job_id, next_run_at FROM due_index")
    assert all(r["n"] == 1 for r in per_occurrence)
    assert len(per_occurrence) == 60 == queued_total
    cron_ids = {uuid.UUID(i["jobId"]) for n, i in enumerate(items) if n % 3 == 0}
    assert {r["job_id"] for r in successors} == cron_ids
    assert all(r["next_run_at"] == T0 + timedelta(minutes=10) for r in successors)
    assert all(shard_of(j) in revisions for j in cron_ids)


async def _retry_rows(db) -> list[tuple[bool, int]]:
    """(parked, attempt) of each due row that retries an execution."""
    async with db.connection() as conn:
        rows = await conn.fetch("SELECT due_minute = 'infinity' AS parked, attempt FROM due_index "
                                "WHERE execution_id IS NOT NULL")
    return [(r["parked"], r["attempt"]) for r in rows]


async def test_a_retry_claimed_behind_a_pause_is_parked_not_started(api: Api, db) -> None:
    resp = await api.submit(make_job(schedule={"runAt": T0.isoformat()},
                                     retry={"maxAttempts": 3, "backoffSeconds": 10}))
    job_id, tenant_id = uuid.UUID((await resp.json())["jobId"]), uuid.UUID(api.tenant_id)
    held = await leases.claim(db, "racer", 256, 3600, T0 - timedelta(seconds=1))
    revisions = {lease.shard_id: lease.revision for lease in held}

    async def dispatch_at(now, due):
        key = DueKey(shard_of(job_id), due, job_id)
        return await dispatch.dispatch(db, "racer", revisions, [key], now,
                                       lambda claimed: plan(claimed, now))

    # The occurrence runs and its first attempt fails: the retry is due 10 s on.
    [first] = (await dispatch_at(T0, T0)).queued
    retry_at = T0 + timedelta(seconds=10)
    await executions.apply(db, [ExecutionUpdate(
        execution_id=str(first.execution_id), scheduled_for=first.scheduled_for, attempt=1,
        state="retry_wait", job_id=str(job_id), retry_at=retry_at)], [], T0, shard_of,
        lambda *_: None)

    # A pause (the statements of storage.jobs.transition_job) has locked the job's due rows
    # when the retry falls due; the dispatcher claiming it waits, and the pause commits.
    async with db.transaction() as pause:
        await pause.execute(q("lock_due_rows"), job_id)
        await pause.fetchrow(q("lock_job"), tenant_id, job_id)
        await pause.execute(q("delete_due_occurrences"), job_id)
        await pause.fetchrow(q("set_job_state"), tenant_id, job_id, "paused", T0, T0, False)
        racer = asyncio.create_task(dispatch_at(retry_at, retry_at))
        await waiting_on_a_lock(db)
    assert (await racer).queued == []  # the pause won: the retry did not start
    assert await _retry_rows(db) == [(True, 2)]  # held for the resume, out of every load

    resumed = await api.client.post(f"/v1/jobs/{job_id}:resume", headers=api.auth())
    assert resumed.status == 200
    assert await _retry_rows(db) == [(False, 2)]
    later = retry_at + timedelta(seconds=5)
    [retry] = (await dispatch_at(later, retry_at)).queued
    assert (retry.execution_id, retry.attempt) == (first.execution_id, 2)
