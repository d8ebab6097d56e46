"""Redis loses everything in the middle of a run: every job still completes, no attempt twice.

DESIGN.md, dispatch path 7: executions Postgres has as queued or running but
the hot tier has not are republished with a bumped attempt, which fences out
any worker still holding the old one. Here that happens to a real run: a
scheduler, the gateway and two SDK workers, on a Redis server of the test's
own (the suite's server is shared, and FLUSHALL would wipe the other tests).

150 jobs fall due and 50 more wait a minute. The workers finish 80, are in
the middle of 40 more (their handlers hold until the lease is lost) and
leave 30 unread on the ready stream. Then the server loses everything, by
FLUSHALL or by a restart without persistence (which also drops the
functions). The sweeper finds the epoch key gone and republishes the 70
unfinished executions with attempt 2; the held handlers are cancelled by
LEASE_LOST; the late 50 are dispatched into the new Redis as usual.

Schedules move on the injected clock; leases and heartbeats run on the Redis
server's clock, as in production, so this module's clock starts at real time.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import pytest
import redis.asyncio as aioredis

import herdwick
from herdwick.actors.base import Tick, sync
from herdwick.actors.scheduler import Scheduler
from herdwick.actors.sweeper import RECOVERY_GRACE_S
from herdwick.clock import ManualClock
from herdwick.config import Settings
from herdwick.embedded import EmbeddedService, start_redis
from herdwick.schedule import format_utc
from herdwick.storage import keys
from tests.integration.conftest import Api, make_job, tenant_api
from tests.integration.stack import advance

pytestmark = pytest.mark.slow

POOL = "emails"
EARLY_JOBS = 150  # due at once
LATE_JOBS = 50  # due in a minute: still in Postgres when Redis loses its data
LATE_DELAY_S = 60
FINISHED_BEFORE = 80  # handlers that finish before the loss; every later one holds
WORKERS = 2
CONCURRENCY = 20  # per worker: 40 held, 30 left unread on the stream
LEASE_S = 6.0  # heartbeats every 2 s: a held handler learns of the loss within that
WAIT_S = 15.0  # longest wait for anything the system does on its own
POLL_S = 0.05


class PrivateRedis:
    """A valkey-server of this test's own (herdwick.embedded), on a unix socket."""

    def __init__(self, data_dir: Path) -> None:
        self._data_dir = data_dir
        self._server: EmbeddedService = start_redis(data_dir)
        self.url = self._server.url

    def restart(self) -> None:
        """Stop and start again in the same directory: same socket, nothing persisted."""
        self._server.stop()
        self._server = start_redis(self._data_dir)
        assert self._server.url == self.url

    def stop(self) -> None:
        self._server.stop()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(datetime.now(UTC).replace(microsecond=0))


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    # Started on the test's (main) thread: the server dies with the thread that started it.
    server = PrivateRedis(tmp_path)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def admin(private_redis: PrivateRedis) -> AsyncIterator[aioredis.Redis]:
    """The test's own connection to the private server: what an operator's redis-cli is."""
    client = aioredis.from_url(private_redis.url)
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
async def api(db_url, private_redis, key_prefix, clock) -> AsyncIterator[Api]:
    async with tenant_api(db_url, private_redis.url, key_prefix, clock) as holder:
        yield holder


@pytest.fixture
async def node(db, private_redis, key_prefix, clock) -> AsyncIterator[Scheduler]:
    """One scheduler node on the private server; timers are the test's to send."""
    client = aioredis.from_url(private_redis.url)
    scheduler = Scheduler(Settings(key_prefix=key_prefix), clock=clock, db=db, redis=client,
                          node_id="node-0", tick=False)
    await scheduler.start()
    try:
        yield scheduler
    finally:
        await scheduler.stop()
        await client.aclose()


@dataclass
class Ledger:
    """What the workers' handler saw: each (execution_id, attempt) started, finished, cut off.

    Written by the handler, read by the test; `changed` wakes a waiting test.
    """

    finish_before: int
    lost_data: bool = False  # set by the test just before Redis loses its data
    started: list[tuple[str, int]] = field(default_factory=list)
    finished: list[tuple[str, int]] = field(default_factory=list)
    held: list[tuple[str, int]] = field(default_factory=list)
    cut_off: list[tuple[str, int]] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, ctx: herdwick.Context) -> dict:
        key = (ctx.execution_id, ctx.attempt)
        self.started.append(key)
        if not self.lost_data and len(self.finished) >= self.finish_before:
            self.held.append(key)
            self.changed.set()
            try:
                await asyncio.Event().wait()  # until LEASE_LOST cancels us
            except asyncio.CancelledError:
                self.cut_off.append(key)
                self.changed.set()
                raise
        self.finished.append(key)
        self.changed.set()
        return {"attempt": ctx.attempt}

    async def until(self, condition: Callable[[], bool], what: str) -> None:
        async def wait() -> None:
            while not condition():
                self.changed.clear()
                await self.changed.wait()
        try:
            await asyncio.wait_for(wait(), WAIT_S)
        except TimeoutError:
            raise AssertionError(f"not within {WAIT_S} s: {what}") from None


@pytest.fixture
async def ledger(private_redis, key_prefix) -> AsyncIterator[Ledger]:
    """Real SDK workers on the private server, each running the ledger's handler."""
    book = Ledger(finish_before=FINISHED_BEFORE)
    workers = [herdwick.Worker(private_redis.url, POOL, CONCURRENCY, key_prefix=key_prefix,
                               worker_id=f"worker-{i}", lease_s=LEASE_S, grace_s=1.0)
               for i in range(WORKERS)]
    for worker in workers:
        worker.handler(book.handle)
    tasks = [asyncio.create_task(worker.run()) for worker in workers]
    try:
        yield book
    finally:
        for worker in workers:
            await asyncio.wait_for(worker.stop(), WAIT_S)
        await asyncio.gather(*tasks)


async def submit_all(api: Api) -> None:
    bodies = [make_job(name=f"early-{i}", schedule={"delaySeconds": 1}) for i in
              range(EARLY_JOBS)]
    bodies += [make_job(name=f"late-{i}", schedule={"delaySeconds": LATE_DELAY_S}) for i in
               range(LATE_JOBS)]
    for start in range(0, len(bodies), 25):
        chunk = bodies[start:start + 25]
        for resp in await asyncio.gather(*(api.submit(body) for body in chunk)):
            assert resp.status == 201, await resp.text()


async def states(db) -> Counter:
    async with db.connection() as conn:
        rows = await conn.fetch("SELECT state, count(*) AS n FROM executions GROUP BY state")
    return Counter({r["state"]: r["n"] for r in rows})


async def succeeded_attempts(db) -> dict[str, int]:
    async with db.connection() as conn:
        rows = await conn.fetch("SELECT execution_id, attempt FROM executions "
                                "WHERE state = 'succeeded'")
    return {str(r["execution_id"]): r["attempt"] for r in rows}


async def drive_until(node: Scheduler, db, condition: Callable[[Counter], bool],
                      what: str) -> Counter:
    """Run the scheduler's periodic passes (what its tickers do) until Postgres says so."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while True:
        await node.reaper.send(Tick())  # as its ticker does; it runs on its own meanwhile
        await node.sweeper.run_once()
        await node.settle()
        await node.settle_events()
        found = await states(db)
        if condition(found):
            return found
        if loop.time() > deadline:
            raise AssertionError(f"not within {WAIT_S} s: {what}; executions {dict(found)}")
        await asyncio.sleep(POLL_S)  # the workers run on their own meanwhile


async def sweep_after_loss(node: Scheduler, clock: ManualClock) -> int:
    """The sweeper's passes after Redis lost its data: the first finds the epoch gone and
    waits for the workers to send their completions again; one RECOVERY_GRACE_S later,
    it republishes what is still unfinished."""
    assert await node.sweeper.run_once() == 0
    clock.advance(RECOVERY_GRACE_S)
    return await node.sweeper.run_once()


async def functions_loaded(client: aioredis.Redis) -> bool:
    return bool(await client.function_list(library="herdwick"))


async def lose_everything(how: str, admin: aioredis.Redis, server: PrivateRedis) -> None:
    if how == "flushall":
        assert await admin.flushall() is True
        assert await functions_loaded(admin)  # FLUSHALL drops keys, not functions
    else:
        server.restart()
        assert not await functions_loaded(admin)  # a new server: no keys, no functions


@pytest.mark.parametrize("how", ["flushall", "restart"])
async def test_redis_losing_everything_mid_run(how, api, node, ledger, admin, private_redis,
                                               clock, db) -> None:
    await submit_all(api)
    await advance(clock, 2, node)
    await node.settle()

    # Mid-run: 80 finished (and applied), 40 held by handlers, 30 unread, 50 not yet due.
    await ledger.until(lambda: len(ledger.held) == WORKERS * CONCURRENCY,
                       "every worker slot holds a handler")
    assert len(ledger.finished) == FINISHED_BEFORE
    before = await drive_until(node, db, lambda s: s["succeeded"] == FINISHED_BEFORE,
                               "the first completions are in Postgres")
    assert before == {"succeeded": 80, "running": 40, "queued": 30}
    finished_before = set(ledger.finished)
    held = set(ledger.held)

    ledger.lost_data = True
    await lose_everything(how, admin, private_redis)

    if how == "flushall":
        # The late jobs fall due before any sweep: dispatched into the empty Redis as usual.
        await advance(clock, LATE_DELAY_S, node)
        await node.settle()
        assert await sweep_after_loss(node, clock) == 70  # the epoch key is gone
    else:
        assert await sweep_after_loss(node, clock) == 70
        assert await functions_loaded(admin)  # the sweeper reloaded them
        await advance(clock, LATE_DELAY_S, node)
        await node.settle()

    after = await drive_until(node, db, lambda s: s["succeeded"] == EARLY_JOBS + LATE_JOBS,
                              "every execution succeeded")
    assert after == {"succeeded": EARLY_JOBS + LATE_JOBS}

    # The held handlers were cancelled by the lost lease; none finished.
    await ledger.until(lambda: set(ledger.cut_off) == held, "every held handler is cut off")
    assert held.isdisjoint(ledger.finished)

    # No attempt ran twice, and each execution finished exactly once, at the attempt
    # Postgres records as its success.
    assert [k for k, n in Counter(ledger.started).items() if n > 1] == []
    by_execution = Counter(eid for eid, _ in ledger.finished)
    assert set(by_execution.values()) == {1}
    assert dict(ledger.finished) == await succeeded_attempts(db)

    # What finished before the loss did not run again; what was held or lost ran again
    # at attempt 2 (the sweeper's bump); the late jobs ran once, at attempt 1.
    assert finished_before.issubset(ledger.finished)
    assert {eid for eid, _ in finished_before} & {eid for eid, _ in held} == set()
    assert {eid: a for eid, a in ledger.finished if eid in dict(held)} == {
        eid: 2 for eid, _ in held}
    assert Counter(attempt for _, attempt in ledger.finished) == {1: 130, 2: 70}
    for eid, attempt in ledger.finished:
        earlier = [a for e, a in ledger.started if e == eid and a != attempt]
        assert all(a < attempt for a in earlier), (eid, earlier, attempt)


async def test_work_published_before_the_sweep_still_reaches_postgres(
        api, node, ledger, admin, private_redis, clock, db) -> None:
    """Work published into the empty Redis before the sweeper saw the loss.

    It went out under the scheduler's stale group cache: no pool-set entry, no
    consumer group. The sweeper puts both back, or the event actor would never
    read that pool's outcomes again (the sweep itself finds nothing to republish).
    """
    ledger.finish_before = EARLY_JOBS + LATE_JOBS  # nothing holds: a quiet moment
    await submit_all(api)
    await advance(clock, 2, node)
    await node.settle()
    await drive_until(node, db, lambda s: s["succeeded"] == EARLY_JOBS,
                      "the early jobs are in Postgres")

    # Redis loses everything while nothing is unfinished; the late jobs fall due and are
    # published into the empty Redis before the sweeper notices, so it republishes nothing.
    await lose_everything("flushall", admin, private_redis)
    await node.events.send(Tick())  # a second on: the event actor looks for pools again
    await sync(node.events)
    await advance(clock, LATE_DELAY_S, node)
    await node.settle()
    assert await node.sweeper.run_once() == 0

    after = await drive_until(node, db, lambda s: s["succeeded"] == EARLY_JOBS + LATE_JOBS,
                              "the late jobs' outcomes are in Postgres")
    assert after == {"succeeded": EARLY_JOBS + LATE_JOBS}
    assert [k for k, n in Counter(ledger.started).items() if n > 1] == []


async def test_the_attempt_cut_off_by_the_loss_does_not_stay_running_in_history(
        api, node, ledger, admin, private_redis, clock, db) -> None:
    ledger.finish_before = 0  # the one job's handler holds
    resp = await api.submit(make_job(schedule={"delaySeconds": 1}))
    assert resp.status == 201, await resp.text()
    await advance(clock, 2, node)
    await node.settle()
    await ledger.until(lambda: len(ledger.held) == 1, "the handler holds")
    await drive_until(node, db, lambda s: s["running"] == 1, "the lease is in Postgres")

    ledger.lost_data = True
    await lose_everything("flushall", admin, private_redis)
    assert await sweep_after_loss(node, clock) == 1
    await drive_until(node, db, lambda s: s["succeeded"] == 1, "attempt 2 succeeded")

    [(eid, _)] = ledger.held
    got = await (await api.client.get(f"/v1/executions/{eid}", headers=api.auth())).json()
    assert (got["state"], got["attempt"]) == ("succeeded", 2)
    assert [a["attempt"] for a in got["attempts"]] == [1, 2]
    assert got["attempts"][1]["outcome"] == "succeeded"
    assert got["attempts"][0]["outcome"] == "expired"
    assert got["attempts"][0]["finishedAt"] is not None


async def test_completions_redis_lost_before_postgres_had_them_are_sent_again_not_rerun(
        api, node, ledger, admin, private_redis, clock, db, caplog) -> None:
    """The window the loss opens: workers were told their completes were recorded, and the
    events saying so were still in Redis. The workers keep that evidence, and send it again
    (hw_recover) when they see Redis's new epoch; the sweeper waits for it."""
    ledger.finish_before = EARLY_JOBS + LATE_JOBS  # nothing holds
    await node._core.stop("execution-events")  # behind: nothing reaches Postgres yet
    await submit_all(api)
    await advance(clock, 2, node)
    await node.settle()
    await ledger.until(lambda: len(ledger.finished) == EARLY_JOBS, "the early jobs finished")
    assert (await states(db))["running"] + (await states(db))["queued"] == EARLY_JOBS

    await lose_everything("flushall", admin, private_redis)  # their events with it
    await node._core.start("execution-events", node._new_events)
    assert await node.sweeper.run_once() == 0  # a new epoch; waiting for the workers
    # The manual clock stands still: the sweeper republishes nothing while this waits.
    after = await drive_until(node, db, lambda s: s["succeeded"] == EARLY_JOBS,
                              "the recovered completions are in Postgres")
    assert after == {"succeeded": EARLY_JOBS}
    sent_again = [r for r in caplog.records if "event=completions_recovered" in r.getMessage()]
    assert sum(int(r.getMessage().split("count=")[1].split()[0]) for r in sent_again) \
        == EARLY_JOBS
    clock.advance(RECOVERY_GRACE_S)
    assert await node.sweeper.run_once() == 0  # nothing left to run again
    assert [k for k, n in Counter(ledger.started).items() if n > 1] == []
    assert Counter(attempt for _, attempt in ledger.finished) == {1: EARLY_JOBS}
    async with db.connection() as conn:
        recovered = await conn.fetchval(
            "SELECT count(*) FROM execution_attempts WHERE outcome = 'succeeded' "
            "AND worker_id LIKE 'worker-%'")
    assert recovered == EARLY_JOBS  # each by the worker that ran it


async def test_a_completion_sent_again_as_the_sweeper_republishes_stands(
        api, node, admin, private_redis, key_prefix, clock, db) -> None:
    """The race CI found under load: the sweeper looked at Redis (nothing there) and bumped
    the attempt in Postgres, and a worker's hw_recover of attempt 1 landed before the bump's
    publish. Redis must not run attempt 2 after a done attempt 1, and Postgres must take
    attempt 1's success over its bump; before, the job ran twice with both successes
    recorded. Here the worker is stopped before the loss and its recover is sent at that
    moment: the same FCALL, with what the worker would send."""
    worker = herdwick.Worker(private_redis.url, POOL, CONCURRENCY, key_prefix=key_prefix,
                             worker_id="worker-0", lease_s=LEASE_S, grace_s=1.0)
    finish = asyncio.Event()

    @worker.handler
    async def handle(ctx: herdwick.Context) -> dict:
        await finish.wait()
        return {"ok": True}

    async def until(what: str, done: Callable[[], Awaitable[bool]]) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT_S
        while not await done():
            assert loop.time() < deadline, f"not within {WAIT_S} s: {what}"
            await asyncio.sleep(POLL_S)

    for i in range(5):
        resp = await api.submit(make_job(name=f"raced-{i}", schedule={"delaySeconds": 1}))
        assert resp.status == 201, await resp.text()
    running = asyncio.create_task(worker.run())
    await advance(clock, 2, node)
    await node.settle()

    async def leases_in_postgres() -> bool:
        await node.settle_events()
        return (await states(db))["running"] == 5

    await until("the five leases in Postgres", leases_in_postgres)
    await node._core.stop("execution-events")  # behind from here: completions stay in Redis
    finish.set()
    events = keys.events_stream(key_prefix, POOL)

    async def completed_in_redis() -> bool:
        entries = await admin.xrange(events)
        return sum(f[b"e"].count(b'"completed"') for _, f in entries) == 5

    await until("the five completions in Redis", completed_in_redis)
    await asyncio.wait_for(worker.stop(), WAIT_S)
    await running

    async with db.connection() as conn:
        rows = await conn.fetch("SELECT execution_id, job_id, tenant_id, scheduled_for "
                                "FROM executions")
    now_ms = int(clock.now().timestamp() * 1000)
    completions = [v for r in rows for v in (
        str(r["execution_id"]), 1, str(r["job_id"]), str(r["tenant_id"]),
        format_utc(r["scheduled_for"]), now_ms - 50, now_ms, '{"ok": true}')]
    await lose_everything("flushall", admin, private_redis)
    await node._core.start("execution-events", node._new_events)

    publish = node.sweeper._publish

    async def recovered_first(pool: str, message) -> None:
        assert await admin.fcall("hw_recover", 1, keys.pool_base(key_prefix, POOL),
                                 "worker-0", *completions) == 5
        await publish(pool, message)

    node.sweeper._publish = recovered_first
    assert await sweep_after_loss(node, clock) == 5  # bumped in Postgres, sent to publish
    await node.settle()
    assert await admin.xlen(keys.ready_stream(key_prefix, POOL)) == 0  # attempt 2 not out
    node.sweeper._publish = publish
    after = await drive_until(node, db, lambda s: s["succeeded"] == 5, "attempt 1 stands")
    assert after == {"succeeded": 5}
    async with db.connection() as conn:
        assert await conn.fetchval("SELECT count(*) FROM executions WHERE attempt = 1") == 5
        attempts = await conn.fetch("SELECT attempt, outcome, error FROM execution_attempts")
        assert await conn.fetchval("SELECT count(*) FROM jobs WHERE state = 'completed'") == 5
    assert sorted((a["attempt"], a["outcome"], a["error"]) for a in attempts) == \
        [(1, "succeeded", None)] * 5
