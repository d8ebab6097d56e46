"""A trigger of a one-off job is an extra run: the job's own occurrence still stands.

Workers are played through storage.protocol, as in test_execution_tier.py; time
moves through the fake clock (started at real time: leases use the Redis clock).
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from herdwick.clock import ManualClock
from herdwick.storage.protocol import Protocol
from tests.integration.conftest import Api
from tests.integration.stack import advance, ready, submit

POOL = "emails"


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(datetime.now(UTC).replace(microsecond=0))


async def _job(api: Api, job_id: str) -> dict:
    return await (await api.client.get(f"/v1/jobs/{job_id}", headers=api.auth())).json()


async def _run(node, clock, protocol: Protocol, redis_client, key_prefix, seconds: float,
               outcome: str = "complete") -> str:
    """Time passes, the next published execution is leased and finished; its id."""
    await advance(clock, seconds, node)
    await node.settle()
    entry = (await ready(redis_client, key_prefix))[-1]
    eid = entry["execution_id"]
    assert await protocol.lease(POOL, "w", 30, eid, 1) is not None
    if outcome == "complete":
        assert await protocol.complete(POOL, eid, 1, "w", "{}") is True
    else:
        await protocol.fail(POOL, eid, 1, "w", '{"message": "no"}', False)
    await node.settle_events()
    return eid


@pytest.mark.parametrize("outcome", ["complete", "dead"])
async def test_a_triggered_run_leaves_the_one_off_active_until_its_own_run(
        api: Api, schedulers, redis_client, key_prefix, clock, db, outcome) -> None:
    protocol = Protocol(redis_client, key_prefix)
    job = await submit(api, schedule={"delaySeconds": 90})
    node = await schedulers()

    # Triggered now: that execution runs and finishes (succeeds, or dies at once)...
    resp = await api.client.post(f"/v1/jobs/{job['jobId']}:trigger", headers=api.auth())
    triggered = (await resp.json())["executionId"]
    assert await _run(node, clock, protocol, redis_client, key_prefix, 1, outcome) == triggered

    # ...and the job is still active, its scheduled occurrence still due.
    got = await _job(api, job["jobId"])
    assert (got["state"], got["nextRunAt"]) == ("active", job["nextRunAt"])
    async with db.connection() as conn:
        due = await conn.fetch("SELECT next_run_at, execution_id FROM due_index "
                               "WHERE job_id = $1", got["jobId"])
    assert [(r["next_run_at"].isoformat().replace("+00:00", "Z"), r["execution_id"])
            for r in due] == [(job["nextRunAt"], None)]

    # The scheduled occurrence runs at its time, and its end completes the job.
    scheduled = await _run(node, clock, protocol, redis_client, key_prefix, 90)
    assert scheduled != triggered
    got = await _job(api, job["jobId"])
    assert (got["state"], got["nextRunAt"]) == ("completed", None)
