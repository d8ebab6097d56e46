"""The worker protocol's Redis functions, driven as a worker and a reaper would.

Real Redis; the library is loaded from lua/ as the scheduler loads it. Lease
deadlines run on the Redis server's clock, which a test cannot move: lapsed
leases are made by writing the deadline into the past (`lapse`), except in
the GC-pause story, which waits out one real 200 ms lease.
"""

from __future__ import annotations

import asyncio
import json
import math
import uuid
from collections.abc import AsyncIterator

import msgspec
import pytest
import redis.asyncio as aioredis

from herdwick.storage import keys
from herdwick.storage.hot import HotTier, ReadyExecution
from herdwick.storage.protocol import DEAD, Event, Protocol

POOL = "emails"
GROUP = "scheduler"
HOUR_MS = 3_600_000


def make_execution(**overrides) -> ReadyExecution:
    fields = {"execution_id": str(uuid.uuid4()), "attempt": 1, "job_id": str(uuid.uuid4()),
              "tenant_id": "tenant-1", "scheduled_for": "2026-12-02T12:00:00Z",
              "payload": '{"to":"a@example.com"}', "timeout_seconds": 60,
              "max_attempts": 5, "backoff_ms": 10_000}
    fields.update(overrides)
    return ReadyExecution(**fields)


@pytest.fixture
async def hot(redis_client, key_prefix) -> HotTier:
    tier = HotTier(redis_client, key_prefix)
    await tier.load_functions()
    return tier


@pytest.fixture
def proto(hot, redis_client, key_prefix) -> Protocol:
    return Protocol(redis_client, key_prefix)


@pytest.fixture
def publish(hot):
    async def publish(**overrides) -> ReadyExecution:
        execution = make_execution(**overrides)
        assert await hot.publish({POOL: [execution]}) == 1
        return execution
    return publish


async def redis_now_ms(client: aioredis.Redis) -> int:
    seconds, micros = await client.time()
    return seconds * 1000 + micros // 1000


async def lapse(client: aioredis.Redis, prefix: str, execution_id: str) -> None:
    """Make the execution's lease deadline already past, as if its holder stalled."""
    past = await redis_now_ms(client) - 1
    await client.hset(keys.hot_state(prefix, POOL, execution_id), "lease_until", past)
    await client.zadd(keys.leases_zset(prefix, POOL), {execution_id: past})


async def hot_state(client: aioredis.Redis, prefix: str, execution_id: str) -> dict[str, str]:
    raw = await client.hgetall(keys.hot_state(prefix, POOL, execution_id))
    return {k.decode(): v.decode() for k, v in raw.items()}


async def events(proto: Protocol) -> list[Event]:
    """Everything on the pool's events stream so far, acked."""
    await proto.ensure_events_group(POOL, GROUP)
    got = await proto.read_events(POOL, GROUP, "reader", 1000, None)
    await proto.ack_events(POOL, GROUP, [e.stream_id for e in got])
    return got


async def test_a_ready_attempt_is_leased_by_one_worker(proto, publish, redis_client,
                                                       key_prefix) -> None:
    execution = await publish()
    before = await redis_now_ms(redis_client)
    until = await proto.lease(POOL, "worker-a", 30, execution.execution_id, 1)
    after = await redis_now_ms(redis_client)
    assert until is not None and before + 30_000 <= until <= after + 30_000

    assert await proto.lease(POOL, "worker-b", 30, execution.execution_id, 1) is None
    again = await proto.lease(POOL, "worker-a", 60, execution.execution_id, 1)
    assert again is not None and again >= until + 30_000  # idempotent re-lease extends

    state = await hot_state(redis_client, key_prefix, execution.execution_id)
    assert (state["state"], state["lease_owner"], int(state["lease_until"])) == \
        ("leased", "worker-a", again)
    assert await redis_client.zscore(keys.leases_zset(key_prefix, POOL),
                                     execution.execution_id) == again
    [leased] = await events(proto)  # the re-lease is not a second event
    assert (leased.type, leased.worker_id, leased.lease_until_ms) == ("leased", "worker-a", until)


async def test_unknown_or_other_attempts_are_lost(proto, publish) -> None:
    execution = await publish()
    assert await proto.lease(POOL, "w", 30, str(uuid.uuid4()), 1) is None
    assert await proto.lease(POOL, "w", 30, execution.execution_id, 2) is None
    assert await proto.lease(POOL, "w", 30, execution.execution_id, 0) is None
    assert await proto.heartbeat(POOL, execution.execution_id, 1, "w", 30) is None  # not leased
    leased, stale = await proto.lease_many(POOL, "w", 30, [(execution.execution_id, 1),
                                                           (execution.execution_id, 2)])
    assert isinstance(leased, int) and stale is None


async def test_the_batch_forms_answer_each_item_as_the_single_calls_would(
        proto, publish, redis_client, key_prefix) -> None:
    base = keys.pool_base(key_prefix, POOL)
    first, second, taken = await publish(), await publish(), await publish()
    assert await proto.lease(POOL, "worker-b", 30, taken.execution_id, 1) is not None
    replies = await redis_client.fcall(
        "hw_lease_batch", 1, base, "worker-a", "30", first.execution_id, 1,
        second.execution_id, 2, taken.execution_id, 1, second.execution_id, 1)
    assert [r if isinstance(r, bytes) else "until" for r in replies] == \
        ["until", b"LEASE_LOST", b"LEASE_LOST", "until"]  # stale attempt, held by another
    done = await redis_client.fcall(
        "hw_complete_batch", 1, base, "worker-a", first.execution_id, 1, '{"n": 1}',
        taken.execution_id, 1, "null", second.execution_id, 1, '{"n": 2}')
    assert done == [b"OK", b"LEASE_LOST", b"OK"]
    assert (await hot_state(redis_client, key_prefix, taken.execution_id))["state"] == "leased"
    # One entry a call: the single lease, then each batch call's events together.
    assert await redis_client.xlen(keys.events_stream(key_prefix, POOL)) == 3
    told = [(e.type, e.execution_id, e.worker_id, e.result) for e in await events(proto)]
    assert told == [("leased", taken.execution_id, "worker-b", None),
                    ("leased", first.execution_id, "worker-a", None),
                    ("leased", second.execution_id, "worker-a", None),
                    ("completed", first.execution_id, "worker-a", '{"n": 1}'),
                    ("completed", second.execution_id, "worker-a", '{"n": 2}')]
    with pytest.raises(aioredis.ResponseError, match="pairs"):
        await redis_client.fcall("hw_lease_batch", 1, base, "w", "30", first.execution_id)
    with pytest.raises(aioredis.ResponseError, match="triples"):
        await redis_client.fcall("hw_complete_batch", 1, base, "w", first.execution_id, 1)


async def test_publish_carries_any_payload_text_exactly(hot, redis_client, key_prefix) -> None:
    payload = '{"to": "Zoë <z@example.com>", "quote": "\\"hi\\"", "nl": "a\\nb", "n": 1e400}'
    execution = make_execution(payload=payload)
    assert await hot.publish({POOL: [execution]}) == 1
    [(_, fields)] = await redis_client.xrange(keys.ready_stream(key_prefix, POOL))
    assert fields[b"payload"].decode() == payload
    assert fields[b"attempt"] == b"1" and fields[b"timeout_seconds"] == b"60"
    assert await hot.publish({POOL: [execution]}) == 0  # the same attempt again: a no-op


async def test_publish_refuses_what_is_not_its_msgpack(hot, redis_client, key_prefix) -> None:
    base = keys.pool_base(key_prefix, POOL)
    for bad in (b"\xc1", msgspec.msgpack.encode([["only", "three", "strings"]]),
                msgspec.msgpack.encode({"a": 1}), msgspec.msgpack.encode("text")):
        with pytest.raises(aioredis.ResponseError, match="hw_publish"):
            await redis_client.fcall("hw_publish", 1, base, bad)
    assert await redis_client.exists(keys.ready_stream(key_prefix, POOL)) == 0


async def test_heartbeat_extends_only_a_live_lease_of_its_holder(proto, publish, redis_client,
                                                                 key_prefix) -> None:
    execution = await publish()
    xid = execution.execution_id
    until = await proto.lease(POOL, "worker-a", 10, xid, 1)
    extended = await proto.heartbeat(POOL, xid, 1, "worker-a", 30)
    assert extended is not None and extended >= until + 20_000

    assert await proto.heartbeat(POOL, xid, 1, "worker-b", 30) is None
    assert await proto.heartbeat(POOL, xid, 2, "worker-a", 30) is None

    await lapse(redis_client, key_prefix, xid)
    assert await proto.heartbeat(POOL, xid, 1, "worker-a", 30) is None
    assert await proto.lease(POOL, "worker-a", 30, xid, 1) is None  # a lapsed lease is the reaper's
    assert await proto.lease(POOL, "worker-b", 30, xid, 1) is None


async def test_complete_is_recorded_once(proto, publish, redis_client, key_prefix) -> None:
    execution = await publish()
    xid = execution.execution_id
    await proto.lease(POOL, "worker-a", 30, xid, 1)
    assert await proto.complete(POOL, xid, 1, "worker-a", '{"sent":true}') is True

    assert await proto.complete(POOL, xid, 1, "worker-a", '{"sent":true}') is False
    assert await proto.heartbeat(POOL, xid, 1, "worker-a", 30) is None
    assert await proto.fail(POOL, xid, 1, "worker-a", "{}", True) is None
    # What stays of a finished attempt: its number and state, for a minute.
    assert await hot_state(redis_client, key_prefix, xid) == {"attempt": "1", "state": "done"}
    assert 0 < await redis_client.pttl(keys.hot_state(key_prefix, POOL, xid)) <= 60_000
    assert await redis_client.zcard(keys.leases_zset(key_prefix, POOL)) == 0
    _, completed = await events(proto)
    assert (completed.type, completed.worker_id, completed.result) == \
        ("completed", "worker-a", '{"sent":true}')
    assert await publish_again(proto, execution) == 0  # a done attempt is not revived


async def publish_again(proto: Protocol, execution: ReadyExecution) -> int:
    return await HotTier(proto.client, proto.prefix).publish({POOL: [execution]})


@pytest.mark.parametrize(("attempt", "backoff_ms", "d"), [
    (1, 10_000, 10_000),
    (2, 10_000, 20_000),
    (3, 10_000, 40_000),
    (2, 3_000_000, HOUR_MS),  # 6,000,000 capped at an hour before the jitter
])
async def test_a_retryable_failure_waits_out_its_backoff(proto, publish, redis_client, key_prefix,
                                                         attempt, backoff_ms, d) -> None:
    execution = await publish(attempt=attempt, backoff_ms=backoff_ms, max_attempts=10)
    xid = execution.execution_id
    await proto.lease(POOL, "worker-a", 30, xid, attempt)
    before = await redis_now_ms(redis_client)
    retry_at = await proto.fail(POOL, xid, attempt, "worker-a", '{"message":"smtp 451"}', True)
    after = await redis_now_ms(redis_client)

    assert isinstance(retry_at, int)
    assert before + math.ceil(d / 2) <= retry_at <= after + d
    assert (await hot_state(redis_client, key_prefix, xid))["state"] == "retry_wait"
    assert await proto.complete(POOL, xid, attempt, "worker-a", "{}") is False
    _, failed = await events(proto)
    assert (failed.type, failed.attempt, failed.error, failed.retryable, failed.outcome,
            failed.retry_at_ms) == ("failed", attempt, '{"message":"smtp 451"}', True, "retry",
                                    retry_at)


async def test_a_herd_failing_together_does_not_retry_together(proto, hot) -> None:
    herd = [make_execution(backoff_ms=10_000) for _ in range(8)]
    await hot.publish({POOL: herd})
    for execution in herd:
        await proto.lease(POOL, "worker-a", 30, execution.execution_id, 1)
    retry_ats = [await proto.fail(POOL, e.execution_id, 1, "worker-a", "{}", True) for e in herd]
    assert len(set(retry_ats)) > 1


async def test_a_permanent_failure_is_dead_at_once(proto, publish, redis_client,
                                                   key_prefix) -> None:
    execution = await publish(max_attempts=5)
    await proto.lease(POOL, "worker-a", 30, execution.execution_id, 1)
    assert await proto.fail(POOL, execution.execution_id, 1, "worker-a",
                            '{"message":"bad address"}', False) == DEAD
    assert (await hot_state(redis_client, key_prefix, execution.execution_id))["state"] == "dead"
    _, failed = await events(proto)
    assert (failed.retryable, failed.outcome, failed.retry_at_ms) == (False, "dead", None)


async def test_the_last_attempt_is_dead(proto, publish) -> None:
    execution = await publish(attempt=3, max_attempts=3)
    await proto.lease(POOL, "worker-a", 30, execution.execution_id, 3)
    assert await proto.fail(POOL, execution.execution_id, 3, "worker-a", "{}", True) == DEAD


async def test_a_lapsed_lease_expires_as_a_failed_attempt(proto, publish, redis_client,
                                                          key_prefix) -> None:
    stalled, live = await publish(), await publish()
    await proto.lease(POOL, "worker-a", 30, stalled.execution_id, 1)
    await proto.lease(POOL, "worker-b", 30, live.execution_id, 1)
    await lapse(redis_client, key_prefix, stalled.execution_id)

    assert await proto.expire(POOL, 100) == [stalled.execution_id]
    assert await proto.expire(POOL, 100) == []
    assert await proto.heartbeat(POOL, stalled.execution_id, 1, "worker-a", 30) is None
    assert await proto.complete(POOL, stalled.execution_id, 1, "worker-a", "{}") is False
    assert await proto.heartbeat(POOL, live.execution_id, 1, "worker-b", 30) is not None
    assert await redis_client.zrange(keys.leases_zset(key_prefix, POOL), 0, -1) == \
        [live.execution_id.encode()]
    expired = [e for e in await events(proto) if e.type == "expired"]
    assert [(e.execution_id, e.worker_id, json.loads(e.error), e.retryable, e.outcome)
            for e in expired] == [(stalled.execution_id, "worker-a",
                                   {"type": "LeaseExpired", "message": "lease expired"},
                                   True, "retry")]
    assert expired[0].retry_at_ms is not None


async def test_an_expired_last_attempt_is_dead(proto, publish, redis_client, key_prefix) -> None:
    poison = await publish(attempt=2, max_attempts=2)
    await proto.lease(POOL, "worker-a", 30, poison.execution_id, 2)
    await lapse(redis_client, key_prefix, poison.execution_id)
    assert await proto.expire(POOL, 1) == [poison.execution_id]
    assert (await hot_state(redis_client, key_prefix, poison.execution_id))["state"] == "dead"
    [*_, expired] = await events(proto)
    assert (expired.type, expired.outcome, expired.retry_at_ms) == ("expired", "dead", None)


async def test_the_next_attempt_goes_to_whoever_leases_it(proto, publish) -> None:
    first = await publish()
    await proto.lease(POOL, "worker-a", 30, first.execution_id, 1)
    assert isinstance(await proto.fail(POOL, first.execution_id, 1, "worker-a", "{}", True), int)

    await publish(execution_id=first.execution_id, job_id=first.job_id, attempt=2)
    assert await proto.lease(POOL, "worker-b", 30, first.execution_id, 2) is not None
    assert await proto.lease(POOL, "worker-a", 30, first.execution_id, 1) is None
    assert await proto.complete(POOL, first.execution_id, 2, "worker-b", "{}") is True


async def test_cancel_takes_the_attempt_from_its_holder(proto, publish, redis_client,
                                                        key_prefix) -> None:
    running, waiting = await publish(), await publish()
    await proto.lease(POOL, "worker-a", 30, running.execution_id, 1)

    await proto.cancel(POOL, running.execution_id)
    await proto.cancel(POOL, waiting.execution_id)
    await proto.cancel(POOL, running.execution_id)  # idempotent
    await proto.cancel(POOL, str(uuid.uuid4()))  # unknown: nothing to do

    assert await proto.heartbeat(POOL, running.execution_id, 1, "worker-a", 30) is None
    assert await proto.complete(POOL, running.execution_id, 1, "worker-a", "{}") is False
    assert await proto.fail(POOL, running.execution_id, 1, "worker-a", "{}", True) is None
    assert await proto.lease(POOL, "worker-b", 30, waiting.execution_id, 1) is None
    assert await redis_client.zcard(keys.leases_zset(key_prefix, POOL)) == 0
    assert await publish_again(proto, running) == 0  # a canceled attempt is not revived
    canceled = [(e.execution_id, e.worker_id) for e in await events(proto)
                if e.type == "canceled"]
    assert canceled == [(running.execution_id, "worker-a"), (waiting.execution_id, "")]


async def test_the_events_stream_tells_each_attempt_in_order(proto, publish) -> None:
    assert await proto.read_events(POOL, GROUP, "reader", 10, None) == []  # group made on demand
    execution = await publish(backoff_ms=1_000)
    xid = execution.execution_id
    await proto.lease(POOL, "worker-a", 30, xid, 1)
    await proto.heartbeat(POOL, xid, 1, "worker-a", 30)
    retry_at = await proto.fail(POOL, xid, 1, "worker-a", '{"message":"timeout"}', True)
    await publish(execution_id=xid, job_id=execution.job_id, attempt=2, backoff_ms=1_000)
    until = await proto.lease(POOL, "worker-b", 30, xid, 2)
    await proto.complete(POOL, xid, 2, "worker-b", '{"id":42}')

    got = await proto.read_events(POOL, GROUP, "reader", 10, None)
    assert [(e.type, e.attempt, e.worker_id) for e in got] == [
        ("leased", 1, "worker-a"), ("failed", 1, "worker-a"),
        ("leased", 2, "worker-b"), ("completed", 2, "worker-b")]
    for e in got:
        assert (e.execution_id, e.job_id, e.tenant_id, e.scheduled_for) == \
            (xid, execution.job_id, "tenant-1", "2026-12-02T12:00:00Z")
    assert [e.at_ms for e in got] == sorted(e.at_ms for e in got)
    assert got[1].retry_at_ms == retry_at and got[2].lease_until_ms == until
    assert got[3].result == '{"id":42}' and got[3].error is None

    # Unacked events are replayed to a restarted reader; acked ones are not.
    replay = await proto.read_events(POOL, GROUP, "reader", 10, None, from_id="0")
    assert [e.stream_id for e in replay] == [e.stream_id for e in got]
    assert await proto.ack_events(POOL, GROUP, [e.stream_id for e in got]) == 4
    assert await proto.read_events(POOL, GROUP, "reader", 10, None, from_id="0") == []


async def test_gc_pause(proto, publish, hot, redis_client) -> None:
    """Worker A stalls past its lease; the reaper re-queues attempt 2; B completes it;
    A wakes, and its complete and heartbeat are refused, each a `stale` event."""
    execution = await publish(backoff_ms=0)
    xid = execution.execution_id
    a_until = await proto.lease(POOL, "worker-a", 0.2, xid, 1)

    # A pauses. Redis time passes its lease (the one real wait in this file).
    await asyncio.sleep((a_until - await redis_now_ms(redis_client)) / 1000 + 0.02)
    assert await redis_now_ms(redis_client) > a_until

    assert await proto.expire(POOL, 100) == [xid]
    await publish(execution_id=xid, job_id=execution.job_id, attempt=2, backoff_ms=0)
    assert await proto.lease(POOL, "worker-b", 30, xid, 2) is not None
    assert await proto.complete(POOL, xid, 2, "worker-b", '{"sent":true}') is True

    # A wakes up and carries on as if nothing happened.
    assert await proto.complete(POOL, xid, 1, "worker-a", '{"sent":true}') is False
    assert await proto.heartbeat(POOL, xid, 1, "worker-a", 30) is None

    got = await events(proto)
    assert [(e.type, e.attempt, e.worker_id) for e in got] == [
        ("leased", 1, "worker-a"), ("expired", 1, "worker-a"),
        ("leased", 2, "worker-b"), ("completed", 2, "worker-b"),
        ("stale", 1, "worker-a"), ("stale", 1, "worker-a")]
    assert [e.call for e in got[-2:]] == ["complete", "heartbeat"]


@pytest.fixture
async def plain_client(services, hot) -> AsyncIterator[aioredis.Redis]:
    """RESP2, decoded, with redis-py's reply parsing switched off: what any client sees."""
    client = aioredis.from_url(services.redis_url, protocol=2, decode_responses=True)
    client.response_callbacks.clear()
    try:
        yield client
    finally:
        await client.aclose()


async def test_a_worker_needs_only_plain_redis_commands(plain_client, publish, proto,
                                                        key_prefix) -> None:
    execution = await publish(payload='{"n":21}')
    # Built from CONTRACT.md by hand, as a worker in another language would.
    base = f"{key_prefix}:{{{POOL}}}"
    r = plain_client.execute_command

    [[stream, [[message_id, flat]]]] = await r(
        "XREADGROUP", "GROUP", "workers", "raw-1", "COUNT", "10", "BLOCK", "100",
        "STREAMS", f"{base}:ready", ">")
    message = dict(zip(flat[::2], flat[1::2], strict=True))
    assert stream == f"{base}:ready"
    xid, attempt = message["execution_id"], message["attempt"]
    assert isinstance(await r("FCALL", "hw_lease", "1", base, "raw-1", "30", xid, attempt), int)
    assert await r("XACK", f"{base}:ready", "workers", message_id) == 1

    result = json.dumps({"doubled": json.loads(message["payload"])["n"] * 2})
    assert isinstance(await r("FCALL", "hw_heartbeat", "1", base, xid, attempt, "raw-1", "30"),
                      int)
    assert await r("FCALL", "hw_complete", "1", base, xid, attempt, "raw-1", result) == "OK"
    assert await r("FCALL", "hw_complete", "1", base, xid, attempt, "raw-1", result) == \
        "LEASE_LOST"

    [_, completed] = await events(proto)
    assert (completed.type, completed.execution_id, completed.worker_id, completed.result) == \
        ("completed", execution.execution_id, "raw-1", '{"doubled": 42}')


async def test_a_settled_outcome_leaves_redis_in_seconds_and_a_live_attempt_stays(
        proto, publish, redis_client, key_prefix) -> None:
    done, live = await publish(), await publish()
    for execution in (done, live):
        await proto.lease(POOL, "worker-a", 30, execution.execution_id, 1)
    assert await proto.complete(POOL, done.execution_id, 1, "worker-a", "{}") is True
    done_key = keys.hot_state(key_prefix, POOL, done.execution_id)
    live_key = keys.hot_state(key_prefix, POOL, live.execution_id)
    assert 10_000 < await redis_client.pttl(done_key) <= 60_000  # Postgres has not applied it
    await proto.ensure_events_group(POOL, GROUP)
    got = await proto.read_events(POOL, GROUP, "reader", 1000, None)
    # As the event actor acks: the done one is final, the live one is named too and
    # must be left alone (only a finished hash is shortened).
    await proto.ack_events(POOL, GROUP, [e.stream_id for e in got],
                           [done.execution_id, live.execution_id])
    assert 0 < await redis_client.pttl(done_key) <= 10_000
    assert await redis_client.pttl(live_key) > 60_000
    assert (await hot_state(redis_client, key_prefix, done.execution_id))["state"] == "done"
    # A late republish of the finished attempt, within those seconds, is still a no-op.
    hot = HotTier(redis_client, key_prefix)
    assert await hot.publish({POOL: [done]}) == 0


async def test_hw_recover_restores_only_what_redis_forgot(proto, publish, redis_client,
                                                          key_prefix) -> None:
    """A worker's completions sent again after a loss: one Redis forgot becomes done, with
    a `completed` event marked recovered; so does one a failover took back to before the
    completion (still ready at that attempt, or still leased by this worker). Done ones,
    another worker's lease and later attempts are left alone."""
    others = await publish()
    await proto.lease(POOL, "w2", 30, others.execution_id, 1)
    mine = await publish()
    await proto.lease(POOL, "w", 30, mine.execution_id, 1)
    unleased = await publish()
    done = await publish()
    await proto.lease(POOL, "w", 30, done.execution_id, 1)
    await proto.complete(POOL, done.execution_id, 1, "w", "{}")
    await events(proto)  # what came before
    base = keys.pool_base(key_prefix, POOL)
    forgotten = "01a24300-0000-7000-8000-000000000001"

    def fields(execution_id: str) -> list:
        return [execution_id, 1, "job", "tenant", "2026-12-02T12:00:00Z", 1000, 2000, '{"ok":1}']

    sent = [others, mine, unleased, done]
    assert await redis_client.fcall(
        "hw_recover", 1, base, "w", *(f for e in sent for f in fields(e.execution_id)),
        *fields(forgotten)) == 3

    async def state(execution_id: str) -> bytes | None:
        return await redis_client.hget(keys.hot_state(key_prefix, POOL, execution_id), "state")

    assert await redis_client.hgetall(keys.hot_state(key_prefix, POOL, forgotten)) == {
        b"attempt": b"1", b"state": b"done"}
    assert await state(others.execution_id) == b"leased"
    assert [await state(e.execution_id) for e in (mine, unleased, done)] == [b"done"] * 3
    # A recovered lease no longer waits to be reaped.
    assert await redis_client.zscore(keys.leases_zset(key_prefix, POOL),
                                     mine.execution_id) is None
    got = await events(proto)
    assert sorted(e.execution_id for e in got) == sorted(
        [mine.execution_id, unleased.execution_id, forgotten])
    recovered = next(e for e in got if e.execution_id == forgotten)
    assert (recovered.type, recovered.worker_id, recovered.at_ms, recovered.started_ms,
            recovered.result) == ("completed", "w", 2000, 1000, '{"ok":1}')
    # Recovered once is known: a second send changes nothing, and the attempt it
    # finished can no longer be leased.
    assert await redis_client.fcall("hw_recover", 1, base, "w", *fields(forgotten),
                                    *fields(unleased.execution_id)) == 0
    assert await proto.lease(POOL, "w3", 30, unleased.execution_id, 1) is None
    with pytest.raises(aioredis.ResponseError, match="8 fields"):
        await redis_client.fcall("hw_recover", 1, base, "w", forgotten, 1)
