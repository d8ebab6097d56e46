"""`herdwick loadtest herd`: a herd of jobs due in one second, against a stack it starts.

One run, in order:

1. heap memory and raw limits (loadtest/raw_limits.py): one shard actor's
   heap, then a second herd of the same size through the fenced dispatch
   transaction flat out, and its executions through hw_publish and as XADDs;
2. the herd: `schedulers` processes of `herdwick scheduler` on a fresh
   database and Redis key prefix. The herd is inserted parked a day ahead,
   then moved in one transaction to a whole second `due_in_s` ahead, so every
   shard has loaded it before it falls due. No-op consumers read the ready
   streams. An optional steady background is inserted with a short delay
   (and notified, as the gateway does).

Lag is read from the streams, not from the scheduler's histograms (they live
in the other process): an entry's ID is the Redis server's clock at XADD in
ms, its `scheduled_for` field the due time. Every figure stands beside the
raw limit of the same work on this machine, measured in the same run; Redis
memory is the server's used_memory, sampled with the streams.
Only loopback addresses; every wait has a deadline; the scheduler processes,
scratch databases and Redis keys are removed however the run ends.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Annotated, Any

import msgspec
import redis.asyncio as aioredis
from msgspec import Meta

from herdwick.config import ConfigError
from herdwick.errors import HerdwickError
from herdwick.loadtest.background import Background
from herdwick.loadtest.consumers import BACKGROUND, HERD, Watch, consumers
from herdwick.loadtest.driver import (
    RunFailed,
    SchedulerProcess,
    check_alive,
    leases_settled,
    require_loopback,
    running,
    scheduler_processes,
    scratch_database,
    scratch_name,
    scratch_prefix,
)
from herdwick.loadtest.herd_report import (
    BackgroundResult,
    HerdResult,
    HerdTimes,
    Ratio,
    SchedulerCost,
    background_lines,
    background_result,
    cost_lines,
    herd_lines,
    herd_result,
    ratios,
    raw_lines,
    scheduler_cost,
    timeline_of,
    warnings,
)
from herdwick.loadtest.html_report import check_path, write_report
from herdwick.loadtest.jobs import (
    JobFactory,
    TenantRef,
    create_tenants,
    due_second,
    herd_batches,
    insert_batches,
    move_herd,
    parking_time,
    pool_names,
    tenant_counts,
)
from herdwick.loadtest.measure import (
    CpuMark,
    Machine,
    ProcessProbe,
    RedisMemory,
    StreamSampler,
    machine_info,
    py_spy,
)
from herdwick.loadtest.raw_limits import (
    HeapMemory,
    RawLimits,
    RawShape,
    heap_memory,
    raw_limits,
)
from herdwick.loadtest.report import Progress, add_report_flags, render_json
from herdwick.loadtest.timeline import Timeline
from herdwick.storage.db import Database
from herdwick.storage.hot import HotTier

DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
IDLE_SAMPLE_S = 2.0
DUPLICATE_GRACE_S = 1.0  # keep reading this long after the last expected entry
CLEANUP_GRACE_S = 60.0  # past --timeout, for stopping and dropping: the hard bound


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


class Report(msgspec.Struct, frozen=True, kw_only=True):
    started_at: datetime
    plan: Plan
    machine: Machine
    heap: HeapMemory
    raw: RawLimits | None
    herd: HerdResult | None
    background: BackgroundResult | None
    cost: SchedulerCost
    redis_memory: RedisMemory  # from just before the move (or the background) to the end
    ratios: list[Ratio]
    profiles: list[str]
    warnings: list[str]  # what makes this run's figures doubtful
    # Per second from the herd's due second: entries XADDed to the ready streams, their lag.
    timeline: Timeline | None = None

    @property
    def complete(self) -> bool:
        return all(r.check.exact for r in (self.herd, self.background) if r is not None)


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
    sampler: StreamSampler
    progress: Progress
    deadline: float


async def herd_stage(options: Options, progress: Progress, deadline: float,
                     ) -> tuple[HerdTimes, Stack, list[str]]:
    """Fresh database and prefix, K scheduler processes, consumers; then the load."""
    plan = options.plan
    async with scratch_prefix(options.redis_url, "herd") as (client, prefix), \
            scratch_database(options.database_url, scratch_name("herd"), options.keep,
                             progress.say) as dsn:
        db = await Database.connect(dsn, max_size=plan.insert_connections + 12)
        try:
            tenants = await create_tenants(db, plan.tenants)
            progress.set("schedulers")
            async with scheduler_processes(plan.schedulers, dsn, options.redis_url,
                                           prefix) as procs:
                await leases_settled(db, procs, deadline)
                pools = pool_names(plan.pools)
                stack = Stack(plan=plan, db=db, client=client, prefix=prefix, tenants=tenants,
                              factory=JobFactory(pools), watch=Watch(), procs=procs,
                              probe=ProcessProbe([p.pid for p in procs]),
                              sampler=StreamSampler(client, prefix, pools),
                              progress=progress, deadline=deadline)
                times, profiles = await _load(stack, options.py_spy_dir)
                progress.set("stopping the schedulers")
                return times, stack, profiles
        finally:
            await db.close()


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
        s.progress.set("reading for duplicates")
        await asyncio.sleep(DUPLICATE_GRACE_S)
        s.progress.set("stopping the consumers")
    return times, profiles


async def _insert_parked(s: Stack) -> tuple[datetime | None, float]:
    """The herd, parked a day ahead; returns the parking instant and the insert time."""
    if s.plan.jobs == 0:
        s.watch.close(HERD)
        return None, 0.0
    parked = parking_time()
    batches = herd_batches(s.factory, s.tenants,
                           tenant_counts(s.plan.jobs, s.plan.tenants, s.plan.skew), parked)
    for tenant, jobs in batches:
        s.watch.expect(HERD, jobs, tenant)
    s.watch.close(HERD)
    inserted = [0]
    s.progress.set("submitting", done=lambda: inserted[0], total=s.plan.jobs)
    start = time.perf_counter()
    await insert_batches(s.db, batches, s.plan.insert_connections,
                         lambda n: inserted.__setitem__(0, inserted[0] + n))
    return parked, time.perf_counter() - start


async def _dispatch_phase(s: Stack, parked: datetime | None, insert_s: float,
                          idle: tuple[CpuMark, CpuMark], baseline: list[int]) -> HerdTimes:
    """Move the herd to its due second, run the background, wait until all is on the
    streams (or the deadline); CPU is marked around the herd, else around the background."""
    w = s.watch
    p = s.plan

    def on_the_streams(due_at: datetime | None = None) -> None:
        s.progress.set("on the streams", lambda: f"herd {w.seen[HERD]}/{w.expected[HERD]}  "
                       f"background {w.seen[BACKGROUND]}/{w.expected[BACKGROUND]}",
                       done=lambda: w.seen[HERD] + w.seen[BACKGROUND],
                       total=p.jobs + p.background_jobs,
                       due_at=None if due_at is None else due_at.timestamp())

    on_the_streams()
    await s.sampler.baseline()
    start = s.probe.mark()
    due_at, move_s, lead_s = None, 0.0, 0.0
    if parked is not None:
        due_at, move_s, lead_s = await _move(s, parked)
        on_the_streams(due_at)
    background = Background(p.rate, p.duration_s, p.delay_s, s.db, HotTier(s.client, s.prefix),
                            s.tenants, s.factory,
                            lambda tenant, jobs: w.expect(BACKGROUND, jobs, tenant))

    async def generate() -> None:
        await background.run()
        w.close(BACKGROUND)

    async with s.sampler.sampling() as sampler:
        if p.rate > 0:
            generator = asyncio.create_task(generate(), name="the background generator")
        else:
            w.close(BACKGROUND)
            generator = None
        try:
            helpers = (sampler, generator)
            await wait_for(w.complete[HERD], s.deadline, s.procs, helpers)
            herd_end = s.probe.mark()
            if generator is not None:
                await wait_for(w.complete[BACKGROUND], s.deadline, s.procs, helpers)
            end = herd_end if parked is not None else s.probe.mark()
        finally:
            if generator is not None:
                generator.cancel()
                await asyncio.gather(generator, return_exceptions=True)
    s.progress.set("last sample")
    await s.sampler.sample()
    return HerdTimes(due_at=due_at, insert_s=insert_s, move_s=move_s, lead_s=lead_s,
                     idle=idle, window=(start, end),
                     window_name="herd move -> last herd entry" if parked is not None
                     else "background start -> last background entry",
                     baseline_rss=baseline, peak_rss=s.probe.high_water(),
                     background_late_s=background.late_max_s)


async def _move(s: Stack, parked: datetime) -> tuple[datetime, float, float]:
    start = time.perf_counter()
    due = due_second(s.plan.due_in_s)
    moved = await move_herd(s.db, parked, due, hot=HotTier(s.client, s.prefix))
    if moved != s.plan.jobs:
        raise RunFailed(f"moved {moved} due rows of a herd of {s.plan.jobs}")
    lead_s = due.timestamp() - time.time()
    return due, time.perf_counter() - start, lead_s


async def wait_for(event: asyncio.Event, deadline: float, procs: list[SchedulerProcess],
                   helpers: tuple[asyncio.Task | None, ...] = ()) -> bool:
    """Until `event` is set (True) or the deadline passes (False); fails if a scheduler dies
    or a helper task (the sampler, the background generator) fails."""
    while not event.is_set():
        check_alive(procs, helpers)
        left = deadline - time.perf_counter()
        if left <= 0:
            return False
        try:
            await asyncio.wait_for(event.wait(), min(left, 0.5))
        except TimeoutError:
            pass
    return True


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
        machine = await machine_info(options.database_url, options.redis_url)
        raw = None
        if plan.raw and plan.raw_jobs:
            shape = RawShape(jobs=plan.raw_jobs, tenants=plan.tenants, pools=plan.pools,
                             skew=plan.skew, insert_connections=plan.insert_connections,
                             connections=plan.raw_connections)
            raw = await raw_limits(options.database_url, options.redis_url, shape, progress)
        times, stack, profiles = await herd_stage(options, progress, deadline)
    watch = stack.watch
    herd = herd_result(times, watch, stack.tenants,
                       tenant_counts(plan.jobs, plan.tenants, plan.skew))
    cost = scheduler_cost(plan.schedulers, times, watch)
    background = background_result(plan.rate, plan.duration_s, plan.delay_s, times, watch,
                                   stack.tenants)
    return Report(started_at=started, plan=plan, machine=machine, heap=heap, raw=raw,
                  herd=herd, background=background,
                  cost=cost, redis_memory=stack.sampler.memory(), ratios=ratios(herd, raw),
                  profiles=profiles, warnings=warnings(herd, cost, watch),
                  timeline=timeline_of(times, watch))


# --- the report as text ----------------------------------------------------------------------


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
        lines += herd_lines(report.herd)
    if report.background is not None:
        lines += background_lines(report.background)
    lines += cost_lines(report.cost, report.heap, report.redis_memory)
    if report.raw is not None:
        lines += raw_lines(report.raw, report.ratios)
    if report.profiles:
        lines.append("py-spy profiles: " + ", ".join(report.profiles))
    lines += [f"WARNING: {w}" for w in report.warnings]
    lines.append("complete" if report.complete else "INCOMPLETE: see the stream checks")
    return "\n".join(lines) + "\n"


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
    add_report_flags(parser)


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
    progress = Progress.of_args(args, "herd")
    options = options_from(args)
    check_path(args.report)
    try:
        report = await run(options, progress)
    except TimeoutError:
        # The hard bound: a stage that should have given up at --timeout did not.
        raise RunFailed(f"gave up {options.plan.timeout_s + CLEANUP_GRACE_S:g} s in, in "
                        f"stage {progress.phase!r} ({progress.detail()})") from None
    text = render_text(report)
    sys.stdout.write(render_json(report) if args.json else text)
    sys.stdout.flush()
    write_report(args, "loadtest herd", report, text, headline(report), report.timeline,
                 report.started_at)
    return 0 if report.complete else 1


def headline(r: Report) -> list[tuple[str, str]]:
    """The figures a reader looks for first, as the text says them."""
    found = []
    if (h := r.herd) is not None:
        found += [("herd: jobs/s onto the streams", f"{h.jobs_per_s:,.0f}"),
                  ("herd: last entry after due", f"{h.last_after_due_ms:.0f} ms"),
                  ("herd: due -> XADD p50 / p99 / max ms",
                   f"{h.lag.p50_ms:.0f} / {h.lag.p99_ms:.0f} / {h.lag.max_ms:.0f}")]
    if (b := r.background) is not None:
        found.append(("background: due -> XADD p50 / p99 / max ms",
                      f"{b.lag.p50_ms:.0f} / {b.lag.p99_ms:.0f} / {b.lag.max_ms:.0f}"))
    c = r.cost
    found.append(("scheduler CPU", f"{c.cpu_s:.2f} s for {c.jobs} jobs = {c.cpu_s_per_1000:.3f}"
                                   " s per 1,000"))
    found += [(f"herd / raw: {x.figure}", f"{x.herd_over_raw:.2f}") for x in r.ratios[-1:]]
    return [*found, ("streams", "complete" if r.complete else "INCOMPLETE")]


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
