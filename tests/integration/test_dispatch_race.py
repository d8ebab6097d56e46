"""Concurrent dispatchers racing on the same due rows: exactly one execution per occurrence."""

from __future__ import annotations

import asyncio
import random
from datetime import timedelta

from actors.dispatcher import plan
from herdwick.ids import shard_of
from storage import dispatch, leases
from storage.dispatch import DueKey
from tests.conftest import T0
from tests.integration.conftest import Api, make_job

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
    import uuid

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
