"""One bad row never stops an actor: it records why on the row and goes on with the rest.

Each story plants a row that earlier releases could write (or that Postgres
refuses) beside ordinary ones, and checks that the ordinary ones run and the
bad one ends dead with its reason, visible through the API.
"""

from __future__ import annotations

import json
import uuid
from datetime import timedelta

from herdwick.actors.sweeper import RECOVERY_GRACE_S
from herdwick.storage import keys
from herdwick.storage.protocol import Protocol
from tests.conftest import T0
from tests.integration.stack import advance, ready, submit, sweep_after_redis_lost

SHARD = 7


async def _same_shard(db, *job_ids: str) -> None:
    """Move the jobs' due rows into one shard, so one load and one batch hold them all."""
    async with db.connection() as conn:
        await conn.execute("UPDATE due_index SET shard_id = $1 WHERE job_id = ANY($2::uuid[])",
                           SHARD, list(job_ids))


async def _execution_of(api, job_id: str) -> dict:
    resp = await api.client.get(f"/v1/jobs/{job_id}/executions", headers=api.auth())
    assert resp.status == 200
    [item] = (await resp.json())["items"]
    return item


async def _job(api, job_id: str) -> dict:
    resp = await api.client.get(f"/v1/jobs/{job_id}", headers=api.auth())
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def test_a_due_row_without_a_finite_time_is_recorded_and_its_shard_runs_on(
        api, schedulers, redis_client, key_prefix, clock, db) -> None:
    good = await submit(api, name="good", schedule={"delaySeconds": 5})
    bad = await submit(api, name="bad", schedule={"delaySeconds": 5})
    await _same_shard(db, good["jobId"], bad["jobId"])
    async with db.connection() as conn:  # what runAt 0001-01-01 used to store
        await conn.execute("UPDATE due_index SET next_run_at = '-infinity', "
                           "due_minute = '-infinity' WHERE job_id = $1", bad["jobId"])
        await conn.execute("UPDATE jobs SET next_run_at = '-infinity' WHERE job_id = $1",
                           bad["jobId"])

    node = await schedulers()  # its shard's first load meets the bad row
    await advance(clock, 5, node)
    await node.settle()

    [entry] = await ready(redis_client, key_prefix)
    assert entry["job_id"] == good["jobId"]
    dead = await _execution_of(api, bad["jobId"])
    assert dead["state"] == "dead"
    assert dead["error"]["type"] == "UnloadableDueRow"
    assert dead["scheduledFor"] == "2026-12-02T12:00:00Z"  # when it was found
    assert (await _job(api, bad["jobId"]))["state"] == "completed"
    async with db.connection() as conn:
        assert await conn.fetchval("SELECT count(*) FROM due_index") == 0


async def test_a_schedule_that_no_longer_evaluates_fails_alone(
        api, schedulers, redis_client, key_prefix, clock, db) -> None:
    good = await submit(api, name="good", schedule={"cron": "* * * * *"})
    bad = await submit(api, name="bad", schedule={"cron": "* * * * *"})
    await _same_shard(db, good["jobId"], bad["jobId"])
    async with db.connection() as conn:  # stored by a release whose parser took it
        await conn.execute("""UPDATE jobs SET schedule = '{"cron": "61 * * * *", "tz": "UTC"}'
                              WHERE job_id = $1""", bad["jobId"])
    node = await schedulers()
    await advance(clock, 60, node)
    await node.settle()

    assert [e["job_id"] for e in await ready(redis_client, key_prefix)] == [good["jobId"]]
    dead = await _execution_of(api, bad["jobId"])
    assert (dead["state"], dead["error"]["type"]) == ("dead", "DispatchFailed")
    assert "ScheduleError" in dead["error"]["message"]
    assert dead["scheduledFor"] == bad["nextRunAt"]
    job = await _job(api, bad["jobId"])
    assert (job["state"], job["nextRunAt"]) == ("active", None)  # a cron job: its owner decides
    async with db.connection() as conn:
        good_next = await conn.fetchval("SELECT next_run_at FROM due_index WHERE job_id = $1",
                                        good["jobId"])
    assert good_next == T0 + timedelta(minutes=2)


async def test_a_row_postgres_refuses_is_isolated_from_its_batch(
        api, schedulers, redis_client, key_prefix, clock, db) -> None:
    jobs = [await submit(api, name=f"j{i}", schedule={"delaySeconds": 5}) for i in range(9)]
    bad = jobs[4]
    await _same_shard(db, *(j["jobId"] for j in jobs))
    async with db.connection() as conn:  # Postgres will refuse this one's execution
        await conn.execute(f"ALTER TABLE executions ADD CONSTRAINT refuse_one CHECK "
                           f"(job_id <> '{bad['jobId']}' OR state = 'dead')")
    node = await schedulers()
    await advance(clock, 5, node)
    await node.settle()

    published = sorted(e["job_id"] for e in await ready(redis_client, key_prefix))
    assert published == sorted(j["jobId"] for j in jobs if j is not bad)
    dead = await _execution_of(api, bad["jobId"])
    assert (dead["state"], dead["error"]["type"]) == ("dead", "DispatchRejected")
    assert "refuse_one" in dead["error"]["message"]
    assert sum(d.failed for d in node.dispatchers) == 1


async def test_the_sweeper_records_what_it_cannot_republish_and_sweeps_the_rest(
        api, schedulers, redis_client, key_prefix, clock, db) -> None:
    node = await schedulers()
    good = await submit(api, name="good", schedule={"delaySeconds": 1})
    bad = await submit(api, name="bad", schedule={"delaySeconds": 1})
    await advance(clock, 1, node)
    await node.settle()
    async with db.connection() as conn:
        await conn.execute("UPDATE executions SET scheduled_for = '-infinity' WHERE job_id = $1",
                           bad["jobId"])
    # The hot tier lost both; the loss seen, the workers' turn comes first.
    assert await sweep_after_redis_lost(node, redis_client, key_prefix, clock) == 0

    [entry] = await ready(redis_client, key_prefix)
    assert (entry["job_id"], entry["attempt"]) == (good["jobId"], "2")
    async with db.connection() as conn:
        row = await conn.fetchrow("SELECT state, error::text AS error FROM executions "
                                  "WHERE job_id = $1", bad["jobId"])
    assert row["state"] == "dead"
    assert json.loads(row["error"])["type"] == "UnpublishableExecution"
    assert (await _job(api, bad["jobId"]))["state"] == "completed"


async def test_an_event_postgres_refuses_still_lands_without_its_worker_text(
        api, schedulers, redis_client, key_prefix, clock, db) -> None:
    """A worker in another language leases with a NUL in its id: Postgres text refuses it."""
    node = await schedulers()
    jobs = [await submit(api, name=f"j{i}", schedule={"delaySeconds": 1}) for i in range(3)]
    await advance(clock, 1, node)
    await node.settle()
    entries = await ready(redis_client, key_prefix)
    protocol = Protocol(redis_client, key_prefix)
    for i, entry in enumerate(entries):
        worker = "bad\x00worker" if i == 1 else f"worker-{i}"
        assert await protocol.lease("emails", worker, 30, entry["execution_id"], 1)
        assert await protocol.complete("emails", entry["execution_id"], 1, worker, '"done"')
    await node.settle_events()

    assert len(entries) == len(jobs)
    for i, entry in enumerate(entries):
        resp = await api.client.get(f"/v1/executions/{entry['execution_id']}",
                                    headers=api.auth())
        execution = await resp.json()
        assert execution["state"] == "succeeded"
        assert execution["startedAt"] is not None
        [attempt] = execution["attempts"]
        if i == 1:
            assert execution["error"]["type"] == "EventRejected"
            assert attempt["workerId"] is None
        else:
            assert execution["result"] == "done"
            assert attempt["workerId"] == f"worker-{i}"
        assert attempt["outcome"] == "succeeded"


async def test_a_scheduler_starts_though_its_sweeper_meets_a_bad_row_first(
        api, schedulers, redis_client, key_prefix, clock, db) -> None:
    job = await submit(api, schedule={"delaySeconds": 1})
    async with db.connection() as conn:
        execution_id = uuid.uuid4()
        await conn.execute(
            "INSERT INTO executions (execution_id, job_id, tenant_id, scheduled_for, attempt, "
            "state, queued_at) VALUES ($1, $2, $3, '-infinity', 1, 'queued', $4)",
            execution_id, uuid.UUID(job["jobId"]), uuid.UUID(api.tenant_id),
            T0 - timedelta(hours=1))
    node = await schedulers()  # the sweeper's first pass runs in its start: a new epoch
    assert node.sweeper is not None
    clock.advance(RECOVERY_GRACE_S)  # the workers' turn to recover, then the sweep
    await node.sweeper.run_once()
    async with db.connection() as conn:
        assert await conn.fetchval("SELECT state FROM executions WHERE execution_id = $1",
                                   execution_id) == "dead"
    assert await redis_client.exists(keys.epoch_key(key_prefix))
