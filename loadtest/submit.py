"""`herdwick loadtest submit`: how fast the submit path is, and what HTTP costs on top of it.

Four phases, each `warmup_s` then `duration_s` of closed-loop load (every
client sends its next request when the last one is answered):

- http-single: POST /v1/jobs, `clients` concurrent clients, one job each;
- http-batch:  POST /v1/jobs:batch, `batch_clients` clients, `batch_size` jobs each;
- raw-single / raw-batch: the same jobs through storage.jobs.insert_jobs (the
  one `insert_jobs` statement the gateway runs) on as many pooled asyncpg
  connections as there were clients (`raw_clients` to choose otherwise, e.g.
  the gateway's own pool size for a like-for-like baseline), with no HTTP.

HTTP/raw for each shape is the figure that matters: what the gateway costs.
The API runs in its own processes (`herdwick api`), never in the load
generator's, so that CPU seconds can be split between them. Only loopback
addresses are accepted as targets; every loop stops by itself.

With --url the HTTP phases go to an API someone else runs, into a real
tenant's queues, so nothing they submit may run: each job is due no sooner
than URL_DUE_AFTER_S (30 days) after its submit, is named
`loadtest-<run>-<n>`, and every id a 201 returned is canceled through the same
API (DELETE /v1/jobs/{jobId}) once the phases end, or when the run fails or a
SIGINT/SIGTERM stops it (a second signal abandons that cleanup). The cleanup
is outside every measured window. The target's database is not inspected: the
report says how many jobs were submitted and canceled instead, and the exit
status is 1 if any could not be. Nor is the target's Postgres CPU counted. The
raw phases still run in a scratch database on --database-url: a like-for-like
baseline only if the target uses that server. Canceling takes one DELETE per
job, so after a long batch phase the cleanup takes far longer than the phases.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import itertools
import math
import os
import random
import secrets
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Annotated, Literal, TextIO

import aiohttp
import msgspec
from msgspec import Meta

from herdwick import schedule as sched
from herdwick.config import DEFAULT_HERD_WARN_JOBS, ConfigError
from herdwick.errors import HerdwickError
from herdwick.gateway.herd import herd_check
from herdwick.gateway.submit import prepare
from herdwick.ids import shard_of, uuid7
from herdwick.loadtest import html_report
from herdwick.loadtest.driver import (
    api_processes,
    require_loopback,
    running,
    scratch_database,
    scratch_name,
)
from herdwick.loadtest.measure import CpuProbe, Machine, database_of, machine_info
from herdwick.loadtest.report import Progress, add_report_flags
from herdwick.loadtest.timeline import Second, Series, Timeline, per_second
from herdwick.model import MAX_BATCH_JOBS, JobSpec, TenantSpec
from herdwick.storage import jobs as store
from herdwick.storage.db import Database
from herdwick.storage.jobs import NewJob
from herdwick.storage.tenants import create_tenant

DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DELAY_SPREAD_S = 3600  # due times spread over an hour: no herd-warning path dominates
# With --url, every due time is pushed this far out, so that nothing fires during or
# soon after the run (a scheduler looks a minute ahead), even if the cleanup fails.
URL_DUE_AFTER_S = 30 * 24 * 3600
DISTINCT_BODIES = 1024  # single bodies, cycled; batch bodies are slices of them
REQUEST_TIMEOUT_S = 30.0
API_START_TIMEOUT_S = 30.0
API_STOP_TIMEOUT_S = 10.0
CLEANUP_CLIENTS = 16  # concurrent DELETEs after a run with --url
PREFILL_BATCH = 1000  # jobs a statement when filling the scratch database first
ONE_SECOND_AFTER_S = 3600  # --one-second: the second they are all due in, after the start
CLEANUP_PASSES = 3  # deletes that failed transiently (5xx, 429, no answer) are retried
CLEANUP_RETRY_PAUSE_S = 0.5  # between passes, jittered
DELETE_TIMEOUT_S = 10.0
OK = "ok"  # the outcome of a request that created its jobs; anything else is an error name

Phase = Literal["http-single", "http-batch", "raw-single", "raw-batch"]
PHASES: tuple[Phase, ...] = ("http-single", "raw-single", "http-batch", "raw-batch")


# --- what to run ------------------------------------------------------------------------


class Plan(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The shape of the load."""

    clients: Annotated[int, Meta(ge=1, le=1024)] = 64
    raw_clients: Annotated[int, Meta(ge=1, le=1024)] | None = None  # None: as many as clients
    batch_clients: Annotated[int, Meta(ge=1, le=64)] = 4
    batch_size: Annotated[int, Meta(ge=1, le=MAX_BATCH_JOBS)] = MAX_BATCH_JOBS
    duration_s: Annotated[float, Meta(gt=0, le=3600)] = 10.0
    warmup_s: Annotated[float, Meta(ge=0, le=600)] = 2.0
    phases: tuple[Phase, ...] = PHASES
    # Jobs in the scratch database before the first phase: what a submit pays can depend
    # on what its tenant already holds (the herd check's count, indexes past memory).
    prefill: Annotated[int, Meta(ge=0, le=10_000_000)] = 0
    # Every job due in one second (a herd built by submits) instead of over an hour.
    one_second: bool = False

    @property
    def raw_connections(self) -> int:
        return self.raw_clients or self.clients


class Options(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Where to run it. Without `url`, the tool starts `api_processes` of `herdwick api`."""

    plan: Plan = Plan()
    api_processes: Annotated[int, Meta(ge=1, le=16)] = 1
    url: str | None = None
    api_key: str | None = None
    database_url: str = DEFAULT_DATABASE_URL
    redis_url: str = DEFAULT_REDIS_URL
    keep: bool = False


# --- the report ---------------------------------------------------------------------------


class Latency(msgspec.Struct, frozen=True, kw_only=True):
    samples: int
    p50_ms: float
    p95_ms: float
    p99_ms: float
    max_ms: float


class Cpu(msgspec.Struct, frozen=True, kw_only=True):
    """CPU seconds spent during the measured window."""

    api_s: float | None  # every API process together; None when the tool did not start them
    loadgen_s: float  # this process
    # This database's backends and the server's shared processes; None when the load
    # went to a database the tool does not know (--url).
    postgres_s: float | None
    machine_busy_s: float  # all CPUs, every process: the rest is other work on the machine
    capacity_s: float  # CPUs x window


class PhaseResult(msgspec.Struct, frozen=True, kw_only=True):
    name: Phase
    concurrency: int
    jobs_per_request: int
    measured_s: float
    requests: int  # completed inside the window, any outcome
    ok: int  # of which created their jobs
    requests_per_s: float
    jobs_per_s: float
    latency: Latency
    errors: dict[str, int]  # by HTTP status or exception name, over the whole phase
    jobs_created: int  # every job a request created, warm-up and tail included
    cpu: Cpu
    # By second of the measured window: jobs created by the requests answered in it, and
    # those requests' latency.
    per_second: list[Second] = []


class Ratio(msgspec.Struct, frozen=True, kw_only=True):
    shape: Literal["single", "batch"]
    http_jobs_per_s: float
    raw_jobs_per_s: float
    http_over_raw: float


class DatabaseCheck(msgspec.Struct, frozen=True, kw_only=True):
    """The scratch database against what the phases say they put there: every phase
    without --url, only the raw phases with it."""

    jobs_expected: int  # what the phases say they created in this database
    jobs_found: int
    due_rows_found: int
    consistent: bool
    jobs_prefilled: int = 0  # there before the first phase (--prefill)


class Cleanup(msgspec.Struct, frozen=True, kw_only=True):
    """With --url: what became of the jobs the run submitted through that API."""

    job_names: str  # every job the run submitted is named so, e.g. "loadtest-1a2b3c4d-*"
    due_after_s: float  # none was due sooner than this after its submit
    submitted: int  # job ids the 201 answers returned
    canceled: int  # DELETE answered 204
    already_gone: int  # DELETE answered 404
    failed: int  # not canceled, as far as the tool knows
    failures: dict[str, int]  # the failed deletes by last HTTP status or exception name
    failed_job_ids: list[str]
    unanswered_requests: int  # submits sent with no readable answer: what they made is unknown
    seconds: float  # wall time of the cleanup, outside every measured window

    @property
    def complete(self) -> bool:
        return self.failed == 0 and self.unanswered_requests == 0


class Report(msgspec.Struct, frozen=True, kw_only=True):
    started_at: datetime
    plan: Plan
    api_processes: int | None  # None: an API the tool did not start (--url)
    machine: Machine
    phases: list[PhaseResult]
    ratios: list[Ratio]
    database: DatabaseCheck | None  # None: nothing went into the scratch database (--url, no raw)
    cleanup: Cleanup | None  # None without --url: the scratch database went, jobs and all

    @property
    def passed(self) -> bool:
        return ((self.database is None or self.database.consistent)
                and (self.cleanup is None or self.cleanup.complete))


# --- measuring one phase -------------------------------------------------------------------


class Window(msgspec.Struct, frozen=True):
    """A phase's timeline on time.perf_counter(): warm-up, then the measured part."""

    start: float
    measure_from: float
    stop_at: float

    @classmethod
    def starting_now(cls, warmup_s: float, duration_s: float) -> Window:
        now = time.perf_counter()
        return cls(now, now + warmup_s, now + warmup_s + duration_s)


class Recorder:
    """One phase's outcomes. Its client tasks write; the progress watcher reads (one loop)."""

    def __init__(self, jobs_per_request: int, window: Window) -> None:
        self.jobs_per_request = jobs_per_request
        self.window = window
        self.latencies_s: list[float] = []
        self.ok = 0
        self.errors: collections.Counter[str] = collections.Counter()
        self.jobs_created = 0
        # Each measured request: (s into the window, latency ms, jobs it created).
        self.timeline: list[tuple[float, float, int]] = []

    def record(self, started: float, finished: float, outcome: str) -> None:
        if outcome == OK:
            self.jobs_created += self.jobs_per_request
        else:
            self.errors[outcome] += 1
        if self.window.measure_from <= finished < self.window.stop_at:
            self.latencies_s.append(finished - started)
            self.ok += outcome == OK
            self.timeline.append((finished - self.window.measure_from,
                                  (finished - started) * 1000,
                                  self.jobs_per_request if outcome == OK else 0))


def latency_of(samples_s: list[float]) -> Latency:
    ordered = sorted(samples_s)

    def rank_ms(p: float) -> float:  # nearest rank
        if not ordered:
            return 0.0
        return ordered[max(0, math.ceil(p * len(ordered)) - 1)] * 1000

    return Latency(samples=len(ordered), p50_ms=rank_ms(0.50), p95_ms=rank_ms(0.95),
                   p99_ms=rank_ms(0.99), max_ms=rank_ms(1.0))


async def _sleep_until(when: float) -> None:
    await asyncio.sleep(max(0.0, when - time.perf_counter()))


async def _cpu_in(window: Window, probe: CpuProbe) -> Cpu:
    await _sleep_until(window.measure_from)
    before = probe.read()
    await _sleep_until(window.stop_at)
    after = probe.read()
    api = None if after.api_s is None or before.api_s is None else after.api_s - before.api_s
    postgres = None
    if after.postgres_s is not None and before.postgres_s is not None:
        postgres = sum(s - before.postgres_s.get(pid, 0.0) for pid, s in after.postgres_s.items())
    return Cpu(api_s=api, loadgen_s=after.loadgen_s - before.loadgen_s, postgres_s=postgres,
               machine_busy_s=after.machine_busy_s - before.machine_busy_s,
               capacity_s=(os.cpu_count() or 1) * (window.stop_at - window.measure_from))


async def watch(progress: Progress, name: Phase, rec: Recorder, window: Window) -> None:
    """The phase on the progress bar: warm-up, then the measured window's jobs."""
    def errors() -> str:
        left = max(0.0, window.stop_at - time.perf_counter())
        return f"errors {sum(rec.errors.values())}, {left:.0f} s left"

    progress.set(f"{name} warm-up", errors, done=lambda: rec.jobs_created)
    await _sleep_until(window.measure_from)
    progress.set(f"{name} measuring", errors, done=lambda: rec.ok * rec.jobs_per_request)


Send = Callable[[], Awaitable[str]]


async def _drive(send: Send, rec: Recorder, stop_at: float) -> None:
    while (started := time.perf_counter()) < stop_at:
        outcome = await send()
        rec.record(started, time.perf_counter(), outcome)


async def run_phase(name: Phase, concurrency: int, jobs_per_request: int, send: Send,
                    plan: Plan, probe: CpuProbe, progress: Progress) -> PhaseResult:
    """`concurrency` closed loops of `send` through warm-up and the measured window."""
    window = Window.starting_now(plan.warmup_s, plan.duration_s)
    rec = Recorder(jobs_per_request, window)
    async with asyncio.TaskGroup() as tg:
        cpu = tg.create_task(_cpu_in(window, probe))
        tg.create_task(watch(progress, name, rec, window))
        for _ in range(concurrency):
            tg.create_task(_drive(send, rec, window.stop_at))
    requests = len(rec.latencies_s)
    return PhaseResult(
        name=name, concurrency=concurrency, jobs_per_request=jobs_per_request,
        measured_s=plan.duration_s, requests=requests, ok=rec.ok,
        requests_per_s=requests / plan.duration_s,
        jobs_per_s=rec.ok * jobs_per_request / plan.duration_s,
        latency=latency_of(rec.latencies_s), errors=dict(rec.errors),
        jobs_created=rec.jobs_created, cpu=cpu.result(),
        per_second=per_second(name, rec.timeline).seconds)


# --- the jobs ------------------------------------------------------------------------------


def job_bodies(count: int, seed: int = 2, *, name: str = "loadtest",
               due_after_s: int = 0, at: datetime | None = None) -> list[dict]:
    """Small, realistic queue jobs named `<name>-<i>`, due at times spread over an hour
    (beyond `due_after_s`), or all at `at`."""
    rng = random.Random(seed)
    queues = ("emails", "reports", "billing", "thumbnails")

    def schedule() -> dict:
        if at is not None:
            return {"runAt": sched.format_utc(at)}
        return {"delaySeconds": due_after_s + rng.randrange(60, DELAY_SPREAD_S)}

    return [{"name": f"{name}-{i}",
             "target": {"type": "queue", "ref": queues[i % len(queues)]},
             "payload": {"user": f"user{rng.randrange(10**6)}@example.com",
                         "template": "welcome", "attempt": 1, "tags": ["a", "b"]},
             "schedule": schedule()}
            for i in range(count)]


def _batches(bodies: list[dict], size: int) -> list[list[dict]]:
    """Enough distinct batches to cycle through, each `size` long (wrapping around)."""
    ring = itertools.cycle(bodies)
    count = max(1, len(bodies) // size)
    return [[next(ring) for _ in range(size)] for _ in range(count)]


class JobMaker:
    """Fresh NewJobs from prepared templates: new ids and due times, nothing else re-done.

    The templates go through gateway.submit.prepare once, so raw rows match
    what the gateway would insert for the same bodies.
    """

    def __init__(self, bodies: list[dict]) -> None:
        now = datetime.now(UTC)
        specs = [msgspec.json.decode(msgspec.json.encode(b), type=JobSpec) for b in bodies]
        self._next = itertools.cycle(
            [(prepare(s, now=now, allow=()).job,
              None if s.schedule.delay_seconds is None
              else timedelta(seconds=s.schedule.delay_seconds))
             for s in specs]).__next__

    def make(self, count: int) -> list[NewJob]:
        now = datetime.now(UTC)
        return [self._fresh(now) for _ in range(count)]

    def _fresh(self, now: datetime) -> NewJob:
        template, delay = self._next()
        job_id = uuid7(now)
        return msgspec.structs.replace(  # a runAt template keeps its time
            template, job_id=job_id, shard_id=shard_of(job_id),
            next_run_at=template.next_run_at if delay is None else now + delay)


# --- the phases ----------------------------------------------------------------------------


class HttpTarget(msgspec.Struct, frozen=True):
    url: str  # e.g. http://127.0.0.1:8080
    api_key: str

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}", "Content-Type": "application/json"}


class _Created(msgspec.Struct, rename="camel"):  # JobCreated and BatchItem: only the id
    job_id: str


class _BatchCreated(msgspec.Struct):
    items: list[_Created]


_created = msgspec.json.Decoder(_Created)
_batch_created = msgspec.json.Decoder(_BatchCreated)


def single_ids(answer: bytes) -> list[str]:
    return [_created.decode(answer).job_id]


def batch_ids(answer: bytes) -> list[str]:
    return [item.job_id for item in _batch_created.decode(answer).items]


class Ledger:
    """With --url: every job id the 201s returned, for the cleanup to cancel.

    The requests write it, each in a task of its own, so that a request whose
    client is cancelled (SIGINT, a failing phase) still gets its answer read;
    the phase drains them before closing its session, and the cleanup reads
    the ledger after that (all on one loop).
    """

    def __init__(self, job_names: str) -> None:
        self.job_names = job_names
        self.job_ids: list[str] = []
        self.unanswered = 0  # requests sent with no readable answer: what they made is unknown
        self._in_flight: set[asyncio.Task[str]] = set()
        self.cleanup: Cleanup | None = None  # set by canceled_afterwards, once it has run

    async def track(self, request: Awaitable[str]) -> str:
        task = asyncio.ensure_future(request)
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)
        return await asyncio.shield(task)

    async def drain(self) -> None:
        """Wait for the requests still out; any without an answer in time is unanswered."""
        if not self._in_flight:
            return
        late: set[asyncio.Task[str]] = set(self._in_flight)
        try:
            _, late = await asyncio.wait(late, timeout=REQUEST_TIMEOUT_S)
        finally:  # also when a second signal cancels the wait
            late = {t for t in late if not t.done()}
            for task in late:
                task.cancel()
            self.unanswered += len(late)


IdsOf = Callable[[bytes], list[str]]


async def _post(session: aiohttp.ClientSession, path: str, body: bytes,
                record: tuple[Ledger, IdsOf] | None) -> str:
    try:
        async with session.post(path, data=body) as resp:
            answer = await resp.read()
    except aiohttp.ClientConnectorError as exc:
        return type(exc).__name__  # never sent: created nothing
    except (aiohttp.ClientError, TimeoutError) as exc:
        if record is not None:
            record[0].unanswered += 1
        return type(exc).__name__
    if resp.status != 201:
        return str(resp.status)
    if record is not None:
        ledger, ids_of = record
        try:
            ledger.job_ids += ids_of(answer)
        except msgspec.DecodeError:
            ledger.unanswered += 1
            return "unreadable 201"
    return OK


async def _http_phase(name: Phase, target: HttpTarget, path: str, bodies: list[bytes],
                      concurrency: int, jobs_per_request: int, plan: Plan, probe: CpuProbe,
                      progress: Progress, record: tuple[Ledger, IdsOf] | None) -> PhaseResult:
    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=concurrency)
    async with aiohttp.ClientSession(target.url, connector=connector, headers=target.headers(),
                                     timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
                                     ) as session:
        next_body = itertools.cycle(bodies).__next__

        def send() -> Awaitable[str]:
            if record is None:
                return _post(session, path, next_body(), None)
            return record[0].track(_post(session, path, next_body(), record))

        try:
            return await run_phase(name, concurrency, jobs_per_request, send, plan, probe,
                                   progress)
        finally:
            if record is not None:
                await record[0].drain()  # before the session closes under them


async def http_phases(plan: Plan, target: HttpTarget, bodies: list[dict], probe: CpuProbe,
                      progress: Progress, ledger: Ledger | None = None) -> list[PhaseResult]:
    """With a ledger, every job id the 201s return goes into it."""
    encode = msgspec.json.encode
    results = []
    if "http-single" in plan.phases:
        results.append(await _http_phase(
            "http-single", target, "/v1/jobs", [encode(b) for b in bodies], plan.clients, 1,
            plan, probe, progress, None if ledger is None else (ledger, single_ids)))
    if "http-batch" in plan.phases:
        batches = [encode({"jobs": b}) for b in _batches(bodies, plan.batch_size)]
        results.append(await _http_phase(
            "http-batch", target, "/v1/jobs:batch", batches, plan.batch_clients,
            plan.batch_size, plan, probe, progress,
            None if ledger is None else (ledger, batch_ids)))
    return results


async def _insert_as_gateway(db: Database, tenant_id: uuid.UUID, jobs: list[NewJob]) -> None:
    """What the gateway's submit does after decoding, minus HTTP: the same statement and args."""
    now = datetime.now(UTC)
    await store.insert_jobs(db, tenant_id, jobs, now=now,
                            herd=herd_check(jobs, now, DEFAULT_HERD_WARN_JOBS))


async def _insert(db: Database, tenant_id: uuid.UUID, jobs: list[NewJob]) -> str:
    """A raw phase's request: OK, or the name of the error."""
    try:
        await _insert_as_gateway(db, tenant_id, jobs)
    except HerdwickError as exc:
        return type(exc).__name__
    return OK


async def prefill(db: Database, tenant_id: uuid.UUID, bodies: list[dict], count: int,
                  concurrency: int) -> None:
    """`count` of the tenant's jobs, due over the same hour as the phases', through the
    same statement in batches of PREFILL_BATCH; raises if Postgres refuses one."""
    maker = JobMaker(bodies)
    sizes = iter([min(PREFILL_BATCH, count - i) for i in range(0, count, PREFILL_BATCH)])

    async def insert_some() -> None:
        for size in sizes:  # one iterator: each batch goes to one of the tasks
            await _insert_as_gateway(db, tenant_id, maker.make(size))

    await asyncio.gather(*(insert_some() for _ in range(concurrency)))


async def raw_phases(plan: Plan, db: Database, tenant_id: uuid.UUID, bodies: list[dict],
                     probe: CpuProbe, progress: Progress) -> list[PhaseResult]:
    """`db` needs a pool of at least plan.raw_connections connections."""
    maker = JobMaker(bodies)
    results = []
    for name, concurrency, size in (("raw-single", plan.raw_connections, 1),
                                    ("raw-batch", plan.batch_clients, plan.batch_size)):
        if name not in plan.phases:
            continue

        def send(size: int = size) -> Awaitable[str]:
            return _insert(db, tenant_id, maker.make(size))

        results.append(await run_phase(name, concurrency, size, send, plan, probe, progress))
    return results


def ratios(phases: list[PhaseResult]) -> list[Ratio]:
    by_name = {p.name: p for p in phases}
    found = []
    for shape in ("single", "batch"):
        http, raw = by_name.get(f"http-{shape}"), by_name.get(f"raw-{shape}")
        if http is None or raw is None:
            continue
        found.append(Ratio(shape=shape, http_jobs_per_s=http.jobs_per_s,
                           raw_jobs_per_s=raw.jobs_per_s,
                           http_over_raw=http.jobs_per_s / raw.jobs_per_s if raw.jobs_per_s
                           else 0.0))
    return found


# --- with --url: canceling what the run submitted ------------------------------------------


_TRANSIENT_STATUSES = frozenset({429, 500, 502, 503, 504})
NOT_TRIED = "not tried"


class Canceller:
    """DELETEs a ledger's jobs, CLEANUP_CLIENTS at a time; deletes that failed transiently
    are tried again in up to CLEANUP_PASSES passes. Only its own tasks write it."""

    def __init__(self, target: HttpTarget, ledger: Ledger) -> None:
        self._target = target
        self._ledger = ledger
        self.canceled = 0
        self.already_gone = 0
        # Every job not yet settled -> (why, worth retrying): what is left is what failed.
        self.left: dict[str, tuple[str, bool]] = dict.fromkeys(ledger.job_ids, (NOT_TRIED, True))

    async def run(self, progress: Progress) -> None:
        connector = aiohttp.TCPConnector(limit=CLEANUP_CLIENTS, limit_per_host=CLEANUP_CLIENTS)
        async with aiohttp.ClientSession(self._target.url, connector=connector,
                                         headers=self._target.headers(),
                                         timeout=aiohttp.ClientTimeout(total=DELETE_TIMEOUT_S)
                                         ) as session:
            progress.set("cleanup: canceling",
                         lambda: f"failing {len(self.left) - self._untried()}",
                         done=lambda: self.canceled + self.already_gone,
                         total=len(self._ledger.job_ids))
            for attempt in range(CLEANUP_PASSES):
                todo = [job_id for job_id, (_, retry) in self.left.items() if retry]
                if not todo:
                    break
                if attempt:
                    await asyncio.sleep(CLEANUP_RETRY_PAUSE_S * random.uniform(0.5, 1.5))
                ids = iter(todo)  # shared by the workers: each takes the next id
                async with asyncio.TaskGroup() as tg:
                    for _ in range(min(CLEANUP_CLIENTS, len(todo))):
                        tg.create_task(self._work(session, ids))

    async def _work(self, session: aiohttp.ClientSession, ids: Iterator[str]) -> None:
        for job_id in ids:
            try:
                async with session.delete(f"/v1/jobs/{job_id}") as resp:
                    await resp.read()
                    status = resp.status
            except (aiohttp.ClientError, TimeoutError) as exc:
                self.left[job_id] = (type(exc).__name__, True)
                continue
            if status == 204:
                self.canceled += 1
                del self.left[job_id]
            elif status == 404:
                self.already_gone += 1
                del self.left[job_id]
            else:
                self.left[job_id] = (str(status), status in _TRANSIENT_STATUSES)

    def _untried(self) -> int:
        return sum(why == NOT_TRIED for why, _ in self.left.values())

    def result(self, seconds: float, interrupted: bool) -> Cleanup:
        failures = collections.Counter(
            "interrupted" if interrupted and why == NOT_TRIED else why
            for why, _ in self.left.values())
        return Cleanup(job_names=f"{self._ledger.job_names}-*", due_after_s=URL_DUE_AFTER_S,
                       submitted=len(self._ledger.job_ids), canceled=self.canceled,
                       already_gone=self.already_gone, failed=len(self.left),
                       failures=dict(failures), failed_job_ids=list(self.left),
                       unanswered_requests=self._ledger.unanswered, seconds=seconds)


async def cancel_submitted(target: HttpTarget, ledger: Ledger, progress: Progress) -> Cleanup:
    """Cancel every job in the ledger through the API; says how that went on `progress`,
    even when a signal interrupts it."""
    progress.say(f"cleanup: canceling the {len(ledger.job_ids)} jobs submitted through --url")
    canceller = Canceller(target, ledger)
    started = time.perf_counter()
    try:
        await canceller.run(progress)
    except asyncio.CancelledError:
        _say_cleanup(progress, "cleanup interrupted",
                     canceller.result(time.perf_counter() - started, interrupted=True))
        raise
    cleanup = canceller.result(time.perf_counter() - started, interrupted=False)
    _say_cleanup(progress, "cleanup", cleanup)
    return cleanup


@contextlib.asynccontextmanager
async def canceled_afterwards(target: HttpTarget, job_names: str,
                              progress: Progress) -> AsyncIterator[Ledger]:
    """A ledger for the phases; on the way out, however it is taken, its jobs are canceled
    and the outcome left in `ledger.cleanup`."""
    ledger = Ledger(job_names)
    try:
        yield ledger
    finally:
        ledger.cleanup = await cancel_submitted(target, ledger, progress)


def cleanup_lines(c: Cleanup) -> list[str]:
    """The first line always; the others when something is left to know."""
    lines = [f"submitted {c.submitted} jobs through --url; canceled {c.canceled} "
             f"(failed {c.failed}) in {c.seconds:.1f} s"]
    if c.already_gone:
        lines.append(f"already gone (404): {c.already_gone}")
    if c.failed:
        why = ", ".join(f"{k}: {v}" for k, v in sorted(c.failures.items()))
        shown = ", ".join(c.failed_job_ids[:3]) + (", ... (all in --json)" if c.failed > 3
                                                   else "")
        lines.append(f"NOT CANCELED: {c.failed} jobs ({why}), ids {shown}")
    if c.unanswered_requests:
        lines.append(f"NOT ACCOUNTED FOR: {c.unanswered_requests} submit(s) got no readable "
                     "answer; any jobs they created were not canceled")
    if not c.complete:
        lines.append(f"what is left is named {c.job_names} and due no sooner than "
                     f"{c.due_after_s / 86400:g} days after its submit: cancel it with "
                     "DELETE /v1/jobs/{jobId}")
    return lines


def _say_cleanup(progress: Progress, head: str, cleanup: Cleanup) -> None:
    first, *rest = cleanup_lines(cleanup)
    progress.say(f"{head}: {first}")
    for line in rest:
        progress.say(f"  {line}")


# --- setting up -------------------------------------------------------------------------


# The tool's own statements on its scratch database: storage/ has no row counts.
async def count_rows(db: Database, tenant_id: uuid.UUID) -> tuple[int, int]:
    async with db.connection() as conn:
        jobs = await conn.fetchval("SELECT count(*) FROM jobs WHERE tenant_id = $1", tenant_id)
        due = await conn.fetchval("SELECT count(*) FROM due_index")
    return jobs, due


# --- the whole run -------------------------------------------------------------------------


async def _http_side(options: Options, db_url: str, api_key: str, bodies: list[dict],
                     ledger: Ledger | None, progress: Progress) -> list[PhaseResult]:
    plan = options.plan
    if ledger is not None:
        # The target's database is not ours to find, so its backends are not counted.
        return await http_phases(plan, url_target(options), bodies,
                                 CpuProbe(postgres=False), progress, ledger)
    async with api_processes(options.api_processes, db_url, options.redis_url) as (url, pids):
        progress.say(f"api: {options.api_processes} process(es) at {url}, pids {list(pids)}")
        probe = CpuProbe(pids, database=database_of(db_url))
        return await http_phases(plan, HttpTarget(url, api_key), bodies, probe, progress)


def url_target(options: Options) -> HttpTarget:
    assert options.url is not None
    return HttpTarget(options.url.rstrip("/"), options.api_key or "")


async def run(options: Options, progress: Progress) -> Report:
    """Set up, run every phase of the plan, tear down; the API is stopped before raw phases
    so its idle pool does not hold connections the raw phases need. With --url, what the
    HTTP phases submitted is canceled after the last phase, or on the way out of a failure."""
    for url, what in ((options.database_url, "--database-url"), (options.url, "--url"),
                      (options.redis_url, "--redis-url")):
        if url is not None:
            require_loopback(url, what)
    if options.url is not None and not options.api_key:
        raise ConfigError("--url needs --api-key (a key of a tenant of that API)")
    started = datetime.now(UTC)
    plan = options.plan
    due_after_s = 0 if options.url is None else URL_DUE_AFTER_S
    at = (started.replace(microsecond=0) + timedelta(seconds=due_after_s + ONE_SECOND_AFTER_S)
          if plan.one_second else None)
    names = "loadtest" if options.url is None else f"loadtest-{secrets.token_hex(4)}"
    bodies = job_bodies(DISTINCT_BODIES, name=names, due_after_s=due_after_s, at=at)
    ledger_of = (contextlib.nullcontext(None) if options.url is None
                 else canceled_afterwards(url_target(options), names, progress))
    machine = await machine_info(options.database_url, options.redis_url)
    async with scratch_database(options.database_url, scratch_name("loadtest"), options.keep,
                                progress.say) as dsn:
        db = await Database.connect(dsn, min_size=1,
                                    max_size=max(plan.raw_connections, plan.batch_clients))
        try:
            tenant = await create_tenant(db, TenantSpec(name="loadtest"), started)
            if plan.prefill:
                progress.say(f"prefilling the scratch database with {plan.prefill} jobs")
                await prefill(db, tenant.tenant_id, bodies, plan.prefill, plan.batch_clients)
            async with ledger_of as ledger:
                phases = await _http_side(options, dsn, tenant.api_key, bodies, ledger,
                                          progress)
                phases += await raw_phases(plan, db, tenant.tenant_id, bodies,
                                           CpuProbe(database=database_of(dsn)), progress)
            jobs, due = await count_rows(db, tenant.tenant_id)
        finally:
            await db.close()
    # With --url only the raw phases wrote to the scratch database.
    ours = [p for p in phases if options.url is None or p.name.startswith("raw-")]
    expected = sum(p.jobs_created for p in ours)
    database = None if not ours and options.url is not None and not plan.prefill \
        else DatabaseCheck(jobs_expected=expected, jobs_found=jobs, due_rows_found=due,
                           consistent=jobs == due == expected + plan.prefill,
                           jobs_prefilled=plan.prefill)
    order = {name: i for i, name in enumerate(PHASES)}
    phases.sort(key=lambda p: order[p.name])
    return Report(started_at=started, plan=plan,
                  api_processes=None if options.url else options.api_processes,
                  machine=machine, phases=phases, ratios=ratios(phases), database=database,
                  cleanup=None if ledger is None else ledger.cleanup)


# --- the command ---------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `herdwick loadtest submit`; an unset flag takes Plan's default."""
    a = parser.add_argument
    a("--clients", type=int, metavar="N",
      help="concurrent single-submit clients; default 64")
    a("--raw-clients", type=int, metavar="N",
      help="connections of the raw single-insert baseline; default --clients")
    a("--batch-clients", type=int, metavar="C",
      help="concurrent batch clients; default 4")
    a("--batch-size", type=int, metavar="JOBS",
      help="jobs per batch request; default 1000")
    a("--duration", type=float, metavar="S",
      help="measured seconds per phase; default 10")
    a("--warmup", type=float, metavar="S",
      help="warm-up seconds before each phase is measured; default 2")
    a("--prefill", type=int, metavar="JOBS",
      help="jobs put into the scratch database before the first phase (the tenant's, due "
           "over the same hour, 1,000 a statement), so the phases submit into a table that "
           "size; default 0")
    a("--one-second", action="store_true", default=None,
      help="every job due in the same second, an hour ahead, instead of over an hour: a "
           "herd built by submits, each of which counts the jobs already there for the "
           "herd warning")
    a("--phases", metavar="LIST",
      help="comma-separated subset of http-single,raw-single,http-batch,raw-batch; "
           "default all")
    a("--api-processes", type=int, metavar="K",
      help="herdwick api processes to start on one port; default 1")
    a("--url", help="target a running API (loopback only) instead; its jobs are due no "
      "sooner than 30 days after submit and are all canceled through that API (DELETE "
      "/v1/jobs/{jobId}) when the phases end, fail or are stopped by a signal; its database "
      "is not inspected, and the exit status is 1 if any job could not be canceled")
    a("--api-key", help="a tenant's API key for --url: it needs to submit and cancel jobs")
    a("--database-url", help="Postgres server for the scratch database; "
      "default $HERDWICK_DATABASE_URL, else postgres@127.0.0.1:5432")
    a("--redis-url", help="default $HERDWICK_REDIS_URL, else 127.0.0.1:6379")
    a("--keep", action="store_true", help="keep the scratch database")
    a("--json", action="store_true", help="the report as JSON")
    add_report_flags(parser)


def options_from(args: argparse.Namespace) -> Options:
    """CLI flags to Options; an unset flag takes the default (or the environment's URL)."""
    plan = {k: v for k, v in {
        "clients": args.clients, "raw_clients": args.raw_clients,
        "batch_clients": args.batch_clients,
        "batch_size": args.batch_size, "duration_s": args.duration, "warmup_s": args.warmup,
        "phases": tuple(p.strip() for p in args.phases.split(",")) if args.phases else None,
        "prefill": args.prefill, "one_second": args.one_second,
    }.items() if v is not None}
    raw = {"plan": plan, "api_processes": args.api_processes, "url": args.url,
           "api_key": args.api_key, "keep": args.keep,
           "database_url": (args.database_url or os.environ.get("HERDWICK_DATABASE_URL")
                            or DEFAULT_DATABASE_URL),
           "redis_url": (args.redis_url or os.environ.get("HERDWICK_REDIS_URL")
                         or DEFAULT_REDIS_URL)}
    try:
        return msgspec.convert({k: v for k, v in raw.items() if v is not None}, Options)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"loadtest submit: {exc}") from None


def render_text(report: Report) -> str:
    m = report.machine
    via_url = report.cleanup is not None
    procs = ("an API at --url" if via_url else f"{report.api_processes} api process(es)")
    lines = [
        f"herdwick loadtest submit  {report.started_at:%Y-%m-%dT%H:%M:%SZ}",
        f"machine: {m.cpus} CPUs, Python {m.python}, PostgreSQL {m.postgres} (fsync {m.fsync}, "
        f"synchronous_commit {m.synchronous_commit}); {procs}",
    ]
    if via_url:
        lines.append("(that PostgreSQL is --database-url's, where the raw phases ran; the "
                     "target API's processes and database were not inspected)")
    lines += [
        f"each phase: {report.plan.warmup_s:g} s warm-up, {report.plan.duration_s:g} s measured"
        + (f"; {report.plan.prefill} jobs in the scratch database before the first"
           if report.plan.prefill else "")
        + ("; every job due in one second" if report.plan.one_second else ""),
        "",
        f"{'phase':<11} {'conc':>4} {'jobs/req':>8} {'req/s':>9} {'jobs/s':>9} {'p50 ms':>8} "
        f"{'p95 ms':>8} {'p99 ms':>8} {'max ms':>8}  errors",
    ]
    for p in report.phases:
        lat = p.latency
        errors = ", ".join(f"{k}: {v}" for k, v in sorted(p.errors.items())) or "0"
        lines.append(f"{p.name:<11} {p.concurrency:>4} {p.jobs_per_request:>8} "
                     f"{p.requests_per_s:>9.0f} {p.jobs_per_s:>9.0f} {lat.p50_ms:>8.1f} "
                     f"{lat.p95_ms:>8.1f} {lat.p99_ms:>8.1f} {lat.max_ms:>8.1f}  {errors}")
    lines += ["", "HTTP / raw (jobs/s): " + "   ".join(
        f"{r.shape} {r.http_over_raw:.2f} ({r.http_jobs_per_s:.0f} / {r.raw_jobs_per_s:.0f})"
        for r in report.ratios)]
    if via_url and report.ratios:
        lines.append("(raw ran in a scratch database on --database-url: a like-for-like "
                     "baseline only if the target API uses that server)")
    lines += ["", "CPU seconds in the measured window:",
              f"{'phase':<11} {'api':>7} {'loadgen':>8} {'postgres':>8} {'other':>7} "
              f"{'busy':>7} {'of':>6}"]
    for p in report.phases:
        c = p.cpu
        api = "-" if c.api_s is None else f"{c.api_s:.1f}"
        postgres = "-" if c.postgres_s is None else f"{c.postgres_s:.1f}"
        other = max(0.0, c.machine_busy_s - (c.api_s or 0.0) - c.loadgen_s
                    - (c.postgres_s or 0.0))
        lines.append(f"{p.name:<11} {api:>7} {c.loadgen_s:>8.1f} {postgres:>8} "
                     f"{other:>7.1f} {c.machine_busy_s:>7.1f} {c.capacity_s:>6.1f}")
    lines.append("(other: the kernel and anything else running on the machine"
                 + ("; with --url, the target API and its PostgreSQL too)" if via_url else ")"))
    lines += ["", *_database_lines(report)]
    return "\n".join(lines)


def _database_lines(report: Report) -> list[str]:
    d, c = report.database, report.cleanup
    before = f" and {d.jobs_prefilled} were there before" if d and d.jobs_prefilled else ""
    check = [] if d is None else [
        f"{d.jobs_found} jobs, {d.due_rows_found} due rows; the "
        f"{'phases' if c is None else 'raw phases'} reported {d.jobs_expected}{before}: "
        f"{'consistent' if d.consistent else 'MISMATCH'}"]
    if c is None:
        return [f"database: {check[0]}"]
    first, *rest = cleanup_lines(c)
    lines = [f"database: the target's database was not inspected (--url); {first}",
             *(f"  {line}" for line in rest)]
    return lines + [f"scratch database (raw phases only): {line}" for line in check]


def write_report(report: Report, out: TextIO, as_json: bool) -> None:
    out.write(msgspec.json.encode(report).decode() if as_json else render_text(report))
    out.write("\n")
    out.flush()


async def command(args: argparse.Namespace) -> int:
    """`herdwick loadtest submit`: progress on stderr, the report on stdout.

    SIGTERM and SIGINT cancel the run, so the API processes are stopped, the
    scratch database dropped and, with --url, the submitted jobs canceled on the
    way out (a second signal abandons that). Exit 1 if a check failed or a job
    could not be canceled.
    """
    options = options_from(args)
    html_report.check_path(args.report)
    progress = Progress.of_args(args, "submit")
    main = asyncio.current_task()
    assert main is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, main.cancel)
    try:
        async with running(progress.run()):
            report = await run(options, progress)
    except asyncio.CancelledError:
        # With --url the cleanup has said above what became of the jobs.
        progress.say("stopped by a signal" + ("; cleaned up" if options.url is None else ""))
        return 130
    write_report(report, sys.stdout, args.json)
    html_report.write_report(args, "loadtest submit", report, render_text(report),
                             headline(report), timeline_of(report), report.started_at)
    return 0 if report.passed else 1


def timeline_of(report: Report) -> Timeline:
    """Each phase's seconds, every phase from the start of its own measured window."""
    return Timeline(origin=report.started_at, x_label="s into each phase's measured window",
                    count_label="jobs created per second (by the requests answered in it)",
                    lag_label="request latency, ms",
                    series=[Series(name=p.name, seconds=p.per_second) for p in report.phases])


def headline(r: Report) -> list[tuple[str, str]]:
    """The figures a reader looks for first, as the text says them."""
    found = [(f"{p.name}: jobs/s, latency p50 / p99 ms",
              f"{p.jobs_per_s:,.0f}, {p.latency.p50_ms:.1f} / {p.latency.p99_ms:.1f}")
             for p in r.phases]
    found += [(f"HTTP / raw, {x.shape}", f"{x.http_over_raw:.2f}") for x in r.ratios]
    return [*found, ("checks", "passed" if r.passed else "FAILED")]
