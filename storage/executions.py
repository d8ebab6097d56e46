"""Execution outcomes into Postgres: the execution-event actor's batched, attempt-fenced writes."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import datetime

import msgspec

from storage.db import Database, retrying
from storage.jobs import due_minute
from storage.sql import q


class ExecutionUpdate(msgspec.Struct, kw_only=True):
    """An execution's final state within one batch of events."""

    execution_id: uuid.UUID
    scheduled_for: datetime
    attempt: int
    state: str  # running | succeeded | retry_wait | dead
    job_id: uuid.UUID
    lease_owner: str | None = None
    lease_until: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    result: str | None = None  # JSON text
    error: str | None = None  # JSON text
    retry_at: datetime | None = None


class AttemptRow(msgspec.Struct, kw_only=True):
    execution_id: uuid.UUID
    attempt: int
    scheduled_for: datetime
    worker_id: str | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
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
    """One transaction: execution states (fenced by attempt), attempt rows, retries, successors.

    `next_after(job_id, schedule_json)` gives a forbid-overlap cron job's next
    occurrence once its running one finished.
    """
    return await retrying(lambda: _apply_once(db, updates, attempts, now, shard_of, next_after))


async def _apply_once(db: Database, updates: list[ExecutionUpdate], attempts: list[AttemptRow],
                      now: datetime | None, shard_of: Callable[[uuid.UUID], int],
                      next_after: Callable[[uuid.UUID, str], datetime | None]) -> Applied:
    async with db.transaction() as conn:
        changed = await conn.fetch(q("apply_execution_updates"), *_update_args(updates))
        if attempts:
            await conn.execute(q("upsert_attempts"), *_attempt_args(attempts))
        moved = {r["execution_id"] for r in changed}
        retry = [u for u in updates if u.execution_id in moved and u.state == "retry_wait"]
        if retry:
            await conn.execute(q("insert_retry_due"), *_retry_args(retry, shard_of))
        finished = sorted({u.job_id for u in updates
                           if u.execution_id in moved and u.state in ("succeeded", "dead")})
        successors = []
        if finished:
            status = await conn.execute(q("complete_one_offs"), finished, now)
            completed = int(status.split()[-1])
            for row in await conn.fetch(q("forbid_successors"), finished):
                when = next_after(row["job_id"], row["schedule"])
                if when is not None:
                    successors.append((row["job_id"], when))
            if successors:
                await conn.execute(q("insert_retry_due"), *_successor_args(successors, shard_of))
        else:
            completed = 0
    return Applied(changed=len(moved), retries=len(retry), completed_jobs=completed,
                   successors=len(successors))


def _update_args(updates: list[ExecutionUpdate]) -> tuple[list, ...]:
    return ([u.execution_id for u in updates], [u.scheduled_for for u in updates],
            [u.attempt for u in updates], [u.state for u in updates],
            [u.lease_owner for u in updates], [u.lease_until for u in updates],
            [u.started_at for u in updates], [u.finished_at for u in updates],
            [u.result for u in updates], [u.error for u in updates])


def _attempt_args(rows: list[AttemptRow]) -> tuple[list, ...]:
    return ([r.execution_id for r in rows], [r.attempt for r in rows],
            [r.scheduled_for for r in rows], [r.worker_id for r in rows],
            [r.started_at for r in rows], [r.finished_at for r in rows],
            [r.outcome for r in rows], [r.error for r in rows])


def _retry_args(retry: list[ExecutionUpdate], shard_of) -> tuple[list, ...]:
    return ([shard_of(u.job_id) for u in retry], [due_minute(u.retry_at) for u in retry],
            [u.retry_at for u in retry], [u.job_id for u in retry],
            [u.execution_id for u in retry], [u.scheduled_for for u in retry],
            [u.attempt + 1 for u in retry])


def _successor_args(successors: list[tuple[uuid.UUID, datetime]], shard_of) -> tuple[list, ...]:
    return ([shard_of(j) for j, _ in successors], [due_minute(t) for _, t in successors],
            [t for _, t in successors], [j for j, _ in successors],
            [None] * len(successors), [None] * len(successors), [None] * len(successors))
