"""`herdwick loadtest herd`: a herd of jobs due in one second, against a stack it starts.

One run, in order:

1. heap memory: one shard actor's heap of HEAP_ENTRIES entries, built by
   actors/shard.py's own code, measured in this process (tracemalloc);
2. raw limits, in a scratch database of their own: a second herd of the same
   size through the fenced dispatch transaction (storage.dispatch.dispatch:
   claim_due + finish_dispatch) flat out, under leases a fake node claimed;
   then its executions through hw_publish, and as plain XADDs, pipelined;
3. the herd: `schedulers` processes of `herdwick scheduler` on a fresh
   database and Redis key prefix. The herd is inserted parked a day ahead,
   then moved in one transaction to a whole second `due_in_s` ahead, so every
   shard has loaded it before it falls due. No-op consumers read the ready
   streams. An optional steady background is inserted with a short delay
   (and notified, as the gateway does).

Lag is read from the streams, not from the scheduler's histograms (they live
in the other process): an entry's ID is the Redis server's clock at XADD in
ms, its `scheduled_for` field the due time. Every figure stands beside the
raw limit of the same work on this machine, measured in the same run.
Only loopback addresses; every wait has a deadline; the scheduler processes,
scratch databases and Redis keys are removed however the run ends.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import gc
import math
import os
import secrets
import shutil
import signal
import sys
import time
import tracemalloc
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any, TextIO

import asyncpg
import hiredis
import msgspec
import psutil
import redis.asyncio as aioredis
from msgspec import Meta

from herdwick import schedule as sched
from herdwick.actors.shard import ShardActor, entry, to_us
from herdwick.clock import SystemClock
from herdwick.config import ConfigError
from herdwick.errors import HerdwickError
from herdwick.gateway.submit import prepare
from herdwick.ids import SHARD_COUNT, shard_of, uuid7
from herdwick.loadtest.common import Child, require_loopback, with_database
from herdwick.model import JobSpec, Schedule, Target, TenantSpec
from herdwick.storage import dispatch as dispatch_store
from herdwick.storage import keys, leases, migrate
from herdwick.storage.db import Database
from herdwick.storage.dispatch import Claimed, Dispatched, DueKey, NewExecution
from herdwick.storage.hot import PUBLISH_CHUNK, HotTier, NotifyMessage, ReadyExecution, publish_arg
from herdwick.storage.jobs import NewJob, due_minute, insert_jobs
from herdwick.storage.tenants import create_tenant

DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
PAYLOAD = b'{"user": "user42@example.com", "template": "welcome", "tags": ["a", "b"]}'
INSERT_BATCH = 1_000  # jobs per insert_jobs call
RAW_BATCH = 5_000  # keys per raw dispatch transaction: the dispatch actor's MAX_BATCH_KEYS
RAW_PUBLISH_BATCH = 2_000  # executions per raw publish call: the pool queue's PUBLISH_BATCH
RAW_XADD_PIPELINE = 1_000
RAW_LEASE_S = 600.0  # the fake node's leases outlive any raw phase
HEAP_ENTRIES = 100_000
HEAP_AIM_BYTES = 150
PARK_AHEAD = timedelta(days=1)  # far past the shards' lookahead: invisible until moved
BACKGROUND_TICK_S = 0.1
CONSUMER_COUNT = 1_000
CONSUMER_BLOCK_MS = 100
IDLE_SAMPLE_S = 2.0
DUPLICATE_GRACE_S = 1.0  # keep reading this long after the last expected entry
RSS_SAMPLE_S = 0.1
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 20.0
CLEANUP_GRACE_S = 60.0  # past --timeout, for stopping and dropping: the hard bound
PROGRESS_EVERY_S = 1.0
HERD, BACKGROUND = 0, 1
MIN_LEAD_S = 2.5  # a shard loads every 2 s: a herd moved later than this may be loaded late
BUSY_WARN_SHARE = 0.2  # the machine busier than this before the load: other work skews it


class RunFailed(HerdwickError):
    """The stack did not come up or died during the run; the message says which part."""


# --- what to run ----------------------------------------------------------------------


class Plan(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The shape of the load."""

    jobs: Annotated[int, Meta(ge=0, le=10_000_000)] = 100_000
    tenants: Annotated[int, Meta(ge=1, le=1_000)] = 10
    pools: Annotated[int, Meta(ge=1, le=64)] = 4
    skew: Annotated[float, Meta(ge=0, lt=1)] = 0.0  # the noisy tenant's share; 0: even
    due_in_s: Annotated[float, Meta(ge=1, le=600)] = 5.0
    rate: Annotated[float, Meta(ge=0, le=100_000)] = 0.0  # background jobs/s
    duration_s: Annotated[float, Meta(gt=0, le=3_600)] = 20.0  # of the background
    delay_s: Annotated[float, Meta(ge=0.5, le=60)] = 2.5  # background jobs' delaySeconds
    schedulers: Annotated[int, Meta(ge=1, le=16)] = 1
    insert_connections: Annotated[int, Meta(ge=1, le=64)] = 4
    raw: bool = True
    raw_connections: Annotated[int, Meta(ge=1, le=64)] = 2  # the scheduler's DISPATCH_ACTORS
    timeout_s: Annotated[float, Meta(gt=0, le=3_600)] = 120.0

    @property
    def background_jobs(self) -> int:
        return round(self.rate * self.duration_s)

    @property
    def raw_jobs(self) -> int:
        return self.jobs or self.background_jobs


class Options(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    plan: Plan = Plan()
    database_url: str = DEFAULT_DATABASE_URL
    redis_url: str = DEFAULT_REDIS_URL
    keep: bool = False
    py_spy_dir: str | None = None  # record each scheduler with py-spy during the herd


# --- the report -------------------------------------------------------------------------


class Lag(msgspec.Struct, frozen=True, kw_only=True):
    """Stream entry time minus scheduled_for, nearest-rank percentiles."""

    samples: int
    p50_ms: float
    p95_ms: float
    p99_ms: float
    max_ms: float


class TenantLag(msgspec.Struct, frozen=True, kw_only=True):
    tenant: str
    expected: int
    seen: int
    lag: Lag


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


class HerdResult(msgspec.Struct, frozen=True, kw_only=True):
    jobs: int
    due_at: datetime
    insert_s: float
    insert_jobs_per_s: float
    move_s: float  # the transaction that moved the herd to its due second
    lead_s: float  # from the move's commit to the due second: the shards' time to load it
    check: StreamCheck
    first_after_due_ms: float
    last_after_due_ms: float
    jobs_per_s: float  # jobs / (last XADD - due second)
    peak_per_s: int  # most entries XADDed in one second after due
    lag: Lag
    tenants: list[TenantLag]


class BackgroundResult(msgspec.Struct, frozen=True, kw_only=True):
    rate: float
    duration_s: float
    delay_s: float
    check: StreamCheck
    generator_late_max_ms: float  # how far the generator's inserts fell behind its schedule
    lag: Lag
    tenants: list[TenantLag]


class SchedulerCost(msgspec.Struct, frozen=True, kw_only=True):
    """CPU and memory of the scheduler processes (psutil), all of them together."""

    processes: int
    window: str  # what the CPU window covers
    window_s: float
    jobs: int
    cpu_s: float
    cpu_s_per_1000: float
    idle_cpu_s_per_s: float  # before the load: shard loads, lease renewals
    net_cpu_s_per_1000: float  # with the idle rate over the window taken off
    machine_busy_share: float  # every CPU, every process, over the window
    idle_machine_busy_share: float  # the same before the load: other work on the machine
    baseline_rss_mb: list[float]
    peak_rss_mb: list[float]  # per process: the kernel's high-water mark (VmHWM)
    rss_growth_bytes_per_job: float  # (sum of peaks - sum of baselines) / jobs


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


class Ratio(msgspec.Struct, frozen=True, kw_only=True):
    figure: str
    herd: float
    raw: float
    herd_over_raw: float


class Machine(msgspec.Struct, frozen=True, kw_only=True):
    cpus: int
    python: str
    postgres: str
    fsync: str
    synchronous_commit: str
    redis: str
    load_average_1m: float  # at the start: other work on the machine skews every figure


class Report(msgspec.Struct, frozen=True, kw_only=True):
    started_at: datetime
    plan: Plan
    machine: Machine
    heap: HeapMemory
    raw: RawLimits | None
    herd: HerdResult | None
    background: BackgroundResult | None
    cost: SchedulerCost
    ratios: list[Ratio]
    profiles: list[str]
    warnings: list[str]  # what makes this run's figures doubtful

    @property
    def complete(self) -> bool:
        return all(r.check.exact for r in (self.herd, self.background) if r is not None)


# --- progress ---------------------------------------------------------------------------


class Progress:
    """One line a second on a stream (stderr in the command); silent without one.

    The run sets `phase` and `detail` (a callable for the phase's counters); the
    ticker task reads them. One event loop, so no locking.
    """

    def __init__(self, stream: TextIO | None) -> None:
        self._stream = stream
        self._start = time.perf_counter()
        self.phase = "setup"
        self.detail: Callable[[], str] = lambda: ""

    def set(self, phase: str, detail: Callable[[], str] | None = None) -> None:
        self.phase, self.detail = phase, detail or (lambda: "")

    def say(self, text: str) -> None:
        if self._stream is not None:
            self._stream.write(text + "\n")
            self._stream.flush()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(PROGRESS_EVERY_S)
            elapsed = time.perf_counter() - self._start
            self.say(f"herd {elapsed:6.1f}s  {self.phase:<13} {self.detail()}")


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
            actor._push(entry(due_us + i, job, i % 64))  # as many classes as tenant x pool
        traced = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    sized = (sum(sys.getsizeof(item) for item in actor.heap) + sys.getsizeof(actor.heap)
             + sys.getsizeof(actor._members))
    return HeapMemory(entries=count, tracemalloc_bytes_per_entry=traced / count,
                      getsizeof_bytes_per_entry=sized / count)


# --- the jobs -----------------------------------------------------------------------------


class TenantRef(msgspec.Struct, frozen=True):
    tenant_id: uuid.UUID
    name: str

    @property
    def key(self) -> bytes:  # as it appears in a stream entry's tenant_id field
        return str(self.tenant_id).encode()


def pool_names(count: int) -> list[str]:
    return [f"loadtest-{i}" for i in range(count)]


def tenant_counts(total: int, tenants: int, skew: float) -> list[int]:
    """The noisy first tenant takes `skew` of the total; the rest split what is left evenly."""
    if skew > 0 and tenants > 1:
        noisy = round(total * skew)
        return [noisy, *_even(total - noisy, tenants - 1)]
    return _even(total, tenants)


def _even(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


async def create_tenants(db: Database, count: int) -> list[TenantRef]:
    now = datetime.now(UTC)
    tenants = []
    for i in range(count):
        name = f"herd-{i:02d}"
        created = await create_tenant(db, TenantSpec(name=name), now)
        tenants.append(TenantRef(created.tenant_id, name))
    return tenants


class JobFactory:
    """NewJobs from one template per pool, each prepared by the gateway's own `prepare`.

    A job differs from its template only in id, shard and due time, so the rows
    are what the gateway would insert for the same body.
    """

    def __init__(self, pools: list[str]) -> None:
        now = datetime.now(UTC)
        self._templates = [_template(pool, now) for pool in pools]

    def make(self, index: int, due: datetime, now: datetime) -> NewJob:
        job_id = uuid7(now)
        return msgspec.structs.replace(self._templates[index % len(self._templates)],
                                       job_id=job_id, shard_id=shard_of(job_id), next_run_at=due)


def _template(pool: str, now: datetime) -> NewJob:
    spec = JobSpec(name="loadtest-herd", target=Target(type="queue", ref=pool),
                   schedule=Schedule(delay_seconds=60), payload=msgspec.Raw(PAYLOAD))
    prepared = prepare(spec, now=now, allow=())
    if prepared.job is None:
        raise RunFailed(f"the job template does not validate: {prepared.errors}")
    return prepared.job


Batch = tuple[TenantRef, list[NewJob]]


def herd_batches(factory: JobFactory, tenants: list[TenantRef], counts: list[int],
                 due: datetime) -> list[Batch]:
    """Every tenant's share of the herd, due at `due`, cut into insert batches."""
    now = datetime.now(UTC)
    batches: list[Batch] = []
    index = 0
    for tenant, count in zip(tenants, counts, strict=True):
        jobs = [factory.make(index + i, due, now) for i in range(count)]
        index += count
        batches += [(tenant, jobs[i:i + INSERT_BATCH]) for i in range(0, count, INSERT_BATCH)]
    return batches


async def insert_batches(db: Database, batches: list[Batch], connections: int,
                         on_inserted: Callable[[int], None]) -> None:
    """insert_jobs for every batch, `connections` at a time."""
    pending = iter(batches)

    async def worker() -> None:
        for tenant, jobs in pending:  # one shared iterator: each batch goes to one worker
            outcome = await insert_jobs(db, tenant.tenant_id, jobs, now=datetime.now(UTC))
            if not outcome.inserted:
                raise RunFailed("insert_jobs wrote nothing for a batch")
            on_inserted(len(jobs))

    async with asyncio.TaskGroup() as tg:
        for _ in range(connections):
            tg.create_task(worker())


# The tool's own statements on its scratch database. storage/ has no query
# that moves a herd in time or lists lease owners, and none should exist
# outside a load test; so, like submit's row counts, they live here.
# Only the due rows move: dispatch reads the due time from due_index and
# clears jobs.next_run_at whatever it held, so the jobs keep the parked time
# (an UPDATE of jobs would double the move's cost and eat the shards' lead).
_MOVE_DUE = "UPDATE due_index SET next_run_at = $1, due_minute = $2 WHERE next_run_at = $3"
_LEASE_OWNERS = ("SELECT owner, count(*) AS shards FROM shard_leases "
                 "WHERE owner IS NOT NULL AND lease_until > now() GROUP BY owner")


async def move_herd(db: Database, parked_at: datetime, due: datetime) -> int:
    """One statement: every parked due row falls due at `due` at once."""
    async with db.connection() as conn:
        status = await conn.execute(_MOVE_DUE, due, due_minute(due), parked_at)
    return int(status.split()[-1])


async def lease_owners(db: Database) -> dict[str, int]:
    async with db.connection() as conn:
        return {r["owner"]: r["shards"] for r in await conn.fetch(_LEASE_OWNERS)}


# --- the stack: scratch databases and scheduler processes --------------------------------




async def machine_info(options: Options) -> Machine:
    admin = await asyncpg.connect(options.database_url, timeout=10)
    try:
        pg = [await admin.fetchval(f"SHOW {s}")
              for s in ("server_version", "fsync", "synchronous_commit")]
    finally:
        await admin.close()
    client = aioredis.from_url(options.redis_url)
    try:
        redis_version = (await client.info("server"))["redis_version"]
    finally:
        await client.aclose()
    return Machine(cpus=os.cpu_count() or 1, python=sys.version.split()[0], postgres=pg[0],
                   fsync=pg[1], synchronous_commit=pg[2], redis=str(redis_version),
                   load_average_1m=os.getloadavg()[0])


# Administrative statements on a throwaway database: storage/ creates no databases.
@contextlib.asynccontextmanager
async def scratch_database(server_dsn: str, name: str, keep: bool,
                           progress: Progress) -> AsyncIterator[str]:
    """A fresh, migrated database `name` on the server; dropped afterwards unless `keep`."""
    admin = await asyncpg.connect(server_dsn, timeout=10)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        try:
            dsn = with_database(server_dsn, name)
            await migrate.apply(dsn)
            yield dsn
        finally:
            if keep:
                progress.say(f"kept database {name}")
            else:
                await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


async def delete_keys(client: aioredis.Redis, prefix: str) -> int:
    """Every key under `prefix:`; the prefix is this run's own, so nothing else matches."""
    deleted = 0
    batch: list[bytes] = []
    async for key in client.scan_iter(match=f"{prefix}:*", count=5_000):
        batch.append(key)
        if len(batch) >= 5_000:
            deleted += await client.unlink(*batch)
            batch = []
    if batch:
        deleted += await client.unlink(*batch)
    return deleted


class SchedulerProcess(Child):
    """One `herdwick scheduler` child (a clean stop releases its leases).
    Owned by scheduler_processes()."""

    command = "herdwick scheduler"
    marker = "event=scheduler_started"
    start_timeout_s = START_TIMEOUT_S
    stop_timeout_s = STOP_TIMEOUT_S
    error = RunFailed


@contextlib.asynccontextmanager
async def scheduler_processes(count: int, dsn: str, redis_url: str, prefix: str,
                              ready_max: str = "100000000",
                              ) -> AsyncIterator[list[SchedulerProcess]]:
    # The herd's consumers only read the streams, they lease nothing: by default unbounded
    # streams, so what is measured is the scheduler tier's dispatch (e2e leases: "auto").
    env = {**os.environ, "HERDWICK_DATABASE_URL": dsn, "HERDWICK_REDIS_URL": redis_url,
           "HERDWICK_KEY_PREFIX": prefix, "HERDWICK_READY_MAX": ready_max}
    procs: list[SchedulerProcess] = []
    try:
        for _ in range(count):
            procs.append(SchedulerProcess(await asyncio.create_subprocess_exec(
                sys.executable, "-m", "herdwick.cli", "scheduler", env=env,
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT)))
            await procs[-1].started()
        yield procs
    finally:
        results = await asyncio.gather(*(p.stop() for p in procs), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result


async def leases_settled(db: Database, procs: list[SchedulerProcess], deadline: float) -> None:
    """Wait until the processes hold all 256 shards in fair shares (a rebalance takes a few
    renewal rounds): a herd measured before that would measure one node, not K."""
    while True:
        owners = await lease_owners(db)
        counts = sorted(owners.values())
        if len(counts) == len(procs) and sum(counts) == SHARD_COUNT and counts[-1] - counts[0] <= 1:
            return
        for proc in procs:
            proc.check_alive()
        if time.perf_counter() > deadline:
            raise RunFailed(f"the shards did not settle over {len(procs)} schedulers: {owners}")
        await asyncio.sleep(0.2)


# --- probes: the scheduler processes' CPU and memory --------------------------------------


class CpuMark(msgspec.Struct, frozen=True):
    at: float  # time.perf_counter()
    schedulers_s: float
    machine_busy_s: float


class ProcessProbe:
    """CPU seconds and RSS of the scheduler processes; RSS is sampled by `sample()`."""

    def __init__(self, pids: list[int]) -> None:
        self._procs = [psutil.Process(pid) for pid in pids]
        self.peak_rss = {p.pid: 0 for p in self._procs}

    def mark(self) -> CpuMark:
        cpu = sum(t.user + t.system for t in (p.cpu_times() for p in self._procs))
        m = psutil.cpu_times()
        busy = m.user + m.nice + m.system + m.irq + m.softirq + m.steal
        return CpuMark(time.perf_counter(), cpu, busy)

    def rss(self) -> list[int]:
        sizes = [p.memory_info().rss for p in self._procs]
        for p, size in zip(self._procs, sizes, strict=True):
            self.peak_rss[p.pid] = max(self.peak_rss[p.pid], size)
        return sizes

    def high_water(self) -> list[int]:
        """The kernel's peak RSS (VmHWM) where there is one, else the sampled peak."""
        return [max(self.peak_rss[p.pid], _vm_hwm(p.pid)) for p in self._procs]

    async def sample(self) -> None:
        while True:
            self.rss()
            await asyncio.sleep(RSS_SAMPLE_S)


def _profile_paths(out_dir: str, count: int) -> list[str]:
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    return [str(Path(out_dir) / f"scheduler-{i}.speedscope.json") for i in range(count)]


def _vm_hwm(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@contextlib.asynccontextmanager
async def py_spy(procs: list[SchedulerProcess], out_dir: str | None) -> AsyncIterator[list[str]]:
    """`py-spy record` on each scheduler while the body runs; yields the profile paths."""
    if out_dir is None:
        yield []
        return
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    paths = _profile_paths(out_dir, len(procs))
    spies = [await asyncio.create_subprocess_exec(
        exe, "record", "--pid", str(p.pid), "--format", "speedscope", "--output", path,
        "--rate", "100", stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL) for p, path in zip(procs, paths, strict=True)]
    try:
        yield paths
    finally:
        for spy in spies:  # SIGINT: py-spy writes its file and exits
            if spy.returncode is None:
                spy.send_signal(signal.SIGINT)
        for spy in spies:
            try:
                await asyncio.wait_for(spy.wait(), STOP_TIMEOUT_S)
            except BaseException:
                if spy.returncode is None:
                    spy.kill()
                raise


# --- the consumers -------------------------------------------------------------------------


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


async def consume(client: aioredis.Redis, prefix: str, pool: str, watch: Watch) -> None:
    """A no-op worker: XREADGROUP on `workers`, note each entry, XACK. Cancelled to stop."""
    stream = keys.ready_stream(prefix, pool)
    consumer = f"loadtest-{secrets.token_hex(3)}"
    while True:
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
    tasks = [asyncio.create_task(consume(client, prefix, pool, watch)) for pool in pools]
    try:
        yield
        for task in tasks:
            if task.done():  # a consumer that failed must not pass for an empty stream
                task.result()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@contextlib.asynccontextmanager
async def running(coro) -> AsyncIterator[asyncio.Task]:
    """A helper task for the body's duration (samplers, tickers); cancelled after it."""
    task = asyncio.create_task(coro)
    try:
        yield task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def wait_for(event: asyncio.Event, deadline: float, procs: list[SchedulerProcess],
                   helpers: tuple[asyncio.Task, ...] = ()) -> bool:
    """Until `event` is set (True) or the deadline passes (False); fails if a scheduler dies
    or a helper task (the background generator) fails."""
    while not event.is_set():
        for proc in procs:
            proc.check_alive()
        for task in helpers:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise RunFailed(f"{task.get_name()} failed") from task.exception()
        left = deadline - time.perf_counter()
        if left <= 0:
            return False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), min(left, 0.5))
    return True


# --- the background --------------------------------------------------------------------------


class Background:
    """Steady jobs: every tick, rate x tick jobs due `delay_s` later, their due times evenly
    spaced, the tenants and pools in turn; inserted per tenant and notified as the
    gateway notifies near-due submissions. Paced on an absolute schedule."""

    def __init__(self, plan: Plan, db: Database, hot: HotTier, tenants: list[TenantRef],
                 factory: JobFactory, watch: Watch) -> None:
        self._plan, self._db, self._tenants = plan, db, tenants
        self._factory, self._watch, self._hot = factory, watch, hot
        self.made = 0
        self.late_max_s = 0.0

    async def run(self) -> None:
        start_perf, start_wall = time.perf_counter(), datetime.now(UTC)
        ticks = max(1, round(self._plan.duration_s / BACKGROUND_TICK_S))
        for k in range(ticks):
            await asyncio.sleep(max(0.0, start_perf + k * BACKGROUND_TICK_S - time.perf_counter()))
            self.late_max_s = max(self.late_max_s,
                                  time.perf_counter() - start_perf - k * BACKGROUND_TICK_S)
            due0 = start_wall + timedelta(seconds=self._plan.delay_s + k * BACKGROUND_TICK_S)
            await self._tick(due0, self._count(k + 1) - self._count(k))
        self._watch.close(BACKGROUND)

    def _count(self, ticks: int) -> int:
        return round(self._plan.rate * BACKGROUND_TICK_S * ticks)

    async def _tick(self, due0: datetime, count: int) -> None:
        now = datetime.now(UTC)
        per_tenant: dict[int, list[NewJob]] = collections.defaultdict(list)
        for j in range(count):
            due = due0 + timedelta(seconds=BACKGROUND_TICK_S * j / count)
            per_tenant[(self.made + j) % len(self._tenants)].append(
                self._factory.make(self.made + j, due, now))
        self.made += count
        for t, jobs in per_tenant.items():
            self._watch.expect(BACKGROUND, jobs, self._tenants[t])
        await asyncio.gather(*(self._insert(self._tenants[t], jobs)
                               for t, jobs in per_tenant.items()))

    async def _insert(self, tenant: TenantRef, jobs: list[NewJob]) -> None:
        await insert_jobs(self._db, tenant.tenant_id, jobs, now=datetime.now(UTC))
        # All are due within the gateway's NEAR_DUE, so it would announce every one.
        await self._hot.notify([NotifyMessage(j.shard_id, str(j.job_id), to_us(j.next_run_at))
                                for j in jobs])


# --- raw limits -----------------------------------------------------------------------------


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


async def raw_publish_bare(url: str, prefix: str, by_pool: ByPool) -> float:
    """The same FCALLs, hiredis-packed on bare connections: the server's limit."""
    conns = {pool: await BareRedis.connect(url) for pool in by_pool}

    async def one_pool(pool: str, items: list[ReadyExecution]) -> None:
        base = keys.pool_base(prefix, pool)
        for i in range(0, len(items), RAW_PUBLISH_BATCH):
            await conns[pool].pipeline(_fcall_publish(base, items[i:i + RAW_PUBLISH_BATCH]))

    try:
        return await _per_pool(by_pool, one_pool)
    finally:
        for conn in conns.values():
            await conn.close()


async def raw_xadd_bare(url: str, prefix: str, by_pool: ByPool) -> float:
    """The same entries as plain XADDs, hiredis-packed, RAW_XADD_PIPELINE a pipeline."""
    conns = {pool: await BareRedis.connect(url) for pool in by_pool}

    async def one_pool(pool: str, items: list[ReadyExecution]) -> None:
        stream = keys.ready_stream(prefix, pool)
        for i in range(0, len(items), RAW_XADD_PIPELINE):
            await conns[pool].pipeline([_xadd(stream, it)
                                        for it in items[i:i + RAW_XADD_PIPELINE]])

    try:
        return await _per_pool(by_pool, one_pool)
    finally:
        for conn in conns.values():
            await conn.close()


async def raw_redis(url: str, by_pool: ByPool, progress: Progress) -> tuple[float, float, float]:
    """Seconds for: hw_publish via redis-py, hw_publish bare, XADD bare; each on a fresh
    prefix (hw_publish skips an attempt already published), all deleted afterwards."""
    prefixes = [f"hwraw{secrets.token_hex(4)}" for _ in range(3)]
    client = aioredis.from_url(url)
    try:
        await HotTier(client, prefixes[0]).load_functions()
        progress.set("raw-publish")
        client_s = await raw_publish_client(HotTier(client, prefixes[0]), by_pool)
        bare_s = await raw_publish_bare(url, prefixes[1], by_pool)
        progress.set("raw-xadd")
        xadd_s = await raw_xadd_bare(url, prefixes[2], by_pool)
    finally:
        for prefix in prefixes:
            await delete_keys(client, prefix)
        await client.aclose()
    return client_s, bare_s, xadd_s


async def raw_limits(options: Options, progress: Progress) -> RawLimits:
    plan = options.plan
    name = f"hw_herd_{secrets.token_hex(5)}_raw"
    async with scratch_database(options.database_url, name, False, progress) as dsn:
        db = await Database.connect(dsn, max_size=max(plan.insert_connections,
                                                      plan.raw_connections))
        try:
            due_keys = await _insert_raw_herd(db, plan, progress)
            progress.set("raw-dispatch")
            dispatch_s, results = await raw_dispatch(db, due_keys, plan.raw_connections)
        finally:
            await db.close()
    client_s, bare_s, xadd_s = await raw_redis(options.redis_url, ready_of(results), progress)
    n = len(due_keys)
    return RawLimits(jobs=n, dispatch_connections=plan.raw_connections, dispatch_batch=RAW_BATCH,
                     dispatch_s=dispatch_s, dispatch_rows_per_s=n / dispatch_s,
                     publish_s=bare_s, publish_entries_per_s=n / bare_s,
                     publish_client_s=client_s, publish_client_entries_per_s=n / client_s,
                     xadd_s=xadd_s, xadd_entries_per_s=n / xadd_s)


async def _insert_raw_herd(db: Database, plan: Plan, progress: Progress) -> list[DueKey]:
    """The second herd, already due; returns its due keys in shard order."""
    tenants = await create_tenants(db, plan.tenants)
    batches = herd_batches(JobFactory(pool_names(plan.pools)), tenants,
                           tenant_counts(plan.raw_jobs, plan.tenants, plan.skew),
                           datetime.now(UTC))
    inserted = [0]
    progress.set("raw-insert", lambda: f"inserted {inserted[0]}")
    await insert_batches(db, batches, plan.insert_connections,
                         lambda n: inserted.__setitem__(0, inserted[0] + n))
    due_keys = [DueKey(j.shard_id, j.next_run_at, j.job_id) for _, jobs in batches for j in jobs]
    due_keys.sort(key=lambda k: (k.shard_id, k.job_id.int))
    return due_keys


# --- the herd run ---------------------------------------------------------------------------


class Stack(msgspec.Struct, kw_only=True):
    """What the herd stage works with; built by herd_stage(), read by the steps."""

    plan: Plan
    db: Database
    client: aioredis.Redis
    prefix: str
    tenants: list[TenantRef]
    factory: JobFactory
    watch: Watch
    procs: list[SchedulerProcess]
    probe: ProcessProbe
    progress: Progress
    deadline: float


class HerdTimes(msgspec.Struct, frozen=True, kw_only=True):
    """When the herd stage's steps happened; turned into the report by analysis."""

    due_at: datetime | None
    insert_s: float
    move_s: float
    lead_s: float
    idle: tuple[CpuMark, CpuMark]
    window: tuple[CpuMark, CpuMark]
    window_name: str
    baseline_rss: list[int]
    peak_rss: list[int]
    background_late_s: float


async def herd_stage(options: Options, progress: Progress,
                     deadline: float) -> tuple[HerdTimes, Watch, list[TenantRef], list[str]]:
    """Fresh database and prefix, K scheduler processes, consumers; then the load."""
    plan = options.plan
    prefix = f"hwherd{secrets.token_hex(4)}"
    name = f"hw_herd_{secrets.token_hex(5)}"
    client = aioredis.from_url(options.redis_url)
    try:
        async with scratch_database(options.database_url, name, options.keep, progress) as dsn:
            db = await Database.connect(dsn, max_size=plan.insert_connections + 12)
            try:
                tenants = await create_tenants(db, plan.tenants)
                progress.set("schedulers")
                async with scheduler_processes(plan.schedulers, dsn, options.redis_url,
                                               prefix) as procs:
                    await leases_settled(db, procs, deadline)
                    stack = Stack(plan=plan, db=db, client=client, prefix=prefix,
                                  tenants=tenants, factory=JobFactory(pool_names(plan.pools)),
                                  watch=Watch(), procs=procs,
                                  probe=ProcessProbe([p.pid for p in procs]),
                                  progress=progress, deadline=deadline)
                    times, profiles = await _load(stack, options.py_spy_dir)
                    return times, stack.watch, tenants, profiles
            finally:
                await db.close()
    finally:
        await delete_keys(client, prefix)
        await client.aclose()


async def _load(s: Stack, py_spy_dir: str | None) -> tuple[HerdTimes, list[str]]:
    async with consumers(s.client, s.prefix, pool_names(s.plan.pools), s.watch), \
            running(s.probe.sample()):
        s.progress.set("idle")
        idle0 = s.probe.mark()
        await asyncio.sleep(IDLE_SAMPLE_S)
        idle = (idle0, s.probe.mark())
        baseline = s.probe.rss()
        parked, insert_s = await _insert_parked(s)
        async with py_spy(s.procs, py_spy_dir) as profiles:
            times = await _dispatch_phase(s, parked, insert_s, idle, baseline)
        await asyncio.sleep(DUPLICATE_GRACE_S)
    return times, profiles


async def _insert_parked(s: Stack) -> tuple[datetime | None, float]:
    """The herd, parked a day ahead; returns the parking instant and the insert time."""
    if s.plan.jobs == 0:
        s.watch.close(HERD)
        return None, 0.0
    parked = (datetime.now(UTC) + PARK_AHEAD).replace(microsecond=0)
    batches = herd_batches(s.factory, s.tenants,
                           tenant_counts(s.plan.jobs, s.plan.tenants, s.plan.skew), parked)
    for tenant, jobs in batches:
        s.watch.expect(HERD, jobs, tenant)
    s.watch.close(HERD)
    inserted = [0]
    s.progress.set("insert", lambda: f"inserted {inserted[0]}/{s.plan.jobs}")
    start = time.perf_counter()
    await insert_batches(s.db, batches, s.plan.insert_connections,
                         lambda n: inserted.__setitem__(0, inserted[0] + n))
    return parked, time.perf_counter() - start


async def _dispatch_phase(s: Stack, parked: datetime | None, insert_s: float,
                          idle: tuple[CpuMark, CpuMark], baseline: list[int]) -> HerdTimes:
    """Move the herd to its due second, run the background, wait until all is on the
    streams (or the deadline); CPU is marked around the herd, else around the background."""
    w = s.watch
    s.progress.set("herd", lambda: f"herd {w.seen[HERD]}/{w.expected[HERD]}  background "
                                   f"{w.seen[BACKGROUND]}/{w.expected[BACKGROUND]}")
    start = s.probe.mark()
    due_at, move_s, lead_s = None, 0.0, 0.0
    if parked is not None:
        due_at, move_s, lead_s = await _move(s, parked)
    background = Background(s.plan, s.db, HotTier(s.client, s.prefix), s.tenants, s.factory, w)
    if s.plan.rate > 0:
        bg_task = asyncio.create_task(background.run(), name="the background generator")
    else:
        w.close(BACKGROUND)
        bg_task = None
    try:
        helpers = (bg_task,) if bg_task is not None else ()
        await wait_for(w.complete[HERD], s.deadline, s.procs, helpers)
        herd_end = s.probe.mark()
        if bg_task is not None:
            await wait_for(w.complete[BACKGROUND], s.deadline, s.procs, helpers)
        end = herd_end if parked is not None else s.probe.mark()
    finally:
        if bg_task is not None:
            bg_task.cancel()
            await asyncio.gather(bg_task, return_exceptions=True)
    return HerdTimes(due_at=due_at, insert_s=insert_s, move_s=move_s, lead_s=lead_s,
                     idle=idle, window=(start, end),
                     window_name="herd move -> last herd entry" if parked is not None
                     else "background start -> last background entry",
                     baseline_rss=baseline, peak_rss=s.probe.high_water(),
                     background_late_s=background.late_max_s)


async def _move(s: Stack, parked: datetime) -> tuple[datetime, float, float]:
    start = time.perf_counter()
    due = datetime.fromtimestamp(math.ceil(time.time() + s.plan.due_in_s), UTC)
    moved = await move_herd(s.db, parked, due)
    if moved != s.plan.jobs:
        raise RunFailed(f"moved {moved} due rows of a herd of {s.plan.jobs}")
    lead_s = due.timestamp() - time.time()
    return due, time.perf_counter() - start, lead_s


# --- analysis -------------------------------------------------------------------------------


def lag_of(samples_ms: list[float]) -> Lag:
    ordered = sorted(samples_ms)

    def rank(p: float) -> float:
        return ordered[max(0, math.ceil(p * len(ordered)) - 1)] if ordered else 0.0

    return Lag(samples=len(ordered), p50_ms=rank(0.50), p95_ms=rank(0.95), p99_ms=rank(0.99),
               max_ms=rank(1.0))


def stream_check(watch: Watch, kind: int) -> StreamCheck:
    return StreamCheck(expected=watch.expected[kind], seen=watch.seen[kind],
                       duplicates=watch.duplicates[kind],
                       missing=watch.expected[kind] - watch.seen[kind],
                       wrong_tenant=watch.wrong_tenant[kind])


def _lags_ms(entries: list[tuple[bytes, int, bytes]]) -> list[tuple[bytes, float]]:
    parsed: dict[bytes, float] = {}
    out = []
    for tenant, added_ms, scheduled_for in entries:
        due_ms = parsed.get(scheduled_for)
        if due_ms is None:
            due_ms = parsed[scheduled_for] = (
                datetime.fromisoformat(scheduled_for.decode()).timestamp() * 1000)
        out.append((tenant, added_ms - due_ms))
    return out


def tenant_lags(lags: list[tuple[bytes, float]], tenants: list[TenantRef],
                expected: list[int]) -> list[TenantLag]:
    by_tenant: dict[bytes, list[float]] = collections.defaultdict(list)
    for tenant, lag in lags:
        by_tenant[tenant].append(lag)
    return [TenantLag(tenant=t.name, expected=n, seen=len(by_tenant[t.key]),
                      lag=lag_of(by_tenant[t.key]))
            for t, n in zip(tenants, expected, strict=True)]


def herd_result(plan: Plan, times: HerdTimes, watch: Watch,
                tenants: list[TenantRef]) -> HerdResult | None:
    if times.due_at is None:
        return None
    due_ms = times.due_at.timestamp() * 1000
    added = [added_ms - due_ms for _, added_ms, _ in watch.entries[HERD]]
    lags = _lags_ms(watch.entries[HERD])
    last = max(added, default=0.0)
    per_second = collections.Counter(int(a // 1000) for a in added)
    return HerdResult(
        jobs=plan.jobs, due_at=times.due_at, insert_s=times.insert_s,
        insert_jobs_per_s=plan.jobs / times.insert_s if times.insert_s else 0.0,
        move_s=times.move_s, lead_s=times.lead_s, check=stream_check(watch, HERD),
        first_after_due_ms=min(added, default=0.0), last_after_due_ms=last,
        jobs_per_s=watch.seen[HERD] / (last / 1000) if last > 0 else 0.0,
        peak_per_s=max(per_second.values(), default=0),
        lag=lag_of([lag for _, lag in lags]),
        tenants=tenant_lags(lags, tenants, tenant_counts(plan.jobs, plan.tenants, plan.skew)))


def background_result(plan: Plan, times: HerdTimes, watch: Watch,
                      tenants: list[TenantRef]) -> BackgroundResult | None:
    if plan.rate <= 0:
        return None
    lags = _lags_ms(watch.entries[BACKGROUND])
    return BackgroundResult(
        rate=plan.rate, duration_s=plan.duration_s, delay_s=plan.delay_s,
        check=stream_check(watch, BACKGROUND),
        generator_late_max_ms=times.background_late_s * 1000,
        lag=lag_of([lag for _, lag in lags]),
        tenants=tenant_lags(lags, tenants, _even(watch.expected[BACKGROUND], len(tenants))))


def scheduler_cost(plan: Plan, times: HerdTimes, watch: Watch) -> SchedulerCost:
    idle0, idle1 = times.idle
    idle_rate = (idle1.schedulers_s - idle0.schedulers_s) / (idle1.at - idle0.at)
    start, end = times.window
    window_s = end.at - start.at
    cpu_s = end.schedulers_s - start.schedulers_s
    jobs = watch.seen[HERD] if times.due_at is not None else watch.seen[BACKGROUND]
    per = 1000 / jobs if jobs else 0.0
    cpus = os.cpu_count() or 1
    mb = 1024 * 1024
    return SchedulerCost(
        processes=plan.schedulers, window=times.window_name, window_s=window_s, jobs=jobs,
        cpu_s=cpu_s, cpu_s_per_1000=cpu_s * per, idle_cpu_s_per_s=idle_rate,
        net_cpu_s_per_1000=max(0.0, cpu_s - idle_rate * window_s) * per,
        machine_busy_share=(end.machine_busy_s - start.machine_busy_s) / (cpus * window_s)
        if window_s > 0 else 0.0,
        idle_machine_busy_share=(idle1.machine_busy_s - idle0.machine_busy_s)
        / (cpus * (idle1.at - idle0.at)),
        baseline_rss_mb=[r / mb for r in times.baseline_rss],
        peak_rss_mb=[r / mb for r in times.peak_rss],
        rss_growth_bytes_per_job=(sum(times.peak_rss) - sum(times.baseline_rss)) / jobs
        if jobs else 0.0)


def ratios(herd: HerdResult | None, raw: RawLimits | None) -> list[Ratio]:
    if herd is None or raw is None:
        return []
    pairs = [("jobs/s vs dispatch transaction rows/s", raw.dispatch_rows_per_s),
             ("jobs/s vs hw_publish entries/s", raw.publish_entries_per_s),
             ("jobs/s vs hw_publish via redis-py", raw.publish_client_entries_per_s),
             ("jobs/s vs XADD entries/s", raw.xadd_entries_per_s),
             ("jobs/s vs the slower raw stage", min(raw.dispatch_rows_per_s,
                                                    raw.publish_entries_per_s))]
    return [Ratio(figure=f, herd=herd.jobs_per_s, raw=r, herd_over_raw=herd.jobs_per_s / r)
            for f, r in pairs]


# --- the whole run --------------------------------------------------------------------------


async def run(options: Options, progress: Progress) -> Report:
    """Heap, raw limits, then the herd; bounded by plan.timeout_s (waits give up and report
    what they saw) plus CLEANUP_GRACE_S (a hard bound on everything, cleanup included)."""
    require_loopback(options.database_url, "--database-url")
    require_loopback(options.redis_url, "--redis-url")
    plan = options.plan
    if plan.jobs == 0 and plan.rate == 0:
        raise ConfigError("loadtest herd: nothing to do (--jobs 0 and no --rate)")
    started = datetime.now(UTC)
    deadline = time.perf_counter() + plan.timeout_s
    progress.set("heap")
    heap = heap_memory()
    async with running(progress.run()), asyncio.timeout(plan.timeout_s + CLEANUP_GRACE_S):
        machine = await machine_info(options)
        raw = await raw_limits(options, progress) if plan.raw and plan.raw_jobs else None
        times, watch, tenants, profiles = await herd_stage(options, progress, deadline)
    herd = herd_result(plan, times, watch, tenants)
    cost = scheduler_cost(plan, times, watch)
    return Report(started_at=started, plan=plan, machine=machine, heap=heap, raw=raw,
                  herd=herd, background=background_result(plan, times, watch, tenants),
                  cost=cost, ratios=ratios(herd, raw), profiles=profiles,
                  warnings=warnings(herd, cost, watch))


def warnings(herd: HerdResult | None, cost: SchedulerCost, watch: Watch) -> list[str]:
    found = []
    if herd is not None and herd.lead_s < MIN_LEAD_S:
        found.append(f"the herd was moved only {herd.lead_s:.1f} s before due (the move took "
                     f"{herd.move_s:.1f} s): shards may have loaded it late; raise --due-in")
    if cost.idle_machine_busy_share > BUSY_WARN_SHARE:
        found.append(f"the machine was {cost.idle_machine_busy_share:.0%} busy before the load "
                     "(other work on it): every figure is skewed")
    if watch.unknown:
        found.append(f"{watch.unknown} stream entries were of no job this run inserted")
    return found


# --- the report as text ----------------------------------------------------------------------


def _lag_rows(lag: Lag, tenants: list[TenantLag]) -> list[str]:
    rows = [f"  {'lag (ms)':<12} {'expected':>8} {'seen':>8} {'p50':>8} {'p95':>8} "
            f"{'p99':>8} {'max':>8}",
            _lag_row("all", sum(t.expected for t in tenants), lag.samples, lag)]
    rows += [_lag_row(t.tenant, t.expected, t.seen, t.lag) for t in tenants]
    return rows


def _lag_row(name: str, expected: int, seen: int, lag: Lag) -> str:
    return (f"  {name:<12} {expected:>8} {seen:>8} {lag.p50_ms:>8.0f} {lag.p95_ms:>8.0f} "
            f"{lag.p99_ms:>8.0f} {lag.max_ms:>8.0f}")


def _check_line(c: StreamCheck) -> str:
    verdict = "exactly once" if c.exact else "NOT exactly once"
    return (f"  on the streams: {c.seen} of {c.expected} jobs, {verdict} (duplicates "
            f"{c.duplicates}, missing {c.missing}, wrong tenant {c.wrong_tenant})")


def _herd_lines(h: HerdResult) -> list[str]:
    return [
        f"herd: {h.jobs} jobs due at {sched.format_utc(h.due_at)}; inserted in "
        f"{h.insert_s:.1f} s ({h.insert_jobs_per_s:,.0f} jobs/s), moved in {h.move_s:.2f} s, "
        f"{h.lead_s:.1f} s before due",
        _check_line(h.check),
        f"  throughput: {h.jobs_per_s:,.0f} jobs/s (first entry {h.first_after_due_ms:.0f} ms, "
        f"last {h.last_after_due_ms:.0f} ms after due); peak {h.peak_per_s:,} in one second",
        *_lag_rows(h.lag, h.tenants), ""]


def _background_lines(b: BackgroundResult) -> list[str]:
    return [
        f"background: {b.rate:g} jobs/s for {b.duration_s:g} s, delaySeconds {b.delay_s:g} "
        f"(generator at most {b.generator_late_max_ms:.0f} ms behind)",
        _check_line(b.check), *_lag_rows(b.lag, b.tenants), ""]


def _cost_lines(c: SchedulerCost, heap: HeapMemory) -> list[str]:
    peaks = ", ".join(f"{p:.0f}" for p in c.peak_rss_mb)
    bases = ", ".join(f"{p:.0f}" for p in c.baseline_rss_mb)
    return [
        f"scheduler: {c.processes} process(es); window {c.window} = {c.window_s:.1f} s",
        f"  CPU {c.cpu_s:.2f} s for {c.jobs} jobs = {c.cpu_s_per_1000:.3f} s per 1,000 "
        f"(idle {c.idle_cpu_s_per_s:.3f} s/s; net of idle {c.net_cpu_s_per_1000:.3f}); "
        f"machine {c.machine_busy_share:.0%} busy "
        f"({c.idle_machine_busy_share:.0%} before the load)",
        f"  peak RSS {peaks} MB (idle {bases} MB): {c.rss_growth_bytes_per_job:.0f} B per job",
        f"  heap entry: {heap.tracemalloc_bytes_per_entry:.0f} B (tracemalloc), "
        f"{heap.getsizeof_bytes_per_entry:.0f} B (getsizeof) at {heap.entries:,} entries; "
        f"aim <= {heap.aim_bytes}", ""]


def _raw_lines(raw: RawLimits, report_ratios: list[Ratio]) -> list[str]:
    rows = [
        (f"dispatch transaction (claim_due + finish_dispatch), {raw.dispatch_batch}/txn, "
         f"{raw.dispatch_connections} conn", raw.dispatch_rows_per_s, "rows/s"),
        (f"FCALL hw_publish, {RAW_PUBLISH_BATCH}/pipeline, hiredis-packed",
         raw.publish_entries_per_s, "entries/s"),
        ("the same through HotTier.publish (redis-py)", raw.publish_client_entries_per_s,
         "entries/s"),
        (f"XADD, {RAW_XADD_PIPELINE}/pipeline, hiredis-packed", raw.xadd_entries_per_s,
         "entries/s")]
    lines = [f"raw limits (same run, a second herd of {raw.jobs} jobs):"]
    lines += [f"  {label:<70} {value:>9,.0f} {unit}" for label, value, unit in rows]
    if report_ratios:
        lines += ["", f"  {'herd vs raw':<40} {'herd':>9} {'raw':>9} {'herd/raw':>9}"]
        lines += [f"  {r.figure:<40} {r.herd:>9,.0f} {r.raw:>9,.0f} {r.herd_over_raw:>9.2f}"
                  for r in report_ratios]
    return [*lines, ""]


def render_text(report: Report) -> str:
    m, p = report.machine, report.plan
    skew = f"noisy tenant {p.skew:.0%}" if p.skew else "even"
    lines = [
        f"herdwick loadtest herd  {report.started_at:%Y-%m-%dT%H:%M:%SZ}",
        f"machine: {m.cpus} CPUs (load {m.load_average_1m:.1f} at start), Python {m.python}, "
        f"PostgreSQL {m.postgres} (fsync {m.fsync}, synchronous_commit "
        f"{m.synchronous_commit}), Redis {m.redis}",
        f"plan: {p.jobs} jobs over {p.tenants} tenants ({skew}), {p.pools} pools, "
        f"{p.schedulers} scheduler process(es); background {p.rate:g} jobs/s", ""]
    if report.herd is not None:
        lines += _herd_lines(report.herd)
    if report.background is not None:
        lines += _background_lines(report.background)
    lines += _cost_lines(report.cost, report.heap)
    if report.raw is not None:
        lines += _raw_lines(report.raw, report.ratios)
    if report.profiles:
        lines.append("py-spy profiles: " + ", ".join(report.profiles))
    lines += [f"WARNING: {w}" for w in report.warnings]
    lines.append("complete" if report.complete else "INCOMPLETE: see the stream checks")
    return "\n".join(lines) + "\n"


def render_json(report: Report) -> str:
    return msgspec.json.format(msgspec.json.encode(report).decode(), indent=2) + "\n"


# --- the command -----------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `herdwick loadtest herd`; an unset flag takes Plan's default."""
    a = parser.add_argument
    a("--jobs", type=int, metavar="N", help="herd size, all due in one second; default 100000")
    a("--tenants", type=int, metavar="T", help="tenants the herd is spread over; default 10")
    a("--pools", type=int, metavar="P", help="worker pools (ready streams); default 4")
    a("--skew", type=float, metavar="SHARE",
      help="one noisy tenant takes this share of the herd (e.g. 0.5); default even")
    a("--due-in", type=float, metavar="S",
      help="the herd falls due S s after it is inserted (whole second); default 5")
    a("--rate", type=float, metavar="R", help="steady background jobs/s; default 0 (none)")
    a("--duration", type=float, metavar="S", help="background seconds; default 20")
    a("--delay", type=float, metavar="S", help="background jobs' delaySeconds; default 2.5")
    a("--schedulers", type=int, metavar="K", help="herdwick scheduler processes; default 1")
    a("--insert-connections", type=int, metavar="C",
      help="parallel insert connections; default 4")
    a("--raw-connections", type=int, metavar="C",
      help="parallel raw dispatch transactions; default 2 (the scheduler's dispatch actors)")
    a("--no-raw", action="store_true", help="skip measuring the raw limits")
    a("--timeout", type=float, metavar="S", help="give up waiting after S s; default 120")
    a("--database-url", help="Postgres server for the scratch databases; default "
      "$HERDWICK_DATABASE_URL, else postgresql://postgres@127.0.0.1:5432/postgres")
    a("--redis-url", help="default $HERDWICK_REDIS_URL, else redis://127.0.0.1:6379/0")
    a("--keep", action="store_true", help="keep the herd's scratch database")
    a("--py-spy", metavar="DIR", dest="py_spy",
      help="record each scheduler with py-spy during the herd (speedscope JSON in DIR)")
    a("--json", action="store_true", help="the report as JSON")


_PLAN_FLAGS = {"jobs": "jobs", "tenants": "tenants", "pools": "pools", "skew": "skew",
               "due_in": "due_in_s", "rate": "rate", "duration": "duration_s",
               "delay": "delay_s", "schedulers": "schedulers",
               "insert_connections": "insert_connections",
               "raw_connections": "raw_connections", "timeout": "timeout_s"}


def options_from(args: argparse.Namespace) -> Options:
    plan: dict[str, Any] = {field: getattr(args, flag) for flag, field in _PLAN_FLAGS.items()
                            if getattr(args, flag, None) is not None}
    if getattr(args, "no_raw", False):
        plan["raw"] = False
    raw = {"plan": plan, "keep": bool(getattr(args, "keep", False)),
           "py_spy_dir": getattr(args, "py_spy", None),
           "database_url": (getattr(args, "database_url", None)
                            or os.environ.get("HERDWICK_DATABASE_URL") or DEFAULT_DATABASE_URL),
           "redis_url": (getattr(args, "redis_url", None)
                         or os.environ.get("HERDWICK_REDIS_URL") or DEFAULT_REDIS_URL)}
    try:
        return msgspec.convert({k: v for k, v in raw.items() if v is not None}, Options)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"loadtest herd: {exc}") from None


async def command(args: argparse.Namespace) -> int:
    """`herdwick loadtest herd`: progress on stderr, the report on stdout; 1 if incomplete.

    SIGTERM cancels the run like Ctrl-C does, so the schedulers, scratch
    databases and keys are cleaned up either way.
    """
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    report = await run(options_from(args), Progress(sys.stderr))
    sys.stdout.write(render_json(report) if args.json else render_text(report))
    sys.stdout.flush()
    return 0 if report.complete else 1


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.herd", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        runner: Callable[[Any], int] = asyncio.run
    else:
        runner = uvloop.run
    try:
        return runner(command(args))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("herdwick loadtest herd: interrupted; cleaned up", file=sys.stderr)
        return 130
    except ConfigError as exc:
        print(f"herdwick loadtest herd: {exc}", file=sys.stderr)
        return 2
    except HerdwickError as exc:
        print(f"herdwick loadtest herd: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(_main())
