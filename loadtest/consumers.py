"""No-op consumers of the ready streams, and what they saw (`loadtest herd`).

They read as a worker would (XREADGROUP on the workers group, XACK) but lease
nothing and run nothing: what is measured is the scheduler tier's dispatch.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator

import msgspec
import redis.asyncio as aioredis

from herdwick.loadtest.jobs import TenantRef
from herdwick.storage import keys
from herdwick.storage.hot import HotTier
from herdwick.storage.jobs import NewJob

CONSUMER_COUNT = 1_000
CONSUMER_BLOCK_MS = 100
STOP_S = 35.0  # past the client's socket timeout
HERD, BACKGROUND = 0, 1  # the kinds of job a Watch tells apart


class StreamCheck(msgspec.Struct, frozen=True, kw_only=True):
    """Each expected job should appear on the streams exactly once, under its own tenant."""

    expected: int
    seen: int  # distinct jobs
    duplicates: int  # sightings past the first
    missing: int
    wrong_tenant: int

    @property
    def exact(self) -> bool:
        return self.seen == self.expected and not (self.duplicates or self.wrong_tenant)


class Watch:
    """What the no-op consumers saw on the ready streams.

    The consumer tasks write (`note`); the run and the progress line read. One
    event loop, so no locking. Only a job's first sighting is kept for lag;
    later ones count as duplicates.
    """

    def __init__(self) -> None:
        self._expected: dict[bytes, tuple[int, bytes]] = {}  # job id -> (kind, tenant key)
        self._seen: set[bytes] = set()
        self.expected = [0, 0]  # by kind
        self.seen = [0, 0]
        self.duplicates = [0, 0]
        self.wrong_tenant = [0, 0]
        self.unknown = 0
        # per kind: (tenant key, XADD ms, scheduled_for text), first sightings only
        self.entries: list[list[tuple[bytes, int, bytes]]] = [[], []]
        self.complete = [asyncio.Event(), asyncio.Event()]
        self._closed = [False, False]  # no more jobs of that kind will be expected

    def expect(self, kind: int, jobs: list[NewJob], tenant: TenantRef) -> None:
        for job in jobs:
            self._expected[str(job.job_id).encode()] = (kind, tenant.key)
        self.expected[kind] += len(jobs)

    def close(self, kind: int) -> None:
        self._closed[kind] = True
        self._check(kind)

    def note(self, job: bytes, tenant: bytes, added_ms: int, scheduled_for: bytes) -> None:
        known = self._expected.get(job)
        if known is None:
            self.unknown += 1
            return
        kind, tenant_key = known
        if job in self._seen:
            self.duplicates[kind] += 1
            return
        self._seen.add(job)
        self.seen[kind] += 1
        if tenant != tenant_key:
            self.wrong_tenant[kind] += 1
        self.entries[kind].append((tenant, added_ms, scheduled_for))
        self._check(kind)

    def _check(self, kind: int) -> None:
        if self._closed[kind] and self.seen[kind] >= self.expected[kind]:
            self.complete[kind].set()

    def check(self, kind: int) -> StreamCheck:
        return StreamCheck(expected=self.expected[kind], seen=self.seen[kind],
                           duplicates=self.duplicates[kind],
                           missing=self.expected[kind] - self.seen[kind],
                           wrong_tenant=self.wrong_tenant[kind])


async def consume(client: aioredis.Redis, prefix: str, pool: str, watch: Watch,
                  stop: asyncio.Event) -> None:
    """A no-op worker: XREADGROUP on `workers`, note each entry, XACK, until `stop`."""
    stream = keys.ready_stream(prefix, pool)
    consumer = f"loadtest-{secrets.token_hex(3)}"
    while not stop.is_set():
        reply = await client.xreadgroup(keys.WORKERS_GROUP, consumer, {stream: ">"},
                                        count=CONSUMER_COUNT, block=CONSUMER_BLOCK_MS)
        for _, entries in reply or ():
            ids = []
            for entry_id, fields in entries:
                ids.append(entry_id)
                watch.note(fields[b"job_id"], fields[b"tenant_id"],
                           int(entry_id.split(b"-", 1)[0]), fields[b"scheduled_for"])
            if ids:
                await client.xack(stream, keys.WORKERS_GROUP, *ids)


@contextlib.asynccontextmanager
async def consumers(client: aioredis.Redis, prefix: str, pools: list[str],
                    watch: Watch) -> AsyncIterator[None]:
    hot = HotTier(client, prefix)
    for pool in pools:  # the group must exist before the first XREADGROUP
        await hot.ensure_group(pool)
    stop = asyncio.Event()
    tasks = [asyncio.create_task(consume(client, prefix, pool, watch, stop)) for pool in pools]
    try:
        yield
        for task in tasks:
            if task.done():  # a consumer that failed must not pass for an empty stream
                task.result()
    finally:
        # Stopped between reads (each blocks CONSUMER_BLOCK_MS), not cancelled inside a
        # Redis call: see measure.StreamSampler.sampling.
        stop.set()
        _, pending = await asyncio.wait(tasks, timeout=STOP_S)
        for task in pending:
            task.cancel()
