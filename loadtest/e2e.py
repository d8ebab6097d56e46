"""`herdwick loadtest e2e`: a herd through real SDK workers to outcomes committed in Postgres.

Due -> published -> leased by `herdwick worker` processes running a no-op
handler -> completed -> applied by the execution-event actor. Reports the
time until every execution has succeeded in Postgres, due->lease lag (from
the lease time Redis stamped on each attempt), and Postgres transactions
and Redis commands per execution (this run's database and the whole Redis
server: keep the machine otherwise quiet).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import secrets
import sys
import time
from datetime import UTC, datetime

import msgspec
import redis.asyncio as aioredis

from loadtest.common import require_loopback
from loadtest.herd import (
    PARK_AHEAD,
    JobFactory,
    Progress,
    create_tenants,
    delete_keys,
    herd_batches,
    insert_batches,
    leases_settled,
    move_herd,
    pool_names,
    scheduler_processes,
    scratch_database,
    tenant_counts,
)
from storage.db import Database

POLL_S = 0.1
_LAG_SQL = """
SELECT percentile_disc(ARRAY[0.5, 0.95, 0.99, 1.0]) WITHIN GROUP (
           ORDER BY extract(epoch FROM started_at - scheduled_for) * 1000)
FROM executions WHERE started_at IS NOT NULL"""
_DONE_SQL = "SELECT count(*) FILTER (WHERE state = 'succeeded'), count(*) FROM executions"
_XACTS_SQL = "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"


class Report(msgspec.Struct, kw_only=True):
    jobs: int
    schedulers: int
    workers: int
    succeeded: int
    last_succeeded_after_due_s: float
    jobs_per_s: float
    lease_lag_ms: dict[str, float]
    pg_transactions_per_execution: float
    redis_commands_per_execution: float


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--jobs", type=int, default=50_000, help="herd size, all due in one second")
    a("--tenants", type=int, default=10)
    a("--schedulers", type=int, default=1)
    a("--workers", type=int, default=2, help="`herdwick worker` processes")
    a("--concurrency", type=int, default=200, help="handlers per worker process")
    a("--due-in", type=float, default=6.0, help="seconds from the move to the due second")
    a("--timeout", type=float, default=180.0)
    a("--database-url", default=os.environ.get("HERDWICK_DATABASE_URL",
                                               "postgresql://postgres@127.0.0.1:5432/postgres"))
    a("--redis-url", default=os.environ.get("HERDWICK_REDIS_URL", "redis://127.0.0.1:6379/0"))
    a("--json", action="store_true")


@contextlib.asynccontextmanager
async def worker_processes(count: int, redis_url: str, prefix: str, pool: str,
                           concurrency: int):
    env = {**os.environ, "HW_E2E_REDIS_URL": redis_url, "HW_E2E_PREFIX": prefix,
           "HW_E2E_POOL": pool, "HW_E2E_CONCURRENCY": str(concurrency)}
    procs = [await asyncio.create_subprocess_exec(
        sys.executable, "-m", "herdwick.cli", "worker", "loadtest.noop_worker:worker",
        env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        for _ in range(count)]
    try:
        yield procs
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.terminate()
        for proc in procs:
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def _commands(client: aioredis.Redis) -> int:
    stats = await client.info("commandstats")
    return sum(int(v["calls"]) for v in stats.values())


async def _until_done(db: Database, jobs: int, deadline: float, progress: Progress) -> float:
    while True:
        async with db.connection() as conn:
            done, total = await conn.fetchrow(_DONE_SQL)
        progress.set("e2e", lambda d=done, t=total: f"succeeded {d}/{jobs} (executions {t})")
        if done >= jobs:
            return time.time()
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {done} of {jobs} succeeded before the timeout")
        await asyncio.sleep(POLL_S)


async def run(args: argparse.Namespace, progress: Progress) -> Report:
    require_loopback(args.database_url, "--database-url")
    require_loopback(args.redis_url, "--redis-url")
    prefix, name = f"hwe2e{secrets.token_hex(4)}", f"hw_e2e_{secrets.token_hex(5)}"
    pool = pool_names(1)[0]
    deadline = time.monotonic() + args.timeout
    client = aioredis.from_url(args.redis_url)
    try:
        async with scratch_database(args.database_url, name, False, progress) as dsn:
            db = await Database.connect(dsn, max_size=8)
            try:
                return await _measure(args, db, dsn, client, prefix, pool, deadline, progress)
            finally:
                await db.close()
    finally:
        await delete_keys(client, prefix)
        await client.aclose()


async def _measure(args, db, dsn, client, prefix, pool, deadline, progress) -> Report:
    tenants = await create_tenants(db, args.tenants)
    parked = (datetime.now(UTC) + PARK_AHEAD).replace(microsecond=0)
    batches = herd_batches(JobFactory([pool]), tenants,
                           tenant_counts(args.jobs, args.tenants, 0.0), parked)
    progress.set("insert")
    await insert_batches(db, batches, 4, lambda n: None)
    async with scheduler_processes(args.schedulers, dsn, args.redis_url, prefix) as procs, \
            worker_processes(args.workers, args.redis_url, prefix, pool, args.concurrency):
        await leases_settled(db, procs, deadline)
        async with db.connection() as conn:
            xacts0 = await conn.fetchval(_XACTS_SQL)
        commands0 = await _commands(client)
        due = datetime.fromtimestamp(math.ceil(time.time() + args.due_in), UTC)
        await move_herd(db, parked, due)
        finished = await _until_done(db, args.jobs, deadline, progress)
        async with db.connection() as conn:
            xacts = await conn.fetchval(_XACTS_SQL) - xacts0
            lags = await conn.fetchval(_LAG_SQL)
        commands = await _commands(client) - commands0
    after_due = finished - due.timestamp()
    return Report(jobs=args.jobs, schedulers=args.schedulers, workers=args.workers,
                  succeeded=args.jobs, last_succeeded_after_due_s=round(after_due, 2),
                  jobs_per_s=round(args.jobs / after_due),
                  lease_lag_ms=dict(zip(("p50", "p95", "p99", "max"),
                                        [round(float(v)) for v in lags], strict=True)),
                  pg_transactions_per_execution=round(xacts / args.jobs, 3),
                  redis_commands_per_execution=round(commands / args.jobs, 3))


def _text(r: Report) -> str:
    lag = r.lease_lag_ms
    return "\n".join([
        f"herdwick loadtest e2e: {r.jobs} jobs due in one second; {r.schedulers} scheduler, "
        f"{r.workers} worker process(es) with a no-op handler",
        f"  all {r.succeeded} succeeded in Postgres {r.last_succeeded_after_due_s} s after due "
        f"({r.jobs_per_s:,} jobs/s end to end)",
        f"  due -> lease lag ms: p50 {lag['p50']}  p95 {lag['p95']}  p99 {lag['p99']}  "
        f"max {lag['max']}",
        f"  per execution: {r.pg_transactions_per_execution} Postgres transactions (whole "
        f"run, this database), {r.redis_commands_per_execution} Redis commands (server-wide)",
    ])


async def command(args: argparse.Namespace) -> int:
    progress = Progress(sys.stderr)
    ticker = asyncio.create_task(progress.run())
    try:
        report = await run(args, progress)
    finally:
        ticker.cancel()
    print(msgspec.json.encode(report).decode() if args.json else _text(report))
    return 0
