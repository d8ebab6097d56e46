"""`herdwick loadtest http`: the capacity of the built-in http pool, callbacks to local receivers.

A herd of http jobs (--jobs, all due in one second), a steady rate (--rate for
--duration) or both, split over --targets targets in turn: each target is its
own scheme://host:port (the unit of a circuit breaker and of a concurrency cap),
served by a receiver process (loadtest/receiver.py) that answers every POST 200.
--down-targets of them point at ports where nothing listens, so every delivery
to them is refused and their breakers open. Real `herdwick scheduler` and
`herdwick http-worker` processes run on a scratch database and key prefix, the
tenants' signing secrets copied to Redis by the schedulers' maintenance actor.

The run ends once every job of a healthy target has succeeded in Postgres;
the down targets' jobs stay in retry_wait. Reports callbacks/s, due -> arrival
at the receiver (the receiver's clock and the Herdwick-Scheduled-For header:
both this machine's wall clock) and due -> first lease (Postgres started_at)
for the healthy targets; for each down target the attempts burned (failed)
before and after its breaker opened and the deferrals; CPU seconds by kind of
process over the drain, and per 1,000 callbacks.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import math
import os
import signal
import sys
import tempfile
import time
import urllib.parse
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated

import msgspec
import redis.asyncio as aioredis
from msgspec import Meta

from herdwick.config import ConfigError
from herdwick.errors import StorageUnavailable
from herdwick.loadtest.background import Background
from herdwick.loadtest.driver import (
    Child,
    RunFailed,
    add_scratch_flags,
    free_port,
    http_worker_processes,
    leases_settled,
    receiver_processes,
    record_path,
    require_loopback,
    running,
    scheduler_processes,
    scratch_database,
    scratch_name,
    scratch_prefix,
)
from herdwick.loadtest.html_report import check_path, write_report
from herdwick.loadtest.http_raw import RawHttp, raw_http
from herdwick.loadtest.jobs import (
    INSERT_CONNECTIONS,
    JobFactory,
    TenantRef,
    create_tenants,
    due_second,
    herd_batches,
    insert_batches,
    move_herd,
    parking_time,
    tenant_counts,
)
from herdwick.loadtest.measure import (
    KindsCpu,
    KindsMark,
    KindsProbe,
    Lag,
    RedisMemory,
    StreamSampler,
    StreamSamples,
    database_of,
    lag_of,
    redis_pids,
)
from herdwick.loadtest.outcomes import History, Outcomes, drain, history_of, uuid7_floor
from herdwick.loadtest.profiled import profile_path
from herdwick.loadtest.receiver import read_record
from herdwick.loadtest.report import Progress, add_report_flags, memory_line, render_json
from herdwick.loadtest.timeline import Timeline, at_epoch, per_second
from herdwick.storage import signing
from herdwick.storage.db import Database
from herdwick.storage.hot import HotTier

HTTP_POOL = "http"
LOOPBACK = "127.0.0.0/8"  # the http workers' HERDWICK_HTTP_ALLOW: the receivers are local
SECRETS_POLL_S = 0.2

# The tool's own statements on its scratch database (storage/ has no reporting queries).
# Per target: its executions, and its attempts by outcome. A deferral's error names its
# class (herdwick/http_worker.py): circuit_open, target_busy or secret_missing. An attempt
# "burned on an open breaker" is a failed one leased after the target's first
# circuit_open deferral was; one leased `cooldown` ($1 s) or more after it may be the
# half-open probe, counted apart.
_TARGETS = """
SELECT j.target_ref AS target, count(*) AS executions,
       count(*) FILTER (WHERE e.state = 'succeeded') AS succeeded,
       count(*) FILTER (WHERE e.state = 'retry_wait') AS retry_wait
FROM executions e JOIN jobs j ON j.job_id = e.job_id GROUP BY 1"""
_ATTEMPTS = """
WITH a AS (
    SELECT j.target_ref AS target, a.outcome, a.started_at, a.error->>'class' AS class
    FROM execution_attempts a
    JOIN executions e ON e.execution_id = a.execution_id AND e.scheduled_for = a.scheduled_for
    JOIN jobs j ON j.job_id = e.job_id
), opened AS (
    SELECT target, min(started_at) AS at FROM a
    WHERE outcome = 'deferred' AND class = 'circuit_open' GROUP BY 1
)
SELECT a.target, o.at AS opened_at,
       count(*) FILTER (WHERE a.outcome = 'failed') AS burned,
       count(*) FILTER (WHERE a.outcome = 'failed' AND a.started_at > o.at
                          AND a.started_at < o.at + $1 * interval '1 second') AS burned_open,
       count(*) FILTER (WHERE a.outcome = 'failed'
                          AND a.started_at >= o.at + $1 * interval '1 second') AS burned_later,
       count(*) FILTER (WHERE a.outcome = 'deferred') AS deferred,
       count(*) FILTER (WHERE a.outcome = 'deferred' AND a.class = 'circuit_open') AS open,
       count(*) FILTER (WHERE a.outcome = 'deferred' AND a.class = 'target_busy') AS busy
FROM a LEFT JOIN opened o USING (target) GROUP BY a.target, o.at"""
# Due -> first lease of the healthy targets' executions (started_at is the first
# attempt's, Redis' clock), nearest rank as in measure.py.
_LEASE_LAG = """
SELECT percentile_disc(ARRAY[0.5, 0.95, 0.99, 1.0]) WITHIN GROUP
           (ORDER BY extract(epoch FROM e.started_at - e.scheduled_for) * 1000) AS lag_ms,
       count(*) AS started
FROM executions e JOIN jobs j ON j.job_id = e.job_id
WHERE e.started_at IS NOT NULL AND j.target_ref = ANY($1::text[]) AND e.job_id < $2"""


class Plan(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The flags' limits (those of `loadtest e2e` where they share a name)."""

    jobs: Annotated[int, Meta(ge=0, le=10_000_000)] = 20_000
    tenants: Annotated[int, Meta(ge=1, le=1_000)] = 1
    targets: Annotated[int, Meta(ge=1, le=64)] = 1
    down_targets: Annotated[int, Meta(ge=0, le=63)] = 0
    rate: Annotated[float, Meta(ge=0, le=100_000)] = 0.0
    duration_s: Annotated[float, Meta(gt=0, le=3_600)] = 20.0
    delay_s: Annotated[float, Meta(ge=0.5, le=60)] = 2.5
    schedulers: Annotated[int, Meta(ge=1, le=16)] = 1
    http_workers: Annotated[int, Meta(ge=1, le=16)] = 1
    concurrency: Annotated[int, Meta(ge=1, le=100_000)] = 512
    target_concurrency: Annotated[int, Meta(ge=1, le=100_000)] = 128
    breaker_cooldown_s: Annotated[float, Meta(gt=0, le=3_600)] = 10.0
    due_in_s: Annotated[float, Meta(ge=1, le=600)] = 6.0
    timeout_s: Annotated[float, Meta(gt=0, le=3_600)] = 300.0

    @property
    def healthy(self) -> int:
        return self.targets - self.down_targets

    def healthy_of(self, jobs: int) -> int:
        """How many of the first `jobs` jobs go to a healthy target: job i goes to target
        i modulo targets, and the healthy ones come first."""
        whole, rest = divmod(jobs, self.targets)
        return whole * self.healthy + min(rest, self.healthy)


class TargetFigures(msgspec.Struct, frozen=True, kw_only=True):
    """One target: what Postgres says of its executions and attempts, and for a healthy
    one what its receiver saw."""

    url: str
    up: bool
    executions: int
    succeeded: int
    retry_wait: int
    burned: int  # attempts that failed (a delivery tried and refused)
    # Of those, leased after its first circuit_open deferral and before one cooldown
    # had passed since: burned on an open breaker (0 when the breaker works).
    burned_on_open_breaker: int
    # Leased a cooldown or more after it: the half-open probes (one per cooldown).
    burned_after_cooldown: int
    deferrals: int
    deferred_circuit_open: int
    deferred_target_busy: int
    # Its first circuit_open deferral's lease, from the herd's due second (negative: a
    # steady job's, before it); None without a herd or without such a deferral.
    opened_after_due_s: float | None
    deliveries: int | None  # requests its receiver answered (None for a down target)
    arrival_lag: Lag | None  # due -> arrival at its receiver, the herd's deliveries only


class Steady(msgspec.Struct, frozen=True, kw_only=True):
    rate_per_s: float
    duration_s: float
    delay_s: float
    jobs: int  # made, to every target
    healthy_jobs: int
    succeeded: int
    last_succeeded_after_last_due_s: float | None
    arrival_lag: Lag  # due -> arrival, every healthy receiver's steady deliveries


class Report(msgspec.Struct, kw_only=True):
    plan: Plan
    load_average_1m: float  # at the start: other work on the machine skews every figure
    herd_jobs: int
    healthy_herd_jobs: int
    callbacks: int  # healthy executions succeeded in Postgres, herd and steady
    # The herd's figures; None without a herd. From the due second to the poll that
    # found the last healthy success committed.
    drained_after_due_s: float | None
    callbacks_per_s: float | None
    arrival_lag: Lag | None  # due -> arrival at the receivers, every healthy herd job
    lease_lag_ms: dict[str, float] | None  # due -> first lease (Postgres), healthy herd jobs
    steady: Steady | None
    targets: list[TargetFigures]
    cpu: KindsCpu  # from just before the move (or the steady start) until drained
    drain_cpu: KindsCpu  # from the due second until drained (the herd's shard loads left out)
    cpu_per_1000_callbacks: dict[str, float]
    streams: StreamSamples
    redis_memory: RedisMemory
    history: History
    profiles: list[str] = []  # --profile: the http workers' cProfile stats
    raw_limit: RawHttp | None = None  # --raw-limit
    # Per second from the herd's due second (else the steady start): callbacks arrived at
    # the healthy receivers, and their due -> arrival lag.
    timeline: Timeline | None = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--jobs", type=int, default=20_000,
      help="http jobs in the herd, all due in one second; default 20000; 0 for a steady "
           "rate alone")
    a("--targets", type=int, default=1,
      help="targets the jobs are split over in turn, each a receiver on its own port (a "
           "breaker and concurrency cap each); default 1")
    a("--down-targets", type=int, default=0,
      help="of the targets, how many point at a port where nothing listens (connections "
           "refused: their breakers open); default 0")
    a("--tenants", type=int, default=1,
      help="tenants the jobs are spread over, each with its own signing secret; default 1")
    a("--rate", type=float, default=0.0,
      help="steady http jobs/s (as `loadtest e2e --rate`), alone or beside the herd; "
           "default 0")
    a("--duration", type=float, default=20.0, help="seconds of the steady rate; default 20")
    a("--delay", type=float, default=2.5,
      help="steady jobs are inserted and notified this many seconds before due; "
           "default 2.5")
    a("--schedulers", type=int, default=1, help="`herdwick scheduler` processes; default 1")
    a("--http-workers", type=int, default=1,
      help="`herdwick http-worker` processes; default 1")
    a("--concurrency", type=int, default=512,
      help="each http worker's --concurrency (deliveries in flight); default 512")
    a("--target-concurrency", type=int, default=128,
      help="each http worker's --target-concurrency (in flight to one target); default 128")
    a("--breaker-cooldown", type=float, default=10.0,
      help="each http worker's --breaker-cooldown, seconds; default 10")
    a("--due-in", type=float, default=6.0,
      help="seconds from the move to the due second; default 6")
    a("--timeout", type=float, default=300.0,
      help="give up waiting after this many seconds; default 300")
    a("--profile", default=None, metavar="DIR",
      help="run each http worker under cProfile, its stats written to DIR/herdwick.cli-PID"
           ".prof when it stops (slower: for where the time goes, not for throughput)")
    add_scratch_flags(parser)
    add_report_flags(parser)
    a("--raw-limit", action="store_true",
      help="after the run, the raw limit beside it: the same number of deliveries published "
           "straight onto the http stream, through one http-worker with the same flags, no "
           "scheduler or Postgres (loadtest/http_raw.py)")


def plan_from(args: argparse.Namespace) -> Plan:
    """The flags, checked."""
    try:
        plan = msgspec.convert(
            {"jobs": args.jobs, "tenants": args.tenants, "targets": args.targets,
             "down_targets": args.down_targets, "rate": args.rate,
             "duration_s": args.duration, "delay_s": args.delay,
             "schedulers": args.schedulers, "http_workers": args.http_workers,
             "concurrency": args.concurrency, "target_concurrency": args.target_concurrency,
             "breaker_cooldown_s": args.breaker_cooldown, "due_in_s": args.due_in,
             "timeout_s": args.timeout}, Plan)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"loadtest http: {exc}") from None
    if plan.jobs == 0 and plan.rate == 0:
        raise ConfigError("loadtest http: nothing to run: give --jobs, --rate or both")
    if plan.down_targets >= plan.targets:
        raise ConfigError("loadtest http: --down-targets must leave a healthy target "
                          "(the run ends when the healthy targets' jobs have succeeded)")
    return plan


def target_url(port: int) -> str:
    return f"http://127.0.0.1:{port}/hook"


def _port_of(url: str) -> int:
    port = urllib.parse.urlsplit(url).port
    assert port is not None
    return port


def _worker_flags(plan: Plan) -> list[str]:
    return ["--concurrency", str(plan.concurrency),
            "--target-concurrency", str(plan.target_concurrency),
            "--breaker-cooldown", f"{plan.breaker_cooldown_s:g}"]


async def secrets_published(client: aioredis.Redis, prefix: str, tenants: list[TenantRef],
                            procs: list[Child], deadline: float) -> None:
    """Wait until the signing hash has every tenant: the schedulers' maintenance actor
    copies them from Postgres at start (storage/signing.py); a herd moved before that
    would be deferred as secret_missing, and measure the sync, not delivery."""
    wanted = [str(t.tenant_id) for t in tenants]
    while True:
        with contextlib.suppress(StorageUnavailable):
            if len(await signing.load(client, prefix, wanted)) == len(wanted):
                return
        for proc in procs:
            proc.check_alive()
        if time.perf_counter() > deadline:
            raise RunFailed("the schedulers did not publish the tenants' signing secrets "
                            "to Redis")
        await asyncio.sleep(SECRETS_POLL_S)


async def run(args: argparse.Namespace, progress: Progress) -> Report:
    plan = plan_from(args)
    require_loopback(args.database_url, "--database-url")
    require_loopback(args.redis_url, "--redis-url")
    deadline = time.perf_counter() + plan.timeout_s
    load = os.getloadavg()[0]
    async with scratch_prefix(args.redis_url, "http") as (client, prefix), \
            scratch_database(args.database_url, scratch_name("http"), args.keep,
                             progress.say) as dsn:
        db = await Database.connect(dsn, max_size=8 + plan.tenants)
        try:
            return await _measure(args, plan, load, db, dsn, client, prefix, deadline, progress)
        finally:
            await db.close()


async def _insert_herd(db: Database, plan: Plan, factory: JobFactory,
                       tenants: list[TenantRef], progress: Progress) -> datetime | None:
    """The herd parked a day ahead; returns the parking instant (None without a herd)."""
    if plan.jobs == 0:
        return None
    parked = parking_time()
    batches = herd_batches(factory, tenants, tenant_counts(plan.jobs, plan.tenants, 0.0), parked)
    inserted = [0]
    progress.set("submitting", done=lambda: inserted[0], total=plan.jobs)
    await insert_batches(db, batches, INSERT_CONNECTIONS,
                         lambda n: inserted.__setitem__(0, inserted[0] + n))
    return parked


@dataclass(frozen=True, kw_only=True)
class _Window:
    """What the drain leaves for the report, read before the processes stop."""

    due: datetime | None
    started_s: float  # wall clock at the move (or the steady start)
    outcomes: Outcomes
    background: Background
    cpu: KindsCpu
    drain_cpu: KindsCpu
    targets: dict[str, dict]  # url -> its executions' and attempts' counts
    lease_lag: tuple[list[float], int] | None
    history: History
    sampler: StreamSampler


async def _measure(args: argparse.Namespace, plan: Plan, load: float, db: Database, dsn: str,
                   client: aioredis.Redis, prefix: str, deadline: float,
                   progress: Progress) -> Report:
    # Nothing listens on a down target's port: free_port() closes what it bound.
    ports = [free_port() for _ in range(plan.targets)]
    urls = [target_url(port) for port in ports]
    healthy = urls[:plan.healthy]
    tenants = await create_tenants(db, plan.tenants)
    factory = JobFactory(urls=urls, allow=(ipaddress.ip_network(LOOPBACK),))
    parked = await _insert_herd(db, plan, factory, tenants, progress)
    with tempfile.TemporaryDirectory(prefix="hw-loadtest-http-") as record_dir:
        async with receiver_processes(ports[:plan.healthy], record_dir) as receivers, \
                scheduler_processes(plan.schedulers, dsn, args.redis_url, prefix,
                                    ready_max="auto") as schedulers, \
                http_worker_processes(plan.http_workers, args.redis_url, prefix, LOOPBACK,
                                      _worker_flags(plan), args.profile) as workers:
            procs = [*receivers, *schedulers, *workers]
            window = await _drain(plan, db, dsn, client, prefix, tenants, factory,
                                  parked, healthy, procs, deadline, progress,
                                  {"http-worker": [w.pid for w in workers],
                                   "scheduler": [s.pid for s in schedulers],
                                   "receiver": [r.pid for r in receivers]})
        records = {url: read_record(record_path(record_dir, _port_of(url))) for url in healthy}
    profiles = [] if args.profile is None else \
        [profile_path(args.profile, "herdwick.cli", w.pid) for w in workers]
    report = _report(plan, load, window, urls, records, profiles)
    if args.raw_limit:
        progress.say("raw limit: the same deliveries through one http-worker alone")
        with tempfile.TemporaryDirectory(prefix="hw-loadtest-http-raw-") as raw_dir:
            report.raw_limit = await raw_http(args.redis_url, max(1, plan.jobs),
                                              _worker_flags(plan), raw_dir)
    return report


async def _drain(plan: Plan, db: Database, dsn: str,
                 client: aioredis.Redis, prefix: str, tenants: list[TenantRef],
                 factory: JobFactory, parked: datetime | None, healthy: list[str],
                 procs: list[Child], deadline: float, progress: Progress,
                 kinds: dict[str, list[int]]) -> _Window:
    await leases_settled(db, [p for p in procs if p.command == "herdwick scheduler"], deadline)
    progress.set("secrets")
    await secrets_published(client, prefix, tenants, procs, deadline)
    sampler = StreamSampler(client, prefix, [HTTP_POOL])
    await sampler.baseline()
    pids = await redis_pids(client)
    probe = KindsProbe({**kinds, **({"redis": pids} if pids else {})}, database_of(dsn))
    started_s = time.time()
    steady_from = uuid7_floor(at_epoch(started_s))
    start = probe.read()
    due = None
    if parked is not None:
        due = due_second(plan.due_in_s)
        await move_herd(db, parked, due, hot=HotTier(client, prefix))
    background = Background(plan.rate, plan.duration_s, plan.delay_s, db,
                            HotTier(client, prefix), tenants, factory)
    outcomes = Outcomes(db, plan.healthy_of(plan.jobs), steady_from, plan.healthy_of)
    progress.set("draining", outcomes.detail, done=lambda: outcomes.herd + outcomes.steady,
                 total=outcomes.herd_jobs + plan.healthy_of(round(plan.rate * plan.duration_s)),
                 due_at=None if due is None else due.timestamp())
    async with running(_mark_at(probe, due, start), "the due-time CPU mark") as at_due:
        await drain(outcomes, sampler, background, plan.rate, procs, deadline)
    end = probe.read()
    cpu = KindsProbe.between(start, end)
    drain_cpu = KindsProbe.between(at_due.result() if at_due.done() else start, end)
    await sampler.sample()  # the last one when all have succeeded: what is left behind
    async with db.connection() as conn:
        executions = {r["target"]: dict(r) for r in await conn.fetch(_TARGETS)}
        attempts = {r["target"]: dict(r)
                    for r in await conn.fetch(_ATTEMPTS, plan.breaker_cooldown_s)}
        lease = await conn.fetchrow(_LEASE_LAG, healthy, steady_from) if due else None
    targets = {url: {**executions.get(url, {}), **attempts.get(url, {})}
               for url in {*executions, *attempts}}
    return _Window(due=due, started_s=started_s, outcomes=outcomes, background=background, cpu=cpu,
                   drain_cpu=drain_cpu, targets=targets, history=await history_of(db),
                   sampler=sampler,
                   lease_lag=None if lease is None or lease["lag_ms"] is None
                   else ([float(v) for v in lease["lag_ms"]], lease["started"]))


async def _mark_at(probe: KindsProbe, due: datetime | None, start: KindsMark) -> KindsMark:
    """The CPU mark at the due second (the start's without a herd): the drain's window."""
    if due is None:
        return start
    await asyncio.sleep(max(0.0, due.timestamp() - time.time()))
    return probe.read()


def _lag_ms(pairs: list[tuple[float, float]]) -> list[float]:
    return [(arrived - due) * 1000 for arrived, due in pairs if not math.isnan(due)]


def _report(plan: Plan, load: float, w: _Window, urls: list[str],
            records: dict[str, list[tuple[float, float]]], profiles: list[str]) -> Report:
    herd_due = None if w.due is None else w.due.timestamp()
    herd_lags: list[float] = []
    steady_lags: list[float] = []
    targets = []
    for url in urls:
        row = w.targets.get(url, {})
        seen = records.get(url)
        lags = None
        if seen is not None:
            herd = [p for p in seen if p[1] == herd_due]
            lags = _lag_ms(herd)
            herd_lags += lags
            steady_lags += _lag_ms([p for p in seen if p[1] != herd_due])
        opened = row.get("opened_at")
        targets.append(TargetFigures(
            url=url, up=url in records, executions=row.get("executions", 0),
            succeeded=row.get("succeeded", 0), retry_wait=row.get("retry_wait", 0),
            burned=row.get("burned", 0), burned_on_open_breaker=row.get("burned_open", 0),
            burned_after_cooldown=row.get("burned_later", 0),
            deferrals=row.get("deferred", 0), deferred_circuit_open=row.get("open", 0),
            deferred_target_busy=row.get("busy", 0),
            opened_after_due_s=None if opened is None or herd_due is None
            else round(opened.timestamp() - herd_due, 3),
            deliveries=None if seen is None else len(seen),
            arrival_lag=None if lags is None or not lags else lag_of(lags)))
    o = w.outcomes
    after_due = None if herd_due is None or o.herd_done_at is None else o.herd_done_at - herd_due
    callbacks = o.herd + o.steady
    lease = None
    if w.lease_lag is not None:
        lease = dict(zip(("p50", "p95", "p99", "max"), [round(v) for v in w.lease_lag[0]],
                         strict=True))
    return Report(
        plan=plan, load_average_1m=round(load, 2), herd_jobs=plan.jobs,
        healthy_herd_jobs=o.herd_jobs, callbacks=callbacks,
        drained_after_due_s=None if after_due is None else round(after_due, 2),
        callbacks_per_s=None if after_due is None else round(o.herd_jobs / after_due),
        arrival_lag=lag_of(herd_lags) if herd_lags else None, lease_lag_ms=lease,
        steady=_steady(plan, w, steady_lags), targets=targets, cpu=w.cpu,
        drain_cpu=w.drain_cpu,
        cpu_per_1000_callbacks=w.cpu.per_1000(callbacks), streams=w.sampler.streams(),
        redis_memory=w.sampler.memory(), history=w.history, profiles=profiles,
        timeline=_timeline(w, records))


def _timeline(w: _Window, records: dict[str, list[tuple[float, float]]]) -> Timeline:
    """Arrivals at the healthy receivers by second, the herd's and the steady jobs'."""
    herd_due = None if w.due is None else w.due.timestamp()
    origin = w.started_s if herd_due is None else herd_due
    seen = [pair for pairs in records.values() for pair in pairs if not math.isnan(pair[1])]
    series = [per_second(name, [(arrived - origin, (arrived - due) * 1000, 1)
                                for arrived, due in seen if (due == herd_due) == is_herd])
              for name, is_herd in (("herd", True), ("steady", False))]
    return Timeline(origin=at_epoch(origin),
                    x_label="s after the herd's due second" if herd_due is not None
                    else "s after the steady load began",
                    count_label="callbacks arrived at the receivers per second",
                    lag_label="due -> arrival lag, ms",
                    series=[s for s in series if s.seconds])


def _steady(plan: Plan, w: _Window, lags: list[float]) -> Steady | None:
    if plan.rate == 0:
        return None
    o, made = w.outcomes, w.background.made
    last_due = w.background.last_due  # None if it made no job
    after = None
    if o.steady_done_at is not None and last_due is not None:
        after = round(o.steady_done_at - last_due.timestamp(), 2)
    return Steady(rate_per_s=plan.rate, duration_s=plan.duration_s, delay_s=plan.delay_s,
                  jobs=made, healthy_jobs=plan.healthy_of(made), succeeded=o.steady,
                  last_succeeded_after_last_due_s=after, arrival_lag=lag_of(lags))


# --- the text report ------------------------------------------------------------------------


def _lag_line(name: str, lag: Lag) -> str:
    return (f"    {name} ms: p50 {lag.p50_ms:.0f}  p95 {lag.p95_ms:.0f}  p99 {lag.p99_ms:.0f}  "
            f"max {lag.max_ms:.0f}  ({lag.samples} deliveries)")


def _target_lines(t: TargetFigures) -> list[str]:
    deferred = (f"{t.deferrals} deferrals ({t.deferred_circuit_open} circuit open, "
                f"{t.deferred_target_busy} target busy)")
    if t.up:
        lines = [f"  up   {t.url}: {t.succeeded}/{t.executions} succeeded, {t.deliveries} "
                 f"deliveries received, {t.burned} attempts failed, {deferred}"]
        if t.arrival_lag is not None:
            lines.append(_lag_line("herd due -> arrival", t.arrival_lag))
        return lines
    if t.deferred_circuit_open == 0:
        opened = "its breaker never deferred one"
    elif t.opened_after_due_s is None:
        opened = "its breaker opened"
    else:  # the steady jobs may fall due before the herd
        when = "after" if t.opened_after_due_s >= 0 else "before"
        opened = (f"its first circuit-open deferral leased {abs(t.opened_after_due_s)} s "
                  f"{when} the herd's due second")
    return [f"  down {t.url}: {t.executions} executions ({t.retry_wait} in retry_wait); "
            f"{t.burned} attempts burned, {t.burned_on_open_breaker} of them on an open "
            f"breaker, {t.burned_after_cooldown} a cooldown or more after it opened "
            f"(probes); {deferred}; {opened}"]


def _cpu_lines(r: Report) -> list[str]:
    c, d = r.cpu, r.drain_cpu
    kinds = "  ".join(f"{k} {s:.2f}" for k, s in c.seconds.items())
    per = "  ".join(f"{k} {s:.3f}" for k, s in r.cpu_per_1000_callbacks.items())
    drained = "  ".join(f"{k} {s / d.window_s:.2f}"
                        + (f" (+{d.runqueue_wait_s[k] / d.window_s:.2f} waiting)"
                           if k in d.runqueue_wait_s else "")
                        for k, s in d.seconds.items())
    return [f"  CPU seconds over {c.window_s:.1f} s from the move until drained (machine "
            f"{c.machine_busy_share:.0%} busy, {c.others_s:.2f} s of it not this run's): "
            f"{kinds}",
            f"    per 1,000 callbacks: {per}",
            f"  cores in use over the {d.window_s:.1f} s from due until drained (machine "
            f"{d.machine_busy_share:.0%} busy), and waiting for one: {drained}"]


def render_text(r: Report) -> str:
    p = r.plan
    lines = [f"herdwick loadtest http: {p.schedulers} scheduler, {p.http_workers} http-worker "
             f"process(es) (concurrency {p.concurrency}, {p.target_concurrency} per target), "
             f"{p.targets} target(s) of which {p.down_targets} down, {p.tenants} tenant(s); "
             f"load average {r.load_average_1m} at the start; {r.callbacks} callbacks "
             "succeeded"]
    if r.drained_after_due_s is not None:
        lines += [f"  herd: {r.herd_jobs} jobs due in one second, {r.healthy_herd_jobs} to "
                  "healthy targets",
                  f"    all healthy ones succeeded in Postgres {r.drained_after_due_s} s after "
                  f"due: {r.callbacks_per_s:,} callbacks/s"]
        if r.arrival_lag is not None:
            lines.append(_lag_line("due -> arrival at the receiver", r.arrival_lag))
        if (lease := r.lease_lag_ms) is not None:
            lines.append(f"    due -> first lease (Postgres started_at) ms: p50 {lease['p50']}  "
                         f"p95 {lease['p95']}  p99 {lease['p99']}  max {lease['max']}")
    if (s := r.steady) is not None:
        lines += [f"  steady: {s.rate_per_s:g} jobs/s for {s.duration_s:g} s ({s.jobs} jobs, "
                  f"{s.healthy_jobs} to healthy targets), each inserted {s.delay_s:g} s "
                  "before due",
                  f"    {s.succeeded} succeeded, the last {s.last_succeeded_after_last_due_s} "
                  "s after the last due time",
                  _lag_line("due -> arrival", s.arrival_lag)]
    for t in r.targets:
        lines += _target_lines(t)
    lines += _cpu_lines(r)
    st = r.streams
    lines += [
        f"  ready stream, workers group lag: max {st.ready_lag_max}, last {st.ready_lag_last};"
        f" events stream length max {st.events_len_max}, last {st.events_len_last}",
        memory_line(r.redis_memory),
        f"  history: {r.history.succeeded_without_start} succeeded without a start time, "
        f"{r.history.attempts_left_running} attempts left running"
        + ("" if r.history.sound else "  <- GAPS"),
    ]
    if r.profiles:
        lines.append("  cProfile stats (python -m pstats FILE): " + ", ".join(r.profiles))
    if (raw := r.raw_limit) is not None:
        lines.append(f"  raw limit, one http-worker alone (entries published straight onto its "
                     f"stream): {raw.deliveries} deliveries in {raw.drained_s} s, "
                     f"{raw.callbacks_per_s:,} callbacks/s; per 1,000: http-worker "
                     f"{raw.worker_cpu_per_1000_s:.3f} s, receiver "
                     f"{raw.receiver_cpu_per_1000_s:.3f} s")
    return "\n".join(lines) + "\n"


async def command(args: argparse.Namespace) -> int:
    """`herdwick loadtest http`: progress on stderr, the report on stdout; 1 if the history
    has gaps. SIGTERM cancels the run like Ctrl-C does, so it cleans up either way."""
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    check_path(args.report)
    started = datetime.now(UTC)
    progress = Progress.of_args(args, "http")
    async with running(progress.run()):
        report = await run(args, progress)
    text = render_text(report)
    sys.stdout.write(render_json(report) if args.json else text)
    write_report(args, "loadtest http", report, text, headline(report), report.timeline,
                 started)
    return 0 if report.history.sound else 1


def headline(r: Report) -> list[tuple[str, str]]:
    """The figures a reader looks for first, as the text says them."""
    found = [("callbacks succeeded", f"{r.callbacks:,}")]
    if r.callbacks_per_s is not None:
        found += [("herd: callbacks/s", f"{r.callbacks_per_s:,}"),
                  ("herd: all healthy ones succeeded after due", f"{r.drained_after_due_s} s")]
    if (lag := r.arrival_lag) is not None:
        found.append(("herd: due -> arrival p50 / p99 / max ms",
                      f"{lag.p50_ms:.0f} / {lag.p99_ms:.0f} / {lag.max_ms:.0f}"))
    found += [("CPU s per 1,000 callbacks", ", ".join(
        f"{k} {v:.3f}" for k, v in r.cpu_per_1000_callbacks.items()))]
    if (raw := r.raw_limit) is not None:
        found.append(("raw limit, one http-worker alone", f"{raw.callbacks_per_s:,} callbacks/s"))
    return [*found, ("history", "sound" if r.history.sound else "GAPS")]
