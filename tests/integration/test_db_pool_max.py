"""HERDWICK_DB_POOL_MAX: a process's cap on its Postgres connections (docs/reference.md)."""

from __future__ import annotations

import asyncio
import os
import sys
from datetime import UTC, datetime

import pytest

from herdwick.actors.scheduler import Scheduler
from herdwick.clock import ManualClock
from herdwick.config import MIN_DB_POOL_MAX, ConfigError, from_env
from herdwick.gateway.context import CTX
from herdwick.storage.protocol import Protocol
from tests.integration.conftest import tenant_api
from tests.integration.stack import advance, ready

POOL = "emails"
JOBS = 60


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(datetime.now(UTC).replace(microsecond=0))


@pytest.mark.parametrize("value", ["3", "0", "1001", "many", "2.5"])
def test_an_invalid_db_pool_max_is_refused(value: str) -> None:
    with pytest.raises(ConfigError, match="HERDWICK_DB_POOL_MAX"):
        from_env({"HERDWICK_DB_POOL_MAX": value})


async def test_the_scheduler_refuses_to_start_with_a_db_pool_max_not_a_number() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "herdwick.cli", "scheduler", "--db-pool-max", "lots",
        env=os.environ, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2
    assert "--db-pool-max must be a whole number" in err.decode()


async def test_a_gateway_and_scheduler_at_the_floor_carry_jobs_to_the_end(
        db_url, services, redis_client, key_prefix, clock) -> None:
    settings = from_env({"HERDWICK_DB_POOL_MAX": str(MIN_DB_POOL_MAX),
                         "HERDWICK_DATABASE_URL": db_url,
                         "HERDWICK_REDIS_URL": services.redis_url,
                         "HERDWICK_KEY_PREFIX": key_prefix})
    async with tenant_api(db_url, services.redis_url, key_prefix, clock,
                          db_pool_max=settings.db_pool_max) as api:
        gateway_pool = api.client.server.app[CTX].db.pool
        jobs = [{"name": f"j{i}", "target": {"type": "queue", "ref": POOL},
                 "schedule": {"delaySeconds": 1}} for i in range(JOBS)]
        resp = await api.client.post("/v1/jobs:batch", json={"jobs": jobs}, headers=api.auth())
        assert resp.status == 201, await resp.text()
        node = await Scheduler(settings, clock=clock, redis=redis_client, tick=False).start()
        try:
            assert (node.db.pool.get_max_size(), gateway_pool.get_max_size()) == \
                (MIN_DB_POOL_MAX, MIN_DB_POOL_MAX)
            await advance(clock, 2, node)
            await node.settle()
            published = await ready(redis_client, key_prefix)
            assert len(published) == JOBS
            protocol = Protocol(redis_client, key_prefix)
            for entry in published:
                eid, attempt = entry["execution_id"], int(entry["attempt"])
                assert await protocol.lease(POOL, "w", 30, eid, attempt) is not None
                assert await protocol.complete(POOL, eid, attempt, "w", "{}")
            await node.settle_events()
            async with node.db.connection() as conn:
                states = await conn.fetch("SELECT state, count(*) FROM executions GROUP BY 1")
            assert {r["state"]: r["count"] for r in states} == {"succeeded": JOBS}
            assert node.db.pool.get_size() <= MIN_DB_POOL_MAX
        finally:
            await node.stop()
