"""An SDK worker whose handler takes a set time, for `herdwick loadtest noisy-neighbour`:
`herdwick worker herdwick.loadtest.sleep_worker:worker`.

The handler awaits asyncio.sleep, so a process's capacity is concurrency /
handler time, not its CPU: the workers are the bottleneck the scenario
wants. Configured from the environment the load test sets for its worker
processes (loadtest/driver.py, worker_processes).
"""

from __future__ import annotations

import asyncio
import os

from herdwick.worker import Context, Worker

HANDLER_S = float(os.environ.get("HW_LOADTEST_HANDLER_MS", "40")) / 1000

worker = Worker(os.environ.get("HW_LOADTEST_REDIS_URL", "redis://127.0.0.1:6379/0"),
                os.environ.get("HW_LOADTEST_POOL", "loadtest-0"),
                concurrency=int(os.environ.get("HW_LOADTEST_CONCURRENCY", "100")),
                key_prefix=os.environ.get("HW_LOADTEST_PREFIX", "hw"))


@worker.handler
async def sleep(ctx: Context) -> None:
    await asyncio.sleep(HANDLER_S)
