"""The sweeper's reads and its attempt bump."""

from __future__ import annotations

import uuid
from datetime import datetime

import msgspec

from herdwick import schedule as sched
from herdwick.storage.db import Database
from herdwick.storage.hot import ReadyExecution
from herdwick.storage.sql import q


class Unfinished(msgspec.Struct, frozen=True, kw_only=True):
    execution_id: uuid.UUID
    job_id: uuid.UUID
    tenant_id: uuid.UUID
    scheduled_for: datetime
    attempt: int
    state: str
    pool: str
    payload: str
    timeout_s: int
    max_attempts: int  # the job's, plus the execution's deferrals
    backoff_s: float
    target: str = ""  # an http job's URL


async def unfinished(db: Database, queued_before: datetime, limit: int) -> list[Unfinished]:
    async with db.connection() as conn:
        rows = await conn.fetch(q("unfinished_executions"), queued_before, limit)
    return [Unfinished(**dict(r)) for r in rows]


async def queued_of_jobs(db: Database, job_ids: list[uuid.UUID],
                         since: datetime) -> list[Unfinished]:
    async with db.connection() as conn:
        rows = await conn.fetch(q("queued_of_jobs"), job_ids, since)
    return [Unfinished(**dict(r)) for r in rows]


def ready(row: Unfinished, attempt: int) -> ReadyExecution:
    """The ready-stream fields of `row` at `attempt`."""
    return ReadyExecution(
        execution_id=str(row.execution_id), attempt=attempt, job_id=str(row.job_id),
        tenant_id=str(row.tenant_id), scheduled_for=sched.format_utc(row.scheduled_for),
        payload=row.payload, timeout_seconds=row.timeout_s, max_attempts=row.max_attempts,
        backoff_ms=round(row.backoff_s * 1000), target=row.target)


async def bump(db: Database, rows: list[Unfinished], now: datetime | None) -> dict[uuid.UUID, int]:
    """Attempt + 1 for each row still at its attempt; returns execution_id -> new attempt."""
    async with db.transaction(by_key=True) as conn:
        out = await conn.fetch(q("bump_attempts"), [r.execution_id for r in rows],
                               [r.scheduled_for for r in rows], [r.attempt for r in rows], now)
    return {r["execution_id"]: r["attempt"] for r in out}


async def fail(db: Database, rows: list[Unfinished], error: str, now: datetime | None) -> int:
    """Dead, with `error` (JSON text): executions the sweeper cannot republish."""
    async with db.transaction(by_key=True) as conn:
        return await conn.fetchval(q("fail_executions"), [r.execution_id for r in rows],
                                   [r.scheduled_for for r in rows], [r.attempt for r in rows],
                                   error, now)
