"""A row inserted while its day's executions partition is being attached.

Maintenance creates a day's partition (moving that day's rows out of the default one)
and attaches it; an insert of that day's execution meanwhile waits on the attach's lock,
then goes where routing had sent it, the default partition, whose constraint now refuses
it. That is no fault of the row: run again, the transaction succeeds. The dispatcher once
rejected such a row as poison, which made the occurrence dead and left a cron job with
no next run.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, date, datetime

import asyncpg
import pytest

from herdwick.actors.dispatcher import plan
from herdwick.errors import PartitionAttached, StorageUnavailable
from herdwick.ids import shard_of
from herdwick.storage import dispatch, leases
from herdwick.storage.dispatch import DueKey
from tests.integration.conftest import Api, waiting_on_a_lock

DAY = date(2026, 11, 20)  # before the partitions the migration made: the default's
DUE = datetime(2026, 11, 20, 12, 0, tzinfo=UTC)


async def _attaching(db_url: str) -> tuple[asyncpg.Connection, asyncpg.transaction.Transaction]:
    """A transaction that has created and attached DAY's partition, not yet committed."""
    conn = await asyncpg.connect(db_url)
    tx = conn.transaction()
    await tx.start()
    assert await conn.fetchval("SELECT herdwick_ensure_execution_partitions($1, 1)", DAY) == 1
    return conn, tx


async def _due_job(db, tenant_id: uuid.UUID) -> uuid.UUID:
    job_id = uuid.uuid4()
    async with db.connection() as conn:
        await conn.execute("""
            INSERT INTO jobs (job_id, tenant_id, name, target_type, target_ref, pool, payload,
                              schedule, max_attempts, backoff_s, timeout_s, state,
                              next_run_at, created_at, updated_at)
            VALUES ($1, $2, 'late', 'queue', 'emails', 'emails', 'null',
                    '{"runAt": "2026-11-20T12:00:00Z"}', 3, 1, 30, 'active', $3, $3, $3)""",
                           job_id, tenant_id, DUE)
        await conn.execute(
            "INSERT INTO due_index (shard_id, due_minute, next_run_at, job_id) "
            "VALUES ($1, $2, $2, $3)", shard_of(job_id), DUE, job_id)
    return job_id


async def test_a_dispatch_waiting_on_the_attach_runs_again_and_queues(
        api: Api, db, db_url: str) -> None:
    job_id = await _due_job(db, uuid.UUID(api.tenant_id))
    held = await leases.claim(db, "racer", 256, 3600, DUE)
    revisions = {lease.shard_id: lease.revision for lease in held}
    attach, tx = await _attaching(db_url)
    try:
        racer = asyncio.create_task(dispatch.dispatch(
            db, "racer", revisions, [DueKey(shard_of(job_id), DUE, job_id)], DUE,
            lambda claimed: plan(claimed, DUE)))
        await waiting_on_a_lock(db)
        await tx.commit()
        out = await racer
    finally:
        await attach.close()
    assert [q.job_id for q in out.queued] == [job_id]
    async with db.connection() as conn:
        where = await conn.fetchval(
            "SELECT tableoid::regclass::text FROM executions WHERE job_id = $1", job_id)
    assert where == "executions_20261120"


async def test_outside_a_retried_transaction_it_reads_as_unavailable_not_refused(
        db, db_url: str) -> None:
    attach, tx = await _attaching(db_url)
    try:
        async def insert() -> None:
            async with db.transaction() as conn:
                await conn.execute(
                    "INSERT INTO executions (execution_id, job_id, tenant_id, scheduled_for, "
                    "attempt, state) VALUES ($1, $1, $1, $2, 1, 'queued')", uuid.uuid4(), DUE)

        racer = asyncio.create_task(insert())
        await waiting_on_a_lock(db)
        await tx.commit()
        with pytest.raises(PartitionAttached) as caught:
            await racer
    finally:
        await attach.close()
    assert isinstance(caught.value, StorageUnavailable)
