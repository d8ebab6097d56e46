"""The worker SDK against real Redis and the real herdwick functions.

Each test publishes executions the way the scheduler does (HotTier.publish),
runs a herdwick.Worker on them and reads what the worker reported on the
pool's events stream, where the scheduler tier would read it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path

import msgspec
import pytest
import redis.asyncio as aioredis
from redis.exceptions import TimeoutError as RedisTimeoutError

import herdwick
from herdwick.storage import keys
from herdwick.storage.hot import HotTier, ReadyExecution
from tests.services import Services

POOL = "emails"
WAIT_S = 5.0  # longest wait for anything the worker should do promptly


def make_execution(**overrides) -> ReadyExecution:
    fields = {"execution_id": str(uuid.uuid4()), "attempt": 1, "job_id": str(uuid.uuid4()),
              "tenant_id": str(uuid.uuid4()), "scheduled_for": "2026-12-02T12:00:00Z",
              "payload": '{"to": "a@example.com"}', "timeout_seconds": 30}
    fields.update(overrides)
    return ReadyExecution(**fields)


def _events(fields: dict) -> list[dict[str, str]]:
    """An events entry's events: its field `e` holds one, or a batch call's list."""
    got = msgspec.json.decode(fields[b"e"])
    return got if isinstance(got, list) else [got]


class Pool:
    """One pool under test: publish executions, make workers, read their reports."""

    def __init__(self, client: aioredis.Redis, prefix: str, redis_url: str) -> None:
        self.client = client
        self.prefix = prefix
        self.redis_url = redis_url
        self.base = keys.pool_base(prefix, POOL)
        self.ready = keys.ready_stream(prefix, POOL)
        self.events_key = keys.events_stream(prefix, POOL)
        self.hot = HotTier(client, prefix)

    def worker(self, concurrency: int = 10, **options) -> herdwick.Worker:
        return herdwick.Worker(self.redis_url, POOL, concurrency, key_prefix=self.prefix,
                               **options)

    async def publish(self, *executions: ReadyExecution) -> None:
        assert await self.hot.publish({POOL: list(executions)}) == len(executions)

    async def events(self, execution_id: str | None = None) -> list[dict[str, str]]:
        entries = [e for _, f in await self.client.xrange(self.events_key) for e in _events(f)]
        return [e for e in entries if execution_id in (None, e["execution_id"])]

    async def next_event(self, kind: str, execution_id: str,
                         timeout_s: float = WAIT_S) -> dict[str, str]:
        """Block on the events stream (XREAD, no polling sleeps) until that event appears."""
        loop = asyncio.get_running_loop()
        deadline, last = loop.time() + timeout_s, "0-0"
        while (left_ms := int((deadline - loop.time()) * 1000)) > 0:
            for _, entries in await self.client.xread({self.events_key: last}, count=100,
                                                      block=left_ms) or []:
                for entry_id, fields in entries:
                    last = entry_id
                    for event in _events(fields):
                        if event["type"] == kind and event["execution_id"] == execution_id:
                            return event
        raise AssertionError(f"no {kind} event for {execution_id} within {timeout_s} s")

    async def entries_read(self) -> int:
        """How many ready entries the group has delivered to any consumer."""
        (group,) = await self.client.xinfo_groups(self.ready)
        return group["entries-read"] or 0

    async def hot_state(self, execution_id: str) -> str:
        return (await self.client.hget(keys.hot_state(self.prefix, POOL, execution_id),
                                       "state")).decode()


@pytest.fixture
async def pool(redis_client: aioredis.Redis, key_prefix: str, services: Services) -> Pool:
    under_test = Pool(redis_client, key_prefix, services.redis_url)
    await under_test.hot.load_functions()
    return under_test


@asynccontextmanager
async def running(worker: herdwick.Worker) -> AsyncIterator[asyncio.Task]:
    task = asyncio.create_task(worker.run())
    try:
        yield task
    finally:
        await asyncio.wait_for(worker.stop(), WAIT_S)
        await task


def error_of(event: dict[str, str]) -> dict:
    return msgspec.json.decode(event["error"])


# --- outcomes ---------------------------------------------------------------------------


async def test_a_returned_value_completes_the_attempt(pool: Pool) -> None:
    worker = pool.worker()

    @worker.handler
    async def handle(ctx: herdwick.Context) -> dict:
        return {"sent_to": ctx.payload["to"]}

    execution = make_execution()
    await pool.publish(execution)
    async with running(worker):
        done = await pool.next_event("completed", execution.execution_id)
    assert msgspec.json.decode(done["result"]) == {"sent_to": "a@example.com"}
    assert done["worker_id"] == worker.worker_id
    assert [e["type"] for e in await pool.events()] == ["leased", "completed"]
    # XACKed after the lease: nothing is left pending in the group.
    assert (await pool.client.xpending(pool.ready, keys.WORKERS_GROUP))["pending"] == 0


async def test_an_exception_fails_the_attempt_for_retry(pool: Pool) -> None:
    worker = pool.worker()

    @worker.handler
    async def handle(ctx: herdwick.Context) -> None:
        raise ValueError("smtp said no")

    execution = make_execution()
    await pool.publish(execution)
    async with running(worker):
        failed = await pool.next_event("failed", execution.execution_id)
    assert (failed["retryable"], failed["outcome"]) == ("1", "retry")
    assert error_of(failed) == {"type": "ValueError", "message": "smtp said no"}


async def test_permanent_dead_letters_at_once(pool: Pool) -> None:
    worker = pool.worker()

    @worker.handler
    async def handle(ctx: herdwick.Context) -> None:
        raise herdwick.Permanent("no such mailbox")

    execution = make_execution()
    await pool.publish(execution)
    async with running(worker):
        failed = await pool.next_event("failed", execution.execution_id)
    assert (failed["retryable"], failed["outcome"]) == ("0", "dead")
    assert error_of(failed) == {"type": "Permanent", "message": "no such mailbox"}


async def test_retry_after_holds_the_next_attempt_back(pool: Pool) -> None:
    worker = pool.worker()

    @worker.handler
    async def handle(ctx: herdwick.Context) -> None:
        raise herdwick.RetryAfter(90, "slow down")

    execution = make_execution(max_attempts=3, backoff_ms=1000)
    await pool.publish(execution)
    async with running(worker):
        failed = await pool.next_event("failed", execution.execution_id)
    assert (failed["outcome"], error_of(failed)["message"]) == ("retry", "slow down")
    # The backoff alone would be 0.5-1 s; Retry-After asks for 90.
    assert int(failed["retry_at_ms"]) - int(failed["at_ms"]) == 90_000


async def test_defer_puts_an_attempt_off_without_counting_it(pool: Pool) -> None:
    worker = pool.worker()

    @worker.handler
    async def handle(ctx: herdwick.Context) -> None:
        raise herdwick.Defer(30, "downstream is down")

    # On its last attempt: a failure would dead-letter it, a deferral does not.
    execution = make_execution(max_attempts=1)
    await pool.publish(execution)
    async with running(worker):
        failed = await pool.next_event("failed", execution.execution_id)
    assert (failed["outcome"], failed["deferred"]) == ("retry", "1")
    assert int(failed["retry_at_ms"]) - int(failed["at_ms"]) == 30_000
    assert error_of(failed) == {"type": "Defer", "message": "downstream is down"}
    hot = keys.hot_state(pool.prefix, POOL, execution.execution_id)
    assert await pool.client.hget(hot, "max_attempts") == b"2"


async def test_a_long_error_message_is_truncated(pool: Pool) -> None:
    worker = pool.worker()

    @worker.handler
    async def handle(ctx: herdwick.Context) -> None:
        raise RuntimeError("é" * 10_000)

    execution = make_execution()
    await pool.publish(execution)
    async with running(worker):
        failed = await pool.next_event("failed", execution.execution_id)
    message = error_of(failed)["message"]
    assert len(message.encode()) <= 4096 and set(message) == {"é"}


async def test_unencodable_result_and_bad_payload_are_permanent(pool: Pool) -> None:
    worker = pool.worker()

    @worker.handler
    async def handle(ctx: herdwick.Context) -> object:
        return object()

    unencodable = make_execution()
    bad_payload = make_execution(payload="{not json")
    await pool.publish(unencodable, bad_payload)
    async with running(worker):
        first = await pool.next_event("failed", unencodable.execution_id)
        second = await pool.next_event("failed", bad_payload.execution_id)
    assert (error_of(first)["type"], first["outcome"]) == ("ResultNotSerializable", "dead")
    assert (error_of(second)["type"], second["outcome"]) == ("MalformedMessage", "dead")


async def test_the_handler_sees_its_execution(pool: Pool) -> None:
    worker = pool.worker()
    seen: list[herdwick.Context] = []

    @worker.handler
    async def handle(ctx: herdwick.Context) -> None:
        seen.append(ctx)

    execution = make_execution(attempt=2, payload='{"n": [1, 2]}', timeout_seconds=45)
    await pool.publish(execution)
    async with running(worker):
        await pool.next_event("completed", execution.execution_id)
    (ctx,) = seen
    assert ctx.payload == {"n": [1, 2]}
    assert ctx.attempt == 2
    assert ctx.idempotency_key == f"{execution.job_id}:2026-12-02T12:00:00Z"
    assert ctx.scheduled_for == datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
    assert ctx.scheduled_for.tzinfo is not None
    assert (ctx.execution_id, ctx.job_id, ctx.tenant_id, ctx.timeout_s) == (
        execution.execution_id, execution.job_id, execution.tenant_id, 45)


# --- concurrency and time ---------------------------------------------------------------


async def test_concurrency_bounds_handlers_and_reads(pool: Pool) -> None:
    worker = pool.worker(concurrency=2)
    active, peak = 0, 0
    two_running, release = asyncio.Event(), asyncio.Event()

    @worker.handler
    async def handle(ctx: herdwick.Context) -> None:
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        if active == 2:
            two_running.set()
        await release.wait()
        active -= 1

    executions = [make_execution() for _ in range(5)]
    await pool.publish(*executions)
    async with running(worker):
        await asyncio.wait_for(two_running.wait(), WAIT_S)
        assert await pool.entries_read() == 2  # it reads only as many as it has free slots
        release.set()
        for execution in executions:
            await pool.next_event("completed", execution.execution_id)
    assert peak == 2


async def test_a_handler_past_its_timeout_is_cancelled_and_failed(pool: Pool) -> None:
    worker = pool.worker()
    cancelled = asyncio.Event()

    @worker.handler
    async def handle(ctx: herdwick.Context) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    execution = make_execution(timeout_seconds=1)  # the stream's unit: one real second
    await pool.publish(execution)
    async with running(worker):
        failed = await pool.next_event("failed", execution.execution_id)
    assert cancelled.is_set()
    assert error_of(failed)["type"] == "Timeout"
    assert (failed["retryable"], failed["outcome"]) == ("1", "retry")


async def test_lease_lost_cancels_the_handler_and_reports_nothing(pool: Pool) -> None:
    worker = pool.worker(lease_s=0.6)  # heartbeats every 0.2 s
    started, cancelled = asyncio.Event(), asyncio.Event()

    @worker.handler
    async def handle(ctx: herdwick.Context) -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    execution = make_execution()
    await pool.publish(execution)
    async with running(worker):
        await asyncio.wait_for(started.wait(), WAIT_S)
        await pool.client.fcall("hw_cancel", 1, pool.base, execution.execution_id)
        await asyncio.wait_for(cancelled.wait(), WAIT_S)  # on the next heartbeat
    # stop() drained the worker, so anything it was going to report is in.
    assert [e["type"] for e in await pool.events()] == ["leased", "canceled"]


async def test_a_worker_that_stalled_past_its_lease_says_so_to_redis(pool: Pool) -> None:
    """The 40-second GC pause, in small: the loop is frozen past the lease. Woken, the
    worker steps down, and its last word is refused and recorded as a possible duplicate
    (the handler may have acted before the stall, and the attempt will run again)."""
    import time

    worker = pool.worker(lease_s=0.6)
    cancelled = asyncio.Event()

    @worker.handler
    async def handle(ctx: herdwick.Context) -> None:
        time.sleep(0.9)  # noqa: ASYNC251 - the point: nothing runs, not even the heartbeats
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    execution = make_execution()
    await pool.publish(execution)
    async with running(worker):
        await asyncio.wait_for(cancelled.wait(), WAIT_S)
        stale = await pool.next_event("stale", execution.execution_id)
    assert (stale["call"], stale["attempt"], stale["worker_id"]) == (
        "heartbeat", "1", worker.worker_id)


async def test_heartbeat_raises_lease_lost_to_the_handler(pool: Pool) -> None:
    worker = pool.worker()  # 30 s lease: no automatic heartbeat during the test
    extended, go, outcome = asyncio.Event(), asyncio.Event(), asyncio.Future()

    @worker.handler
    async def handle(ctx: herdwick.Context) -> None:
        await ctx.heartbeat()  # a live lease extends
        extended.set()
        await go.wait()
        try:
            await ctx.heartbeat()
        except herdwick.LeaseLost as exc:
            outcome.set_result(exc)
            raise

    execution = make_execution()
    await pool.publish(execution)
    async with running(worker):
        await asyncio.wait_for(extended.wait(), WAIT_S)
        await pool.client.fcall("hw_cancel", 1, pool.base, execution.execution_id)
        go.set()
        assert isinstance(await asyncio.wait_for(outcome, WAIT_S), herdwick.LeaseLost)
    assert [e["type"] for e in await pool.events()] == ["leased", "canceled"]


async def test_a_message_whose_reader_died_is_claimed(pool: Pool) -> None:
    execution = make_execution()
    await pool.publish(execution)
    # A worker that read the message and died before leasing it.
    await pool.client.xreadgroup(keys.WORKERS_GROUP, "dead-worker", {pool.ready: ">"}, count=1)
    worker = pool.worker(lease_s=0.6)  # claims what has been idle for over 0.6 s

    @worker.handler
    async def handle(ctx: herdwick.Context) -> str:
        return "rescued"

    async with running(worker):
        done = await pool.next_event("completed", execution.execution_id)
    assert done["worker_id"] == worker.worker_id
    assert (await pool.client.xpending(pool.ready, keys.WORKERS_GROUP))["pending"] == 0


async def test_a_message_claimed_back_while_running_does_not_run_twice(pool: Pool) -> None:
    # Its XACK was lost: the message sits in this worker's own pending list while it runs.
    worker = pool.worker(lease_s=0.6)
    started, release, runs = asyncio.Event(), asyncio.Event(), []

    @worker.handler
    async def handle(ctx: herdwick.Context) -> None:
        runs.append(ctx.attempt)
        started.set()
        await release.wait()

    execution = make_execution()
    await pool.publish(execution)
    async with running(worker):
        await asyncio.wait_for(started.wait(), WAIT_S)
        (entry_id, _), = await pool.client.xrange(pool.ready)
        await pool.client.execute_command("XCLAIM", pool.ready, keys.WORKERS_GROUP,
                                          worker.worker_id, 0, entry_id, "IDLE", 60_000, "FORCE")
        await eventually(lambda: pending(pool), 0)  # claimed back by XAUTOCLAIM, then acked
        release.set()
        await pool.next_event("completed", execution.execution_id)
    assert runs == [1]
    assert [e["type"] for e in await pool.events()] == ["leased", "completed"]


async def pending(pool: Pool) -> int:
    return (await pool.client.xpending(pool.ready, keys.WORKERS_GROUP))["pending"]


async def eventually(probe, want, timeout_s: float = WAIT_S) -> None:
    """Poll Redis state the worker changes on its own timer (no signal to wait on)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while (got := await probe()) != want:
        assert loop.time() < deadline, f"still {got!r}, want {want!r}"
        await asyncio.sleep(0.02)


# --- shutdown ---------------------------------------------------------------------------


async def test_graceful_shutdown_lets_in_flight_work_finish(pool: Pool) -> None:
    worker = pool.worker()
    started, proceed = asyncio.Event(), asyncio.Event()

    @worker.handler
    async def handle(ctx: herdwick.Context) -> str:
        started.set()
        await proceed.wait()
        return "finished"

    first, late = make_execution(), make_execution()
    await pool.publish(first)
    run = asyncio.create_task(worker.run())
    await asyncio.wait_for(started.wait(), WAIT_S)
    stopping = asyncio.create_task(worker.stop())
    with pytest.raises(TimeoutError):  # it waits for the handler (a negative: a short wait)
        await asyncio.wait_for(asyncio.shield(stopping), 0.2)
    await pool.publish(late)  # it stopped reading: this one stays for another worker
    proceed.set()
    await asyncio.wait_for(stopping, WAIT_S)
    await run
    done = await pool.next_event("completed", first.execution_id)
    assert msgspec.json.decode(done["result"]) == "finished"
    assert await pool.events(late.execution_id) == []
    assert await pool.entries_read() == 1


async def test_past_the_grace_handlers_are_cancelled_and_leases_left_to_lapse(
        pool: Pool) -> None:
    worker = pool.worker(grace_s=0.2)
    started, cancelled = asyncio.Event(), asyncio.Event()

    @worker.handler
    async def handle(ctx: herdwick.Context) -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    execution = make_execution()
    await pool.publish(execution)
    async with running(worker):
        await asyncio.wait_for(started.wait(), WAIT_S)
    assert cancelled.is_set()
    assert [e["type"] for e in await pool.events()] == ["leased"]  # not failed: the reaper's
    assert await pool.hot_state(execution.execution_id) == "leased"


async def test_the_cli_runs_a_worker_until_sigterm(pool: Pool, tmp_path: Path) -> None:
    (tmp_path / "handlers.py").write_text(textwrap.dedent("""
        import os

        import herdwick

        worker = herdwick.Worker(os.environ["TEST_REDIS_URL"], "emails",
                                 key_prefix=os.environ["TEST_KEY_PREFIX"])

        @worker.handler
        async def handle(ctx):
            return {"echo": ctx.payload}
    """))
    execution = make_execution()
    await pool.publish(execution)
    herdwick_cmd = Path(sys.executable).parent / "herdwick"  # the console script: cwd not on path
    env = {**os.environ, "TEST_REDIS_URL": pool.redis_url, "TEST_KEY_PREFIX": pool.prefix}
    proc = await asyncio.create_subprocess_exec(str(herdwick_cmd), "worker", "handlers:worker",
                                                cwd=tmp_path, env=env,
                                                stderr=asyncio.subprocess.PIPE)
    try:
        done = await pool.next_event("completed", execution.execution_id, timeout_s=15)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(proc.communicate(), WAIT_S)
    assert msgspec.json.decode(done["result"]) == {"echo": {"to": "a@example.com"}}
    assert proc.returncode == 0, stderr.decode()
    assert b"event=worker_stopped" in stderr


async def test_a_failed_lease_call_leaves_the_batch_pending_until_it_works(
        tmp_path: Path) -> None:
    # A private server: the library is taken away (what an empty Redis restart does).
    from herdwick.embedded import start_redis

    server = start_redis(tmp_path)
    client = aioredis.from_url(server.url)
    try:
        pool = Pool(client, "hwt:lib", server.url)
        await pool.hot.load_functions()
        execution = make_execution()
        await pool.publish(execution)
        await client.function_delete("herdwick")
        worker = pool.worker(lease_s=0.6)  # claims what has been idle for over 0.6 s
        runs = []

        @worker.handler
        async def handle(ctx: herdwick.Context) -> None:
            runs.append(ctx.attempt)

        async with running(worker):
            await eventually(lambda: pool.entries_read(), 1)
            assert await pending(pool) == 1 and runs == []  # read, not leased: still pending
            await pool.hot.load_functions()
            await pool.next_event("completed", execution.execution_id)
        assert runs == [1]
        assert await pending(pool) == 0
    finally:
        await client.aclose()
        server.stop()


async def test_a_lease_granted_but_its_reply_lost_is_asked_for_again(
        pool: Pool, monkeypatch) -> None:
    """Seen in the SIGSTOP fault scenario: the lease call in flight when the process
    stopped ran in Redis, and on waking its read timed out before the reply was read.
    The worker asks again; the lease it holds is renewed, not granted twice, and runs
    now, not one lease and a retry later (without a reaper here: never)."""
    from herdwick import worker as sdk

    lost = []
    lease_many = sdk._Calls.lease_many

    async def reply_lost_once(self, messages):
        replies = await lease_many(self, messages)
        if not lost:
            lost.append(replies)
            raise RedisTimeoutError("Timeout reading from 127.0.0.1:6379")
        return replies

    monkeypatch.setattr(sdk._Calls, "lease_many", reply_lost_once)
    worker = pool.worker(lease_s=5)
    runs = []

    @worker.handler
    async def handle(ctx: herdwick.Context) -> None:
        runs.append(ctx.attempt)

    execution = make_execution()
    await pool.publish(execution)
    async with running(worker):
        await pool.next_event("completed", execution.execution_id)
    assert lost and lost[0][0] is not None  # the first call did lease it
    assert runs == [1]
    assert [e["type"] for e in await pool.events(execution.execution_id)] == [
        "leased", "completed"]


async def test_a_reply_out_of_contract_fails_that_call_not_the_worker(tmp_path: Path) -> None:
    # A library that is not ours: hw_complete_batch answers a string, not one reply an item.
    from herdwick.embedded import start_redis

    server = start_redis(tmp_path)
    client = aioredis.from_url(server.url)
    try:
        await client.function_load("\n".join([
            "#!lua name=herdwick",
            "redis.register_function('hw_lease_batch', function(keys, args)",
            "  local r = {} for i = 3, #args, 2 do r[#r + 1] = 1 end return r end)",
            "redis.register_function('hw_complete_batch', function(keys, args)",
            "  return 'not an array' end)"]))
        pool = Pool(client, "hwt:odd", server.url)
        worker = pool.worker()
        ran = asyncio.Queue()

        @worker.handler
        async def handle(ctx: herdwick.Context) -> None:
            ran.put_nowait(ctx.execution_id)

        async with running(worker):
            for _ in range(2):  # the second is read, leased and run after the first's failure
                execution = make_execution()
                fields = {"execution_id": execution.execution_id, "attempt": "1",
                          "job_id": execution.job_id, "tenant_id": execution.tenant_id,
                          "scheduled_for": execution.scheduled_for,
                          "payload": execution.payload, "timeout_seconds": "30",
                          "idempotency_key": execution.idempotency_key}
                await client.xadd(pool.ready, fields)
                assert await asyncio.wait_for(ran.get(), WAIT_S) == execution.execution_id
        assert worker._done.is_set()  # stopped cleanly: nothing waits on a dead pipeline
    finally:
        await client.aclose()
        server.stop()


async def test_a_worker_without_a_url_takes_the_environment_s(pool: Pool, monkeypatch) -> None:
    monkeypatch.setenv("HERDWICK_REDIS_URL", pool.redis_url)
    monkeypatch.setenv("HERDWICK_KEY_PREFIX", pool.prefix)
    worker = herdwick.Worker(pool=POOL)
    done = asyncio.Event()

    @worker.handler
    async def handle(ctx: herdwick.Context) -> str:
        done.set()
        return "ok"

    execution = make_execution()
    await pool.publish(execution)
    async with running(worker):
        await pool.next_event("completed", execution.execution_id)
    assert done.is_set()


def test_a_pool_that_no_job_can_target_is_refused_at_once() -> None:
    for bad in ("Emails", "emails\n", "", "http pool", None):
        with pytest.raises(ValueError, match="pool must be a queue name"):
            herdwick.Worker("redis://127.0.0.1:6379/0", bad)


async def test_a_worker_on_a_redis_no_scheduler_uses_says_so(tmp_path: Path, caplog) -> None:
    from herdwick.embedded import start_redis

    with start_redis(tmp_path) as server:  # a Redis without the function library
        worker = herdwick.Worker(server.url, POOL, key_prefix="hwt:nolib")

        @worker.handler
        async def handle(ctx: herdwick.Context) -> None:
            return None

        async with running(worker):
            pass  # it checks before its first read, and stopping waits for the read loop
    assert "event=functions_missing pool=emails" in caplog.text
    assert "HERDWICK_REDIS_URL" in caplog.text


async def test_a_closed_pipeline_stops_even_if_its_cancel_is_lost(redis_client) -> None:
    """Shutdown closes the worker's coalescing pipeline as well as cancelling it: a cancel
    that lands just as a Redis reply arrives can be lost inside the client, and its task
    would then wait for more commands for ever (a `herdwick dev` that would not stop)."""
    from herdwick.worker import _Pipeline

    pipeline = _Pipeline(redis_client)
    flusher = asyncio.create_task(pipeline.run())
    assert await pipeline.submit("PING") is True
    pipeline.close()  # and no cancel at all
    await asyncio.wait_for(flusher, WAIT_S)
    assert flusher.done() and not flusher.cancelled()
