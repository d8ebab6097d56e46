"""`herdwick loadtest noisy-neighbour`: one tenant's herd beside twenty quiet tenants.

The noisy tenant has --jobs due in one second; each quiet tenant has
--quiet-jobs due in the same second; every tenant's jobs are spread evenly
over that second, so with first-in first-out dispatch a quiet job waits
behind every noisy job due before it. The pool's workers are the bottleneck:
`herdwick worker` processes whose handler sleeps --handler-ms, so their
capacity is workers x concurrency / handler time, whatever the machine. With
--noisy-rate the noisy tenant has that dispatchRate quota. --fair off runs
the schedulers with HERDWICK_DISPATCH_ORDER=fifo for the contrast.

Reports each tenant's due->lease lag, the noisy tenant's drain rate beside the
pool's and its quota, Jain's fairness index over the quiet tenants' service
rates, the ready stream's length and Redis used_memory.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
import uuid
from datetime import UTC, datetime
from typing import Annotated

import msgspec
import redis.asyncio as aioredis
from msgspec import Meta

from herdwick.config import ConfigError
from herdwick.loadtest.background import Background
from herdwick.loadtest.driver import (
    add_scratch_flags,
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
    JobFactory,
    TenantRef,
    create_tenants_of,
    due_second,
    herd_batches,
    insert_batches,
    move_herd,
    parking_time,
    pool_names,
)
from herdwick.loadtest.measure import (
    RedisMemory,
    StreamSampler,
    StreamSamples,
    TenantLeases,
    lease_lag_of,
    lease_lags_by_tenant,
)
from herdwick.loadtest.outcomes import History, Outcomes, drain, history_of, uuid7_floor
from herdwick.loadtest.report import Progress, add_report_flags, memory_line, render_json
from herdwick.loadtest.timeline import Timeline, leases_per_second
from herdwick.model import TenantSpec
from herdwick.storage.db import Database
from herdwick.storage.hot import HotTier

WORKER_APP = "herdwick.loadtest.sleep_worker:worker"
NOISY = "noisy"
STEADY_TENANTS = 4  # the background load's own tenants, apart from the quiet ones

# The tool's own statement on its scratch database (storage/ has no such query): when
# the middle 80 % of a tenant's executions were leased, for a drain rate that leaves
# out the first burst and the last stragglers.
_LEASE_SPAN = """
SELECT count(*) AS started,
       percentile_disc(ARRAY[0.1, 0.9]) WITHIN GROUP (ORDER BY started_at) AS at
FROM executions WHERE started_at IS NOT NULL AND tenant_id = ANY($1::uuid[])"""


# Of the leases in the noisy tenant's middle 80 %, its own: a share at most 1 by construction
# (two rates over two spans are not).
_SHARE = """
WITH span AS (
    SELECT percentile_disc(ARRAY[0.1, 0.9]) WITHIN GROUP (ORDER BY started_at) AS at
    FROM executions WHERE started_at IS NOT NULL AND tenant_id = $1)
SELECT count(*) FILTER (WHERE e.tenant_id = $1) AS mine, count(*) AS every
FROM executions e, span
WHERE e.tenant_id = ANY($2::uuid[]) AND e.started_at BETWEEN span.at[1] AND span.at[2]"""


class Plan(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The flags' limits."""

    jobs: Annotated[int, Meta(ge=1, le=10_000_000)] = 100_000
    quiet_tenants: Annotated[int, Meta(ge=1, le=1_000)] = 20
    quiet_jobs: Annotated[int, Meta(ge=1, le=100_000)] = 50
    fair: bool = True
    noisy_rate: Annotated[float, Meta(gt=0, le=1_000_000)] | None = None
    noisy_burst: Annotated[int, Meta(ge=1, le=1_000_000)] | None = None
    workers: Annotated[int, Meta(ge=1, le=16)] = 2
    concurrency: Annotated[int, Meta(ge=1, le=10_000)] = 100
    handler_ms: Annotated[float, Meta(ge=0, le=60_000)] = 40.0
    schedulers: Annotated[int, Meta(ge=1, le=16)] = 1
    ready_max: str = "auto"  # HERDWICK_READY_MAX for the schedulers
    rate: Annotated[float, Meta(ge=0, le=100_000)] = 0.0
    duration_s: Annotated[float, Meta(gt=0, le=3_600)] = 20.0
    due_in_s: Annotated[float, Meta(ge=1, le=600)] = 6.0
    timeout_s: Annotated[float, Meta(gt=0, le=3_600)] = 600.0

    @property
    def capacity_per_s(self) -> float | None:
        """What the workers can take, by their handler time; None for a no-op handler."""
        if self.handler_ms == 0:
            return None
        return self.workers * self.concurrency * 1000 / self.handler_ms


class TenantLag(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    jobs: int
    started: int
    p50_ms: float
    p99_ms: float
    max_ms: float


class Noisy(msgspec.Struct, frozen=True, kw_only=True):
    lag: TenantLag
    drain_per_s: float  # over the middle 80 % of its leases
    quota_per_s: float | None
    # Of the pool's leases over its own middle 80 %: its share of the workers.
    share_of_pool: float


class Report(msgspec.Struct, frozen=True, kw_only=True):
    plan: Plan
    capacity_per_s: float | None
    pool_drain_per_s: float  # every tenant's leases, middle 80 %
    noisy: Noisy
    quiet: TenantLag  # every quiet tenant's executions together
    quiet_tenants: list[TenantLag]
    # Over the quiet tenants' service rates (jobs / due->last lease): 1 when they are
    # served alike, 1/n when one takes everything.
    quiet_jain_index: float
    steady: TenantLag | None
    drained_after_due_s: float  # until every herd execution had succeeded in Postgres
    streams: StreamSamples
    redis_memory: RedisMemory
    history: History
    # Per second from the due second: leases of the noisy, quiet and steady tenants, lag.
    timeline: Timeline | None = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--jobs", type=int, default=100_000,
      help="the noisy tenant's jobs, all due in one second; default 100000")
    a("--quiet-tenants", type=int, default=20, help="quiet tenants; default 20")
    a("--quiet-jobs", type=int, default=50,
      help="jobs per quiet tenant, due in the same second; default 50")
    a("--fair", choices=("on", "off"), default="on",
      help="weighted fair queuing (on) or first-in first-out dispatch (off); default on")
    a("--noisy-rate", type=float, default=None,
      help="the noisy tenant's dispatchRate quota, jobs/s; default none")
    a("--noisy-burst", type=int, default=None,
      help="its quota's burst; default the tenant default (one second of the rate)")
    a("--workers", type=int, default=2, help="`herdwick worker` processes; default 2")
    a("--concurrency", type=int, default=100, help="handlers per worker process; default 100")
    a("--handler-ms", type=float, default=40.0,
      help="each job's handler sleeps this long; default 40 (2 x 100 / 40 ms = 5,000 jobs/s)")
    a("--schedulers", type=int, default=1, help="`herdwick scheduler` processes; default 1")
    a("--ready-max", default="auto",
      help="the schedulers' HERDWICK_READY_MAX (the ready stream's bound); default auto")
    a("--rate", type=float, default=0.0,
      help=f"steady background jobs/s, over {STEADY_TENANTS} tenants of their own; default 0")
    a("--duration", type=float, default=20.0, help="seconds of the steady rate; default 20")
    a("--due-in", type=float, default=6.0,
      help="seconds from the move to the due second; default 6")
    a("--timeout", type=float, default=600.0,
      help="give up waiting after this many seconds; default 600")
    add_scratch_flags(parser)
    add_report_flags(parser)


def plan_from(args: argparse.Namespace) -> Plan:
    try:
        return msgspec.convert(
            {"jobs": args.jobs, "quiet_tenants": args.quiet_tenants,
             "quiet_jobs": args.quiet_jobs, "fair": args.fair == "on",
             "noisy_rate": args.noisy_rate, "noisy_burst": args.noisy_burst,
             "workers": args.workers, "concurrency": args.concurrency,
             "handler_ms": args.handler_ms, "schedulers": args.schedulers,
             "ready_max": args.ready_max, "rate": args.rate,
             "duration_s": args.duration, "due_in_s": args.due_in, "timeout_s": args.timeout},
            Plan)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"loadtest noisy-neighbour: {exc}") from None


def jain_index(values: list[float]) -> float:
    """(sum x)^2 / (n sum x^2)."""
    squares = sum(v * v for v in values)
    return 1.0 if squares == 0 else sum(values) ** 2 / (len(values) * squares)


def service_rate(leases: TenantLeases) -> float:
    """Jobs per second from the tenant's first due time to its last lease."""
    span = (leases.last_started - leases.first_due).total_seconds()
    return leases.started / max(span, 0.001)


async def drain_rate(db: Database, tenant_ids: list[uuid.UUID]) -> float:
    async with db.connection() as conn:
        row = await conn.fetchrow(_LEASE_SPAN, tenant_ids)
    if row["at"] is None:
        return 0.0
    first, last = row["at"]
    return 0.8 * row["started"] / max((last - first).total_seconds(), 0.001)


async def share_of(db: Database, tenant_id: uuid.UUID, pool: list[uuid.UUID]) -> float:
    """The tenant's part of the pool's leases over the middle 80 % of its own."""
    async with db.connection() as conn:
        row = await conn.fetchrow(_SHARE, tenant_id, pool)
    return round(row["mine"] / row["every"], 3) if row["every"] else 0.0


def _lag(name: str, jobs: int, leases: TenantLeases | None) -> TenantLag:
    if leases is None:
        return TenantLag(name=name, jobs=jobs, started=0, p50_ms=0, p99_ms=0, max_ms=0)
    return TenantLag(name=name, jobs=jobs, started=leases.started, p50_ms=leases.p50_ms,
                     p99_ms=leases.p99_ms, max_ms=leases.max_ms)


async def _group_lag(db: Database, name: str, jobs: int, tenants: list[TenantRef]) -> TenantLag:
    started, (p50, p99, top) = await lease_lag_of(db, [t.tenant_id for t in tenants])
    return TenantLag(name=name, jobs=jobs, started=started, p50_ms=p50, p99_ms=p99, max_ms=top)


def _tenant_specs(plan: Plan) -> list[TenantSpec]:
    noisy = TenantSpec(name=NOISY, dispatch_rate=plan.noisy_rate, burst=plan.noisy_burst)
    quiet = [TenantSpec(name=f"quiet-{i:02d}") for i in range(plan.quiet_tenants)]
    steady = [TenantSpec(name=f"steady-{i}") for i in range(STEADY_TENANTS if plan.rate else 0)]
    return [noisy, *quiet, *steady]


async def run(args: argparse.Namespace, progress: Progress) -> Report:
    plan = plan_from(args)
    require_loopback(args.database_url, "--database-url")
    require_loopback(args.redis_url, "--redis-url")
    deadline = time.perf_counter() + plan.timeout_s
    async with scratch_prefix(args.redis_url, "noisy") as (client, prefix), \
            scratch_database(args.database_url, scratch_name("noisy"), args.keep,
                             progress.say) as dsn:
        db = await Database.connect(dsn, max_size=8 + STEADY_TENANTS)
        try:
            return await _measure(args, plan, db, dsn, client, prefix, deadline, progress)
        finally:
            await db.close()


async def _measure(args: argparse.Namespace, plan: Plan, db: Database, dsn: str,
                   client: aioredis.Redis, prefix: str, deadline: float,
                   progress: Progress) -> Report:
    pool = pool_names(1)[0]
    tenants = await create_tenants_of(db, _tenant_specs(plan))
    noisy, quiet = tenants[0], tenants[1:1 + plan.quiet_tenants]
    steady_tenants = tenants[1 + plan.quiet_tenants:]
    factory = JobFactory([pool])
    herd_jobs = plan.jobs + plan.quiet_tenants * plan.quiet_jobs
    parked = parking_time()
    inserted = [0]
    progress.set("submitting", done=lambda: inserted[0], total=herd_jobs)
    await insert_batches(db, herd_batches(factory, [noisy, *quiet],
                                          [plan.jobs] + [plan.quiet_jobs] * len(quiet),
                                          parked, spread=True),
                         INSERT_CONNECTIONS, lambda n: inserted.__setitem__(0, inserted[0] + n))
    order = {"HERDWICK_DISPATCH_ORDER": "fair" if plan.fair else "fifo"}
    async with scheduler_processes(plan.schedulers, dsn, args.redis_url, prefix,
                                   ready_max=plan.ready_max, **order) as procs, \
            worker_processes(plan.workers, WORKER_APP, args.redis_url, prefix, pool,
                             plan.concurrency, plan.handler_ms) as workers:
        await leases_settled(db, procs, deadline)
        sampler = StreamSampler(client, prefix, [pool])
        await sampler.baseline()
        steady_from = uuid7_floor(datetime.now(UTC))
        due = due_second(plan.due_in_s)
        await move_herd(db, parked, due, hot=HotTier(client, prefix))
        background = Background(plan.rate, plan.duration_s, 2.5, db, HotTier(client, prefix),
                                steady_tenants, factory)
        outcomes = Outcomes(db, herd_jobs, steady_from)
        progress.set("draining", outcomes.detail,
                     done=lambda: outcomes.herd + outcomes.steady,
                     total=herd_jobs + round(plan.rate * plan.duration_s),
                     due_at=due.timestamp())
        await drain(outcomes, sampler, background, plan.rate, [*procs, *workers], deadline)
        await sampler.sample()
    by_tenant = await lease_lags_by_tenant(db)
    timeline = Timeline(
        origin=due, x_label="s after the herd's due second",
        count_label="executions leased per second", lag_label="due -> lease lag, ms",
        series=await leases_per_second(
            db, {NOISY: [noisy.tenant_id], "quiet": [t.tenant_id for t in quiet],
                 "steady": [t.tenant_id for t in steady_tenants]},
            steady_from, due.timestamp()))
    quiet_leases = [by_tenant.get(t.tenant_id) for t in quiet]
    noisy_drain = await drain_rate(db, [noisy.tenant_id])
    pool = [noisy.tenant_id, *(t.tenant_id for t in quiet)]
    pool_drain = await drain_rate(db, pool)
    return Report(
        plan=plan, capacity_per_s=plan.capacity_per_s, pool_drain_per_s=round(pool_drain),
        noisy=Noisy(lag=_lag(NOISY, plan.jobs, by_tenant.get(noisy.tenant_id)),
                    drain_per_s=round(noisy_drain), quota_per_s=plan.noisy_rate,
                    share_of_pool=await share_of(db, noisy.tenant_id, pool)),
        quiet=await _group_lag(db, "quiet", plan.quiet_jobs * len(quiet), quiet),
        quiet_tenants=[_lag(t.name, plan.quiet_jobs, leases)
                       for t, leases in zip(quiet, quiet_leases, strict=True)],
        quiet_jain_index=round(jain_index([0.0 if q is None else service_rate(q)
                                           for q in quiet_leases]), 4),
        steady=(await _group_lag(db, "steady", background.made, steady_tenants)
                if plan.rate else None),
        drained_after_due_s=round(outcomes.herd_done_at - due.timestamp(), 2),
        streams=sampler.streams(), redis_memory=sampler.memory(), history=await history_of(db),
        timeline=timeline)


def _row(t: TenantLag) -> str:
    return (f"  {t.name:<10} {t.jobs:>8} {t.started:>8} {t.p50_ms:>8.0f} {t.p99_ms:>8.0f} "
            f"{t.max_ms:>8.0f}")


def render_text(r: Report) -> str:
    p, n = r.plan, r.noisy
    capacity = "" if r.capacity_per_s is None else f" = {r.capacity_per_s:,.0f} jobs/s"
    quota = "none" if n.quota_per_s is None else f"{n.quota_per_s:,.0f} jobs/s"
    lines = [
        f"herdwick loadtest noisy-neighbour: fair queuing {'on' if p.fair else 'off'}",
        f"  noisy tenant: {p.jobs} jobs due in one second (quota {quota}); {p.quiet_tenants} "
        f"quiet tenants x {p.quiet_jobs} in the same second",
        f"  workers: {p.workers} x {p.concurrency} handlers of {p.handler_ms:g} ms{capacity}; "
        f"{p.schedulers} scheduler(s)"
        + (f"; background {p.rate:g} jobs/s for {p.duration_s:g} s" if p.rate else ""),
        f"  every herd execution succeeded {r.drained_after_due_s} s after due",
        "",
        f"  {'lag (ms)':<10} {'jobs':>8} {'started':>8} {'p50':>8} {'p99':>8} {'max':>8}",
        _row(n.lag), _row(r.quiet),
        *([_row(r.steady)] if r.steady is not None else []),
        "",
        f"  noisy drain {n.drain_per_s:,} jobs/s, {n.share_of_pool:.0%} of the pool's "
        f"{r.pool_drain_per_s:,} jobs/s (middle 80 % of leases)"
        + ("" if n.quota_per_s is None else f"; {n.drain_per_s / n.quota_per_s:.2f} x quota"),
        f"  Jain's index over the quiet tenants' service rates: {r.quiet_jain_index}",
        "  quiet tenants' p99 lag ms, each: "
        + " ".join(f"{t.p99_ms:.0f}" for t in r.quiet_tenants),
        f"  ready stream length max {r.streams.ready_len_max}, workers group lag max "
        f"{r.streams.ready_lag_max}",
        memory_line(r.redis_memory),
        f"  history: {r.history.succeeded_without_start} succeeded without a start time, "
        f"{r.history.attempts_left_running} attempts left running"
        + ("" if r.history.sound else "  <- GAPS"),
    ]
    return "\n".join(lines) + "\n"


async def command(args: argparse.Namespace) -> int:
    """Progress on stderr, the report on stdout; 1 if the history has gaps."""
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    check_path(args.report)
    started = datetime.now(UTC)
    progress = Progress.of_args(args, "noisy")
    async with running(progress.run()):
        report = await run(args, progress)
    text = render_text(report)
    sys.stdout.write(render_json(report) if args.json else text)
    write_report(args, "loadtest noisy-neighbour", report, text, headline(report),
                 report.timeline, started)
    return 0 if report.history.sound else 1


def headline(r: Report) -> list[tuple[str, str]]:
    """The figures a reader looks for first, as the text says them."""
    n = r.noisy
    return [("fair queuing", "on" if r.plan.fair else "off"),
            ("quiet tenants: due -> lease p50 / p99 / max ms",
             f"{r.quiet.p50_ms:.0f} / {r.quiet.p99_ms:.0f} / {r.quiet.max_ms:.0f}"),
            ("noisy tenant: due -> lease p50 / p99 / max ms",
             f"{n.lag.p50_ms:.0f} / {n.lag.p99_ms:.0f} / {n.lag.max_ms:.0f}"),
            ("noisy drain", f"{n.drain_per_s:,} jobs/s, {n.share_of_pool:.0%} of the pool's "
                            f"{r.pool_drain_per_s:,}"),
            ("Jain's index, quiet tenants", f"{r.quiet_jain_index}"),
            ("every herd execution succeeded after due", f"{r.drained_after_due_s} s"),
            ("history", "sound" if r.history.sound else "GAPS")]

