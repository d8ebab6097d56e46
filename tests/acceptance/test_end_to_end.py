"""All tiers together: HTTP submit -> scheduler -> ready stream -> SDK worker -> Postgres."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest

import herdwick
from herdwick.clock import ManualClock
from tests.integration.stack import advance, submit


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(datetime.now(UTC).replace(microsecond=0))


async def wait_state(api, execution_id: str, state: str, node, timeout_s: float = 10) -> dict:
    async def poll() -> dict:
        while True:
            await node.settle_events()
            got = await (await api.client.get(f"/v1/executions/{execution_id}",
                                              headers=api.auth())).json()
            if got["state"] == state:
                return got
            await asyncio.sleep(0.02)

    return await asyncio.wait_for(poll(), timeout_s)


async def test_a_job_runs_through_every_tier(api, schedulers, services, key_prefix,
                                             clock) -> None:
    seen: list[herdwick.Context] = []
    fails_left = {"n": 1}
    worker = herdwick.Worker(services.redis_url, "emails", concurrency=4, key_prefix=key_prefix,
                             lease_s=5)

    @worker.handler
    async def send(ctx: herdwick.Context) -> dict:
        seen.append(ctx)
        if fails_left["n"]:
            fails_left["n"] -= 1
            raise RuntimeError("smtp busy")
        return {"sent_to": ctx.payload["to"]}

    job = await submit(api, schedule={"delaySeconds": 1},
                       retry={"maxAttempts": 3, "backoffSeconds": 1})
    node = await schedulers()
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run(stop))
    try:
        await advance(clock, 1, node)
        await node.settle()
        listed = await (await api.client.get(f"/v1/jobs/{job['jobId']}/executions",
                                             headers=api.auth())).json()
        [first] = listed["items"]
        await wait_state(api, first["executionId"], "retry_wait", node)
        await advance(clock, 3, node)
        await node.settle()
        done = await wait_state(api, first["executionId"], "succeeded", node)
    finally:
        stop.set()
        await asyncio.wait_for(running, 10)
    assert done["result"] == {"sent_to": "a@example.com"}
    assert [a["outcome"] for a in done["attempts"]] == ["failed", "succeeded"]
    assert done["attempts"][0]["error"]["message"] == "smtp busy"
    assert [c.attempt for c in seen] == [1, 2]
    assert {c.idempotency_key for c in seen} == {f"{job['jobId']}:{job['nextRunAt']}"}
    got = await (await api.client.get(f"/v1/jobs/{job['jobId']}", headers=api.auth())).json()
    assert got["state"] == "completed"
