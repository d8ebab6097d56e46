"""The raw limit `loadtest http --raw-limit` stands its figures beside: the http pool alone.

The same herd's deliveries, published straight onto the `http` pool's ready stream
(HotTier.publish, as a scheduler would) in a key prefix of their own, with the
tenant's signing keys in Redis and no scheduler or Postgres behind them: one
`herdwick http-worker` with the run's flags and one receiver, timed from the
worker's start until the stream is drained (nothing undelivered, pending or
leased); its CPU includes its start-up. What that reaches is what the http
worker does when the rest of the pipeline costs it nothing.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import msgspec
import psutil

from herdwick.loadtest.driver import (
    free_port,
    http_worker_processes,
    receiver_processes,
    scratch_prefix,
)
from herdwick.loadtest.measure import cpu_s
from herdwick.signing import SigningKeys
from herdwick.storage import keys, signing
from herdwick.storage.hot import HotTier, ReadyExecution

PUBLISH_BATCH = 5_000
POLL_S = 0.02


class RawHttp(msgspec.Struct, frozen=True, kw_only=True):
    deliveries: int
    drained_s: float  # from the worker's start to the drained stream
    callbacks_per_s: float
    worker_cpu_per_1000_s: float
    receiver_cpu_per_1000_s: float


async def raw_http(redis_url: str, jobs: int, worker_flags: list[str],
                   record_dir: str) -> RawHttp:
    async with scratch_prefix(redis_url, "httpraw") as (client, prefix):
        hot = HotTier(client, prefix)
        await hot.load_functions()
        await hot.ensure_group("http")
        tenant = str(uuid.uuid4())
        await signing.publish(client, prefix, {tenant: SigningKeys(current="whsec_raw")})
        port = free_port()
        url = f"http://127.0.0.1:{port}/hook"
        items = [ReadyExecution(execution_id=str(uuid.uuid4()), attempt=1,
                                job_id=str(uuid.uuid4()), tenant_id=tenant,
                                scheduled_for="2026-12-04T00:00:00Z", payload='{"n": 1}',
                                timeout_seconds=30, target=url) for _ in range(jobs)]
        for start in range(0, jobs, PUBLISH_BATCH):
            await hot.publish({"http": items[start:start + PUBLISH_BATCH]})
        async with receiver_processes([port], record_dir) as receivers, \
                http_worker_processes(1, redis_url, prefix, "127.0.0.0/8",
                                      worker_flags) as workers:
            began = time.perf_counter()  # it has started: its read loop is next
            await _drained(client, prefix)
            took = time.perf_counter() - began
            worker_cpu = cpu_s(psutil.Process(workers[0].pid).cpu_times())
            receiver_cpu = cpu_s(psutil.Process(receivers[0].pid).cpu_times())
    return RawHttp(deliveries=jobs, drained_s=round(took, 2),
                   callbacks_per_s=round(jobs / took),
                   worker_cpu_per_1000_s=round(worker_cpu / jobs * 1000, 3),
                   receiver_cpu_per_1000_s=round(receiver_cpu / jobs * 1000, 3))


async def _drained(client, prefix: str) -> None:
    stream = keys.ready_stream(prefix, "http")
    leases = keys.leases_zset(prefix, "http")
    while True:
        groups = await client.xinfo_groups(stream)
        mine = next(g for g in groups if g["name"] in (b"workers", "workers"))
        if mine["lag"] == 0 and mine["pending"] == 0 and await client.zcard(leases) == 0:
            return
        await asyncio.sleep(POLL_S)
