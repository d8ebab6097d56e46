"""Execution outcomes into Postgres: the execution-event actor's batched, attempt-fenced writes."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import datetime

import msgspec

from herdwick.storage.db import Database, retrying
from herdwick.storage.jobs import due_minute
from herdwick.storage.sql import q


class ExecutionUpdate(msgspec.Struct, kw_only=True):
    """An execution's final state within one batch of events.

    Ids are UUID text and times Redis milliseconds, as the events carry them:
    asyncpg encodes the text as uuid and the statement converts the times,
    which spares the event actor two objects an event.
    """

    execution_id: str
    scheduled_for: datetime
    attempt: int
    state: str  # running | succeeded | retry_wait | dead
    job_id: str
    lease_owner: str | None = None
    lease_until_ms: int | None = None
    started_ms: int | None = None
    finished_ms: int | None = None
    result: str | None = None  # JSON text
    error: str | None = None  # JSON text
    retry_at: datetime | None = None
    deferrals: int = 0  # deferred attempts among the batch's events


class AttemptRow(msgspec.Struct, kw_only=True):
    execution_id: str  # UUID text
    attempt: int
    scheduled_for: datetime
    worker_id: str | None = None
    started_ms: int | None = None
    finished_ms: int | None = None
    outcome: str = "running"
    error: str | None = None


class Applied(msgspec.Struct, kw_only=True):
    changed: int
    retries: int
    completed_jobs: int
    successors: int


async def apply(db: Database, updates: list[ExecutionUpdate], attempts: list[AttemptRow],
                now: datetime | None, shard_of: Callable[[uuid.UUID], int],
                next_after: Callable[[uuid.UUID, str], datetime | None]) -> Applied:
    """Execution states (fenced by attempt), attempt rows, retries, completed jobs, successors.

    One statement (apply_events) for all but the finished occurrences of
    forbid-overlap cron jobs; those, whose successor `next_after(job_id,
    schedule_json)` computes here, go through one transaction after it.
    Both are idempotent, so replaying the batch after a crash between them
    redoes only what had not committed.
    """
    fast = await retrying(lambda: _apply_events(db, updates, attempts, now, shard_of))
    forbid = {str(job_id) for job_id in fast["forbid"]}
    if not forbid:
        return _applied(fast, 0)
    held = [u for u in updates if u.job_id in forbid and u.state in ("succeeded", "dead")]
    slow, successors = await retrying(lambda: _apply_forbid(db, held, now, shard_of, next_after))
    total = _applied(fast, successors)
    total.changed += slow["changed"]
    total.completed_jobs += slow["completed"]
    return total


def _applied(row, successors: int) -> Applied:
    return Applied(changed=row["changed"], retries=row["retries"], completed_jobs=row["completed"],
                   successors=successors)


async def _apply_events(db: Database, updates: list[ExecutionUpdate], attempts: list[AttemptRow],
                        now: datetime | None, shard_of: Callable[[uuid.UUID], int]):
    async with db.connection() as conn:
        return await conn.fetchrow(q("apply_events"),
                                   *_events_args(updates, attempts, now, shard_of, False))


async def _apply_forbid(db: Database, updates: list[ExecutionUpdate], now: datetime | None,
                        shard_of: Callable[[uuid.UUID], int],
                        next_after: Callable[[uuid.UUID, str], datetime | None]):
    """Finished forbid-overlap occurrences and their successors, in one transaction."""
    async with db.transaction() as conn:
        row = await conn.fetchrow(q("apply_events"),
                                  *_events_args(updates, [], now, shard_of, True))
        successors = []
        for job in await conn.fetch(q("forbid_successors"), row["finished"]):
            when = next_after(job["job_id"], job["schedule"])
            if when is not None:
                successors.append((job["job_id"], when))
        if successors:
            await conn.execute(q("insert_retry_due"), *_successor_args(successors, shard_of))
    return row, len(successors)


def _events_args(updates: list[ExecutionUpdate], attempts: list[AttemptRow],
                 now: datetime | None, shard_of: Callable[[uuid.UUID], int],
                 with_forbid: bool) -> tuple:
    retry = [u.state == "retry_wait" and u.retry_at is not None for u in updates]
    return (*_update_args(updates), [u.job_id for u in updates],
            [shard_of(uuid.UUID(u.job_id)) if r else None
             for u, r in zip(updates, retry, strict=True)],
            [due_minute(u.retry_at) if r else None for u, r in zip(updates, retry, strict=True)],
            [u.retry_at if r else None for u, r in zip(updates, retry, strict=True)],
            *_attempt_args(attempts), now, with_forbid, [u.deferrals for u in updates])


def _update_args(updates: list[ExecutionUpdate]) -> tuple[list, ...]:
    return ([u.execution_id for u in updates], [u.scheduled_for for u in updates],
            [u.attempt for u in updates], [u.state for u in updates],
            [u.lease_owner for u in updates], [u.lease_until_ms for u in updates],
            [u.started_ms for u in updates], [u.finished_ms for u in updates],
            [u.result for u in updates], [u.error for u in updates])


def _attempt_args(rows: list[AttemptRow]) -> tuple[list, ...]:
    return ([r.execution_id for r in rows], [r.attempt for r in rows],
            [r.scheduled_for for r in rows], [r.worker_id for r in rows],
            [r.started_ms for r in rows], [r.finished_ms for r in rows],
            [r.outcome for r in rows], [r.error for r in rows])


def _successor_args(successors: list[tuple[uuid.UUID, datetime]], shard_of) -> tuple[list, ...]:
    return ([shard_of(j) for j, _ in successors], [due_minute(t) for _, t in successors],
            [t for _, t in successors], [j for j, _ in successors],
            [None] * len(successors), [None] * len(successors), [None] * len(successors))
