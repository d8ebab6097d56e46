"""A scheduler dies holding a herd in its fair queue: the survivor dispatches it, each once.

actors/fairqueue.py: what does not fit on a pool's bounded ready stream waits
in the fair queues, and is durable in Postgres as due_index rows until the
dispatch transaction that creates its execution deletes them. So a scheduler
that dies loses nothing of what it held (its shards' next owner loads the
rows again) and duplicates nothing (a row is deleted once).

Here that happens to real processes: two `herdwick scheduler`s with
HERDWICK_READY_MAX=100 split the 256 shards, and 3,000 jobs of three tenants
fall due at one instant in one pool. Then one node is SIGKILLed. SDK workers
drain the pool; the survivor takes the dead node's shards once their leases
lapse (10 s: the coordinator's LEASE_S and NODE_TTL_S, on the database's
clock, so the test waits them out in real time) and dispatches the rest.

- With no worker yet, the stream fills to its bound and every other job
  waits; the node with more of that waiting work dies. The stream is full,
  so nothing it was granted is unpublished (hw_admit keeps undelivered +
  granted <= the bound).
- With workers draining and the doomed node's dispatch stalled in Postgres (a
  lock wait), it goes on asking for room it cannot fill until it holds the
  whole bound, and dies holding it. Its grants lapse RESERVED_TTL_MS after
  they were made, however often the survivor asks meanwhile.

Either way the dead node had nothing committed and not published, so the
sweeper's republish (attempt + 1: the at-least-once allowance after a crash)
has nothing to do: every execution runs once, at attempt 1, from one stream
entry.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

import herdwick
from herdwick.clock import ManualClock
from herdwick.storage import keys
from herdwick.storage.db import Database
from herdwick.storage.hot import Admission, HotTier
from tests.faults.test_scheduler_process import owners, start_process
from tests.integration.conftest import Api, make_job, tenant_api

# The stages' own deadlines (below) add up to 100 s besides the stack's start: under the
# suite's default 120 s a slow run would end without saying which stage stalled.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

POOL = "emails"
TENANTS = ("acme", "globex", "initech")  # acme is tenant_api's own
JOBS_PER_TENANT = 1000  # one jobs:batch request each
JOBS = JOBS_PER_TENANT * len(TENANTS)
READY_MAX = 100
WORKERS = 2
CONCURRENCY = 50
WORKER_LEASE_S = 10.0
SETTLE_WAIT_S = 20.0  # the schedulers split the shards; the stream fills to its bound
DRAIN_WAIT_S = 40.0  # the dead node's leases and grants lapse (10-14 s), then the drain
POLL_S = 0.05  # other processes do the work: Postgres and Redis are looked at this often
SAMPLE_S = 0.02
HELD_POLLS = 10  # half a second on end: a steady state, not a grant in flight


@pytest.fixture
def clock() -> ManualClock:
    """The gateway's clock, held still at real time: every job is due at one instant."""
    return ManualClock(datetime.now(UTC).replace(microsecond=0))


@dataclass
class Node:
    """A `herdwick scheduler` process; its stderr is read all along, so it never blocks."""

    proc: asyncio.subprocess.Process
    lines: list[bytes] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def read_stderr(self) -> None:
        while line := await self.proc.stderr.readline():
            self.lines.append(line)

    async def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        assert await self.proc.wait() == -signal.SIGKILL

    async def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(self.proc.wait(), 30) == 0, self.tail()

    def tail(self, n: int = 20) -> str:
        return b"".join(self.lines[-n:]).decode(errors="replace")


def pid_of(node_id: str) -> int:
    """Scheduler node ids are host:pid:random (actors/scheduler.py new_node_id)."""
    return int(node_id.rsplit(":", 2)[1])


@dataclass
class Ledger:
    """What the workers' handler saw: each (execution_id, attempt) started and finished."""

    started: list[tuple[str, int]] = field(default_factory=list)
    finished: list[tuple[str, int]] = field(default_factory=list)

    async def handle(self, ctx: herdwick.Context) -> dict:
        key = (ctx.execution_id, ctx.attempt)
        self.started.append(key)
        await asyncio.sleep(0)  # a handler that yields, as real ones do
        self.finished.append(key)
        return {"attempt": ctx.attempt}


@dataclass
class StreamSamples:
    """The pool's ready stream, sampled all along: undelivered entries (the `workers`
    group's lag: what hw_admit bounds) and XLEN, which also counts delivered entries
    until the reaper trims them (once a second): the bound plus a second's deliveries."""

    undelivered: list[int] = field(default_factory=list)
    length: list[int] = field(default_factory=list)
    stopped: bool = False  # run() returns at its next turn

    async def run(self, client: aioredis.Redis, key_prefix: str) -> None:
        stream = keys.ready_stream(key_prefix, POOL)
        while not self.stopped:
            try:
                groups = await client.xinfo_groups(stream)
                length = await client.xlen(stream)
            except ResponseError:  # nothing published yet
                groups, length = [], 0
            for group in groups:
                if group["name"] == keys.WORKERS_GROUP.encode():
                    lag = group["lag"]
                    self.undelivered.append(length if lag is None else lag)
            self.length.append(length)
            await asyncio.sleep(SAMPLE_S)


@dataclass
class Cluster:
    """The two scheduler processes and what the test watches them through."""

    nodes: list[Node]
    db: Database
    hot: HotTier

    def node(self, node_id: str) -> Node:
        [found] = [n for n in self.nodes if n.pid == pid_of(node_id)]
        return found

    async def room(self) -> Admission:
        """hw_admit asked for nothing: the bound, what is undelivered and what is granted."""
        return await self.hot.admit(POOL, 0, READY_MAX)

    async def until(self, condition: Callable[[], Awaitable[object]], timeout_s: float,
                    what: str) -> object:
        """Poll until `condition` returns something truthy: the work is other processes'."""
        deadline = time.monotonic() + timeout_s
        while not (found := await condition()):
            if time.monotonic() > deadline:
                raise AssertionError(f"not within {timeout_s} s: {what}\n{await self.state()}")
            await asyncio.sleep(POLL_S)
        return found

    async def state(self) -> str:
        lines = [f"executions {dict(await execution_counts(self.db))}",
                 f"due rows by owner {await due_by_owner(self.db)}",
                 f"shards by owner {await owners(self.db)}", f"stream {await self.room()}"]
        lines += [f"--- scheduler {n.pid} (exit {n.proc.returncode}):\n{n.tail()}"
                  for n in self.nodes]
        return "\n".join(lines)


@pytest.fixture
async def cluster(db_url, db, services, key_prefix, redis_client) -> AsyncIterator[Cluster]:
    """Two scheduler processes on the test's database and prefix, the pool bound READY_MAX,
    once they hold 128 shards each."""
    procs = await asyncio.gather(*(start_process(db_url, services.redis_url, key_prefix,
                                                 ready_max=str(READY_MAX)) for _ in range(2)))
    nodes = [Node(proc) for proc in procs]
    readers = [asyncio.create_task(node.read_stderr()) for node in nodes]
    found = Cluster(nodes, db, HotTier(redis_client, key_prefix))
    try:
        async def split() -> bool:
            held = await owners(db)
            return sorted(held.values()) == [128, 128] and None not in held

        await found.until(split, SETTLE_WAIT_S, "the two schedulers hold 128 shards each")
        yield found
    finally:
        for node in nodes:
            if node.proc.returncode is None:
                node.proc.kill()
                await node.proc.wait()
        await asyncio.gather(*readers)


@contextlib.asynccontextmanager
async def sampling(client: aioredis.Redis, key_prefix: str) -> AsyncIterator[StreamSamples]:
    samples = StreamSamples()
    task = asyncio.create_task(samples.run(client, key_prefix))
    try:
        yield samples
    finally:
        # Not by the cancel alone: one that lands as a Redis call returns can be lost inside
        # redis-py, and the loop would sample for ever (the test hung here, once in ~12 runs).
        samples.stopped = True
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@contextlib.asynccontextmanager
async def workers(redis_url: str, key_prefix: str, ledger: Ledger) -> AsyncIterator[None]:
    """Real SDK workers on the pool, each running the ledger's handler."""
    started = [herdwick.Worker(redis_url, POOL, CONCURRENCY, key_prefix=key_prefix,
                               worker_id=f"worker-{i}", lease_s=WORKER_LEASE_S, grace_s=1.0)
               for i in range(WORKERS)]
    for worker in started:
        worker.handler(ledger.handle)
    tasks = [asyncio.create_task(worker.run()) for worker in started]
    try:
        yield
    finally:
        for worker in started:
            await asyncio.wait_for(worker.stop(), 10)
        await asyncio.gather(*tasks)


@contextlib.asynccontextmanager
async def lease_rows_locked(db, node_id: str) -> AsyncIterator[Callable[[], Awaitable[None]]]:
    """The node's shard_leases rows locked FOR UPDATE: its dispatch transactions, which
    hold them FOR SHARE, wait (as behind a slow migration). Yields `release`."""
    async with db.connection() as conn:
        tx = conn.transaction()
        await tx.start()
        released = False

        async def release() -> None:
            nonlocal released
            if not released:
                released = True
                await tx.rollback()

        try:
            await conn.execute("SELECT 1 FROM shard_leases WHERE owner = $1 FOR UPDATE",
                               node_id)
            yield release
        finally:
            await release()


async def submit_herd(api: Api) -> None:
    for name in TENANTS:
        key = api.key if name == "acme" else (await api.create_tenant(name))["apiKey"]
        jobs = [make_job(name=f"{name}-{i}", schedule={"delaySeconds": 1})
                for i in range(JOBS_PER_TENANT)]
        resp = await api.client.post("/v1/jobs:batch", json={"jobs": jobs},
                                     headers=api.auth(key))
        assert resp.status == 201, await resp.text()


async def due_by_owner(db) -> dict[str, int]:
    async with db.connection() as conn:
        rows = await conn.fetch("SELECT l.owner, count(*) AS n FROM due_index d "
                                "JOIN shard_leases l USING (shard_id) GROUP BY l.owner")
    return {r["owner"]: r["n"] for r in rows}


async def execution_counts(db) -> Counter:
    async with db.connection() as conn:
        rows = await conn.fetch("SELECT state, count(*) AS n FROM executions GROUP BY state")
    return Counter({r["state"]: r["n"] for r in rows})


async def dispatch_waits_on_a_lock(db) -> bool:
    async with db.connection() as conn:
        return await conn.fetchval(
            "SELECT count(*) > 0 FROM pg_stat_activity "
            "WHERE datname = current_database() AND wait_event_type = 'Lock' "
            "AND query LIKE '%FOR SHARE OF l%'")


async def drain_after_kill(cluster: Cluster, survivor_id: str) -> None:
    async def taken_over() -> bool:
        return await owners(cluster.db) == {survivor_id: 256}

    async def drained() -> bool:
        return await execution_counts(cluster.db) == {"succeeded": JOBS}

    await cluster.until(taken_over, DRAIN_WAIT_S, "the survivor holds every shard")
    await cluster.until(drained, DRAIN_WAIT_S, "every execution succeeded")
    await cluster.node(survivor_id).terminate()


async def assert_each_ran_once(db, redis_client, key_prefix: str, ledger: Ledger,
                               samples: StreamSamples) -> None:
    # Each job has exactly one execution for its occurrence, and nothing waits any more.
    async with db.connection() as conn:
        total, occurrences, jobs_run = await conn.fetchrow(
            "SELECT count(*), count(DISTINCT (job_id, scheduled_for)), count(DISTINCT job_id) "
            "FROM executions")
        assert (total, occurrences, jobs_run) == (JOBS, JOBS, JOBS)
        assert await conn.fetchval("SELECT count(*) FROM jobs") == JOBS
        assert await conn.fetchval("SELECT count(*) FROM due_index") == 0
        attempts = {str(r["execution_id"]): r["attempt"] for r in await conn.fetch(
            "SELECT execution_id, attempt FROM executions WHERE state = 'succeeded'")}
        history = await conn.fetch(
            "SELECT execution_id, count(*) FILTER (WHERE outcome = 'succeeded') AS ok, "
            "count(*) AS n FROM execution_attempts GROUP BY execution_id")
    assert len(attempts) == JOBS
    assert len(history) == JOBS and {(r["ok"], r["n"]) for r in history} == {(1, 1)}

    # No attempt ran twice; each execution finished once, at the attempt Postgres has.
    assert [k for k, n in Counter(ledger.started).items() if n > 1] == []
    assert set(Counter(eid for eid, _ in ledger.finished).values()) == {1}
    assert dict(ledger.finished) == attempts

    # The stream took one entry an attempt: the dispatch's, then one per republish.
    # hw_publish adds an attempt once however often it is retried, so a duplicate could
    # only be a republish with attempt + 1; the dead node left none to make.
    info = await redis_client.xinfo_stream(keys.ready_stream(key_prefix, POOL))
    assert info["entries-added"] == sum(attempts.values())
    assert set(attempts.values()) == {1}

    # The bound held while the nodes raced for room and while one was dead: hw_admit
    # counts undelivered entries and every node's unpublished grants together.
    assert max(samples.undelivered) <= READY_MAX, (
        f"undelivered peaked at {max(samples.undelivered)}; XLEN at {max(samples.length)}")


async def test_a_scheduler_killed_with_a_full_fair_queue_loses_and_repeats_nothing(
        cluster, db_url, db, services, key_prefix, redis_client, clock) -> None:
    ledger = Ledger()
    async with sampling(redis_client, key_prefix) as samples, \
            tenant_api(db_url, services.redis_url, key_prefix, clock) as api:
        await submit_herd(api)

        # The stream fills to its bound and stays there; the rest waits in both nodes'
        # shards as due rows (and in their fair queues, once loaded and due).
        async def full() -> dict | None:
            room = await cluster.room()
            waiting = await due_by_owner(db)
            at_bound = (room.waiting, room.reserved) == (READY_MAX, 0) \
                and await execution_counts(db) == {"queued": READY_MAX}
            return waiting if at_bound and len(waiting) == 2 else None

        waiting = await cluster.until(full, SETTLE_WAIT_S, "the stream is at its bound")
        assert sum(waiting.values()) == JOBS - READY_MAX
        assert datetime.now(UTC) > clock.now()  # due: what waits, waits for room

        dead_id = max(waiting, key=waiting.get)
        [survivor_id] = set(waiting) - {dead_id}
        await cluster.node(dead_id).kill()
        async with workers(services.redis_url, key_prefix, ledger):
            await drain_after_kill(cluster, survivor_id)

    await assert_each_ran_once(db, redis_client, key_prefix, ledger, samples)


async def test_a_scheduler_killed_holding_the_stream_s_room_gives_it_back(
        cluster, db_url, db, services, key_prefix, redis_client, clock) -> None:
    dead_id, survivor_id = sorted(await owners(db))
    ledger = Ledger()
    async with sampling(redis_client, key_prefix) as samples, \
            tenant_api(db_url, services.redis_url, key_prefix, clock) as api, \
            workers(services.redis_url, key_prefix, ledger), \
            lease_rows_locked(db, dead_id) as release:
        await submit_herd(api)

        # The stalled node's grants are never published, and it keeps asking: room the
        # workers make goes to it or to the survivor, and only the survivor's comes back.
        # So it comes to hold the whole bound, and the survivor can publish nothing.
        held_for = 0

        async def holds_the_bound() -> bool:
            nonlocal held_for
            room = await cluster.room()
            stalled = (room.waiting, room.reserved) == (0, READY_MAX) \
                and await dispatch_waits_on_a_lock(db)
            held_for = held_for + 1 if stalled else 0
            return held_for >= HELD_POLLS

        await cluster.until(holds_the_bound, SETTLE_WAIT_S, "one node holds all the room")
        assert len(await due_by_owner(db)) == 2  # the survivor has work it cannot publish

        # It dies holding it; its transaction, let go, cannot commit. The survivor keeps
        # asking for room all along, and gets it once the dead node's grants lapse.
        await cluster.node(dead_id).kill()
        await release()
        await drain_after_kill(cluster, survivor_id)

    await assert_each_ran_once(db, redis_client, key_prefix, ledger, samples)
