"""Helpers for tests that drive the scheduler tier: move time, read streams, submit."""

from __future__ import annotations

from datetime import datetime

from herdwick.actors.base import Tick, sync
from herdwick.actors.scheduler import Scheduler
from herdwick.actors.sweeper import RECOVERY_GRACE_S
from herdwick.gateway.submit import prepare
from herdwick.model import JobSpec, Schedule, Target
from herdwick.storage import keys
from herdwick.storage.jobs import NewJob
from tests.integration.conftest import Api, make_job


async def ready(redis_client, key_prefix: str, pool: str = "emails") -> list[dict]:
    entries = await redis_client.xrange(keys.ready_stream(key_prefix, pool))
    return [{k.decode(): v.decode() for k, v in fields.items()} for _, fields in entries]


async def submit(api: Api, key: str | None = None, **overrides) -> dict:
    """A valid job (make_job with `overrides`) as the default tenant, or `key`'s; its 201."""
    resp = await api.submit(make_job(**overrides), key=key)
    assert resp.status == 201, await resp.text()
    return await resp.json()


async def advance(clock, seconds: float, *nodes: Scheduler) -> None:
    """Move time as it really passes: in steps, each node's coordinator renewing its leases."""
    while seconds > 0:
        step = min(seconds, 3.0)
        clock.advance(step)
        seconds -= step
        await tick(*nodes)


async def tick(*nodes: Scheduler) -> None:
    """One coordinator pass on each node, in order."""
    for node in nodes:
        await node.coordinator.send(Tick())
        await sync(node.coordinator)


def queue_job(when: datetime, now: datetime) -> NewJob:
    """A one-off queue job due at `when`, prepared as a submit at `now` would."""
    spec = JobSpec(name="n", target=Target(type="queue", ref="emails"),
                   schedule=Schedule(run_at=when))
    prepared = prepare(spec, now=now, allow=())
    assert prepared.job is not None, prepared.errors
    return prepared.job


async def sweep_after_redis_lost(node: Scheduler, redis_client, key_prefix: str,
                                 clock) -> int:
    """The hot tier loses this test's keys (the server is shared); the sweeper sees the
    loss, gives the workers their grace, then republishes. Returns what its first pass
    did (the loss seen: nothing yet)."""
    await redis_client.delete(*[k async for k in redis_client.scan_iter(f"{key_prefix}:*")])
    clock.advance(60)
    first = await node.sweeper.run_once()
    clock.advance(RECOVERY_GRACE_S)
    await node.sweeper.run_once()
    await node.settle()  # the pool queue publishes what the sweeper handed it
    return first
