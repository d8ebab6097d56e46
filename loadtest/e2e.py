"""`herdwick loadtest e2e`: jobs through real SDK workers to outcomes committed in Postgres.

Due -> published -> leased by `herdwick worker` processes running a no-op
handler -> completed -> applied by the execution-event actor. The load is a
herd (--jobs, all due in one second), a steady rate (--rate for --duration,
the herd load test's own steady generator), or both at once. Reports, for
each, due->lease lag (from the lease time Redis stamped on each attempt) and
when every execution had succeeded in Postgres; the events stream's length,
the ready stream's consumer-group lag and length and the Redis server's
used_memory, sampled through the run; and
Postgres transactions and Redis commands per execution (this run's database
and the whole Redis server: keep the machine otherwise quiet).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import time
from datetime import UTC, datetime, timedelta
from typing import Annotated

import msgspec
import redis.asyncio as aioredis
from msgspec import Meta

from herdwick.config import DEFAULT_RETENTION_DAYS, MAX_RETENTION_DAYS, ConfigError
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
    KindsCpu,
    KindsProbe,
    LeaseLag,
    ProcessProbe,
    RedisMemory,
    StreamSampler,
    StreamSamples,
    database_of,
    lease_lags_by_kind,
    redis_pids,
    retry_gaps,
    server_infos,
)
from herdwick.loadtest.outcomes import History, Outcomes, drain, history_of, uuid7_floor
from herdwick.loadtest.report import Progress, add_report_flags, memory_line
from herdwick.loadtest.timeline import Timeline, leases_per_second
from herdwick.loadtest.writes import WriteProfile, after_move, profile, render_lines, snapshot
from herdwick.loadtest.writes import inserted as writes_settled
from herdwick.model import DEFAULT_RETRY, RetryPolicy
from herdwick.storage.db import Database
from herdwick.storage.hot import HotTier
from herdwick.storage.maintenance import ensure_partitions

WORKER_APP = "herdwick.loadtest.noop_worker:worker"
# --fail-first: a second attempt after a 1 s backoff, its delay drawn from [0.5, 1] s.
FAIL_FIRST_RETRY = RetryPolicy(max_attempts=2, backoff_seconds=1)

# The tool's own statements on its scratch database, as in loadtest/measure.py.
_XACTS_SQL = "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
_PARTITIONS_SQL = "SELECT count(*) FROM pg_inherits WHERE inhparent = 'executions'::regclass"
# INFO calls of server_counts and the write snapshots inside the window (Redis counts
# INFO among its commands).
_OWN_INFO_CALLS = 4
class Plan(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The flags' limits (those of `loadtest herd` where they share a name)."""

    jobs: Annotated[int, Meta(ge=0, le=10_000_000)] = 50_000
    tenants: Annotated[int, Meta(ge=1, le=1_000)] = 10
    due_in_s: Annotated[float, Meta(ge=1, le=600)] = 6.0
    rate: Annotated[float, Meta(ge=0, le=100_000)] = 0.0
    duration_s: Annotated[float, Meta(gt=0, le=3_600)] = 20.0
    delay_s: Annotated[float, Meta(ge=0.5, le=60)] = 2.5
    schedulers: Annotated[int, Meta(ge=1, le=16)] = 1
    timeout_s: Annotated[float, Meta(gt=0, le=3_600)] = 180.0
    cron: bool = False  # every job a cron job (loadtest/jobs.py cron_schedule)
    fail_first: bool = False  # every first attempt fails; each job retries once (FAIL_FIRST_RETRY)
    history_days: Annotated[int, Meta(ge=0, le=MAX_RETENTION_DAYS)] = 0  # past days' partitions


class Steady(msgspec.Struct, frozen=True, kw_only=True):
    rate_per_s: float
    duration_s: float
    delay_s: float  # each job is inserted (and notified) this long before it falls due
    jobs: int
    succeeded: int
    last_succeeded_after_last_due_s: float  # all had succeeded in Postgres by then
    lease_lag_ms: dict[str, float]
    generator_late_max_ms: float  # how far the generator's inserts fell behind its schedule


class Report(msgspec.Struct, kw_only=True):
    jobs: int  # the herd; 0 for a steady rate alone
    cron: bool = False  # cron jobs, each of whose next occurrence dispatch wrote
    history_days: int = 0  # past days' executions partitions added before the run
    partitions: int = 0  # executions partitions the database held when the run ended
    schedulers: int
    workers: int
    succeeded: int  # herd and steady
    # The herd's figures; None without a herd.
    last_succeeded_after_due_s: float | None
    jobs_per_s: float | None
    lease_lag_ms: dict[str, float] | None
    steady: Steady | None
    streams: StreamSamples
    redis_memory: RedisMemory  # from just before the move (or the steady start) to the end
    # Without the tool's own polls, samples and the steady jobs' inserts and notifies.
    pg_transactions_per_execution: float
    redis_commands_per_execution: float
    history: History
    # With --fail-first: executions whose first attempt failed, and from that failure to the
    # next attempt's lease, ms (min, p50, p99, max): the drawn delay, then how late it began.
    retried: int = 0
    retry_gap_ms: dict[str, float] | None = None
    # CPU seconds by kind of process (scheduler, worker, redis, postgres, harness) from just
    # before the move (or the steady start) until drained, and per execution in us.
    cpu: KindsCpu | None = None
    cpu_us_per_execution: dict[str, float] = {}
    peak_rss_mb: dict[str, float] = {}  # by kind: the largest one process reached (VmHWM)
    # Per second from the herd's due second (else the steady start): leases and their lag.
    timeline: Timeline | None = None
    # Rows by table, WAL and Redis commands and bytes per execution, from after the move
    # until the processes exited (loadtest/writes.py); a steady rate's inserts included.
    writes: WriteProfile | None = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--jobs", type=int, default=50_000,
      help="herd size, all due in one second; default 50000; 0 for a steady rate alone")
    a("--rate", type=float, default=0.0,
      help="steady jobs/s (as `loadtest herd --rate`), alone or beside the herd; default 0")
    a("--duration", type=float, default=20.0, help="seconds of the steady rate; default 20")
    a("--delay", type=float, default=2.5,
      help="steady jobs are inserted and notified this many seconds before due; "
      "default 2.5")
    a("--tenants", type=int, default=10, help="tenants the jobs are spread over; default 10")
    a("--schedulers", type=int, default=1, help="`herdwick scheduler` processes; default 1")
    a("--workers", type=int, default=2, help="`herdwick worker` processes; default 2")
    a("--concurrency", type=int, default=200,
      help="handlers per worker process; default 200")
    a("--cron", action="store_true",
      help="every job a cron job (hourly, Europe/London) whose first occurrence is its due "
      "time, so dispatch also computes and writes each one's next occurrence, as in a "
      "top-of-the-hour herd; default: one-off jobs")
    a("--fail-first", action="store_true",
      help="every job's first attempt fails (the handler raises) and its retry, 1 s of "
      "backoff later, succeeds: the report adds how long from each failure to its retry's "
      "lease; default: every attempt succeeds")
    a("--history-days", type=int, default=0, metavar="DAYS",
      help="give the scratch database the daily executions partitions of the DAYS before "
      "today, as a database keeping DAYS days of history hot has (retention keeps "
      f"{DEFAULT_RETENTION_DAYS} by default, and the schedulers keep at least DAYS), so each "
      "statement that finds executions by key pays for them as it would there; they stay "
      "empty; default 0")
    a("--due-in", type=float, default=6.0,
      help="seconds from the move to the due second; default 6")
    a("--timeout", type=float, default=180.0,
      help="give up waiting after this many seconds; default 180")
    a("--metrics-port", type=int, default=None, metavar="PORT",
      help="the schedulers serve Prometheus metrics on 127.0.0.1:PORT, PORT+1, ... and the "
      "workers on the ports after theirs, to watch during the run; default off")
    add_scratch_flags(parser)
    add_report_flags(parser)


def plan_from(args: argparse.Namespace) -> Plan:
    """The flags, checked."""
    try:
        plan = msgspec.convert(
            {"jobs": args.jobs, "tenants": args.tenants, "due_in_s": args.due_in,
             "rate": args.rate, "duration_s": args.duration, "delay_s": args.delay,
             "schedulers": args.schedulers, "timeout_s": args.timeout,
             "cron": args.cron, "fail_first": args.fail_first,
             "history_days": args.history_days}, Plan)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"loadtest e2e: {exc}") from None
    if plan.jobs == 0 and plan.rate == 0:
        raise ConfigError("loadtest e2e: nothing to run: give --jobs, --rate or both")
    last = (args.metrics_port or 1) + plan.schedulers + args.workers - 1
    if args.metrics_port is not None and not (1 <= args.metrics_port and last <= 65535):
        raise ConfigError(f"loadtest e2e: --metrics-port {args.metrics_port}: the processes "
                          f"need ports {args.metrics_port}..{last}, within 1..65535")
    return plan


def scheduler_settings(plan: Plan) -> dict[str, str]:
    """More HERDWICK_* variables for the schedulers: a retention that keeps the history
    the run was given (a pass may come round during a long run)."""
    if plan.history_days > DEFAULT_RETENTION_DAYS:
        return {"HERDWICK_RETENTION_DAYS": str(plan.history_days)}
    return {}


class ServerCounts(msgspec.Struct, frozen=True, kw_only=True):
    """Transactions committed in this run's database; commands the Redis server has run,
    and its PUBLISHes among them (only the steady jobs' notifies publish)."""

    xacts: int
    commands: int
    publishes: int

    def minus(self, before: ServerCounts) -> ServerCounts:
        return ServerCounts(xacts=self.xacts - before.xacts,
                            commands=self.commands - before.commands,
                            publishes=self.publishes - before.publishes)


async def server_counts(db: Database, client: aioredis.Redis) -> ServerCounts:
    async with db.connection() as conn:
        xacts = await conn.fetchval(_XACTS_SQL)
    infos = await server_infos(client, "commandstats")  # a cluster's primaries: their sum
    return ServerCounts(
        xacts=xacts,
        commands=sum(int(v["calls"]) for stats in infos for v in stats.values()),
        publishes=sum(int(stats.get("cmdstat_publish", {}).get("calls", 0)) for stats in infos))


async def run(args: argparse.Namespace, progress: Progress) -> Report:
    plan = plan_from(args)
    require_loopback(args.database_url, "--database-url")
    require_loopback(args.redis_url, "--redis-url")
    deadline = time.perf_counter() + plan.timeout_s
    async with scratch_prefix(args.redis_url, "e2e") as (client, prefix), \
            scratch_database(args.database_url, scratch_name("e2e"), args.keep,
                             progress.say) as dsn:
        # the steady generator inserts for every tenant at once, beside the polls
        db = await Database.connect(dsn, max_size=8 + plan.tenants)
        try:
            return await _measure(args, plan, db, dsn, client, prefix, deadline, progress)
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


async def _measure(args: argparse.Namespace, plan: Plan, db: Database, dsn: str,
                   client: aioredis.Redis, prefix: str, deadline: float,
                   progress: Progress) -> Report:
    pool = pool_names(1)[0]
    if plan.history_days:
        today = datetime.now(UTC).date()
        await ensure_partitions(db, today - timedelta(days=plan.history_days), plan.history_days)
    tenants = await create_tenants(db, plan.tenants)
    factory = JobFactory([pool], cron=plan.cron,
                         retry=FAIL_FIRST_RETRY if plan.fail_first else DEFAULT_RETRY)
    parked = await _insert_herd(db, plan, factory, tenants, progress)
    port = args.metrics_port
    if port is not None:
        progress.say(f"metrics: http://127.0.0.1:{port}/metrics (scheduler)"
                     + (f" ... :{port + plan.schedulers - 1}" if plan.schedulers > 1 else "")
                     + f", workers from :{port + plan.schedulers}")
    async with scheduler_processes(plan.schedulers, dsn, args.redis_url, prefix,
                                   ready_max="auto", metrics_port=port,
                                   **scheduler_settings(plan)) as procs, \
            worker_processes(args.workers, WORKER_APP, args.redis_url, prefix, pool,
                             args.concurrency,
                             metrics_port=None if port is None else port + plan.schedulers,
                             fail_first=plan.fail_first) as workers:
        await leases_settled(db, procs, deadline)
        await writes_settled(db, plan.jobs)  # before the window: the inserts' counters
        kinds = {"scheduler": [p.pid for p in procs], "worker": [w.pid for w in workers]}
        pids = await redis_pids(client)
        probe = KindsProbe({**kinds, **({"redis": pids} if pids else {})}, database_of(dsn))
        rss = {kind: ProcessProbe(pids) for kind, pids in kinds.items()}
        start = probe.read()
        before = await server_counts(db, client)
        sampler = StreamSampler(client, prefix, [pool])
        await sampler.baseline()
        steady_start = datetime.now(UTC)
        steady_from = uuid7_floor(steady_start)
        due = None
        written = await snapshot(db, client)
        if parked is not None:
            due = due_second(plan.due_in_s)
            moved = await move_herd(db, parked, due, jobs_too=True, hot=HotTier(client, prefix))
            written = await after_move(db, client, written, moved)
        background = Background(plan.rate, plan.duration_s, plan.delay_s, db,
                                HotTier(client, prefix), tenants, factory)
        outcomes = Outcomes(db, plan.jobs, steady_from)
        progress.set("draining", outcomes.detail,
                     done=lambda: outcomes.herd + outcomes.steady,
                     total=plan.jobs + round(plan.rate * plan.duration_s),
                     due_at=None if due is None else due.timestamp())
        await drain(outcomes, sampler, background, plan.rate, [*procs, *workers], deadline)
        cpu = KindsProbe.between(start, probe.read())
        peak_rss = {kind: round(max(p.high_water()) / 2**20, 1) for kind, p in rss.items()}
        await sampler.sample()  # the last one when all have succeeded: what is left behind
        spent = (await server_counts(db, client)).minus(before)
        lags = await lease_lags_by_kind(db, steady_from)
        history = await history_of(db)
        retried, gap = await retry_gaps(db) if plan.fail_first else (0, None)
        async with db.connection() as conn:
            partitions = await conn.fetchval(_PARTITIONS_SQL)
        origin = due or steady_start
        timeline = Timeline(
            origin=origin, x_label="s after the herd's due second" if due
            else "s after the steady load began",
            count_label="executions leased per second", lag_label="due -> lease lag, ms",
            series=await leases_per_second(db, {"herd": [t.tenant_id for t in tenants]},
                                           steady_from, origin.timestamp()))
    herd_lag, steady_lag = lags.get(False), lags.get(True)
    after_due = None if due is None else outcomes.herd_done_at - due.timestamp()
    executions = plan.jobs + background.made
    # The processes have exited, so their backends' table counters are all flushed.
    writes = await profile(db, written, await snapshot(db, client), executions,
                           sampler.commands + _OWN_INFO_CALLS)
    # Each steady insert is one insert_jobs transaction and one notify PUBLISH: the
    # gateway's work (loadtest submit measures it), not the pipeline's, so it is left
    # out, like the tool's own polls and samples.
    xacts = spent.xacts - outcomes.polls - spent.publishes
    commands = spent.commands - sampler.commands - spent.publishes
    return Report(
        jobs=plan.jobs, cron=plan.cron, history_days=plan.history_days, partitions=partitions,
        schedulers=plan.schedulers, workers=args.workers,
        succeeded=outcomes.herd + outcomes.steady,
        last_succeeded_after_due_s=None if after_due is None else round(after_due, 2),
        jobs_per_s=None if after_due is None else round(plan.jobs / after_due),
        lease_lag_ms=None if herd_lag is None else herd_lag.ms,
        steady=None if steady_lag is None else _steady(plan, outcomes, background, steady_lag),
        streams=sampler.streams(), redis_memory=sampler.memory(),
        pg_transactions_per_execution=round(xacts / executions, 3),
        redis_commands_per_execution=round(commands / executions, 3),
        history=history, retried=retried, retry_gap_ms=gap, cpu=cpu, peak_rss_mb=peak_rss,
        timeline=timeline,
        cpu_us_per_execution={kind: round(v * 1000, 1)
                              for kind, v in cpu.per_1000(executions).items()},
        writes=writes)


def _steady(plan: Plan, outcomes: Outcomes, background: Background, lag: LeaseLag) -> Steady:
    assert outcomes.steady_done_at is not None  # until_done returned
    return Steady(rate_per_s=plan.rate, duration_s=plan.duration_s, delay_s=plan.delay_s,
                  jobs=background.made, succeeded=outcomes.steady,
                  last_succeeded_after_last_due_s=round(
                      outcomes.steady_done_at - lag.last_due.timestamp(), 2),
                  lease_lag_ms=lag.ms,
                  generator_late_max_ms=round(background.late_max_s * 1000, 1))


def _lag_line(lag: dict[str, float]) -> str:
    return (f"    due -> lease lag ms: first {lag.get('first', '-')}  p50 {lag['p50']}  "
            f"p95 {lag['p95']}  p99 {lag['p99']}  max {lag['max']}")


def _cpu_lines(r: Report) -> list[str]:
    if r.cpu is None:
        return []
    c = r.cpu
    per = "  ".join(f"{k} {v:g}" for k, v in r.cpu_us_per_execution.items())
    total = round(sum(v for k, v in r.cpu_us_per_execution.items() if k != "harness"), 1)
    rss = "  ".join(f"{k} {v:g}" for k, v in r.peak_rss_mb.items())
    return [f"  CPU seconds over {c.window_s:.1f} s from the move until drained (machine "
            f"{c.machine_busy_share:.0%} busy, {c.others_s:.2f} s of it not this run's): "
            + "  ".join(f"{k} {s:.2f}" for k, s in c.seconds.items()),
            f"    per execution, us: {per}; {total} us without the harness",
            f"  peak RSS of one process, MB: {rss}"]


def render_text(r: Report) -> str:
    handler = ("a handler that fails each first attempt" if r.retry_gap_ms is not None
               else "a no-op handler")
    lines = [f"herdwick loadtest e2e: {r.schedulers} scheduler, {r.workers} worker "
             f"process(es) with {handler}; {r.succeeded} executions succeeded"]
    if r.history_days:
        lines += [f"  the database held {r.partitions} executions partitions, {r.history_days} "
                  "of them past days' (empty), as one keeping that much history does"]
    if r.lease_lag_ms is not None:
        lines += [f"  herd: {r.jobs} {'cron' if r.cron else 'one-off'} jobs due in one second",
                  f"    all succeeded in Postgres {r.last_succeeded_after_due_s} s after due "
                  f"({r.jobs_per_s:,} jobs/s end to end)", _lag_line(r.lease_lag_ms)]
    if (s := r.steady) is not None:
        lines += [f"  steady: {s.rate_per_s:g} jobs/s for {s.duration_s:g} s ({s.jobs} jobs), "
                  f"each inserted {s.delay_s:g} s before due; the generator at most "
                  f"{s.generator_late_max_ms} ms late",
                  f"    all {s.succeeded} succeeded in Postgres "
                  f"{s.last_succeeded_after_last_due_s} s after the last due time",
                  _lag_line(s.lease_lag_ms)]
    if (g := r.retry_gap_ms) is not None:
        lines += [f"  retries: {r.retried} first attempts failed; from the failure to the "
                  f"retry's lease, ms: min {g['min']}  p50 {g['p50']}  p99 {g['p99']}  "
                  f"max {g['max']} (the drawn delay alone: 500-1000)"]
    st = r.streams
    lines += _cpu_lines(r)
    lines += [
        f"  events stream length, sampled every {st.every_s:g} s ({st.samples} samples): "
        f"max {st.events_len_max}, last {st.events_len_last}",
        f"  ready stream, workers group lag: max {st.ready_lag_max}, last {st.ready_lag_last};"
        f" length max {st.ready_len_max}, last {st.ready_len_last}",
        memory_line(r.redis_memory),
        f"  per execution: {r.pg_transactions_per_execution} Postgres transactions (this "
        "database, idle shard loads included),",
        f"    {r.redis_commands_per_execution} Redis commands (server-wide); the tool's own "
        "polls and the steady jobs' inserts left out",
    ]
    lines += [] if r.writes is None else render_lines(r.writes)
    lines += [
        f"  history: {r.history.succeeded_without_start} succeeded without a start time, "
        f"{r.history.attempts_left_running} attempts left running"
        + ("" if r.history.sound else "  <- GAPS"),
    ]
    return "\n".join(lines)


async def command(args: argparse.Namespace) -> int:
    """`herdwick loadtest e2e`: progress on stderr, the report on stdout; 1 if the history
    has gaps. SIGTERM cancels the run like Ctrl-C does, so it cleans up either way."""
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    check_path(args.report)
    started = datetime.now(UTC)
    progress = Progress.of_args(args, "e2e")
    async with running(progress.run()):
        report = await run(args, progress)
    text = render_text(report)
    print(msgspec.json.encode(report).decode() if args.json else text)
    write_report(args, "loadtest e2e", report, text, headline(report), report.timeline, started)
    return 0 if report.history.sound else 1


def headline(r: Report) -> list[tuple[str, str]]:
    """The figures a reader looks for first, as the text says them."""
    found = [("executions succeeded", f"{r.succeeded:,}")]
    if r.lease_lag_ms is not None:
        found += [("herd: all succeeded after due", f"{r.last_succeeded_after_due_s} s"),
                  ("herd: jobs/s end to end", f"{r.jobs_per_s:,}"),
                  ("herd: due -> lease p50 / p99 / max ms", _lags(r.lease_lag_ms))]
    if (s := r.steady) is not None:
        found += [("steady: rate", f"{s.rate_per_s:g} jobs/s for {s.duration_s:g} s"),
                  ("steady: due -> lease p50 / p99 / max ms", _lags(s.lease_lag_ms))]
    if (g := r.retry_gap_ms) is not None:
        found += [("retries: failure -> retry's lease p50 / p99 / max ms",
                   f"{g['p50']} / {g['p99']} / {g['max']}")]
    if r.cpu_us_per_execution:
        found += [("CPU per execution, us (scheduler / worker / redis / postgres)",
                   " / ".join(f"{r.cpu_us_per_execution.get(k, 0):g}"
                              for k in ("scheduler", "worker", "redis", "postgres")))]
    return [*found, ("history", "sound" if r.history.sound else "GAPS")]


def _lags(lag: dict[str, float]) -> str:
    return f"{lag['p50']} / {lag['p99']} / {lag['max']}"
