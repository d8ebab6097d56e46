"""A no-op SDK worker for `herdwick loadtest e2e`: `herdwick worker loadtest.noop_worker:worker`.

Configured from the environment the load test sets for its worker processes
(loadtest/driver.py, worker_processes).
"""

from __future__ import annotations

import os

from herdwick.worker import Context, Worker

worker = Worker(os.environ.get("HW_LOADTEST_REDIS_URL", "redis://127.0.0.1:6379/0"),
                os.environ.get("HW_LOADTEST_POOL", "loadtest-0"),
                concurrency=int(os.environ.get("HW_LOADTEST_CONCURRENCY", "200")),
                key_prefix=os.environ.get("HW_LOADTEST_PREFIX", "hw"))


# `loadtest e2e --fail-first`: each first attempt fails, so every job runs a retry.
FAIL_FIRST = os.environ.get("HW_LOADTEST_FAIL_FIRST") == "1"


@worker.handler
async def noop(ctx: Context) -> None:
    if FAIL_FIRST and ctx.attempt == 1:
        raise RuntimeError("a first attempt fails (loadtest e2e --fail-first)")
    return None
