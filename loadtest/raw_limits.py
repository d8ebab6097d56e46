"""The raw limits `loadtest herd` stands its figures beside, measured in the same run.

- heap memory: one shard actor's heap of HEAP_ENTRIES entries, built by
  actors/shard.py's own code, measured in this process (tracemalloc);
- the dispatch transaction: a second herd, in a scratch database of its own,
  through storage.dispatch.dispatch (claim_due + finish_dispatch) flat out,
  under leases a fake node claimed;
- then its executions through hw_publish (hiredis-packed on bare sockets, and
  through HotTier.publish), and as plain XADDs, pipelined.

This is the one module of loadtest/ that reaches into scheduler internals
(ShardActor._push, the dispatch planner's Plan): when those change, this is
what follows them.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import secrets
import sys
import time
import tracemalloc
import urllib.parse
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import hiredis
import msgspec

from herdwick import redis_client
from herdwick import schedule as sched
from herdwick.actors.shard import ShardActor, entry
from herdwick.clock import SystemClock, to_us
from herdwick.ids import SHARD_COUNT, uuid7
from herdwick.loadtest.driver import RunFailed, delete_keys, scratch_database, scratch_name
from herdwick.loadtest.jobs import (
    JobFactory,
    create_tenants,
    herd_batches,
    insert_batches,
    pool_names,
    tenant_counts,
)
from herdwick.loadtest.report import Progress
from herdwick.storage import dispatch as dispatch_store
from herdwick.storage import keys, leases
from herdwick.storage.db import Database
from herdwick.storage.dispatch import Claimed, Dispatched, DueKey, NewExecution
from herdwick.storage.hot import PUBLISH_CHUNK, HotTier, ReadyExecution, publish_arg

RAW_BATCH = 5_000  # keys per raw dispatch transaction: the dispatch actor's MAX_BATCH_KEYS
RAW_PUBLISH_BATCH = 2_000  # executions per raw publish call: the pool queue's PUBLISH_BATCH
RAW_XADD_PIPELINE = 1_000
RAW_LEASE_S = 600.0  # the fake node's leases outlive any raw phase
HEAP_ENTRIES = 100_000
HEAP_AIM_BYTES = 150
HEAP_CLASSES = 64  # as many fair-queue classes (tenant x pool) as a busy shard might hold


class HeapMemory(msgspec.Struct, frozen=True, kw_only=True):
    entries: int
    tracemalloc_bytes_per_entry: float
    getsizeof_bytes_per_entry: float
    aim_bytes: int = HEAP_AIM_BYTES


class RawLimits(msgspec.Struct, frozen=True, kw_only=True):
    jobs: int
    dispatch_connections: int
    dispatch_batch: int
    dispatch_s: float
    dispatch_rows_per_s: float
    publish_s: float
    publish_entries_per_s: float  # FCALL hw_publish as the pool queues batch it, hiredis-packed
    publish_client_s: float
    publish_client_entries_per_s: float  # the same through HotTier.publish (redis-py)
    xadd_s: float
    xadd_entries_per_s: float  # plain XADD of the stream fields, hiredis-packed, pipelined


# --- heap memory -------------------------------------------------------------------------


def heap_memory(count: int = HEAP_ENTRIES) -> HeapMemory:
    """Bytes per entry of a real ShardActor's heap and `_members` set, filled by its `_push`.

    Synchronous on purpose: no other task allocates while tracemalloc counts.
    `_push` is private, but it is exactly what a load runs per row, so the
    figure follows shard.py when its representation changes.
    """
    actor = ShardActor(0, 1, db=None, hand=None, reject=None,  # type: ignore[arg-type]
                       clock=SystemClock())
    now = datetime.now(UTC)
    due_us = to_us(now)
    job_ints = [uuid7(now).int for _ in range(count)]
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i, job in enumerate(job_ints):
            actor._push(entry(due_us + i, job, i % HEAP_CLASSES))
        traced = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    sized = (sum(sys.getsizeof(item) for item in actor.heap) + sys.getsizeof(actor.heap)
             + sys.getsizeof(actor._members))
    return HeapMemory(entries=count, tracemalloc_bytes_per_entry=traced / count,
                      getsizeof_bytes_per_entry=sized / count)


# --- the dispatch transaction ---------------------------------------------------------------


def one_execution_each(claimed: list[Claimed]) -> dispatch_store.Plan:
    """What the dispatch actor's planner writes for due one-off jobs: a queued execution at
    the due time and the job's next_run_at cleared. Nothing else: the raw limit."""
    now = datetime.now(UTC)
    return dispatch_store.Plan(
        executions=[NewExecution(uuid7(now), c.job_id, c.tenant_id, c.next_run_at, "queued")
                    for c in claimed],
        job_next=[(c.job_id, None) for c in claimed])


def ready_of(results: list[Dispatched]) -> dict[str, list[ReadyExecution]]:
    """The queued executions by pool, with the ready stream's contract fields."""
    by_pool: dict[str, list[ReadyExecution]] = collections.defaultdict(list)
    for result in results:
        jobs = {c.job_id: c for c in result.claimed}
        for q in result.queued:
            job = jobs[q.job_id]
            by_pool[job.pool].append(ReadyExecution(
                execution_id=str(q.execution_id), attempt=q.attempt, job_id=str(q.job_id),
                tenant_id=str(job.tenant_id), scheduled_for=sched.format_utc(q.scheduled_for),
                payload=job.payload, timeout_seconds=job.timeout_s, max_attempts=job.max_attempts,
                backoff_ms=round(job.backoff_s * 1000)))
    return dict(by_pool)


async def raw_dispatch(db: Database, due_keys: list[DueKey],
                       connections: int) -> tuple[float, list[Dispatched]]:
    """claim_due + finish_dispatch flat out, RAW_BATCH keys a transaction, `connections`
    transactions at a time, under every shard's lease held by a fake node."""
    node = f"loadtest-raw-{secrets.token_hex(4)}"
    held = await leases.claim(db, node, SHARD_COUNT, RAW_LEASE_S, None)
    revisions = {lease.shard_id: lease.revision for lease in held}
    batches = [due_keys[i:i + RAW_BATCH] for i in range(0, len(due_keys), RAW_BATCH)]
    pending = iter(batches)
    results: list[Dispatched] = []

    async def worker() -> None:
        for batch in pending:
            mine = {k.shard_id: revisions[k.shard_id] for k in batch}
            result = await dispatch_store.dispatch(db, node, mine, batch, None,
                                                   one_execution_each)
            if result.held != set(mine):
                raise RunFailed(f"raw dispatch lost leases: {sorted(set(mine) - result.held)}")
            results.append(result)

    start = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for _ in range(connections):
            tg.create_task(worker())
    elapsed = time.perf_counter() - start
    queued = sum(len(r.queued) for r in results)
    if queued != len(due_keys):
        raise RunFailed(f"raw dispatch queued {queued} of {len(due_keys)} rows")
    return elapsed, results


# --- the hot tier -----------------------------------------------------------------------------


class BareRedis:
    """One RESP connection with no client library in the way: commands packed and replies
    parsed by hiredis (C). What the server can take, not what redis-py can send."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer
        self._parser = hiredis.Reader()

    @classmethod
    async def connect(cls, url: str) -> BareRedis:
        """redis://[user:password@]host[:port][/db] or unix://[user:password@]/path[?db=N]."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme == "unix":  # the embedded server listens on a socket only
            reader, writer = await asyncio.open_unix_connection(parts.path)
            db = urllib.parse.parse_qs(parts.query).get("db", ["0"])[0]
        else:
            reader, writer = await asyncio.open_connection(parts.hostname or "127.0.0.1",
                                                           parts.port or 6379)
            db = parts.path.strip("/")
        conn = cls(reader, writer)
        try:
            if parts.password:
                await conn.pipeline([("AUTH", parts.username or "default", parts.password)])
            if db not in ("", "0"):
                await conn.pipeline([("SELECT", db)])
        except BaseException:
            await conn.close()
            raise
        return conn

    async def pipeline(self, commands: list[tuple]) -> list[object]:
        self._writer.write(b"".join(hiredis.pack_command(c) for c in commands))
        await self._writer.drain()
        replies: list[object] = []
        while len(replies) < len(commands):
            reply = self._parser.gets()
            if reply is False:
                data = await self._reader.read(1 << 16)
                if not data:
                    raise RunFailed("redis closed the connection")
                self._parser.feed(data)
            elif isinstance(reply, hiredis.ReplyError):
                raise RunFailed(f"redis: {reply}")
            else:
                replies.append(reply)
        return replies

    async def close(self) -> None:
        self._writer.close()
        with contextlib.suppress(OSError):
            await self._writer.wait_closed()


def _fcall_publish(base: str, items: list[ReadyExecution]) -> list[tuple]:
    """The pool queue's batch as HotTier.publish sends it: PUBLISH_CHUNK executions a call."""
    return [("FCALL", "hw_publish", 1, base, publish_arg(items[i:i + PUBLISH_CHUNK]))
            for i in range(0, len(items), PUBLISH_CHUNK)]


def _xadd(stream: str, item: ReadyExecution) -> tuple:
    return ("XADD", stream, "*", "execution_id", item.execution_id, "job_id", item.job_id,
            "tenant_id", item.tenant_id, "attempt", item.attempt,
            "scheduled_for", item.scheduled_for, "payload", item.payload,
            "timeout_seconds", item.timeout_seconds, "idempotency_key", item.idempotency_key)


ByPool = dict[str, list[ReadyExecution]]


async def _per_pool(by_pool: ByPool, one_pool: Callable[[str, list[ReadyExecution]], Any]
                    ) -> float:
    """Seconds for `one_pool` to run over every pool at once (one writer per pool, as the
    scheduler has one pool queue per pool)."""
    start = time.perf_counter()
    await asyncio.gather(*(one_pool(pool, items) for pool, items in by_pool.items()))
    return time.perf_counter() - start


async def raw_publish_client(hot: HotTier, by_pool: ByPool) -> float:
    """HotTier.publish (redis-py) in the pool queues' batches: the scheduler's client path."""

    async def one_pool(pool: str, items: list[ReadyExecution]) -> None:
        for i in range(0, len(items), RAW_PUBLISH_BATCH):
            await hot.publish({pool: items[i:i + RAW_PUBLISH_BATCH]})

    return await _per_pool(by_pool, one_pool)


async def _bare_per_pool(url: str, by_pool: ByPool, batch: int,
                         commands: Callable[[str, list[ReadyExecution]], list[tuple]]) -> float:
    """Each pool's `commands` on a bare connection of its own, `batch` executions a
    pipeline."""
    conns = {pool: await BareRedis.connect(url) for pool in by_pool}

    async def one_pool(pool: str, items: list[ReadyExecution]) -> None:
        for i in range(0, len(items), batch):
            await conns[pool].pipeline(commands(pool, items[i:i + batch]))

    try:
        return await _per_pool(by_pool, one_pool)
    finally:
        for conn in conns.values():
            await conn.close()


async def raw_publish_bare(url: str, prefix: str, by_pool: ByPool) -> float:
    """The same FCALLs, hiredis-packed on bare connections: the server's limit."""
    bases = {pool: keys.pool_base(prefix, pool) for pool in by_pool}
    return await _bare_per_pool(url, by_pool, RAW_PUBLISH_BATCH,
                                lambda pool, items: _fcall_publish(bases[pool], items))


async def raw_xadd_bare(url: str, prefix: str, by_pool: ByPool) -> float:
    """The same entries as plain XADDs, hiredis-packed, RAW_XADD_PIPELINE a pipeline."""
    streams = {pool: keys.ready_stream(prefix, pool) for pool in by_pool}
    return await _bare_per_pool(url, by_pool, RAW_XADD_PIPELINE,
                                lambda pool, items: [_xadd(streams[pool], it) for it in items])


async def raw_redis(url: str, by_pool: ByPool, progress: Progress) -> tuple[float, float, float]:
    """Seconds for: hw_publish via redis-py, hw_publish bare, XADD bare; each on a fresh
    prefix (hw_publish skips an attempt already published), all deleted afterwards."""
    prefixes = [f"hwraw{secrets.token_hex(4)}" for _ in range(3)]
    client = redis_client.connect(url)
    try:
        await HotTier(client, prefixes[0]).load_functions()
        progress.set("raw limit: hw_publish")
        client_s = await raw_publish_client(HotTier(client, prefixes[0]), by_pool)
        bare_s = await raw_publish_bare(url, prefixes[1], by_pool)
        progress.set("raw limit: XADD")
        xadd_s = await raw_xadd_bare(url, prefixes[2], by_pool)
    finally:
        for prefix in prefixes:
            await delete_keys(client, prefix)
        await client.aclose()
    return client_s, bare_s, xadd_s


# --- all of them ------------------------------------------------------------------------------


class RawShape(msgspec.Struct, frozen=True, kw_only=True):
    """The second herd: as the measured one, already due."""

    jobs: int
    tenants: int
    pools: int
    skew: float
    insert_connections: int
    connections: int  # parallel dispatch transactions


async def raw_limits(database_url: str, redis_url: str, shape: RawShape,
                     progress: Progress) -> RawLimits:
    name = f"{scratch_name('herd')}_raw"
    async with scratch_database(database_url, name, False, progress.say) as dsn:
        db = await Database.connect(dsn, max_size=max(shape.insert_connections,
                                                      shape.connections))
        try:
            due_keys = await _insert_raw_herd(db, shape, progress)
            progress.set("raw limit: dispatch transactions")
            dispatch_s, results = await raw_dispatch(db, due_keys, shape.connections)
        finally:
            await db.close()
    client_s, bare_s, xadd_s = await raw_redis(redis_url, ready_of(results), progress)
    n = len(due_keys)
    return RawLimits(jobs=n, dispatch_connections=shape.connections, dispatch_batch=RAW_BATCH,
                     dispatch_s=dispatch_s, dispatch_rows_per_s=n / dispatch_s,
                     publish_s=bare_s, publish_entries_per_s=n / bare_s,
                     publish_client_s=client_s, publish_client_entries_per_s=n / client_s,
                     xadd_s=xadd_s, xadd_entries_per_s=n / xadd_s)


async def _insert_raw_herd(db: Database, shape: RawShape, progress: Progress) -> list[DueKey]:
    """The second herd, already due; returns its due keys in shard order."""
    tenants = await create_tenants(db, shape.tenants)
    batches = herd_batches(JobFactory(pool_names(shape.pools)), tenants,
                           tenant_counts(shape.jobs, shape.tenants, shape.skew),
                           datetime.now(UTC))
    inserted = [0]
    progress.set("raw limit: submitting", done=lambda: inserted[0], total=shape.jobs)
    await insert_batches(db, batches, shape.insert_connections,
                         lambda n: inserted.__setitem__(0, inserted[0] + n))
    due_keys = [DueKey(j.shard_id, j.next_run_at, j.job_id) for _, jobs in batches for j in jobs]
    due_keys.sort(key=lambda k: (k.shard_id, k.job_id.int))
    return due_keys
