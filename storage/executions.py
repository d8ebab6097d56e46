"""Execution outcomes into Postgres: the execution-event actor's batched, attempt-fenced writes."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import NamedTuple

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
    lease_until_ms: int | None = None  # the lease's expiry as first granted


class StaleCall(msgspec.Struct, kw_only=True):
    """A worker call the fence refused from an attempt whose lease lapsed or was replaced."""

    execution_id: str  # UUID text
    scheduled_for: datetime | None  # None: Redis no longer knew the execution
    attempt: int  # the caller's
    worker_id: str
    call: str  # heartbeat | complete | fail
    at_ms: int


class Successor(NamedTuple):
    """A forbid-overlap job's next occurrence, written once its occurrence finished."""

    job_id: uuid.UUID
    next_run_at: datetime
    tenant_id: uuid.UUID
    pool: str


class Applied(msgspec.Struct, kw_only=True):
    changed: int
    retries: int
    completed_jobs: int
    successors: list[Successor]


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
        return _applied(fast, [])
    held = [u for u in updates if u.job_id in forbid and u.state in ("succeeded", "dead")]
    slow, successors = await retrying(lambda: _apply_forbid(db, held, now, shard_of, next_after))
    total = _applied(fast, successors)
    total.changed += slow["changed"]
    total.completed_jobs += slow["completed"]
    return total


def _applied(row, successors: list[Successor]) -> Applied:
    return Applied(changed=row["changed"], retries=row["retries"], completed_jobs=row["completed"],
                   successors=successors)


async def _apply_events(db: Database, updates: list[ExecutionUpdate], attempts: list[AttemptRow],
                        now: datetime | None, shard_of: Callable[[uuid.UUID], int]):
    async with db.transaction(by_key=True) as conn:
        return await conn.fetchrow(q("apply_events"),
                                   *_events_args(updates, attempts, now, shard_of, False))


async def _apply_forbid(db: Database, updates: list[ExecutionUpdate], now: datetime | None,
                        shard_of: Callable[[uuid.UUID], int],
                        next_after: Callable[[uuid.UUID, str], datetime | None]):
    """Finished forbid-overlap occurrences and their successors, in one transaction."""
    async with db.transaction(by_key=True) as conn:
        row = await conn.fetchrow(q("apply_events"),
                                  *_events_args(updates, [], now, shard_of, True))
        successors = []
        for job in await conn.fetch(q("forbid_successors"), row["finished"]):
            when = next_after(job["job_id"], job["schedule"])
            if when is not None:
                successors.append(Successor(job["job_id"], when, job["tenant_id"], job["pool"]))
        if successors:
            await conn.execute(q("insert_retry_due"), *_successor_args(successors, shard_of))
    return row, successors


def _events_args(updates: list[ExecutionUpdate], attempts: list[AttemptRow],
                 now: datetime | None, shard_of: Callable[[uuid.UUID], int],
                 with_forbid: bool) -> tuple:
    retry = [u.state == "retry_wait" and u.retry_at is not None for u in updates]
    return (*_update_args(updates), [u.job_id for u in updates],
            [shard_of(uuid.UUID(u.job_id)) if r else None
             for u, r in zip(updates, retry, strict=True)],
            [due_minute(u.retry_at) if r else None for u, r in zip(updates, retry, strict=True)],
            [u.retry_at if r else None for u, r in zip(updates, retry, strict=True)],
            *_attempt_args(attempts), now, with_forbid, [u.deferrals for u in updates],
            [a.lease_until_ms for a in attempts])


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


def _successor_args(successors: list[Successor], shard_of) -> tuple[list, ...]:
    return ([shard_of(s.job_id) for s in successors],
            [due_minute(s.next_run_at) for s in successors],
            [s.next_run_at for s in successors], [s.job_id for s in successors],
            [None] * len(successors), [None] * len(successors), [None] * len(successors))


async def record_stale_calls(db: Database, calls: list[StaleCall]) -> list[tuple[str, str]]:
    """Merges each call into its execution's stale_calls, counted by (attempt, worker, call);
    returns (tenant_id, call) of each call recorded.

    Postgres judges what Redis could not: a call whose execution was gone from Redis
    counts only if a later attempt ran. Replaying a batch counts its calls again (they
    are evidence, not state, so the events' at-least-once delivery can only overcount
    how often, never hide that it happened).
    """
    if not calls:
        return []
    return await retrying(lambda: _record_stale_calls(db, calls))


async def _record_stale_calls(db: Database, calls: list[StaleCall]) -> list[tuple[str, str]]:
    recorded: list[tuple[str, str]] = []
    async with db.transaction(by_key=True) as conn:
        rows = await conn.fetch(q("lock_stale_calls"), [c.execution_id for c in calls],
                                [c.scheduled_for for c in calls])
        by_id = {str(r["execution_id"]): r for r in rows}
        merged: dict[str, list[dict]] = {}
        for call in calls:
            row = by_id.get(call.execution_id)
            if row is None or (call.scheduled_for is None and row["attempt"] <= call.attempt):
                continue
            entries = merged.get(call.execution_id)
            if entries is None:
                entries = merged[call.execution_id] = (
                    msgspec.json.decode(row["stale_calls"]) if row["stale_calls"] else [])
            _merge(entries, call)
            recorded.append((str(row["tenant_id"]), call.call))
        if merged:
            await conn.execute(q("write_stale_calls"), list(merged),
                               [by_id[i]["scheduled_for"] for i in merged],
                               [msgspec.json.encode(e).decode() for e in merged.values()])
    return recorded


MAX_STALE_ENTRIES = 50  # distinct (attempt, worker, call) kept; the metric counts them all


def _merge(entries: list[dict], call: StaleCall) -> None:
    at = datetime.fromtimestamp(call.at_ms / 1000, UTC).isoformat()
    for entry in entries:
        if (entry["attempt"], entry["workerId"], entry["call"]) == \
                (call.attempt, call.worker_id, call.call):
            entry["count"] += 1
            entry["firstAt"] = min(entry["firstAt"], at)
            entry["lastAt"] = max(entry["lastAt"], at)
            return
    if len(entries) >= MAX_STALE_ENTRIES:
        return
    entries.append({"attempt": call.attempt, "workerId": call.worker_id, "call": call.call,
                    "count": 1, "firstAt": at, "lastAt": at})
