"""Concurrent single submits of one tenant go to Postgres as one statement
(gateway/coalesce.py), and each request still gets its own answer, after its commit."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta

from herdwick.clock import ManualClock
from herdwick.errors import QuotaExceeded, StorageUnavailable
from herdwick.gateway.coalesce import Coalescer
from herdwick.gateway.herd import herd_check
from herdwick.model import TenantSpec
from herdwick.storage.jobs import NewJob, Submission, insert_jobs, insert_submissions
from herdwick.storage.tenants import create_tenant
from tests.integration.conftest import Api, make_job
from tests.integration.stack import queue_job

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
LIMIT = 5  # the herd warning's threshold in these tests


def job_at(when: datetime) -> NewJob:
    return queue_job(when, NOW)


async def tenant(db, **limits) -> uuid.UUID:
    return (await create_tenant(db, TenantSpec(name="t", **limits), NOW)).tenant_id


async def job_count(db, tenant_id: uuid.UUID) -> int:
    async with db.connection() as conn:
        return await conn.fetchval("SELECT count(*) FROM jobs WHERE tenant_id = $1", tenant_id)


async def test_submits_waiting_behind_an_insert_go_as_one_statement(db) -> None:
    coalescer = Coalescer(db, clock=ManualClock(NOW), in_flight=1)
    tenant_id = await tenant(db)
    jobs = [job_at(NOW + timedelta(minutes=5 + i)) for i in range(20)]
    outcomes = await asyncio.gather(*(
        coalescer.insert(tenant_id, Submission([j]), max_active_jobs=None, sync=False)
        for j in jobs))
    assert all(o.inserted for o in outcomes)
    assert await job_count(db, tenant_id) == 20
    # All arrived before the lane's insert began: one statement for the twenty.
    assert coalescer.statements == 1


async def test_each_request_s_herd_warning_is_its_own(db) -> None:
    tenant_id = await tenant(db)
    busy = NOW + timedelta(hours=1)
    await insert_jobs(db, tenant_id, [job_at(busy) for _ in range(LIMIT - 1)], now=NOW)
    into_herd, elsewhere = job_at(busy), job_at(busy + timedelta(minutes=7))
    coalescer = Coalescer(db, clock=ManualClock(NOW), in_flight=1)
    first = asyncio.ensure_future(coalescer.insert(
        tenant_id, Submission([job_at(NOW + timedelta(days=1))]), max_active_jobs=None,
        sync=False))
    together = [coalescer.insert(tenant_id, Submission([j], herd_check([j], NOW, LIMIT)),
                                 max_active_jobs=None, sync=False)
                for j in (into_herd, elsewhere)]
    _, herd, calm = await asyncio.gather(first, *together)
    assert coalescer.statements == 1  # the three in one statement, each judged alone
    assert (herd.herd_second, herd.herd_total) == (busy, LIMIT)
    assert calm.herd_total == 1 and calm.herd_second == busy + timedelta(minutes=7)


async def test_requests_checking_one_second_each_get_the_count_they_would_alone(db) -> None:
    """The statement counts a second once for every request that checks it; each request
    still gets its own total: its jobs there, plus the waiting ones up to the limit."""
    tenant_id = await tenant(db)
    busy = NOW + timedelta(hours=1)
    await insert_jobs(db, tenant_id, [job_at(busy) for _ in range(LIMIT - 2)], now=NOW)
    requests = [[job_at(busy) for _ in range(n)] for n in (1, 2, 4, 7)]
    outcomes = await insert_submissions(
        db, tenant_id, [Submission(jobs, herd_check(jobs, NOW, LIMIT)) for jobs in requests],
        now=NOW)
    # 3 waiting: 1 + 3; 2 + 3; 4 + up to 1 (the limit); 7 counts none, it is past it alone.
    assert [(o.herd_second, o.herd_total) for o in outcomes] == [
        (busy, 4), (busy, LIMIT), (busy, LIMIT), (busy, 7)]
    alone = await insert_jobs(db, tenant_id, [job_at(busy)], now=NOW,
                              herd=herd_check([job_at(busy)], NOW, LIMIT))
    assert (alone.herd_second, alone.herd_total) == (busy, LIMIT)  # 17 waiting now


async def test_over_the_quota_together_each_request_gets_its_own_answer(db) -> None:
    tenant_id = await tenant(db, max_active_jobs=3)
    coalescer = Coalescer(db, clock=ManualClock(NOW), in_flight=1)
    results = await asyncio.gather(*(
        coalescer.insert(tenant_id, Submission([job_at(NOW + timedelta(minutes=9 + i))]),
                         max_active_jobs=3, sync=False)
        for i in range(6)), return_exceptions=True)
    refused = [r for r in results if isinstance(r, QuotaExceeded)]
    assert len(refused) == 3 and sum(1 for r in results if not isinstance(r, Exception)) == 3
    assert await job_count(db, tenant_id) == 3


async def test_postgres_away_is_every_waiting_request_s_error_with_nothing_written(
        db, monkeypatch) -> None:
    from herdwick.storage import jobs as store

    async def away(*args, **kwargs):
        raise StorageUnavailable("postgres unavailable: test")

    tenant_id = await tenant(db)
    monkeypatch.setattr(store, "insert_submissions", away)
    coalescer = Coalescer(db, clock=ManualClock(NOW), in_flight=1)
    results = await asyncio.gather(*(
        coalescer.insert(tenant_id, Submission([job_at(NOW + timedelta(minutes=3))]),
                         max_active_jobs=None, sync=False) for _ in range(5)),
        return_exceptions=True)
    assert all(isinstance(r, StorageUnavailable) for r in results)
    assert await job_count(db, tenant_id) == 0


async def test_concurrent_http_submits_each_get_their_own_201(api: Api, db) -> None:
    clients = 32
    answers = await asyncio.gather(*(api.submit(make_job(name=f"c{i}")) for i in range(clients)))
    assert [a.status for a in answers] == [201] * clients
    ids = {(await a.json())["jobId"] for a in answers}
    assert len(ids) == clients
    async with db.connection() as conn:
        found = await conn.fetchval("SELECT count(*) FROM jobs WHERE job_id = ANY($1::uuid[])",
                                    [uuid.UUID(i) for i in ids])
    assert found == clients

