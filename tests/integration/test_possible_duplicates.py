""""Did my job run twice?": a lapsed or replaced attempt's late calls are recorded on its
execution, and the calls that are no sign of a second run are not.

Workers are played through storage.protocol, as in test_execution_tier.py.
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from herdwick.clock import ManualClock
from herdwick.storage import keys
from herdwick.storage.protocol import Protocol
from tests.integration.stack import advance, ready, submit
from tests.integration.test_execution_tier import POOL, execution, lapse


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(datetime.now(UTC).replace(microsecond=0))


@pytest.fixture
def protocol(redis_client, key_prefix) -> Protocol:
    return Protocol(redis_client, key_prefix)


async def leased_one(api, schedulers, protocol, redis_client, key_prefix, clock,
                     **spec) -> tuple[object, str]:
    await submit(api, schedule={"delaySeconds": 1},
                 retry={"maxAttempts": 3, "backoffSeconds": 1}, **spec)
    node = await schedulers()
    await advance(clock, 2, node)
    await node.settle()
    eid = (await ready(redis_client, key_prefix))[-1]["execution_id"]
    assert await protocol.lease(POOL, "worker-a", 30, eid, 1) is not None
    return node, eid


def calls(got: dict) -> list[tuple]:
    return [(d["attempt"], d["workerId"], d["call"], d["count"]) for d in got["possibleDuplicates"]]


async def test_a_lapsed_lease_s_complete_is_recorded_before_the_reaper_comes(
        api, schedulers, protocol, redis_client, key_prefix, clock) -> None:
    node, eid = await leased_one(api, schedulers, protocol, redis_client, key_prefix, clock)
    await lapse(redis_client, key_prefix, eid)
    assert await protocol.complete(POOL, eid, 1, "worker-a", "{}") is False
    assert await protocol.complete(POOL, eid, 1, "worker-a", "{}") is False  # resent
    await node.settle_events()
    got = await execution(api, eid)
    assert calls(got) == [(1, "worker-a", "complete", 2)]
    assert got["possibleDuplicates"][0]["firstAt"] <= got["possibleDuplicates"][0]["lastAt"]
    assert node.events.stale_recorded == 2


async def test_a_reaped_attempt_s_fail_is_recorded(api, schedulers, protocol, redis_client,
                                                  key_prefix, clock) -> None:
    node, eid = await leased_one(api, schedulers, protocol, redis_client, key_prefix, clock)
    await lapse(redis_client, key_prefix, eid)
    assert await node.reaper.run_once() == 1
    assert await protocol.fail(POOL, eid, 1, "worker-a", "{}", True) is None
    await node.settle_events()
    assert calls(await execution(api, eid)) == [(1, "worker-a", "fail", 1)]


async def test_calls_that_are_no_second_run_are_not_recorded(api, schedulers, protocol,
                                                            redis_client, key_prefix,
                                                            clock) -> None:
    node, eid = await leased_one(api, schedulers, protocol, redis_client, key_prefix, clock)
    # Its own fail, then a heartbeat that raced it: the attempt simply ended.
    assert isinstance(await protocol.fail(POOL, eid, 1, "worker-a", "{}", True), int)
    assert await protocol.heartbeat(POOL, eid, 1, "worker-a", 30) is None
    # Another worker's calls for an attempt it never held, and for one not yet published.
    assert await protocol.complete(POOL, eid, 1, "worker-b", "{}") is False
    assert await protocol.complete(POOL, eid, 2, "worker-a", "{}") is False
    await node.settle_events()
    assert (await execution(api, eid))["possibleDuplicates"] == []
    assert node.events.stale_recorded == 0


async def test_a_resent_complete_after_success_is_not_recorded(api, schedulers, protocol,
                                                              redis_client, key_prefix,
                                                              clock) -> None:
    node, eid = await leased_one(api, schedulers, protocol, redis_client, key_prefix, clock)
    assert await protocol.complete(POOL, eid, 1, "worker-a", "{}") is True
    assert await protocol.complete(POOL, eid, 1, "worker-a", "{}") is False  # its reply was lost
    await node.settle_events()
    got = await execution(api, eid)
    assert (got["state"], got["possibleDuplicates"]) == ("succeeded", [])


async def test_calls_after_a_cancel_are_not_recorded(api, schedulers, protocol, redis_client,
                                                    key_prefix, clock) -> None:
    node, eid = await leased_one(api, schedulers, protocol, redis_client, key_prefix, clock)
    job_id = (await ready(redis_client, key_prefix))[-1]["job_id"]
    assert (await api.client.delete(f"/v1/jobs/{job_id}", headers=api.auth())).status == 204
    assert await protocol.heartbeat(POOL, eid, 1, "worker-a", 30) is None
    await node.settle_events()
    assert (await execution(api, eid))["possibleDuplicates"] == []


async def test_when_redis_forgot_the_execution_postgres_judges(api, schedulers, protocol,
                                                               redis_client, key_prefix,
                                                               clock) -> None:
    node, eid = await leased_one(api, schedulers, protocol, redis_client, key_prefix, clock)
    await lapse(redis_client, key_prefix, eid)
    assert await node.reaper.run_once() == 1
    await node.settle_events()
    await advance(clock, 3, node)
    await node.settle()
    assert await protocol.lease(POOL, "worker-b", 30, eid, 2) is not None
    assert await protocol.complete(POOL, eid, 2, "worker-b", "{}") is True
    await node.settle_events()
    await redis_client.delete(keys.hot_state(key_prefix, POOL, eid))  # its TTL ran out
    # A's late complete of attempt 1 still counts (attempt 2 ran); B's resend does not.
    assert await protocol.complete(POOL, eid, 1, "worker-a", "{}") is False
    assert await protocol.complete(POOL, eid, 2, "worker-b", "{}") is False
    await node.settle_events()
    assert calls(await execution(api, eid)) == [(1, "worker-a", "complete", 1)]
