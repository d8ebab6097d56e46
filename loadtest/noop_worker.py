"""A no-op SDK worker for `herdwick loadtest e2e`: `herdwick worker loadtest.noop_worker:worker`.

Configured from the environment the load test sets for its worker processes.
"""

from __future__ import annotations

import os

from herdwick.worker import Context, Worker

worker = Worker(os.environ.get("HW_E2E_REDIS_URL", "redis://127.0.0.1:6379/0"),
                os.environ.get("HW_E2E_POOL", "loadtest-0"),
                concurrency=int(os.environ.get("HW_E2E_CONCURRENCY", "200")),
                key_prefix=os.environ.get("HW_E2E_PREFIX", "hw"))


@worker.handler
async def noop(ctx: Context) -> None:
    return None
