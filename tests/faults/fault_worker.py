"""The fault scenarios' SDK worker: `herdwick worker tests.faults.fault_worker:worker`.

It records nothing of its own: whatever the history shows is what the
protocol wrote. Each handler takes 50-200 ms (a stable hash of the execution
id picks where in the range), so a process killed or stopped during a herd
has handlers in the middle of their work. Configured from the environment
its process is started with: loadtest's worker variables (loadtest/driver.py)
plus the lease and the handler's range.
"""

from __future__ import annotations

import asyncio
import os
import zlib

from herdwick.worker import Context, Worker

LEASE_S_ENV = "HW_FAULT_LEASE_S"
HANDLER_MS_ENV = "HW_FAULT_HANDLER_MS"  # "low,high"

_low_ms, _high_ms = (float(v) for v in os.environ.get(HANDLER_MS_ENV, "50,200").split(","))

worker = Worker(os.environ.get("HW_LOADTEST_REDIS_URL", "redis://127.0.0.1:6379/0"),
                os.environ.get("HW_LOADTEST_POOL", "faults"),
                concurrency=int(os.environ.get("HW_LOADTEST_CONCURRENCY", "50")),
                key_prefix=os.environ.get("HW_LOADTEST_PREFIX", "hw"),
                lease_s=float(os.environ.get(LEASE_S_ENV, "5")), grace_s=1.0)


def handler_s(execution_id: str) -> float:
    spread = zlib.crc32(execution_id.encode()) % 1000 / 1000
    return (_low_ms + (_high_ms - _low_ms) * spread) / 1000


@worker.handler
async def work(ctx: Context) -> None:
    await asyncio.sleep(handler_s(ctx.execution_id))
