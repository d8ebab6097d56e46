"""History reads from a streaming replica, and the staleness rule (docs/operations.md,
"Read replicas"), against a real primary and standby (tests/fleet/postgres_pair.py).

A tenant reads its own writes right after their 201, whatever the replica is doing:
with the standby's replay paused, the tenant that wrote is answered by the primary while
another tenant, with nothing newer than the replica has, is answered by the replica,
until the replica falls further behind than the lag bound. A replica that is down, a
read that fails on it, a Redis that does not answer and a write mark Redis refuses all
end on the primary, never on a stale answer.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import asyncpg
import pytest
import redis.asyncio as aioredis
from aiohttp.test_utils import TestClient
from prometheus_client import REGISTRY

from herdwick.errors import NotFound
from herdwick.gateway.context import CTX
from herdwick.gateway.reads import HISTORY_MARGIN_S, ReadRouter
from herdwick.model import TenantSpec
from herdwick.storage.db import Database
from herdwick.storage.jobs import get_job
from herdwick.storage.replicas import Replicas, name_of
from herdwick.storage.tenants import create_tenant
from herdwick.storage.write_marks import WriteMarks
from tests.faults.redis_server import RedisServer
from tests.fleet.postgres_pair import PostgresPair, bin_dir
from tests.integration.conftest import make_job
from tests.integration.gateway_client import ADMIN_TOKEN, start_client

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("fleet")]

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
MAX_LAG_S = 3.0  # short, so that "beyond the bound" comes within the test
WAIT_S = 10.0


def reads(server: str, reason: str) -> float:
    return REGISTRY.get_sample_value("herdwick_api_reads_total",
                                     {"server": server, "reason": reason}) or 0.0


def marks_failed() -> float:
    return REGISTRY.get_sample_value("herdwick_write_marks_failed_total") or 0.0


async def until(check: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(0.02)


class Tenant:
    def __init__(self, client: TestClient, key: str) -> None:
        self.client, self.key = client, key

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    async def submit(self, **fields) -> str:
        resp = await self.client.post("/v1/jobs", json=make_job(**fields), headers=self.auth)
        assert resp.status == 201, await resp.text()
        return (await resp.json())["jobId"]

    async def job(self, job_id: str) -> dict:
        resp = await self.client.get(f"/v1/jobs/{job_id}", headers=self.auth)
        assert resp.status == 200, await resp.text()
        return await resp.json()

    async def job_names(self) -> list[str]:
        resp = await self.client.get("/v1/jobs", headers=self.auth)
        assert resp.status == 200, await resp.text()
        return [j["name"] for j in (await resp.json())["items"]]


@asynccontextmanager
async def gateway(pair: PostgresPair, redis_url: str, prefix: str,
                  clock) -> AsyncIterator[tuple[TestClient, ReadRouter]]:
    """A gateway on the pair's primary with its standby as read replica; returns once it
    trusts the replica."""
    client = await start_client(pair.primary_dsn, redis_url, prefix, clock,
                                read_database_url=pair.standby_dsn, read_max_lag_s=MAX_LAG_S)
    try:
        router = client.server.app[CTX].reads
        assert router is not None
        await until(lambda: router.replicas.replicas[0].up, "the replica is trusted")
        yield client, router
    finally:
        await client.close()


async def tenant(client: TestClient, name: str) -> Tenant:
    made = await client.post("/v1/tenants", json={"name": name}, headers=ADMIN)
    assert made.status == 201, await made.text()
    return Tenant(client, (await made.json())["apiKey"])


async def whole_pass(router: ReadRouter) -> None:
    """A sampling pass that began after this call has finished."""
    await router.replicas.next_pass()
    await router.replicas.next_pass()


async def replica_has_all_before(router: ReadRouter, moment: float) -> None:
    """Until the gateway knows its replica misses no commit made before `moment`."""
    [replica] = router.replicas.replicas
    await until(lambda: replica.up and (replica.fresh_at or 0) > moment,
                "the replica has caught up, as the gateway sees it")


async def test_a_tenant_reads_its_own_write_while_the_replica_stands_still(
        pair, services, key_prefix, clock) -> None:
    replica = name_of(pair.standby_dsn)
    async with gateway(pair, services.redis_url, key_prefix, clock) as (client, router):
        writer, other = await tenant(client, "writer"), await tenant(client, "other")
        theirs = await other.submit(name="before-the-pause")
        await replica_has_all_before(router, time.monotonic())
        await pair.pause_replay()

        # The writer's submit answers 201; its reads right after, through the same or any
        # other gateway, find the job: the replica does not have it, so the primary answers.
        own_before = reads("primary", "own_write")
        mine = await writer.submit(name="after-the-pause")
        written = time.monotonic()
        assert (await writer.job(mine))["name"] == "after-the-pause"
        assert await writer.job_names() == ["after-the-pause"]
        assert reads("primary", "own_write") == own_before + 2

        # Another tenant wrote nothing the replica lacks: the replica answers it, with the
        # replica's data. A change made on the primary since the pause is not there yet.
        primary = await asyncpg.connect(pair.primary_dsn)
        try:
            await primary.execute("UPDATE jobs SET name = 'renamed' WHERE job_id = $1::uuid",
                                  theirs)
        finally:
            await primary.close()
        fresh_before = reads(replica, "fresh")
        assert (await other.job(theirs))["name"] == "before-the-pause"
        assert reads(replica, "fresh") == fresh_before + 1

        # Past the lag bound the replica serves no one: the primary answers, up to date.
        await until(lambda: not router.replicas.fresh_since(time.monotonic() - MAX_LAG_S),
                    f"the paused replica is more than {MAX_LAG_S} s behind")
        lagging_before = reads("primary", "no_replica")
        assert (await other.job(theirs))["name"] == "renamed"
        assert reads("primary", "no_replica") == lagging_before + 1

        # Replay resumes: once the replica has the writer's write, it answers the writer too.
        await pair.resume_replay()
        await replica_has_all_before(router, written)
        fresh_before = reads(replica, "fresh")
        assert (await writer.job(mine))["name"] == "after-the-pause"
        assert reads(replica, "fresh") == fresh_before + 1


async def test_a_replica_that_is_down_leaves_every_read_to_the_primary(
        pair, services, key_prefix, clock) -> None:
    async with gateway(pair, services.redis_url, key_prefix, clock) as (client, router):
        someone = await tenant(client, "someone")
        job_id = await someone.submit(name="kept")
        pair.stop_standby()
        await whole_pass(router)
        assert not router.replicas.replicas[0].up
        before = reads("primary", "no_replica")
        assert (await someone.job(job_id))["name"] == "kept"
        assert await someone.job_names() == ["kept"]
        executions = await client.get(f"/v1/jobs/{job_id}/executions", headers=someone.auth)
        assert executions.status == 200
        assert reads("primary", "no_replica") == before + 3

        # It comes back: trusted again once it streams and has caught up.
        await pair.start_standby()
        await until(lambda: router.replicas.replicas[0].up, "the replica is trusted again")


async def test_a_read_that_fails_on_the_replica_is_answered_by_the_primary(
        pair, redis_client, key_prefix, clock) -> None:
    """Between two sampling passes the replica dies: the read that meets it goes to the
    primary, and the replica serves nothing more until a pass finds it sound."""
    primary = await Database.connect(pair.primary_dsn, min_size=1, max_size=2)
    replicas = await Replicas.connect(primary, [pair.standby_dsn], history_s=10.0)
    try:
        router = ReadRouter(primary, replicas, WriteMarks(redis_client, key_prefix),
                            max_lag_s=5.0)
        tenant_id = (await create_tenant(primary, TenantSpec(name="t"), clock.now())).tenant_id
        job_id = uuid.uuid4()
        await pair.caught_up()
        await replicas.run_once(time.monotonic())
        await replicas.run_once(time.monotonic())
        [replica] = replicas.replicas
        assert replica.up and replica.fresh_at is not None
        pair.stop_standby()  # and no pass notices before the read

        failed_before = reads("primary", "replica_failed")
        with pytest.raises(NotFound):  # the primary's answer: no such job
            await router.run(tenant_id, lambda db: get_job(db, tenant_id, job_id))
        assert reads("primary", "replica_failed") == failed_before + 1
        assert not replica.up
    finally:
        await replicas.close()
        await primary.close()


@pytest.fixture
async def impatient_pair() -> AsyncIterator[PostgresPair]:
    """A standby that cancels a query in the way of replay after 100 ms (the default is
    30 s): a hot standby's recovery conflicts, soon."""
    if bin_dir() is None:
        pytest.skip("no PostgreSQL binaries in /usr/lib/postgresql/*/bin")
    started = await PostgresPair.start(
        standby_settings={"max_standby_streaming_delay": "100ms"})
    try:
        yield started
    finally:
        started.stop()


async def test_a_read_the_replica_cancels_for_recovery_is_answered_by_the_primary(
        impatient_pair, redis_client, key_prefix, clock) -> None:
    """A read holds a lock on jobs on the standby while the primary takes an exclusive
    one: replaying it, the standby cancels the read ("conflict with recovery"). The
    primary answers it instead."""
    pair = impatient_pair
    primary = await Database.connect(pair.primary_dsn, min_size=1, max_size=2)
    replicas = await Replicas.connect(primary, [pair.standby_dsn], history_s=10.0)
    try:
        router = ReadRouter(primary, replicas, WriteMarks(redis_client, key_prefix),
                            max_lag_s=5.0)
        tenant_id = (await create_tenant(primary, TenantSpec(name="t"), clock.now())).tenant_id
        await pair.caught_up()
        await replicas.run_once(time.monotonic())
        served: list[int] = []

        async def slow_read(db: Database) -> int:  # the test's own statement
            async with db.connection() as conn:
                served.append(conn._addr[1])
                return await conn.fetchval("SELECT count(*) FROM jobs, pg_sleep(1)")

        async def exclusive_lock_on_the_primary() -> None:
            standby = await asyncpg.connect(pair.standby_dsn)
            try:  # until the read runs on the standby, holding its lock on jobs
                for _ in range(500):
                    if await standby.fetchval(
                            "SELECT count(*) FROM pg_stat_activity WHERE state = 'active' "
                            "AND query LIKE '%pg_sleep(1)%' AND pid <> pg_backend_pid()"):
                        break
                    await asyncio.sleep(0.01)
            finally:
                await standby.close()
            async with primary.transaction() as conn:
                await conn.execute("LOCK TABLE jobs IN ACCESS EXCLUSIVE MODE")

        failed_before = reads("primary", "replica_failed")
        count, _ = await asyncio.gather(router.run(tenant_id, slow_read),
                                        exclusive_lock_on_the_primary())
        assert count == 0
        assert served == [pair.standby.port, pair.primary.port]
        assert reads("primary", "replica_failed") == failed_before + 1
    finally:
        await replicas.close()
        await primary.close()


@pytest.fixture
async def own_redis() -> AsyncIterator[RedisServer]:
    server = await RedisServer.start()
    try:
        yield server
    finally:
        server.stop()


async def test_a_redis_that_does_not_answer_sends_reads_to_the_primary(
        pair, own_redis, key_prefix, clock) -> None:
    async with gateway(pair, own_redis.url, key_prefix, clock) as (client, router):
        someone = await tenant(client, "someone")
        job_id = await someone.submit(name="kept")
        await replica_has_all_before(router, time.monotonic())
        os.kill(own_redis._proc.pid, signal.SIGSTOP)  # up, but answering nothing
        try:
            before = reads("primary", "redis")
            began = time.monotonic()
            assert (await someone.job(job_id))["name"] == "kept"
            assert time.monotonic() - began < 1.0  # the mark's read gave up within 0.1 s
            assert reads("primary", "redis") == before + 1
        finally:
            os.kill(own_redis._proc.pid, signal.SIGCONT)


async def test_a_write_whose_mark_redis_refuses_answers_once_the_replica_has_it(
        pair, own_redis, key_prefix, clock) -> None:
    """Redis at maxmemory refuses the mark's SET and still answers its PTTL: no mark, so
    the tenant's next read may go to the replica. The write answers only once the
    replica has it; with replay paused, once the lag bound has passed, after which the
    replica serves no read at all."""
    async with gateway(pair, own_redis.url, key_prefix, clock) as (client, _):
        someone = await tenant(client, "someone")
        limits = aioredis.from_url(own_redis.url)
        await limits.config_set("maxmemory", "1")
        try:
            refused_before = marks_failed()
            job_id = await someone.submit(name="unmarked")
            assert marks_failed() == refused_before + 1
            fresh_before = reads(name_of(pair.standby_dsn), "fresh")
            assert (await someone.job(job_id))["name"] == "unmarked"  # from the replica
            assert reads(name_of(pair.standby_dsn), "fresh") == fresh_before + 1

            await pair.pause_replay()
            began = time.monotonic()
            other_job = await someone.submit(name="unmarked-paused")
            waited_s = time.monotonic() - began
            assert MAX_LAG_S <= waited_s < MAX_LAG_S + HISTORY_MARGIN_S + 1.0, waited_s
            no_replica_before = reads("primary", "no_replica")
            assert (await someone.job(other_job))["name"] == "unmarked-paused"
            assert reads("primary", "no_replica") == no_replica_before + 1
        finally:
            await limits.config_set("maxmemory", "0")
            await limits.aclose()


async def test_without_redis_for_the_marks_every_read_stays_on_the_primary(
        db_url, key_prefix, clock) -> None:
    """The write marks live in Redis: a gateway given read URLs and no Redis uses no
    replica at all (it logs read_replicas_unused) rather than read without the rule."""
    client = await start_client(db_url, None, key_prefix, clock,
                                read_database_url="postgresql://127.0.0.1:1/nowhere")
    try:
        assert client.server.app[CTX].reads is None
        someone = await tenant(client, "someone")
        job_id = await someone.submit(name="kept")
        assert (await someone.job(job_id))["name"] == "kept"
    finally:
        await client.close()
