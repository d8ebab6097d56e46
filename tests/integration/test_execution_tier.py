"""The execution tier end to end: leases, retries, dead letters, history, sweeper, cancel.

Workers here are played through storage.protocol (the same FCALLs any
worker makes), so each step of a story is explicit. Retry times come from
the Redis server's clock, so this module's fake clock starts at real time.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import UTC, datetime

import msgspec
import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from herdwick.actors import shard as shards
from herdwick.actors.sweeper import RECOVERY_GRACE_S
from herdwick.clock import ManualClock, to_us
from herdwick.ids import shard_of
from herdwick.storage import keys
from herdwick.storage.protocol import Protocol
from tests.integration.conftest import Api
from tests.integration.stack import advance, ready, submit

POOL = "emails"
# A failure's retry is announced to its shard as it commits (actors/executions.py), so a
# test that acts on a waiting retry gives it a delay (15-30 s) that its action comes before.
SLOW_RETRY = {"maxAttempts": 3, "backoffSeconds": 30}
PAST_SLOW_RETRY_S = 40


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(datetime.now(UTC).replace(microsecond=0))


@pytest.fixture
def protocol(redis_client, key_prefix) -> Protocol:
    return Protocol(redis_client, key_prefix)


async def lapse(redis_client, key_prefix: str, execution_id: str) -> None:
    """Make a live lease look expired to the reaper: what a long GC pause does."""
    hot = keys.hot_state(key_prefix, POOL, execution_id)
    await redis_client.hset(hot, "lease_until", 1)
    await redis_client.zadd(keys.pool_base(key_prefix, POOL) + ":leases", {execution_id: 1})


async def due_and_published(node, clock, seconds: float = 2) -> None:
    await advance(clock, seconds, node)
    await node.settle()


async def latest(redis_client, key_prefix) -> dict:
    return (await ready(redis_client, key_prefix))[-1]


async def execution(api: Api, execution_id: str) -> dict:
    resp = await api.client.get(f"/v1/executions/{execution_id}", headers=api.auth())
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def test_the_gc_pause_story(api, schedulers, protocol, redis_client, key_prefix,
                                  clock) -> None:
    job = await submit(api, schedule={"delaySeconds": 1},
                       retry={"maxAttempts": 3, "backoffSeconds": 1})
    node = await schedulers()
    await due_and_published(node, clock)
    first = await latest(redis_client, key_prefix)
    eid = first["execution_id"]

    # Worker A leases attempt 1, then stops heartbeating past its lease (a GC pause).
    assert await protocol.lease(POOL, "worker-a", 30, eid, 1) is not None
    await node.settle_events()
    assert (await execution(api, eid))["state"] == "running"
    await lapse(redis_client, key_prefix, eid)

    # The reaper counts the lapsed lease as a failed attempt; attempt 2 is re-queued.
    assert await node.reaper.run_once() == 1
    await node.settle_events()
    assert (await execution(api, eid))["state"] == "retry_wait"
    await due_and_published(node, clock, 3)
    second = await latest(redis_client, key_prefix)
    assert (second["execution_id"], second["attempt"]) == (eid, "2")

    # Worker B takes attempt 2 and completes it.
    assert await protocol.lease(POOL, "worker-b", 30, eid, 2) is not None
    assert await protocol.complete(POOL, eid, 2, "worker-b", '{"sent": true}') is True

    # A wakes up: its heartbeat and its complete are refused.
    assert await protocol.heartbeat(POOL, eid, 1, "worker-a", 30) is None
    assert await protocol.complete(POOL, eid, 1, "worker-a", '{"sent": true}') is False

    await node.settle_events()
    got = await execution(api, eid)
    assert got["jobId"] == job["jobId"]
    assert (got["state"], got["attempt"], got["result"]) == ("succeeded", 2, {"sent": True})
    assert [(a["attempt"], a["workerId"], a["outcome"]) for a in got["attempts"]] == [
        (1, "worker-a", "expired"), (2, "worker-b", "succeeded")]
    assert got["attempts"][0]["error"] == {"type": "LeaseExpired", "message": "lease expired"}
    assert all(a["leaseUntil"] > a["startedAt"] for a in got["attempts"])
    # ...and the execution says A may have acted beside B: a possible duplicate.
    assert [(d["attempt"], d["workerId"], d["call"], d["count"])
            for d in got["possibleDuplicates"]] == [(1, "worker-a", "heartbeat", 1),
                                                    (1, "worker-a", "complete", 1)]
    one_off = await (await api.client.get(f"/v1/jobs/{job['jobId']}", headers=api.auth())).json()
    assert one_off["state"] == "completed"


async def test_a_poison_job_reaches_dead_letters_with_growing_gaps(
        api, schedulers, protocol, redis_client, key_prefix, clock) -> None:
    await submit(api, schedule={"delaySeconds": 1}, retry={"maxAttempts": 3, "backoffSeconds": 1})
    node = await schedulers()
    await due_and_published(node, clock)
    eid = (await latest(redis_client, key_prefix))["execution_id"]
    gaps = []
    for attempt in (1, 2, 3):
        assert await protocol.lease(POOL, "w", 30, eid, attempt) is not None
        reply = await protocol.fail(POOL, eid, attempt, "w",
                                    json.dumps({"type": "Boom", "message": f"try {attempt}"}),
                                    True)
        await node.settle_events()
        if attempt < 3:
            gaps.append(reply)
            await due_and_published(node, clock, 2 ** attempt + 1)
            assert (await latest(redis_client, key_prefix))["attempt"] == str(attempt + 1)
        else:
            assert reply == "DEAD"
    events = await redis_client.xrange(keys.events_stream(key_prefix, POOL))
    assert events == []  # applied and acked: the events stream stays bounded
    got = await execution(api, eid)
    assert got["state"] == "dead" and got["error"]["message"] == "try 3"
    assert [a["outcome"] for a in got["attempts"]] == ["failed"] * 3
    dead = await (await api.client.get("/v1/dead-letters", headers=api.auth())).json()
    assert [d["executionId"] for d in dead["items"]] == [eid]

    # Replay: the same execution runs again with the next attempt.
    resp = await api.client.post(f"/v1/executions/{eid}:retry", headers=api.auth())
    assert resp.status == 202
    await due_and_published(node, clock, 1)
    replayed = await latest(redis_client, key_prefix)
    assert (replayed["execution_id"], replayed["attempt"]) == (eid, "4")
    again = await api.client.post(f"/v1/executions/{eid}:retry", headers=api.auth())
    assert again.status == 409


async def last_event_at_ms(redis_client, key_prefix: str) -> int:
    """When the pool's latest event happened, by the Redis server's clock."""
    [(_, fields)] = (await redis_client.xrange(keys.events_stream(key_prefix, POOL)))[-1:]
    return int(msgspec.json.decode(fields[b"e"])["at_ms"])


async def failed_once(api, node, protocol, redis_client, key_prefix, clock):
    """A one-off published, leased and failed at attempt 1 with a 1 s backoff; -> its
    retry's heap key, its shard's actor (`notified` cleared before the failure) and its
    execution id."""
    job = await submit(api, schedule={"delaySeconds": 1},
                       retry={"maxAttempts": 2, "backoffSeconds": 1})
    await due_and_published(node, clock)
    eid = (await latest(redis_client, key_prefix))["execution_id"]
    job_id = uuid.UUID(job["jobId"])
    shard = node.shard(shard_of(job_id))
    shard.notified.clear()  # the submit's own notify has come and gone
    assert await protocol.lease(POOL, "w", 30, eid, 1) is not None
    retry_at_ms = await protocol.fail(POOL, eid, 1, "w", '{"type": "Boom", "message": "x"}',
                                      True)
    return shards.entry(int(retry_at_ms) * 1000, job_id.int), shard, eid


def took(shard, key: int) -> bool:
    """In the heap, or already popped for its due time."""
    return key in shard._members or key in shard._recent


async def test_a_retry_goes_into_its_shard_s_heap_as_it_commits_not_at_the_next_load(
        api, schedulers, protocol, redis_client, key_prefix, clock) -> None:
    # A retry due before the shard's next load would otherwise start that much late.
    node = await schedulers()
    key, shard, _ = await failed_once(api, node, protocol, redis_client, key_prefix, clock)
    await node.settle_events()  # the clock stands still: no shard loads meanwhile
    await asyncio.wait_for(shard.notified.wait(), 5)
    assert took(shard, key)


async def test_a_retry_whose_notify_is_lost_still_reaches_this_node_s_shard(
        api, schedulers, protocol, redis_client, key_prefix, clock, monkeypatch) -> None:
    # Another node's shard would find it at its next re-read of near rows
    # (test_a_row_without_a_notify_is_read_again_at_the_periodic_re_read).
    node = await schedulers()

    async def lost(messages) -> None:
        raise RedisConnectionError("publish failed")

    monkeypatch.setattr(node.events._hot, "notify", lost)
    key, shard, eid = await failed_once(api, node, protocol, redis_client, key_prefix, clock)
    await node.settle_events()  # the clock stands still: no shard loads meanwhile
    assert (await execution(api, eid))["state"] == "retry_wait"  # committed and acked all
    assert await redis_client.xrange(keys.events_stream(key_prefix, POOL)) == []  # the same
    await asyncio.wait_for(shard.notified.wait(), 5)
    assert took(shard, key)
    await due_and_published(node, clock, 1.5)
    retried = await latest(redis_client, key_prefix)
    assert (retried["execution_id"], retried["attempt"]) == (eid, "2")


async def test_retry_delays_grow_exponentially_within_their_window(
        api, schedulers, protocol, redis_client, key_prefix, clock) -> None:
    await submit(api, schedule={"delaySeconds": 1}, retry={"maxAttempts": 5, "backoffSeconds": 4})
    node = await schedulers()
    await due_and_published(node, clock)
    eid = (await latest(redis_client, key_prefix))["execution_id"]
    for attempt in (1, 2, 3):
        await protocol.lease(POOL, "w", 30, eid, attempt)
        retry_at_ms = await protocol.fail(POOL, eid, attempt, "w", '{"message": "x"}', True)
        failed_at_ms = await last_event_at_ms(redis_client, key_prefix)
        d_ms = 4000 * 2 ** (attempt - 1)
        assert d_ms / 2 <= retry_at_ms - failed_at_ms <= d_ms
        await node.settle_events()
        await due_and_published(node, clock, d_ms / 1000 + 1)


async def defer(redis_client, key_prefix: str, eid: str, attempt: int, delay_ms: int) -> int:
    """A worker defers its leased attempt (`herdwick.Defer`); -> when it comes back (ms)."""
    return await redis_client.fcall("hw_fail", 1, keys.pool_base(key_prefix, POOL), eid,
                                    attempt, "w", '{"message": "busy"}', "1", str(delay_ms), "1")


async def test_deferred_attempts_do_not_grow_the_backoff(
        api, schedulers, protocol, redis_client, key_prefix, clock) -> None:
    # A deferral is not a try: after three, the first failure draws the first try's delay
    # (2-4 s with a 4 s backoff), not the fourth's (16-32 s), as an outage's deferrals
    # would otherwise push a job's next retry out by up to an hour.
    await submit(api, schedule={"delaySeconds": 1}, retry={"maxAttempts": 2, "backoffSeconds": 4})
    node = await schedulers()
    await due_and_published(node, clock)
    eid = (await latest(redis_client, key_prefix))["execution_id"]
    for attempt in (1, 2, 3):
        await protocol.lease(POOL, "w", 30, eid, attempt)
        assert isinstance(await defer(redis_client, key_prefix, eid, attempt, 100), int)
        await node.settle_events()
        await due_and_published(node, clock, 2)
        assert (await latest(redis_client, key_prefix))["attempt"] == str(attempt + 1)
    await protocol.lease(POOL, "w", 30, eid, 4)
    retry_at_ms = await protocol.fail(POOL, eid, 4, "w", '{"message": "x"}', True)
    failed_at_ms = await last_event_at_ms(redis_client, key_prefix)
    assert 2000 <= retry_at_ms - failed_at_ms <= 4000
    # The second try fails for good: maxAttempts counts tries, deferrals aside.
    await node.settle_events()
    await due_and_published(node, clock, 5)
    await protocol.lease(POOL, "w", 30, eid, 5)
    assert await protocol.fail(POOL, eid, 5, "w", '{"message": "x"}', True) == "DEAD"


async def test_a_deferral_goes_into_its_shard_s_heap_as_it_commits(
        api, schedulers, protocol, redis_client, key_prefix, clock) -> None:
    # Defer(seconds) waits exactly that: its due row is announced as a retry's is.
    job = await submit(api, schedule={"delaySeconds": 1},
                       retry={"maxAttempts": 3, "backoffSeconds": 1})
    node = await schedulers()
    await due_and_published(node, clock)
    eid = (await latest(redis_client, key_prefix))["execution_id"]
    job_id = uuid.UUID(job["jobId"])
    shard = node.shard(shard_of(job_id))
    shard.notified.clear()
    await protocol.lease(POOL, "w", 30, eid, 1)
    retry_at_ms = await defer(redis_client, key_prefix, eid, 1, 700)
    await node.settle_events()
    assert (await execution(api, eid))["state"] == "retry_wait"
    await asyncio.wait_for(shard.notified.wait(), 5)
    assert took(shard, shards.entry(int(retry_at_ms) * 1000, job_id.int))


async def test_a_report_that_is_not_json_is_kept_as_text_and_blocks_nothing(
        api, schedulers, redis_client, key_prefix, clock) -> None:
    # Another language's worker may report anything; one bad report must not fail every batch.
    await submit(api, name="a", schedule={"delaySeconds": 1})
    await submit(api, name="b", schedule={"delaySeconds": 1})
    await submit(api, name="c", schedule={"delaySeconds": 1})
    node = await schedulers()
    await due_and_published(node, clock)
    base = keys.pool_base(key_prefix, POOL)
    entries = await redis_client.xrange(keys.ready_stream(key_prefix, POOL))
    ids = [fields[b"execution_id"].decode() for _, fields in entries]
    reports = [b"not json", b'"bad \xff bytes"', b'{"nul": "a\\u0000b"}']
    for eid, report in zip(ids, reports, strict=True):
        await redis_client.fcall("hw_lease", 1, base, "w", "30", eid, 1)
        assert await redis_client.fcall("hw_complete", 1, base, eid, 1, "w", report) == b"OK"
    await node.settle_events()
    got = [await execution(api, eid) for eid in ids]
    assert [g["state"] for g in got] == ["succeeded"] * 3
    assert [g["result"] for g in got] == ["not json", "bad \ufffd bytes", {"nul": "a\ufffdb"}]


async def test_history_times_are_the_redis_servers(api, schedulers, protocol, redis_client,
                                                   key_prefix, clock) -> None:
    async def redis_now() -> datetime:
        seconds, micros = await redis_client.time()
        return datetime.fromtimestamp(seconds + micros // 1000 / 1000, UTC)

    await submit(api, schedule={"delaySeconds": 1})
    node = await schedulers()
    await due_and_published(node, clock)
    eid = (await latest(redis_client, key_prefix))["execution_id"]
    before = await redis_now()
    until_ms = await protocol.lease(POOL, "w", 30, eid, 1)
    await node.settle_events()
    running = await execution(api, eid)
    assert running["state"] == "running"
    started = datetime.fromisoformat(running["startedAt"])
    assert before <= started <= await redis_now()
    assert running["attempts"][0]["startedAt"] == running["startedAt"]
    await protocol.complete(POOL, eid, 1, "w", "{}")
    after = await redis_now()
    await node.settle_events()
    done = await execution(api, eid)
    finished = datetime.fromisoformat(done["finishedAt"])
    assert done["startedAt"] == running["startedAt"] and started <= finished <= after
    assert done["attempts"][0]["finishedAt"] == done["finishedAt"]
    assert until_ms - 30_000 <= started.timestamp() * 1000 <= until_ms


async def test_a_permanent_failure_dead_letters_at_once(api, schedulers, protocol, redis_client,
                                                        key_prefix, clock) -> None:
    await submit(api, schedule={"delaySeconds": 1})
    node = await schedulers()
    await due_and_published(node, clock)
    eid = (await latest(redis_client, key_prefix))["execution_id"]
    await protocol.lease(POOL, "w", 30, eid, 1)
    hot = keys.hot_state(key_prefix, POOL, eid)
    assert await protocol.fail(POOL, eid, 1, "w", '{"message": "bad input"}', False) == "DEAD"
    assert await redis_client.pttl(hot) > 10_000  # Postgres has not got it yet: a minute
    await node.settle_events()
    assert (await execution(api, eid))["state"] == "dead"
    # Once Postgres has the outcome, Redis keeps the finished attempt only seconds.
    assert 0 < await redis_client.pttl(hot) <= 10_000


async def test_replaying_a_batch_of_events_changes_nothing(api, schedulers, protocol,
                                                           redis_client, key_prefix, clock,
                                                           db) -> None:
    from herdwick.actors.executions import GROUP, collapse
    from herdwick.ids import shard_of
    from herdwick.storage import executions as store

    await submit(api, schedule={"delaySeconds": 1})
    node = await schedulers()
    await due_and_published(node, clock)
    eid = (await latest(redis_client, key_prefix))["execution_id"]
    await protocol.lease(POOL, "w", 30, eid, 1)
    await protocol.complete(POOL, eid, 1, "w", '{"n": 1}')
    await node.events.refresh_pools()
    # The event actor commits a batch and dies before its ack: the batch is read again.
    events = await protocol.read_events(POOL, GROUP, "crashy", 100, None)
    updates, attempts = collapse(events)
    for _ in range(2):
        await store.apply(db, updates, attempts, clock.now(), shard_of, lambda *_: None)
    replayed = await protocol.read_events(POOL, GROUP, "crashy", 100, None, from_id="0")
    assert [e.stream_id for e in replayed] == [e.stream_id for e in events]
    updates, attempts = collapse(replayed)
    changed = await store.apply(db, updates, attempts, clock.now(), shard_of, lambda *_: None)
    assert changed.changed == 0
    async with db.connection() as conn:
        rows = await conn.fetch("SELECT state, attempt FROM executions")
        attempt_rows = await conn.fetchval("SELECT count(*) FROM execution_attempts")
    assert [(r["state"], r["attempt"]) for r in rows] == [("succeeded", 1)]
    assert attempt_rows == 1


async def test_the_sweeper_republishes_what_a_crash_left_unpublished(
        api, schedulers, redis_client, key_prefix, clock) -> None:
    await submit(api, schedule={"delaySeconds": 1})
    node = await schedulers()
    await due_and_published(node, clock)
    lost = await latest(redis_client, key_prefix)
    # As if the scheduler died between its commit and its publish: no hot state, no message.
    await redis_client.delete(keys.hot_state(key_prefix, POOL, lost["execution_id"]),
                              keys.ready_stream(key_prefix, POOL))
    assert await node.sweeper.run_once() == 0  # within the grace period: maybe still publishing
    clock.advance(31)
    assert await node.sweeper.run_once() == 1
    await node.settle()
    again = await latest(redis_client, key_prefix)
    assert (again["execution_id"], again["attempt"]) == (lost["execution_id"], "2")


async def test_the_sweeper_waits_while_its_pool_s_events_are_behind(
        api, schedulers, protocol, redis_client, key_prefix, clock) -> None:
    """A finished execution's hot state lives a minute: while its `completed` event may
    still wait, an execution Postgres has as running is not taken for lost."""
    from herdwick.actors.executions import GROUP

    await submit(api, schedule={"delaySeconds": 1})
    node = await schedulers()
    await due_and_published(node, clock)
    eid = (await latest(redis_client, key_prefix))["execution_id"]
    await node._core.stop("execution-events")  # the event actor is behind: nothing applies
    await protocol.lease(POOL, "w", 30, eid, 1)
    await protocol.complete(POOL, eid, 1, "w", "{}")
    # Its events as if read 90 s late: the stream holds one unapplied entry that old.
    events = keys.events_stream(key_prefix, POOL)
    (now_s, _) = await redis_client.time()
    await redis_client.delete(events)
    await redis_client.xadd(events, {"e": "{}"}, id=f"{(now_s - 90) * 1000}-0")
    await protocol.ensure_events_group(POOL, GROUP)
    await redis_client.delete(keys.hot_state(key_prefix, POOL, eid))  # expired meanwhile
    clock.advance(31)
    assert await node.sweeper.run_once() == 0  # events 90 s behind: it cannot tell
    await redis_client.delete(events)  # applied (and trimmed) at last
    assert await node.sweeper.run_once() == 1


async def test_redis_losing_everything_is_swept_at_once(api, schedulers, protocol, redis_client,
                                                        key_prefix, clock, db) -> None:
    jobs = [await submit(api, name=f"j{i}", schedule={"delaySeconds": 1}) for i in range(5)]
    node = await schedulers()
    await due_and_published(node, clock)
    held = await latest(redis_client, key_prefix)
    await protocol.lease(POOL, "old-worker", 30, held["execution_id"], 1)
    await node.settle_events()
    # Redis restarts empty (only this test's keys: the server is shared).
    found = [k async for k in redis_client.scan_iter(match=f"{key_prefix}:*")]
    await redis_client.delete(*found)
    # The epoch key says Redis is new: the sweeper gives the workers RECOVERY_GRACE_S to
    # send their completions again (none here), then republishes everything unfinished.
    assert await node.sweeper.run_once() == 0
    clock.advance(RECOVERY_GRACE_S)
    assert await node.sweeper.run_once() == 5
    await node.settle()
    entries = await ready(redis_client, key_prefix)
    assert sorted(e["job_id"] for e in entries) == sorted(j["jobId"] for j in jobs)
    assert {e["attempt"] for e in entries} == {"2"}
    # The worker that held attempt 1 across the restart is fenced out.
    assert await protocol.complete(POOL, held["execution_id"], 1, "old-worker", "{}") is False
    for entry in entries:
        assert await protocol.lease(POOL, "new", 30, entry["execution_id"], 2) is not None
        assert await protocol.complete(POOL, entry["execution_id"], 2, "new", "{}") is True
    await node.settle_events()
    async with db.connection() as conn:
        states = await conn.fetch("SELECT state, attempt FROM executions")
    assert [(r["state"], r["attempt"]) for r in states] == [("succeeded", 2)] * 5


async def test_cancel_while_running_tells_the_worker(api, schedulers, protocol, redis_client,
                                                     key_prefix, clock) -> None:
    job = await submit(api, schedule={"delaySeconds": 1})
    node = await schedulers()
    await due_and_published(node, clock)
    eid = (await latest(redis_client, key_prefix))["execution_id"]
    await protocol.lease(POOL, "w", 30, eid, 1)
    await node.settle_events()
    assert (await api.client.delete(f"/v1/jobs/{job['jobId']}", headers=api.auth())).status == 204
    assert await protocol.heartbeat(POOL, eid, 1, "w", 30) is None
    await node.settle_events()
    assert (await execution(api, eid))["state"] == "canceled"


async def test_pause_while_running_lets_the_attempt_finish(api, schedulers, protocol,
                                                           redis_client, key_prefix,
                                                           clock) -> None:
    job = await submit(api, schedule={"cron": "* * * * *"})
    node = await schedulers()
    await due_and_published(node, clock, 61)
    eid = (await latest(redis_client, key_prefix))["execution_id"]
    await protocol.lease(POOL, "w", 30, eid, 1)
    await api.client.post(f"/v1/jobs/{job['jobId']}:pause", headers=api.auth())
    assert await protocol.complete(POOL, eid, 1, "w", "{}") is True
    await node.settle_events()
    assert (await execution(api, eid))["state"] == "succeeded"
    await due_and_published(node, clock, 120)
    assert len(await ready(redis_client, key_prefix)) == 1  # nothing new while paused


async def fail_once(node, protocol, eid: str, attempt: int = 1) -> None:
    """A worker takes the attempt and fails it, retryably: the execution waits for a retry."""
    assert await protocol.lease(POOL, "w", 30, eid, attempt) is not None
    assert isinstance(await protocol.fail(POOL, eid, attempt, "w", '{"message": "boom"}', True),
                      int)
    await node.settle_events()


async def job_state(api: Api, job_id: str) -> str:
    return (await (await api.client.get(f"/v1/jobs/{job_id}", headers=api.auth())).json())["state"]


async def test_pause_holds_a_pending_retry_until_resume(api, schedulers, protocol, redis_client,
                                                        key_prefix, clock) -> None:
    job = await submit(api, schedule={"delaySeconds": 1}, retry=SLOW_RETRY)
    node = await schedulers()
    await due_and_published(node, clock)
    eid = (await latest(redis_client, key_prefix))["execution_id"]
    await fail_once(node, protocol, eid)
    assert (await execution(api, eid))["state"] == "retry_wait"

    # Paused while its retry waits: the retry's time comes and goes, and nothing starts.
    paused = await api.client.post(f"/v1/jobs/{job['jobId']}:pause", headers=api.auth())
    assert paused.status == 200
    await due_and_published(node, clock, PAST_SLOW_RETRY_S)
    assert len(await ready(redis_client, key_prefix)) == 1
    assert (await execution(api, eid))["state"] == "retry_wait"

    # Resumed: the retry is overdue, so it runs at once, as the next attempt.
    resumed = await api.client.post(f"/v1/jobs/{job['jobId']}:resume", headers=api.auth())
    assert resumed.status == 200
    await due_and_published(node, clock, 1)
    retry = await latest(redis_client, key_prefix)
    assert (retry["execution_id"], retry["attempt"]) == (eid, "2")
    assert (await execution(api, eid))["state"] == "queued"


@pytest.mark.parametrize("paused_first", [False, True], ids=["active", "paused"])
async def test_cancel_while_a_retry_waits_cancels_the_execution(
        api, schedulers, protocol, redis_client, key_prefix, clock, db, paused_first) -> None:
    job = await submit(api, schedule={"delaySeconds": 1}, retry=SLOW_RETRY)
    node = await schedulers()
    await due_and_published(node, clock)
    eid = (await latest(redis_client, key_prefix))["execution_id"]
    await fail_once(node, protocol, eid)
    if paused_first:
        # The retry falls due while the job is paused, and is held back.
        await api.client.post(f"/v1/jobs/{job['jobId']}:pause", headers=api.auth())
        await due_and_published(node, clock, PAST_SLOW_RETRY_S)

    assert (await api.client.delete(f"/v1/jobs/{job['jobId']}", headers=api.auth())).status == 204
    assert (await execution(api, eid))["state"] == "canceled"
    await due_and_published(node, clock, PAST_SLOW_RETRY_S)
    assert len(await ready(redis_client, key_prefix)) == 1  # the retry never ran
    assert (await execution(api, eid))["state"] == "canceled"
    async with db.connection() as conn:
        assert await conn.fetchval("SELECT count(*) FROM due_index") == 0


async def test_overlap_forbid_waits_for_the_running_occurrence(api, schedulers, protocol,
                                                               redis_client, key_prefix,
                                                               clock, db) -> None:
    job = await submit(api, schedule={"cron": "* * * * *", "overlap": "forbid"})
    node = await schedulers()
    await due_and_published(node, clock, 61)
    [first] = await ready(redis_client, key_prefix)
    await protocol.lease(POOL, "w", 300, first["execution_id"], 1)
    await due_and_published(node, clock, 120)
    assert len(await ready(redis_client, key_prefix)) == 1  # still running: nothing new
    job_id = uuid.UUID(job["jobId"])
    shard = node.shard(shard_of(job_id))
    shard.notified.clear()
    await protocol.complete(POOL, first["execution_id"], 1, "w", "{}")
    await node.settle_events()
    async with db.connection() as conn:
        nxt, tenant = await conn.fetchrow("SELECT next_run_at, tenant_id FROM due_index "
                                          "WHERE job_id = $1", job_id)
    assert nxt is not None and nxt > clock.now()
    assert str(tenant) == api.tenant_id  # the herd check counts the successor for its tenant
    # Announced as it commits: in the heap with the clock standing still, no load since.
    await asyncio.wait_for(shard.notified.wait(), 5)
    assert took(shard, shards.entry(to_us(nxt), job_id.int))
    await due_and_published(node, clock, 61)
    assert len(await ready(redis_client, key_prefix)) == 2


async def test_overlap_replace_cancels_the_running_occurrence(api, schedulers, protocol,
                                                              redis_client, key_prefix,
                                                              clock) -> None:
    await submit(api, schedule={"cron": "* * * * *", "overlap": "replace"})
    node = await schedulers()
    await due_and_published(node, clock, 61)
    [first] = await ready(redis_client, key_prefix)
    await protocol.lease(POOL, "w", 300, first["execution_id"], 1)
    await due_and_published(node, clock, 60)
    entries = await ready(redis_client, key_prefix)
    assert len(entries) == 2
    assert await protocol.heartbeat(POOL, first["execution_id"], 1, "w", 300) is None
    assert (await execution(api, first["execution_id"]))["state"] == "canceled"


async def test_trigger_runs_once_now_outside_the_schedule(api, schedulers, redis_client,
                                                          key_prefix, clock, db) -> None:
    job = await submit(api, schedule={"cron": "0 0 1 1 *"})
    node = await schedulers()
    resp = await api.client.post(f"/v1/jobs/{job['jobId']}:trigger", headers=api.auth())
    assert resp.status == 202
    eid = (await resp.json())["executionId"]
    await due_and_published(node, clock, 1)
    [entry] = await ready(redis_client, key_prefix)
    assert (entry["execution_id"], entry["attempt"]) == (eid, "1")
    got = await (await api.client.get(f"/v1/jobs/{job['jobId']}", headers=api.auth())).json()
    assert got["nextRunAt"] == job["nextRunAt"]  # the schedule did not move


async def test_trigger_runs_a_paused_job_once_and_it_stays_paused(
        api, schedulers, protocol, redis_client, key_prefix, clock) -> None:
    job = await submit(api, schedule={"cron": "* * * * *"},
                       retry={"maxAttempts": 3, "backoffSeconds": 1})
    node = await schedulers()
    await api.client.post(f"/v1/jobs/{job['jobId']}:pause", headers=api.auth())

    # Triggered while paused: it runs once, now; the schedule stays paused.
    resp = await api.client.post(f"/v1/jobs/{job['jobId']}:trigger", headers=api.auth())
    assert resp.status == 202
    eid = (await resp.json())["executionId"]
    await due_and_published(node, clock, 1)
    [entry] = await ready(redis_client, key_prefix)
    assert (entry["execution_id"], entry["attempt"]) == (eid, "1")
    assert await job_state(api, job["jobId"]) == "paused"

    # It fails: its retry, like any, waits for the resume; no occurrence starts either.
    await fail_once(node, protocol, eid)
    await due_and_published(node, clock, 120)
    assert len(await ready(redis_client, key_prefix)) == 1
    assert (await execution(api, eid))["state"] == "retry_wait"

    await api.client.post(f"/v1/jobs/{job['jobId']}:resume", headers=api.auth())
    await due_and_published(node, clock, 1)
    entries = await ready(redis_client, key_prefix)
    assert (eid, "2") in [(e["execution_id"], e["attempt"]) for e in entries]

    # A canceled job is not triggered.
    await api.client.delete(f"/v1/jobs/{job['jobId']}", headers=api.auth())
    again = await api.client.post(f"/v1/jobs/{job['jobId']}:trigger", headers=api.auth())
    assert again.status == 409


async def test_history_is_newest_first_and_keyset_paginated(api, schedulers, redis_client,
                                                            key_prefix, clock) -> None:
    job = await submit(api, schedule={"cron": "* * * * *"})
    node = await schedulers()
    for _ in range(4):
        await due_and_published(node, clock, 60)
    path = f"/v1/jobs/{job['jobId']}/executions"
    seen, cursor = [], None
    while True:
        params = {"limit": "3", **({"cursor": cursor} if cursor else {})}
        page = await (await api.client.get(path, params=params, headers=api.auth())).json()
        seen += [e["scheduledFor"] for e in page["items"]]
        cursor = page["nextCursor"]
        if cursor is None:
            break
    assert len(seen) == 4 and seen == sorted(seen, reverse=True)
    bad = await api.client.get(path, params={"cursor": "nope"}, headers=api.auth())
    assert bad.status == 422
    other = (await api.create_tenant("other"))["apiKey"]
    assert (await api.client.get(path, headers=api.auth(other))).status == 404


async def test_a_dead_nodes_unapplied_events_are_claimed_and_applied(
        api, schedulers, protocol, redis_client, key_prefix, clock, db) -> None:
    from herdwick.actors.executions import GROUP, STALE_MS

    await submit(api, schedule={"delaySeconds": 1})
    node = await schedulers()
    await due_and_published(node, clock)
    eid = (await latest(redis_client, key_prefix))["execution_id"]
    await protocol.lease(POOL, "w", 30, eid, 1)
    await protocol.complete(POOL, eid, 1, "w", "{}")
    await node.events.refresh_pools()
    # Another node's consumer read the events and died before applying them.
    taken = await protocol.read_events(POOL, GROUP, "dead-node", 100, None)
    assert len(taken) == 2
    assert await node.settle_events() == 0  # they are the dead consumer's, not new
    assert await node.events.claim_stale() == 0  # not idle long enough yet
    stream = keys.events_stream(key_prefix, POOL)
    await redis_client.xclaim(stream, GROUP, "dead-node", 0, [e.stream_id for e in taken],
                              idle=STALE_MS + 1)
    assert await node.events.claim_stale() == 2
    assert (await execution(api, eid))["state"] == "succeeded"


async def _stream_events(redis_client, key_prefix) -> list:
    """Every event on the pool's events stream, in order, without consuming any."""
    from herdwick.storage.protocol import _events

    entries = await redis_client.xrange(keys.events_stream(key_prefix, POOL))
    return [e for stream_id, fields in entries for e in _events(stream_id, fields)]


async def test_an_outcome_applied_before_its_lease_still_says_when_it_started(
        api, schedulers, protocol, redis_client, key_prefix, clock, db) -> None:
    """Two scheduler nodes share the events stream: one may apply a completion whose
    `leased` event the other has read and not yet applied."""
    from herdwick.actors.executions import collapse
    from herdwick.ids import shard_of
    from herdwick.storage import executions as store

    await submit(api, schedule={"delaySeconds": 1})
    node = await schedulers()
    await node._core.stop("execution-events")  # this test applies the events itself
    await due_and_published(node, clock)
    eid = (await latest(redis_client, key_prefix))["execution_id"]
    leased_until = await protocol.lease(POOL, "w", 30, eid, 1)
    await protocol.complete(POOL, eid, 1, "w", "{}")
    leased, completed = await _stream_events(redis_client, key_prefix)
    assert (leased.type, completed.type) == ("leased", "completed")
    assert completed.started_ms == leased.at_ms

    for batch in ([completed], [leased]):  # the completion first, then the late lease
        updates, attempts = collapse(batch)
        await store.apply(db, updates, attempts, clock.now(), shard_of, lambda *_: None)
    found = await execution(api, eid)
    assert found["state"] == "succeeded"
    started = datetime.fromisoformat(found["startedAt"])
    assert round(started.timestamp() * 1000) == leased.at_ms == leased_until - 30_000
    assert found["attempts"][0]["startedAt"] == found["startedAt"]


async def test_a_lease_applied_after_a_later_attempt_is_not_left_running(
        api, schedulers, protocol, redis_client, key_prefix, clock, db) -> None:
    """Redis lost the attempt a worker had leased, and the sweeper republished it as the
    next; the `leased` event of the lost attempt, read by a node before the loss, lands
    after that. The lost attempt is over, and its row says so."""
    from herdwick.actors.executions import collapse
    from herdwick.ids import shard_of
    from herdwick.storage import executions as store

    await submit(api, schedule={"delaySeconds": 1})
    node = await schedulers()
    await node._core.stop("execution-events")  # this test applies the events itself
    await due_and_published(node, clock)
    eid = (await latest(redis_client, key_prefix))["execution_id"]
    await protocol.lease(POOL, "w1", 30, eid, 1)
    [leased_1] = await _stream_events(redis_client, key_prefix)
    await redis_client.delete(keys.hot_state(key_prefix, POOL, eid))  # lost with Redis
    clock.advance(60)  # past the sweeper's grace
    assert await node.sweeper.run_once() == 1
    await node.settle()
    assert (await latest(redis_client, key_prefix))["attempt"] == "2"
    updates, attempts = collapse([leased_1])
    await store.apply(db, updates, attempts, clock.now(), shard_of, lambda *_: None)
    await protocol.lease(POOL, "w2", 30, eid, 2)
    await protocol.complete(POOL, eid, 2, "w2", "{}")
    events = await _stream_events(redis_client, key_prefix)
    updates, attempts = collapse(events[-2:])
    await store.apply(db, updates, attempts, clock.now(), shard_of, lambda *_: None)

    found = await execution(api, eid)
    assert (found["state"], found["attempt"]) == ("succeeded", 2)
    first, second = found["attempts"]
    assert (first["outcome"], first["workerId"]) == ("expired", "w1")
    assert first["error"]["type"] == "Superseded" and first["finishedAt"] is not None
    assert (second["outcome"], second["workerId"]) == ("succeeded", "w2")


async def test_on_a_busy_stream_a_lone_lease_waits_one_read_for_its_outcome(
        api, schedulers, protocol, redis_client, key_prefix, clock, monkeypatch) -> None:
    """A herd's leases and completions come in separate entries; a lease read without its
    outcome is held for the next read (every read counts as busy here), so the execution
    is written once. Its entry stays unacked meanwhile: a crash replays it. A lease whose
    outcome is not in the next read either is applied then, not held again."""
    from herdwick.actors import executions as actor

    monkeypatch.setattr(actor, "CARRY_MIN_EVENTS", 1)
    await submit(api, schedule={"delaySeconds": 1})
    await submit(api, schedule={"delaySeconds": 1})
    node = await schedulers()
    await node._core.stop("execution-events")  # this test drives the actor itself
    await due_and_published(node, clock)
    first, second = [e["execution_id"] for e in await ready(redis_client, key_prefix)]
    events, stream = node.events, keys.events_stream(key_prefix, POOL)
    await events.refresh_pools()

    async def pending() -> int:
        return (await redis_client.xpending(stream, actor.GROUP))["pending"]

    await protocol.lease(POOL, "w", 30, first, 1)
    assert await events.run_once() == 1
    await events.quiesce()
    assert (await execution(api, first))["state"] == "queued"  # held, not written
    assert await pending() == 1

    await protocol.complete(POOL, first, 1, "w", "{}")
    await protocol.lease(POOL, "w", 30, second, 1)
    await events.run_once()
    await events.quiesce()
    found = await execution(api, first)
    assert found["state"] == "succeeded" and found["startedAt"] is not None
    assert found["attempts"][0]["outcome"] == "succeeded"
    assert (await execution(api, second))["state"] == "queued"  # the second's lease is held

    await events.run_once()  # nothing new: what was held is applied
    await events.quiesce()
    assert (await execution(api, second))["state"] == "running"
    assert await events.run_once() == 0
    assert await pending() == 0
