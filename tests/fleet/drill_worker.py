"""The failover drill's SDK worker: `herdwick worker tests.fleet.drill_worker:worker`.

Unlike the fault scenarios' worker it counts what it runs, in Redis under the test's key
prefix (keys of the drill's own, not herdwick's): after a failover Postgres cannot show
work done under an execution the new primary never heard of (its dispatch committed on
the old primary and never reached the standby), and these counts can. Configured by
loadtest's worker variables (loadtest/driver.py).
"""

from __future__ import annotations

import asyncio
import os

import redis.asyncio as aioredis

from herdwick.worker import Context, Worker

HANDLER_S = 0.02

_url = os.environ.get("HW_LOADTEST_REDIS_URL", "redis://127.0.0.1:6379/0")
_prefix = os.environ.get("HW_LOADTEST_PREFIX", "hw")
worker = Worker(_url, os.environ.get("HW_LOADTEST_POOL", "drill"),
                concurrency=int(os.environ.get("HW_LOADTEST_CONCURRENCY", "50")),
                key_prefix=_prefix, lease_s=5.0, grace_s=1.0)
_counts = aioredis.from_url(_url)


def runs_key(prefix: str) -> str:
    """Hash: occurrence (job_id:scheduled_for) -> how many attempts of it ran."""
    return f"{prefix}:drill:runs"


def executions_key(prefix: str) -> str:
    """Set: every execution id a handler ran."""
    return f"{prefix}:drill:executions"


@worker.handler
async def work(ctx: Context) -> None:
    await asyncio.sleep(HANDLER_S)
    async with _counts.pipeline(transaction=False) as pipe:
        pipe.hincrby(runs_key(_prefix), ctx.idempotency_key, 1)
        pipe.sadd(executions_key(_prefix), ctx.execution_id)
        await pipe.execute()
