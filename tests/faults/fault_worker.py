"""The fault scenarios' SDK worker: `herdwick worker tests.faults.fault_worker:worker`.

The history it is judged by is what the protocol wrote; given HW_FAULT_STARTS (a
directory), each handler also notes that it began (`execution_id attempt`, a file per
process): its one side effect, which is what a possible duplicate is about. Each
handler takes 50-200 ms (a stable hash of the execution id picks where in the range),
so a process killed or stopped during a herd has handlers in the middle of their work.
Configured from the environment its process is started with: loadtest's worker
variables (loadtest/driver.py) plus the lease and the handler's range.
"""

from __future__ import annotations

import asyncio
import os
import zlib

from herdwick.worker import Context, Worker

LEASE_S_ENV = "HW_FAULT_LEASE_S"
HANDLER_MS_ENV = "HW_FAULT_HANDLER_MS"  # "low,high"
STARTS_ENV = "HW_FAULT_STARTS"

_low_ms, _high_ms = (float(v) for v in os.environ.get(HANDLER_MS_ENV, "50,200").split(","))

worker = Worker(os.environ.get("HW_LOADTEST_REDIS_URL", "redis://127.0.0.1:6379/0"),
                os.environ.get("HW_LOADTEST_POOL", "faults"),
                concurrency=int(os.environ.get("HW_LOADTEST_CONCURRENCY", "50")),
                key_prefix=os.environ.get("HW_LOADTEST_PREFIX", "hw"),
                lease_s=float(os.environ.get(LEASE_S_ENV, "5")), grace_s=1.0)

_starts = (open(os.path.join(os.environ[STARTS_ENV], str(os.getpid())), "a", buffering=1)
           if os.environ.get(STARTS_ENV) else None)


def handler_s(execution_id: str) -> float:
    spread = zlib.crc32(execution_id.encode()) % 1000 / 1000
    return (_low_ms + (_high_ms - _low_ms) * spread) / 1000


@worker.handler
async def work(ctx: Context) -> None:
    if _starts is not None:
        _starts.write(f"{ctx.execution_id} {ctx.attempt}\n")
    await asyncio.sleep(handler_s(ctx.execution_id))
