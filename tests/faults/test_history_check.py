"""The fault verdict itself: a cron minute in flight as it looks is not a stuck run.

The stack keeps running while history.check reads; a cron occurrence that fell due
just before it may be queued or leased. One that fell due long before and is still
running is stuck, and must be reported.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

from herdwick.model import TenantSpec
from herdwick.storage.db import Database
from herdwick.storage.tenants import create_tenant
from tests.faults import history
from tests.faults.harness import CRON_NAME, insert, make_jobs

LEFT = ("executions left queued or running", "attempts left running")


async def _cron_leased(db: Database, fell_due_s_ago: float) -> uuid.UUID:
    """A cron job whose occurrence fell due `fell_due_s_ago` and is leased, unfinished."""
    tenant = await create_tenant(db, TenantSpec(name="verdict"), datetime.now(UTC))
    async with db.connection() as conn:
        now = await conn.fetchval("SELECT now()")
    due = now - timedelta(seconds=fell_due_s_ago)
    [job] = make_jobs(CRON_NAME, 1, due, cron="* * * * *")
    await insert(db, tenant.tenant_id, [job])
    execution_id = uuid.uuid4()
    async with db.connection() as conn:
        await conn.execute(
            "INSERT INTO executions (execution_id, job_id, tenant_id, scheduled_for, attempt,"
            " state, lease_owner, queued_at, started_at)"
            " VALUES ($1, $2, $3, $4, 1, 'running', 'w1', $4, $4)",
            execution_id, job.job_id, tenant.tenant_id, due)
        await conn.execute(
            "INSERT INTO execution_attempts (execution_id, attempt, scheduled_for, worker_id,"
            " started_at, outcome) VALUES ($1, 1, $2, 'w1', $2, 'running')",
            execution_id, due)
    return execution_id


async def test_a_cron_occurrence_that_just_fell_due_may_be_in_flight(db: Database) -> None:
    await _cron_leased(db, fell_due_s_ago=0.5)
    verdict = await history.check(db)
    assert {what: verdict.broken[what] for what in LEFT} == {what: [] for what in LEFT}


async def test_one_that_fell_due_long_before_and_still_runs_is_reported(db: Database) -> None:
    execution_id = await _cron_leased(db, fell_due_s_ago=30)
    verdict = await history.check(db)
    assert {what: verdict.broken[what] for what in LEFT} == {
        what: [str(execution_id)] for what in LEFT}
