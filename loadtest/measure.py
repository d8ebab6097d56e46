"""What a load test measures besides its own counts: CPU and memory of processes, the
machine, the streams and Redis memory over a run, and due->lease lag from Postgres.

Percentiles are nearest-rank everywhere (Postgres' percentile_disc is the
same rule), so the tool's figures and the database's agree.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import re
import shutil
import signal
import sys
import time
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Sequence
from datetime import datetime
from pathlib import Path

import asyncpg
import msgspec
import psutil
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ResponseError

from herdwick import redis_client
from herdwick.loadtest.driver import STOP_TIMEOUT_S, Child
from herdwick.storage import keys
from herdwick.storage.db import Database

RSS_SAMPLE_S = 0.1
STREAM_SAMPLE_S = 0.5


def nearest_rank(ordered: Sequence[float], p: float) -> float:
    """The p-quantile of sorted samples by the nearest-rank rule; 0 for no samples."""
    return ordered[max(0, math.ceil(p * len(ordered)) - 1)] if ordered else 0.0


class Lag(msgspec.Struct, frozen=True, kw_only=True):
    """Stream entry time minus scheduled_for, nearest-rank percentiles."""

    samples: int
    p50_ms: float
    p95_ms: float
    p99_ms: float
    max_ms: float


def lag_of(samples_ms: list[float]) -> Lag:
    ordered = sorted(samples_ms)
    return Lag(samples=len(ordered), p50_ms=nearest_rank(ordered, 0.50),
               p95_ms=nearest_rank(ordered, 0.95), p99_ms=nearest_rank(ordered, 0.99),
               max_ms=nearest_rank(ordered, 1.0))


# --- the machine -------------------------------------------------------------------------


class PostgresInfo(msgspec.Struct, frozen=True, kw_only=True):
    version: str
    fsync: str
    synchronous_commit: str


async def postgres_info(server_dsn: str) -> PostgresInfo:
    admin = await asyncpg.connect(server_dsn, timeout=10)
    try:
        version, fsync, commit = [await admin.fetchval(f"SHOW {s}") for s in
                                  ("server_version", "fsync", "synchronous_commit")]
    finally:
        await admin.close()
    return PostgresInfo(version=version, fsync=fsync, synchronous_commit=commit)


class Machine(msgspec.Struct, frozen=True, kw_only=True):
    cpus: int
    python: str
    postgres: str
    fsync: str
    synchronous_commit: str
    redis: str
    load_average_1m: float  # at the start: other work on the machine skews every figure


async def machine_info(database_url: str, redis_url: str) -> Machine:
    pg = await postgres_info(database_url)
    client = redis_client.connect(redis_url)
    try:
        redis_version = (await client.info("server"))["redis_version"]
    finally:
        await client.aclose()
    return Machine(cpus=os.cpu_count() or 1, python=sys.version.split()[0],
                   postgres=pg.version, fsync=pg.fsync,
                   synchronous_commit=pg.synchronous_commit, redis=str(redis_version),
                   load_average_1m=os.getloadavg()[0])


# --- processes: CPU and memory -------------------------------------------------------------


def cpu_s(times) -> float:
    return times.user + times.system


def machine_busy_s() -> float:
    """Every CPU's busy seconds since boot, every process."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq + t.steal


class CpuMark(msgspec.Struct, frozen=True):
    at: float  # time.perf_counter()
    processes_s: float
    machine_busy_s: float


class ProcessProbe:
    """CPU seconds and RSS of some child processes, all together; RSS is sampled by
    `sample()` (its task writes `peak_rss`, the run reads it after)."""

    def __init__(self, pids: list[int]) -> None:
        self._procs = [psutil.Process(pid) for pid in pids]
        self.peak_rss = {p.pid: 0 for p in self._procs}

    def mark(self) -> CpuMark:
        cpu = sum(cpu_s(p.cpu_times()) for p in self._procs)
        return CpuMark(time.perf_counter(), cpu, machine_busy_s())

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


def _vm_hwm(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class CpuSample(msgspec.Struct, frozen=True):
    api_s: float | None
    loadgen_s: float
    postgres_s: dict[int, float] | None  # by pid: backends come and go
    machine_busy_s: float


class CpuProbe:
    """Reads process and machine CPU seconds (psutil).

    Postgres counts the backends of `database` (all backends when None) and the
    server's shared processes (WAL writer, checkpointer, ...); other databases'
    backends, e.g. a test suite's on a shared server, fall into "other". With
    `postgres=False` (the load goes to a database the tool does not know) it
    counts none: they fall into "other" too.
    """

    def __init__(self, api_pids: tuple[int, ...] = (), database: str | None = None, *,
                 postgres: bool = True) -> None:
        self._api = [psutil.Process(pid) for pid in api_pids]
        self._me = psutil.Process()
        self._database = database
        self._count_postgres = postgres

    def read(self) -> CpuSample:
        api = sum(cpu_s(p.cpu_times()) for p in self._api) if self._api else None
        postgres = self._postgres() if self._count_postgres else None
        return CpuSample(api, cpu_s(self._me.cpu_times()), postgres, machine_busy_s())

    def _postgres(self) -> dict[int, float]:
        # A backend that exits inside the window takes its seconds with it; the
        # pools in use are opened during warm-up, so that is only short-lived ones.
        found = {}
        for p in psutil.process_iter(["name", "cmdline", "cpu_times"]):
            if p.info["name"] != "postgres" or p.info["cpu_times"] is None:
                continue
            title = " ".join(p.info["cmdline"] or ())
            if self._database is None or f" {self._database} " in title or _SHARED.search(title):
                found[p.pid] = cpu_s(p.info["cpu_times"])
        return found


class KindsCpu(msgspec.Struct, frozen=True, kw_only=True):
    """CPU seconds by kind of process over a window, and what the machine did meanwhile."""

    window_s: float
    seconds: dict[str, float]  # kind -> user + system seconds; a kind not measurable is absent
    # kind -> seconds its threads were runnable but waited for a CPU (Linux schedstat;
    # absent elsewhere): a kind whose seconds and wait add up to the window wanted a
    # whole core and was short of one.
    runqueue_wait_s: dict[str, float]
    machine_busy_share: float  # of every CPU over the window, all processes
    # The machine's busy seconds less the kinds' (the kernel's own work included): another
    # user's tests show here, and make every other figure of the run suspect.
    others_s: float

    def per_1000(self, count: int) -> dict[str, float]:
        return {kind: round(s * 1000 / count, 3) if count else 0.0
                for kind, s in self.seconds.items()}


class KindsMark(msgspec.Struct, frozen=True):
    at: float  # time.perf_counter()
    cpu_s: dict[str, float]
    wait_s: dict[str, float]
    sample: CpuSample


class KindsProbe:
    """CPU seconds of processes grouped by kind ("http-worker": [pids], ...), plus this
    process ("harness") and, through a CpuProbe, the Postgres processes of `database`.

    A process that is gone at a read (or that psutil may not read) counts 0 from then:
    the kinds are the run's own children and servers that outlive the run.
    """

    def __init__(self, kinds: dict[str, list[int]], database: str | None) -> None:
        self._kinds = {kind: [p for p in (_process(pid) for pid in pids) if p is not None]
                       for kind, pids in kinds.items()}
        self._pg = CpuProbe(database=database, postgres=database is not None)

    def read(self) -> KindsMark:
        kinds = {kind: procs for kind, procs in self._kinds.items() if procs}
        waits = {kind: [_runqueue_wait_s(p.pid) for p in procs] for kind, procs in kinds.items()}
        return KindsMark(time.perf_counter(),
                         {kind: sum(_cpu_or_0(p) for p in procs) for kind, procs in kinds.items()},
                         {kind: sum(w) for kind, w in waits.items() if None not in w},
                         self._pg.read())

    @staticmethod
    def between(start: KindsMark, end: KindsMark) -> KindsCpu:
        pg0, pg1 = start.sample, end.sample
        seconds = {kind: round(s - start.cpu_s.get(kind, 0.0), 3)
                   for kind, s in end.cpu_s.items()}
        if pg0.postgres_s is not None and pg1.postgres_s is not None:
            seconds["postgres"] = round(sum(s - pg0.postgres_s.get(pid, 0.0)
                                            for pid, s in pg1.postgres_s.items()), 3)
        seconds["harness"] = round(pg1.loadgen_s - pg0.loadgen_s, 3)
        waits = {kind: round(w - start.wait_s[kind], 3)
                 for kind, w in end.wait_s.items() if kind in start.wait_s}
        window = end.at - start.at
        busy_s = pg1.machine_busy_s - pg0.machine_busy_s
        return KindsCpu(window_s=round(window, 3), seconds=seconds, runqueue_wait_s=waits,
                        machine_busy_share=round(busy_s / ((os.cpu_count() or 1) * window), 3),
                        others_s=round(busy_s - sum(seconds.values()), 2))


async def server_infos(client: redis_client.Client, section: str, *,
                       replicas: bool = False) -> list[dict]:
    """INFO `section` of the Redis server, or of each primary of a cluster (and each
    replica, with `replicas`): a cluster's figures are the sum of its nodes'."""
    if not redis_client.is_cluster(client):
        return [await client.info(section)]
    nodes = RedisCluster.ALL_NODES if replicas else RedisCluster.PRIMARIES
    return list((await client.info(section, target_nodes=nodes)).values())


async def redis_pids(client: redis_client.Client) -> list[int]:
    """The pids of the Redis server (every node of a cluster), for their CPU seconds;
    those not running on this machine (a loopback URL into a container, say, names a pid
    of another namespace) are left out."""
    pids = []
    for info in await server_infos(client, "server", replicas=True):
        pid = int(info.get("process_id", 0))
        try:
            name = psutil.Process(pid).name()
        except psutil.Error:
            continue
        if "redis" in name or "valkey" in name:
            pids.append(pid)
    return pids


def database_of(dsn: str) -> str:
    """The database a DSN names: whose Postgres backends a probe counts."""
    return urllib.parse.urlsplit(dsn).path.lstrip("/")


def _runqueue_wait_s(pid: int) -> float | None:
    """Seconds the process's threads have waited on a run queue (/proc schedstat's second
    field, nanoseconds); None where the kernel does not say."""
    tasks = Path(f"/proc/{pid}/task")
    if not tasks.is_dir():
        return None
    total = 0
    try:
        for stat in tasks.glob("*/schedstat"):
            total += int(stat.read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return total / 1e9


def _process(pid: int) -> psutil.Process | None:
    try:
        process = psutil.Process(pid)
        process.cpu_times()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    return process


def _cpu_or_0(process: psutil.Process) -> float:
    try:
        return cpu_s(process.cpu_times())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return 0.0


# The titles of the postmaster and its shared processes (not client backends).
_SHARED = re.compile(r"bin/postgres|: (checkpointer|background writer|walwriter|"
                     r"autovacuum launcher|logical replication launcher|archiver|"
                     r"stats collector)\s*$")


def _profile_paths(out_dir: str, count: int) -> list[str]:
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    return [str(Path(out_dir) / f"scheduler-{i}.speedscope.json") for i in range(count)]


@contextlib.asynccontextmanager
async def py_spy(procs: list[Child], out_dir: str | None) -> AsyncIterator[list[str]]:
    """`py-spy record` on each process while the body runs; yields the profile paths."""
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


# --- Redis over a run: the streams and the server's memory ---------------------------------


STREAM_STOP_S = 35.0  # past the client's socket timeout: a sample in flight ends first


class StreamSamples(msgspec.Struct, frozen=True, kw_only=True):
    """Every STREAM_SAMPLE_S from the start of the load, and once more at its end; each
    figure is the sum over the run's pools.

    The event actor XDELs what it has committed, so the events stream's length is
    its backlog; `ready_lag` is the workers group's XINFO GROUPS lag (entries not yet
    delivered to a worker), None where Redis could not tell; `ready_len` is XLEN of
    the ready streams (delivered entries count until the reaper trims them).
    """

    every_s: float
    samples: int
    events_len_max: int
    events_len_last: int
    ready_lag_max: int | None
    ready_lag_last: int | None
    ready_len_max: int
    ready_len_last: int


class RedisMemory(msgspec.Struct, frozen=True, kw_only=True):
    """INFO memory used_memory of the whole Redis server (other users of it included):
    once before the load, then sampled with the streams."""

    baseline_bytes: int
    peak_bytes: int
    growth_bytes: int  # peak - baseline
    every_s: float
    samples: int


class StreamSampler:
    """Samples the pools' events and ready streams and the server's used_memory; its task
    writes, the run reads after. `commands` counts every call it made, so a run that
    counts the server's commands can leave them out."""

    def __init__(self, client: aioredis.Redis, prefix: str, pools: list[str]) -> None:
        self._client = client
        self._events = [keys.events_stream(prefix, pool) for pool in pools]
        self._ready = [keys.ready_stream(prefix, pool) for pool in pools]
        self.events_len: list[int] = []
        self.ready_lag: list[int | None] = []
        self.ready_len: list[int] = []
        self.used_memory: list[int] = []
        self.baseline_memory: int | None = None
        self.commands = 0
        self._stop = asyncio.Event()

    async def baseline(self) -> None:
        """used_memory before the load."""
        self.baseline_memory = await self._used_memory()

    async def run(self) -> None:
        """Samples until stopped; `sampling` stops it between samples."""
        while not self._stop.is_set():
            await self.sample()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), STREAM_SAMPLE_S)

    @contextlib.asynccontextmanager
    async def sampling(self) -> AsyncIterator[asyncio.Task]:
        """`run` for the body's duration, stopped between two samples rather than
        cancelled inside a Redis call: a redis-py call cancelled mid-reply on uvloop
        was seen to never return, hanging the run (loadtest herd, once in a few runs)."""
        self._stop.clear()
        task = asyncio.create_task(self.run(), name="the streams sampler")
        try:
            yield task
        finally:
            self._stop.set()
            done, _ = await asyncio.wait({task}, timeout=STREAM_STOP_S)
            if not done:
                task.cancel()  # not awaited: that is what could hang

    async def sample(self) -> None:
        self.events_len.append(sum([await self._xlen(s) for s in self._events]))
        self.ready_len.append(sum([await self._xlen(s) for s in self._ready]))
        lags = [await self._ready_lag(s) for s in self._ready]
        self.ready_lag.append(None if None in lags else sum(lag or 0 for lag in lags))
        self.used_memory.append(await self._used_memory())

    async def delivered(self) -> int:
        """Entries the workers' groups have been delivered (XINFO GROUPS), over the pools."""
        total = 0
        for stream in self._ready:
            group = await self._workers_group(stream)
            total += (group or {}).get("entries-read") or 0
        return total

    async def _xlen(self, stream: str) -> int:
        self.commands += 1
        return await self._client.xlen(stream)

    async def _used_memory(self) -> int:
        """Of the whole server, or of every node of a cluster."""
        self.commands += 1
        return sum(int(info["used_memory"])
                   for info in await server_infos(self._client, "memory", replicas=True))

    async def _workers_group(self, stream: str) -> dict | None:
        self.commands += 1
        try:
            groups = await self._client.xinfo_groups(stream)
        except ResponseError:  # no stream yet: nothing published
            return None
        found = [g for g in groups if g["name"] == keys.WORKERS_GROUP.encode()]
        return found[0] if found else None

    async def _ready_lag(self, stream: str) -> int | None:
        group = await self._workers_group(stream)
        return 0 if group is None else group["lag"]

    @property
    def samples(self) -> int:
        return len(self.events_len)

    def streams(self) -> StreamSamples:
        known = [lag for lag in self.ready_lag if lag is not None]
        return StreamSamples(every_s=STREAM_SAMPLE_S, samples=self.samples,
                             events_len_max=max(self.events_len, default=0),
                             events_len_last=self.events_len[-1] if self.events_len else 0,
                             ready_lag_max=max(known, default=None),
                             ready_lag_last=self.ready_lag[-1] if self.ready_lag else None,
                             ready_len_max=max(self.ready_len, default=0),
                             ready_len_last=self.ready_len[-1] if self.ready_len else 0)

    def memory(self) -> RedisMemory:
        baseline = self.baseline_memory
        if baseline is None:  # no baseline taken: the first sample stands in
            baseline = self.used_memory[0] if self.used_memory else 0
        peak = max(self.used_memory, default=baseline)
        return RedisMemory(baseline_bytes=baseline, peak_bytes=peak, growth_bytes=peak - baseline,
                           every_s=STREAM_SAMPLE_S, samples=len(self.used_memory))


# --- due -> lease lag, from Postgres --------------------------------------------------------

# The tool's own statements on its scratch database (storage/ has no reporting
# queries, and none should exist for a load test). started_at is the Redis
# server's clock at the lease; scheduled_for the due time.
_LAG_MS = "extract(epoch FROM e.started_at - e.scheduled_for) * 1000"
# Herd and steady jobs told apart by job id alone, without a join: ids are UUIDv7,
# time-ordered, and every herd job is made before `steady_from` ($1, the floor of
# that instant's ids), every steady job after it.
_LAG_BY_KIND = f"""
SELECT e.job_id >= $1 AS steady,
       percentile_disc(ARRAY[0.0, 0.5, 0.95, 0.99, 1.0]) WITHIN GROUP (ORDER BY {_LAG_MS})
           AS lag_ms,
       max(e.scheduled_for) AS last_due
FROM executions e WHERE e.started_at IS NOT NULL GROUP BY 1"""
# Each execution's failed first attempt to its second's lease: the drawn delay and how late
# the retry started after it.
_RETRY_GAP = """
SELECT count(*) AS retried,
       percentile_disc(ARRAY[0.0, 0.5, 0.99, 1.0]) WITHIN GROUP (
           ORDER BY extract(epoch FROM b.started_at - a.finished_at) * 1000) AS gap_ms
FROM execution_attempts a
JOIN execution_attempts b ON b.execution_id = a.execution_id AND b.attempt = a.attempt + 1
WHERE a.attempt = 1 AND a.outcome = 'failed' AND b.started_at IS NOT NULL"""
_LAG_BY_TENANT = f"""
SELECT e.tenant_id, count(*) FILTER (WHERE e.state = 'succeeded') AS succeeded,
       count(*) AS started,
       percentile_disc(ARRAY[0.5, 0.99, 1.0]) WITHIN GROUP (ORDER BY {_LAG_MS}) AS lag_ms,
       avg({_LAG_MS}) AS mean_ms, min(e.scheduled_for) AS first_due,
       max(e.started_at) AS last_started
FROM executions e WHERE e.started_at IS NOT NULL GROUP BY 1"""
_LAG_OF_TENANTS = f"""
SELECT count(*) AS started,
       percentile_disc(ARRAY[0.5, 0.99, 1.0]) WITHIN GROUP (ORDER BY {_LAG_MS}) AS lag_ms
FROM executions e WHERE e.started_at IS NOT NULL AND e.tenant_id = ANY($1::uuid[])"""


class LeaseLag(msgspec.Struct, frozen=True):
    """One kind's (herd or steady) due->lease lag percentiles, and its last due time."""

    ms: dict[str, float]  # p50, p95, p99, max; whole milliseconds
    last_due: datetime


async def lease_lags_by_kind(db: Database, steady_from: uuid.UUID) -> dict[bool, LeaseLag]:
    """By kind: True for the steady jobs (ids from `steady_from` on), False for the herd."""
    async with db.connection() as conn:
        rows = await conn.fetch(_LAG_BY_KIND, steady_from)
    return {row["steady"]: LeaseLag(ms=dict(zip(("first", "p50", "p95", "p99", "max"),
                                                [round(float(v)) for v in row["lag_ms"]],
                                                strict=True)),
                                    last_due=row["last_due"])
            for row in rows}


async def retry_gaps(db: Database) -> tuple[int, dict[str, float]]:
    """Over every execution whose first attempt failed: (how many, {min, p50, p99, max} ms
    from that failure to the next attempt's lease)."""
    async with db.connection() as conn:
        row = await conn.fetchrow(_RETRY_GAP)
    values = row["gap_ms"] or (0, 0, 0, 0)
    return row["retried"], dict(zip(("min", "p50", "p99", "max"),
                                    [round(float(v)) for v in values], strict=True))


class TenantLeases(msgspec.Struct, frozen=True, kw_only=True):
    """One tenant's started executions: due->lease lag and when its first fell due and
    its last was leased."""

    succeeded: int
    started: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    mean_ms: float
    first_due: datetime
    last_started: datetime


async def lease_lags_by_tenant(db: Database) -> dict[uuid.UUID, TenantLeases]:
    async with db.connection() as conn:
        rows = await conn.fetch(_LAG_BY_TENANT)
    return {r["tenant_id"]: TenantLeases(
        succeeded=r["succeeded"], started=r["started"],
        **dict(zip(("p50_ms", "p99_ms", "max_ms"), map(float, r["lag_ms"]), strict=True)),
        mean_ms=float(r["mean_ms"]), first_due=r["first_due"], last_started=r["last_started"])
        for r in rows}


async def lease_lag_of(db: Database, tenant_ids: list[uuid.UUID]) -> tuple[int, list[float]]:
    """Over every started execution of these tenants together: (count, [p50, p99, max] ms)."""
    async with db.connection() as conn:
        row = await conn.fetchrow(_LAG_OF_TENANTS, tenant_ids)
    return row["started"], [float(v) for v in row["lag_ms"] or (0, 0, 0)]
