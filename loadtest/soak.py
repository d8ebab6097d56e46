"""`herdwick loadtest soak`: steady load with a herd every minute, for many minutes, watching
whether any process's memory or the steady jobs' lag creeps up.

Real `herdwick scheduler` and `herdwick worker` processes (no-op handler) and, with
--api, one `herdwick api` that the steady jobs are submitted through (a batch request
per tenant every 0.1 s, as a client near its due times would); without it the harness
inserts them itself, as the other load tests do. A herd of --herd jobs falls due at
every multiple of --herd-every seconds (the top of each minute by default), inserted
HERD_LEAD_S before it, on tenants of its own, so herd and steady jobs are told apart by
tenant.

Every --sample-every seconds the harness samples each process's RSS and CPU (psutil),
the events and ready streams' depth and Redis' used_memory, and the due->lease lag of
every job leased since the last sample: one statement probes the jobs due and not yet
seen leased by their (job_id, scheduled_for) key, an index lookup each, so a sample
costs the same in the thirtieth minute as in the first (the executions table has no
index on started_at: a window scan would read the whole day's partition every time).
The statement returns each leased job's lag rather than percentiles: a row (one herd
period) spans many windows, and percentiles of windows do not merge. Percentiles are
nearest-rank, as everywhere in loadtest.

It reports one row per herd period (a minute by default): the jobs due in it, steady and
herd lag apart, RSS and CPU by kind of process; and two verdicts, judged by `judge`:
RSS flat and steady p99 flat. Exit 1 when a verdict fails, a job was lost or left
unfinished, or the history has gaps (loadtest e2e's check).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import secrets
import signal
import statistics
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Annotated

import aiohttp
import msgspec
import psutil
import redis.asyncio as aioredis
from msgspec import Meta

from herdwick.config import ConfigError
from herdwick.loadtest.background import Background
from herdwick.loadtest.driver import (
    ApiProcess,
    Child,
    RunFailed,
    add_scratch_flags,
    check_alive,
    child_env,
    children,
    free_port,
    leases_settled,
    require_loopback,
    running,
    scheduler_processes,
    scratch_database,
    scratch_name,
    scratch_prefix,
    worker_processes,
)
from herdwick.loadtest.html_report import check_path, write_report
from herdwick.loadtest.jobs import (
    INSERT_CONNECTIONS,
    PAYLOAD,
    JobFactory,
    TenantRef,
    even_split,
    herd_batches,
    insert_batches,
    pool_names,
)
from herdwick.loadtest.measure import KindsMark, KindsProbe, StreamSampler, nearest_rank
from herdwick.loadtest.outcomes import History, history_of
from herdwick.loadtest.plot import PALETTE, Line, line_chart
from herdwick.loadtest.report import MB, Progress, add_report_flags, render_json
from herdwick.loadtest.timeline import Second, Series, Timeline
from herdwick.model import TenantSpec
from herdwick.storage.db import Database
from herdwick.storage.hot import HotTier
from herdwick.storage.jobs import NewJob
from herdwick.storage.tenants import create_tenant

WORKER_APP = "herdwick.loadtest.noop_worker:worker"
# Inside the shards' 60 s lookahead, so their 2 s loads find a herd well before it is due.
HERD_LEAD_S = 10.0
DRAIN_POLL_S = 0.5
API_CONNECTIONS = 16
# The verdicts (see judge): the run is cut in thirds, the first is warm-up, the last
# third is compared with the second.
RSS_GROWTH_MAX = 0.05  # a process's mean RSS may grow 5 % from the second third to the last
P99_GROWTH_MAX = 0.25  # the steady p99 (median of the rows') may grow 25 % ...
P99_SLACK_MS = 10.0  # ... plus 10 ms: a few ms of jitter on a 20 ms p99 is not a trend
MIN_PER_THIRD = 3  # points in each third, or the series is too short to judge
RSS_RULE = (f"each process's mean RSS over the last third of the samples within "
            f"{RSS_GROWTH_MAX:.0%} above its mean over the second third (the first third "
            f"is warm-up; at least {MIN_PER_THIRD} samples a third)")
P99_RULE = (f"the median of the rows' steady p99 over the last third of the rows at most "
            f"{1 + P99_GROWTH_MAX:g} x that over the second third + {P99_SLACK_MS:g} ms "
            f"(the first third is warm-up; at least {MIN_PER_THIRD} rows a third)")


# --- the verdicts ----------------------------------------------------------------------------


class Flatness(msgspec.Struct, frozen=True, kw_only=True):
    """One series judged: its second and last thirds' centres, the bound the last had to
    keep under; `flat` is None when the series was too short to judge."""

    points: int
    second_third: float | None = None
    last_third: float | None = None
    bound: float | None = None
    flat: bool | None = None

    @property
    def change(self) -> float | None:
        """last / second - 1: +0.02 for 2 % growth."""
        if self.second_third is None or self.last_third is None or not self.second_third:
            return None
        return self.last_third / self.second_third - 1


def thirds(series: Sequence[float]) -> tuple[Sequence[float], Sequence[float]] | None:
    """The second and last thirds, each len // 3 long (the warm-up takes what is over);
    None with fewer than MIN_PER_THIRD points a third."""
    n = len(series) // 3
    if n < MIN_PER_THIRD:
        return None
    return series[-2 * n:-n], series[-n:]


def judge(series: Sequence[float], centre: Callable[[Sequence[float]], float],
          bound_of: Callable[[float], float]) -> Flatness:
    """Flat when the last third's centre is at most bound_of(the second third's)."""
    cut = thirds(series)
    if cut is None:
        return Flatness(points=len(series))
    second, last = centre(cut[0]), centre(cut[1])
    bound = bound_of(second)
    return Flatness(points=len(series), second_third=round(second, 2),
                    last_third=round(last, 2), bound=round(bound, 2), flat=last <= bound)


def rss_flatness(rss_mb: Sequence[float]) -> Flatness:
    """Means: RSS moves little between samples, and a leak moves the mean."""
    return judge(rss_mb, statistics.fmean, lambda second: second * (1 + RSS_GROWTH_MAX))


def p99_flatness(p99_ms: Sequence[float]) -> Flatness:
    """Medians: one row with a GC pause or a neighbour's burst is not a trend."""
    return judge(p99_ms, statistics.median,
                 lambda second: second * (1 + P99_GROWTH_MAX) + P99_SLACK_MS)


# --- the report ----------------------------------------------------------------------------


class Plan(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The flags' limits."""

    minutes: Annotated[float, Meta(gt=0, le=24 * 60)] = 30.0
    rate: Annotated[float, Meta(ge=0, le=20_000)] = 500.0
    herd: Annotated[int, Meta(ge=0, le=1_000_000)] = 5_000
    herd_every_s: Annotated[float, Meta(ge=2, le=3_600)] = 60.0
    sample_every_s: Annotated[float, Meta(ge=0.5, le=60)] = 5.0
    delay_s: Annotated[float, Meta(ge=0.5, le=60)] = 2.5
    tenants: Annotated[int, Meta(ge=1, le=100)] = 10
    schedulers: Annotated[int, Meta(ge=1, le=16)] = 1
    workers: Annotated[int, Meta(ge=1, le=16)] = 2
    concurrency: Annotated[int, Meta(ge=1, le=10_000)] = 200
    api: bool = False
    timeout_s: Annotated[float, Meta(gt=0, le=3_600)] = 120.0

    @property
    def duration_s(self) -> float:
        return self.minutes * 60

    @property
    def herds(self) -> int:
        return 0 if self.herd == 0 else math.ceil(self.duration_s / self.herd_every_s)


class WindowLag(msgspec.Struct, frozen=True, array_like=True):
    """[count, p50_ms, p99_ms, max_ms] in the JSON; the lags None when count is 0."""

    count: int
    p50_ms: float | None
    p99_ms: float | None
    max_ms: float | None


def window_lag(lags_ms: list[float]) -> WindowLag:
    if not lags_ms:
        return WindowLag(0, None, None, None)
    ordered = sorted(lags_ms)
    return WindowLag(len(ordered), round(nearest_rank(ordered, 0.5), 1),
                     round(nearest_rank(ordered, 0.99), 1), round(ordered[-1], 1))


class Sample(msgspec.Struct, frozen=True, kw_only=True):
    """One sample, and what was leased since the one before."""

    t_s: float  # from the first herd's due time
    rss_mb: dict[str, float]  # per process: "scheduler-0", "worker-1", ...
    cpu_share: dict[str, float]  # per kind, of one core over the window; "others" is the
    # machine's busy time that none of the kinds (nor this database's Postgres) spent
    steady: WindowLag
    herd: WindowLag
    events_len: int
    ready_lag: int | None
    ready_len: int
    redis_used_mb: float
    # The lag probe's round trip: if the planner ever chose a scan over the key lookups,
    # this would grow with the run (and Postgres' CPU with it).
    probe_ms: float


class Row(msgspec.Struct, frozen=True, kw_only=True):
    """One herd period: the jobs due in it (its herd falls due at its start)."""

    row: int
    from_s: float
    steady_jobs: int
    herd_jobs: int
    steady_lag: WindowLag  # of those leased
    herd_lag: WindowLag
    rss_mb: dict[str, float]  # per kind: the kind's processes added up, mean of the samples
    cpu_share: dict[str, float]  # per kind: mean of the samples


class RssVerdict(msgspec.Struct, frozen=True, kw_only=True):
    rule: str
    processes: dict[str, Flatness]
    flat: bool | None  # None when no process could be judged


class P99Verdict(msgspec.Struct, frozen=True, kw_only=True):
    rule: str
    steady: Flatness

    @property
    def flat(self) -> bool | None:
        return self.steady.flat


class Report(msgspec.Struct, kw_only=True):
    origin: datetime  # the first herd's due time: t = 0 of the rows and samples
    minutes: float
    rate_per_s: float
    herd: int
    herd_every_s: float
    sample_every_s: float
    schedulers: int
    workers: int
    api: int
    steady_jobs: int
    herd_jobs: int
    succeeded: int
    lost: int  # made, and no execution in Postgres
    unfinished: int  # an execution that had not succeeded when the run gave up waiting
    generator_late_max_ms: float
    rows: list[Row]
    samples: list[Sample]
    rss: RssVerdict
    p99: P99Verdict
    history: History
    passed: bool


# --- the lag of what was leased, probed by key -----------------------------------------------

# The tool's own statement on its scratch database, as in loadtest/measure.py: of the jobs
# given by key ($1 ids, $2 due times; the executions' unique key, so an index probe each),
# those leased, with their due->lease lag (started_at is the Redis server's clock).
_LEASED = """
SELECT k.i, extract(epoch FROM e.started_at - e.scheduled_for) * 1000 AS lag_ms
FROM unnest($1::uuid[], $2::timestamptz[]) WITH ORDINALITY AS k(job_id, scheduled_for, i)
JOIN executions e USING (job_id, scheduled_for)
WHERE e.started_at IS NOT NULL"""
_OUTCOMES = "SELECT count(*), count(*) FILTER (WHERE state = 'succeeded') FROM executions"


@dataclass
class _RowLags:
    steady_jobs: int = 0
    herd_jobs: int = 0
    waiting: int = 0  # made and not yet seen leased
    steady: list[float] = field(default_factory=list)
    herd: list[float] = field(default_factory=list)


class Leases:
    """The jobs made and not yet seen leased, probed by `probe`; each leased job's lag goes
    to the probe's window and to its row. A row's lags are dropped once it is closed
    (summed up in `closed`), so memory stays bounded however long the run.

    The generators write through `expect` (before they insert); the sample loop probes.
    One event loop, so no locking.
    """

    def __init__(self, origin: datetime, row_s: float) -> None:
        self._origin, self._row_s = origin, row_s
        self._waiting: list[tuple[uuid.UUID, datetime, bool, int]] = []
        self._rows: dict[int, _RowLags] = {}
        self.closed: dict[int, tuple[_RowLags, WindowLag, WindowLag]] = {}
        self.made = {False: 0, True: 0}  # herd? -> jobs made
        self.leased = 0
        self.probe_ms = 0.0  # the last probe's statement, as the harness waited for it

    def row_of(self, due: datetime) -> int:
        return max(0, math.floor((due - self._origin).total_seconds() / self._row_s))

    def expect(self, jobs: Sequence[tuple[uuid.UUID, datetime]], herd: bool) -> None:
        for job_id, due in jobs:
            row = self.row_of(due)
            lags = self._rows.setdefault(row, _RowLags())
            if herd:
                lags.herd_jobs += 1
            else:
                lags.steady_jobs += 1
            lags.waiting += 1
            self._waiting.append((job_id, due, herd, row))
        self.made[herd] += len(jobs)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    async def probe(self, db: Database, now: datetime) -> tuple[WindowLag, WindowLag]:
        """Steady and herd lag of the jobs leased since the last probe; rows whose period is
        over and whose jobs have all been leased are closed."""
        due = [w for w in self._waiting if w[1] <= now]
        found: dict[int, float] = {}
        self.probe_ms = 0.0
        if due:
            started = time.perf_counter()
            async with db.connection() as conn:
                rows = await conn.fetch(_LEASED, [w[0] for w in due], [w[1] for w in due])
            self.probe_ms = round((time.perf_counter() - started) * 1000, 1)
            found = {r["i"] - 1: float(r["lag_ms"]) for r in rows}
        window: dict[bool, list[float]] = {False: [], True: []}
        for i, lag in found.items():
            _, _, herd, row = due[i]
            window[herd].append(lag)
            lags = self._rows[row]
            (lags.herd if herd else lags.steady).append(lag)
            lags.waiting -= 1
        self.leased += len(found)
        self._waiting = [w for w in self._waiting if w[1] > now] + [
            w for i, w in enumerate(due) if i not in found]
        self._close_rows(now)
        return window_lag(window[False]), window_lag(window[True])

    def _close_rows(self, now: datetime, every: bool = False) -> None:
        for row, lags in sorted(self._rows.items()):
            ended = self._origin + timedelta(seconds=(row + 1) * self._row_s) <= now
            if every or (ended and lags.waiting == 0):
                self.closed[row] = (lags, window_lag(lags.steady), window_lag(lags.herd))
                lags.steady, lags.herd = [], []
                del self._rows[row]

    def close_all(self) -> None:
        self._close_rows(datetime.now(UTC), every=True)


# --- processes ------------------------------------------------------------------------------


class Processes:
    """RSS of each process (psutil) and CPU seconds by kind (measure.KindsProbe, which adds
    this database's Postgres and the harness)."""

    def __init__(self, kinds: dict[str, list[int]], database: str) -> None:
        self._procs = {f"{kind}-{i}": psutil.Process(pid)
                       for kind, pids in kinds.items() for i, pid in enumerate(pids)}
        self._cpu = KindsProbe(kinds, database)
        self._mark: KindsMark = self._cpu.read()

    def rss_mb(self) -> dict[str, float]:
        return {name: round(p.memory_info().rss / MB, 2) for name, p in self._procs.items()}

    def cpu_share(self) -> dict[str, float]:
        """Each kind's share of one core since the last call."""
        mark = self._cpu.read()
        cpu = KindsProbe.between(self._mark, mark)
        self._mark = mark
        window = cpu.window_s or 1.0
        shares = {kind: round(s / window, 3) for kind, s in cpu.seconds.items()}
        return {**shares, "others": round(max(0.0, cpu.others_s) / window, 3)}


def kind_of(process: str) -> str:
    return process.rsplit("-", 1)[0]


# --- the steady jobs through the api ---------------------------------------------------------


class _Created(msgspec.Struct):
    items: list[_Item]


class _Item(msgspec.Struct, rename="camel"):
    job_id: uuid.UUID
    next_run_at: datetime


_created = msgspec.json.Decoder(_Created)


class ApiBackground(Background):
    """The steady generator's pacing and jobs, each tick's jobs for a tenant submitted as
    one POST /v1/jobs:batch with their due times as runAt: the gateway inserts and
    announces them. The jobs the gateway made (its ids) are what `on_created` hears of."""

    def __init__(self, *args, url: str, keys: dict[uuid.UUID, str], pool: str,
                 http: aiohttp.ClientSession,
                 on_created: Callable[[list[tuple[uuid.UUID, datetime]]], None],
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._url, self._keys, self._pool, self._http = url, keys, pool, http
        self._on_created = on_created
        self._payload = msgspec.json.decode(PAYLOAD)

    # Background's insert step, replaced: the rest of its tick (pacing, due times, the
    # tenants in turn) is what the direct inserts do too.
    async def _insert(self, tenant: TenantRef, jobs: list[NewJob]) -> None:
        body = {"jobs": [{"name": "loadtest-soak", "target": {"type": "queue", "ref": self._pool},
                          "payload": self._payload,
                          "schedule": {"runAt": j.next_run_at.isoformat()}} for j in jobs]}
        headers = {"Authorization": f"Bearer {self._keys[tenant.tenant_id]}"}
        async with self._http.post(f"{self._url}/v1/jobs:batch", json=body,
                                   headers=headers) as resp:
            text = await resp.read()
            if resp.status != 201:
                raise RunFailed(f"POST /v1/jobs:batch: {resp.status} {text[:500]!r}")
        self._on_created([(item.job_id, item.next_run_at) for item in _created.decode(text).items])


@contextlib.asynccontextmanager
async def api_process(enabled: bool, dsn: str, redis_url: str,
                      prefix: str) -> AsyncIterator[tuple[str, list[Child]]]:
    """One `herdwick api` on this run's database and key prefix (its notifies must reach
    these schedulers), or nothing; yields its URL and the process."""
    if not enabled:
        yield "", []
        return
    port = free_port()
    env = child_env(HERDWICK_DATABASE_URL=dsn, HERDWICK_REDIS_URL=redis_url,
                    HERDWICK_KEY_PREFIX=prefix, HERDWICK_ADMIN_TOKEN=secrets.token_urlsafe(24),
                    HERDWICK_API_HOST="127.0.0.1", HERDWICK_API_PORT=str(port))
    async with children(ApiProcess, 1, ["api"], env) as procs:
        yield f"http://127.0.0.1:{port}", procs


# --- the run --------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--minutes", type=float, default=30.0,
      help="minutes of load (a fraction is fine: 0.25 for a quick check); default 30")
    a("--rate", type=float, default=500.0, help="steady jobs/s; default 500")
    a("--herd", type=int, default=5_000,
      help="jobs in each herd, all due in the same instant; default 5000; 0 for none")
    a("--herd-every", type=float, default=60.0, metavar="S",
      help="a herd falls due at every multiple of S seconds (the top of each minute by "
           "default); also the length of a report row; default 60")
    a("--sample-every", type=float, default=5.0, metavar="S",
      help="seconds between samples of RSS, CPU, lag and the streams; default 5")
    a("--delay", type=float, default=2.5,
      help="steady jobs are submitted this many seconds before due; default 2.5")
    a("--tenants", type=int, default=10,
      help="tenants the steady jobs are spread over, and as many again for the herds; "
           "default 10")
    a("--schedulers", type=int, default=1, help="`herdwick scheduler` processes; default 1")
    a("--workers", type=int, default=2, help="`herdwick worker` processes; default 2")
    a("--concurrency", type=int, default=200, help="handlers per worker process; default 200")
    a("--api", action="store_true",
      help="run a `herdwick api` too and submit the steady jobs through it (batch requests)")
    a("--timeout", type=float, default=120.0,
      help="after the load, wait this many seconds at most for every job to succeed; "
           "default 120")
    add_scratch_flags(parser)
    add_report_flags(parser)


def plan_from(args: argparse.Namespace) -> Plan:
    try:
        plan = msgspec.convert(
            {"minutes": args.minutes, "rate": args.rate, "herd": args.herd,
             "herd_every_s": args.herd_every, "sample_every_s": args.sample_every,
             "delay_s": args.delay, "tenants": args.tenants, "schedulers": args.schedulers,
             "workers": args.workers, "concurrency": args.concurrency, "api": args.api,
             "timeout_s": args.timeout}, Plan)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"loadtest soak: {exc}") from None
    if plan.rate == 0 and plan.herd == 0:
        raise ConfigError("loadtest soak: nothing to run: give --rate, --herd or both")
    return plan


def first_due(herd_every_s: float, now_s: float, lead_s: float) -> datetime:
    """The first multiple of herd_every_s (epoch seconds) at least lead_s from now."""
    return datetime.fromtimestamp(math.ceil((now_s + lead_s) / herd_every_s) * herd_every_s, UTC)


async def _tenants(db: Database, plan: Plan) -> tuple[list[TenantRef], list[TenantRef],
                                                      dict[uuid.UUID, str]]:
    now = datetime.now(UTC)
    steady, herd, keys = [], [], {}
    for kind, refs in (("steady", steady), ("herd", herd)):
        for i in range(plan.tenants):
            created = await create_tenant(db, TenantSpec(name=f"soak-{kind}-{i:02d}"), now)
            refs.append(TenantRef(created.tenant_id, f"soak-{kind}-{i:02d}"))
            keys[created.tenant_id] = created.api_key
    return steady, herd, keys


async def run(args: argparse.Namespace, progress: Progress) -> Report:
    plan = plan_from(args)
    require_loopback(args.database_url, "--database-url")
    require_loopback(args.redis_url, "--redis-url")
    name = scratch_name("soak")
    async with scratch_prefix(args.redis_url, "soak") as (client, prefix), \
            scratch_database(args.database_url, name, args.keep, progress.say) as dsn:
        db = await Database.connect(dsn, max_size=8 + plan.tenants)
        try:
            return await _soak(plan, db, dsn, name, args.redis_url, client, prefix, progress)
        finally:
            await db.close()


@dataclass
class _Stack:
    plan: Plan
    db: Database
    client: aioredis.Redis
    prefix: str
    pool: str
    procs: list[Child]
    probe: Processes
    sampler: StreamSampler
    leases: Leases
    origin: datetime
    samples: list[Sample] = field(default_factory=list)


async def _soak(plan: Plan, db: Database, dsn: str, database: str, redis_url: str,
                client: aioredis.Redis, prefix: str, progress: Progress) -> Report:
    pool = pool_names(1)[0]
    steady_tenants, herd_tenants, keys = await _tenants(db, plan)
    factory = JobFactory([pool])
    deadline = time.perf_counter() + 120.0
    progress.set("starting")
    async with scheduler_processes(plan.schedulers, dsn, redis_url, prefix,
                                   ready_max="auto") as schedulers, \
            worker_processes(plan.workers, WORKER_APP, redis_url, prefix, pool,
                             plan.concurrency) as workers, \
            api_process(plan.api, dsn, redis_url, prefix) as (url, apis), \
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=API_CONNECTIONS)) as http:
        await leases_settled(db, schedulers, deadline)
        kinds = {"scheduler": [p.pid for p in schedulers], "worker": [p.pid for p in workers],
                 **({"api": [p.pid for p in apis]} if apis else {})}
        origin = first_due(plan.herd_every_s, time.time(), max(HERD_LEAD_S, plan.delay_s) + 1)
        leases = Leases(origin, plan.herd_every_s)
        sampler = StreamSampler(client, prefix, [pool])
        await sampler.baseline()
        s = _Stack(plan=plan, db=db, client=client, prefix=prefix, pool=pool,
                   procs=[*schedulers, *workers, *apis],
                   probe=Processes(kinds, database), sampler=sampler, leases=leases,
                   origin=origin)
        steady = _steady(s, steady_tenants, factory, url, keys, http)
        progress.set("soaking", lambda: _detail(s), done=lambda: leases.leased,
                     total=round(plan.rate * plan.duration_s) + plan.herd * plan.herds,
                     due_at=origin.timestamp())
        async with running(_herds(s, herd_tenants, factory), "the herd generator") as herds, \
                running(_start_at(origin.timestamp() - plan.delay_s, steady.run()),
                        "the steady generator") as generator:
            await _sample_until(s, origin.timestamp() + plan.duration_s, [herds, generator])
            await _finish(herds, generator)
        progress.set("draining", lambda: f"waiting to be leased: {leases.waiting}",
                     done=lambda: leases.leased, total=sum(leases.made.values()))
        succeeded, executions = await _drain(s, time.perf_counter() + plan.timeout_s)
        history = await history_of(db)
    leases.close_all()
    return _report(s, steady, succeeded, executions, history, len(apis))


def _steady(s: _Stack, tenants: list[TenantRef], factory: JobFactory, url: str,
            keys: dict[uuid.UUID, str], http: aiohttp.ClientSession) -> Background:
    p = s.plan
    if p.api:
        return ApiBackground(p.rate, p.duration_s, p.delay_s, s.db, HotTier(s.client, s.prefix),
                             tenants, factory, url=url, keys=keys, pool=s.pool, http=http,
                             on_created=lambda jobs: s.leases.expect(jobs, herd=False))
    return Background(p.rate, p.duration_s, p.delay_s, s.db, HotTier(s.client, s.prefix),
                      tenants, factory, expect=lambda _tenant, jobs: s.leases.expect(
                          [(j.job_id, j.next_run_at) for j in jobs], herd=False))


async def _start_at(at_s: float, coro) -> None:
    await asyncio.sleep(max(0.0, at_s - time.time()))
    await coro


async def _herds(s: _Stack, tenants: list[TenantRef], factory: JobFactory) -> None:
    """Herd k due at origin + k x herd_every, inserted HERD_LEAD_S before."""
    counts = even_split(s.plan.herd, len(tenants))
    for k in range(s.plan.herds):
        due = s.origin + timedelta(seconds=k * s.plan.herd_every_s)
        await asyncio.sleep(max(0.0, due.timestamp() - HERD_LEAD_S - time.time()))
        batches = herd_batches(factory, tenants, counts, due)
        s.leases.expect([(j.job_id, j.next_run_at) for _, jobs in batches for j in jobs],
                        herd=True)
        await insert_batches(s.db, batches, INSERT_CONNECTIONS, lambda _n: None)


async def _sample_until(s: _Stack, end_s: float, helpers: list[asyncio.Task]) -> None:
    """A sample every sample_every_s from the origin until the load's end. The samples are
    taken here, between awaits of this loop, never cancelled inside a Redis call (see
    StreamSampler.sampling)."""
    start_s, every = s.origin.timestamp(), s.plan.sample_every_s
    s.probe.cpu_share()  # the first window starts at the origin
    k = 0
    while True:
        k += 1
        at_s = start_s + k * every
        while time.time() < at_s:
            check_alive(s.procs, helpers)
            await asyncio.sleep(min(0.5, max(0.0, at_s - time.time())))
        await _sample(s)
        if at_s >= end_s:
            return


async def _sample(s: _Stack) -> None:
    now = datetime.now(UTC)
    rss, cpu = s.probe.rss_mb(), s.probe.cpu_share()
    steady, herd = await s.leases.probe(s.db, now)
    sampler = s.sampler
    await sampler.sample()
    s.samples.append(Sample(
        t_s=round((now - s.origin).total_seconds(), 2), rss_mb=rss, cpu_share=cpu,
        steady=steady, herd=herd, events_len=sampler.events_len[-1],
        ready_lag=sampler.ready_lag[-1], ready_len=sampler.ready_len[-1],
        redis_used_mb=round(sampler.used_memory[-1] / MB, 2), probe_ms=s.leases.probe_ms))


async def _finish(*tasks: asyncio.Task) -> None:
    """The generators end with the load; one that failed fails the run."""
    for task in tasks:
        await task


async def _drain(s: _Stack, deadline: float) -> tuple[int, int]:
    """Until every job made has been leased and has succeeded in Postgres, or the deadline:
    (succeeded, executions). Lags found here count in their rows, in no sample."""
    made = sum(s.leases.made.values())
    while s.leases.waiting and time.perf_counter() < deadline:
        check_alive(s.procs)
        await asyncio.sleep(DRAIN_POLL_S)
        await s.leases.probe(s.db, datetime.now(UTC))
    while True:
        async with s.db.connection() as conn:
            executions, succeeded = await conn.fetchrow(_OUTCOMES)
        if succeeded >= made or time.perf_counter() > deadline:
            return succeeded, executions
        check_alive(s.procs)
        await asyncio.sleep(DRAIN_POLL_S)


def _detail(s: _Stack) -> str:
    if not s.samples:
        return ""
    last = s.samples[-1]
    minute = last.t_s / 60
    p99 = "-" if last.steady.p99_ms is None else f"{last.steady.p99_ms:g}"
    rss = " ".join(f"{k} {v:.0f}" for k, v in _by_kind(last.rss_mb).items())
    return f"min {minute:.1f}/{s.plan.minutes:g}  steady p99 {p99} ms  RSS MB {rss}"


def _by_kind(per_process: dict[str, float]) -> dict[str, float]:
    found: dict[str, float] = {}
    for name, value in per_process.items():
        found[kind_of(name)] = round(found.get(kind_of(name), 0.0) + value, 2)
    return found


def _mean_of(dicts: list[dict[str, float]]) -> dict[str, float]:
    keys = dict.fromkeys(k for d in dicts for k in d)
    return {k: round(statistics.fmean(d[k] for d in dicts if k in d), 3) for k in keys}


def rows_of(leases: Leases, samples: list[Sample], row_s: float,
            sample_every_s: float) -> list[Row]:
    by_row: dict[int, list[Sample]] = {}
    for sample in samples:  # in the row its window's middle falls in
        middle = sample.t_s - sample_every_s / 2
        by_row.setdefault(max(0, math.floor(middle / row_s)), []).append(sample)
    rows = []
    for row, (lags, steady, herd) in sorted(leases.closed.items()):
        inside = by_row.get(row, [])
        rows.append(Row(row=row, from_s=round(row * row_s, 2), steady_jobs=lags.steady_jobs,
                        herd_jobs=lags.herd_jobs, steady_lag=steady, herd_lag=herd,
                        rss_mb=_mean_of([_by_kind(x.rss_mb) for x in inside]),
                        cpu_share=_mean_of([x.cpu_share for x in inside])))
    return rows


def verdicts(samples: list[Sample], rows: list[Row]) -> tuple[RssVerdict, P99Verdict]:
    names = dict.fromkeys(n for x in samples for n in x.rss_mb)
    processes = {n: rss_flatness([x.rss_mb[n] for x in samples if n in x.rss_mb])
                 for n in names}
    judged = [f.flat for f in processes.values() if f.flat is not None]
    rss = RssVerdict(rule=RSS_RULE, processes=processes,
                     flat=all(judged) if judged else None)
    p99s = [r.steady_lag.p99_ms for r in rows if r.steady_lag.p99_ms is not None]
    return rss, P99Verdict(rule=P99_RULE, steady=p99_flatness(p99s))


def _report(s: _Stack, steady: Background, succeeded: int, executions: int, history: History,
            apis: int) -> Report:
    p = s.plan
    rows = rows_of(s.leases, s.samples, p.herd_every_s, p.sample_every_s)
    rss, p99 = verdicts(s.samples, rows)
    made = sum(s.leases.made.values())
    lost, unfinished = max(0, made - executions), executions - succeeded
    passed = (lost == 0 and unfinished == 0 and history.sound
              and rss.flat is not False and p99.flat is not False)
    return Report(
        origin=s.origin, minutes=p.minutes, rate_per_s=p.rate, herd=p.herd,
        herd_every_s=p.herd_every_s,
        sample_every_s=p.sample_every_s, schedulers=p.schedulers, workers=p.workers, api=apis,
        steady_jobs=s.leases.made[False], herd_jobs=s.leases.made[True], succeeded=succeeded,
        lost=lost, unfinished=unfinished,
        generator_late_max_ms=round(steady.late_max_s * 1000, 1), rows=rows,
        samples=s.samples, rss=rss, p99=p99, history=history, passed=passed)


# --- showing it -----------------------------------------------------------------------------


def _lag(lag: WindowLag) -> str:
    return "-" if lag.count == 0 else f"{lag.p50_ms:.0f}/{lag.p99_ms:.0f}"


def _verdict(flat: bool | None) -> str:
    return {True: "yes", False: "NO", None: "not judged (too short)"}[flat]


def _change(f: Flatness) -> str:
    change = f.change
    return "too short" if change is None or f.flat is None else f"{change:+.1%}"


def render_text(r: Report) -> str:
    kinds = list(dict.fromkeys(k for row in r.rows for k in row.rss_mb))
    cpus = list(dict.fromkeys(k for row in r.rows for k in row.cpu_share))
    head = (f"  {'row':>4} {'from s':>7} {'steady':>7} {'herd':>6} {'steady p50/p99':>15} "
            f"{'herd p50/p99':>13}" + "".join(f" {k[:9] + ' MB':>12}" for k in kinds)
            + "".join(f" {k[:9]:>9}" for k in cpus))
    lines = [
        f"herdwick loadtest soak: {r.minutes:g} min of {r.rate_per_s:g} jobs/s steady"
        + (f" and a {r.herd:,}-job herd every {r.herd_every_s:g} s" if r.herd else "")
        + f"; {r.schedulers} scheduler, {r.workers} worker"
        + (f", {r.api} api" if r.api else "") + " process(es), no-op handler",
        f"  jobs: {r.steady_jobs:,} steady + {r.herd_jobs:,} herd made; {r.succeeded:,} "
        f"succeeded, {r.lost} lost, {r.unfinished} unfinished; the steady generator at most "
        f"{r.generator_late_max_ms} ms late",
        f"  per row ({r.herd_every_s:g} s of due times; lag due -> lease ms; RSS MB by kind "
        "and CPU in cores by kind, means of the row's samples; others: the machine's busy "
        "time no kind spent):", head]
    for row in r.rows:
        lines.append(f"  {row.row:>4} {row.from_s:>7g} {row.steady_jobs:>7} {row.herd_jobs:>6} "
                     f"{_lag(row.steady_lag):>15} {_lag(row.herd_lag):>13}"
                     + "".join(f" {row.rss_mb.get(k, 0):>12.1f}" for k in kinds)
                     + "".join(f" {row.cpu_share.get(k, 0):>9.2f}" for k in cpus))
    x = r.samples
    lags = [v.ready_lag for v in x if v.ready_lag is not None]
    lines += [
        f"  streams, sampled every {r.sample_every_s:g} s ({len(x)} samples): events length "
        f"max {max((v.events_len for v in x), default=0)}, ready lag max "
        f"{max(lags, default=0)}; Redis used_memory max "
        f"{max((v.redis_used_mb for v in x), default=0):.1f} MB; the lag probe took at "
        f"most {max((v.probe_ms for v in x), default=0):g} ms",
        f"  RSS flat: {_verdict(r.rss.flat)}" + ("" if r.rss.flat is None else " ("
        + ", ".join(f"{n} {_change(f)}" for n, f in r.rss.processes.items()) + ")"),
        f"    {r.rss.rule}",
        f"  p99 flat: {_verdict(r.p99.flat)}" + (
            "" if r.p99.flat is None else
            f" (steady p99 {r.p99.steady.last_third:g} ms in the last third against "
            f"{r.p99.steady.second_third:g}; bound {r.p99.steady.bound:g})"),
        f"    {r.p99.rule}",
        f"  history: {r.history.succeeded_without_start} succeeded without a start time, "
        f"{r.history.attempts_left_running} attempts left running"
        + ("" if r.history.sound else "  <- GAPS"),
        f"  {'passed' if r.passed else 'FAILED'}"]
    return "\n".join(lines)


def headline(r: Report) -> list[tuple[str, str]]:
    return [("jobs succeeded", f"{r.succeeded:,} of {r.steady_jobs + r.herd_jobs:,}"),
            ("lost / unfinished", f"{r.lost} / {r.unfinished}"),
            ("RSS flat", _verdict(r.rss.flat)), ("steady p99 flat", _verdict(r.p99.flat)),
            ("history", "sound" if r.history.sound else "GAPS"),
            ("verdict", "passed" if r.passed else "FAILED")]


def timeline_of(r: Report) -> Timeline:
    """Per sample: leases per second over its window and their lag, steady and herd."""
    def series(name: str, of: Callable[[Sample], WindowLag]) -> Series:
        seconds, before = [], 0.0
        for x in r.samples:
            lag, window = of(x), max(x.t_s - before, 1e-3)
            seconds.append(Second(round(x.t_s), round(lag.count / window), lag.p50_ms,
                                  lag.p99_ms, lag.max_ms))
            before = x.t_s
        return Series(name=name, seconds=seconds)

    return Timeline(origin=r.origin, x_label="s from the first herd's due time",
                    count_label=f"executions leased per second (mean over each "
                                f"{r.sample_every_s:g} s sample)",
                    lag_label="due -> lease lag, ms",
                    series=[series("steady", lambda x: x.steady), series("herd", lambda x: x.herd)])


def charts(r: Report) -> list[str]:
    """RSS by process, the steady lag alone (the herd's seconds dwarf it on the shared
    chart), CPU by kind, the streams."""
    names = list(dict.fromkeys(n for x in r.samples for n in x.rss_mb))
    kinds = list(dict.fromkeys(k for x in r.samples for k in x.cpu_share))
    x_label = "s from the first herd's due time"

    def line(name: str, i: int, of: Callable[[Sample], float | None],
             dashed: bool = False) -> Line:
        return Line(name, [(x.t_s, of(x)) for x in r.samples], PALETTE[i % len(PALETTE)],
                    dashed)

    return [
        line_chart([line(n, i, lambda x, n=n: x.rss_mb.get(n)) for i, n in enumerate(names)],
                   title="RSS by process", x_label=x_label, y_label="MB"),
        line_chart([line("steady p99", 0, lambda x: x.steady.p99_ms),
                    line("steady p50", 0, lambda x: x.steady.p50_ms, dashed=True)],
                   title="Steady jobs' due -> lease lag (p99 solid, p50 dashed)",
                   x_label=x_label, y_label="ms"),
        line_chart([line(k, i, lambda x, k=k: x.cpu_share.get(k)) for i, k in enumerate(kinds)],
                   title="CPU by kind, share of one core", x_label=x_label, y_label="cores"),
        line_chart([line("events length", 0, lambda x: x.events_len),
                    line("ready lag", 1, lambda x: x.ready_lag)],
                   title="Streams", x_label=x_label, y_label="entries")]


async def command(args: argparse.Namespace) -> int:
    """`herdwick loadtest soak`: progress on stderr, the report on stdout; 1 unless it
    passed. SIGTERM cancels the run like Ctrl-C does, so it cleans up either way."""
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    check_path(args.report)
    started = datetime.now(UTC)
    progress = Progress.of_args(args, "soak")
    async with running(progress.run()):
        report = await run(args, progress)
    text = render_text(report)
    print(render_json(report) if args.json else text)
    write_report(args, "loadtest soak", report, text, headline(report), timeline_of(report),
                 started, extra_charts=charts(report))
    return 0 if report.passed else 1
