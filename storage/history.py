"""Reading executions back, and the API's writes to them (replay, trigger)."""

from __future__ import annotations

import base64
import binascii
import struct
import uuid
from datetime import UTC, datetime, timedelta

import msgspec

from herdwick.errors import Conflict, NotFound
from herdwick.ids import shard_of, uuid7
from herdwick.model import Attempt, Execution, ExecutionSummary, StaleCall
from herdwick.storage.db import Database
from herdwick.storage.jobs import decode_cursor as decode_id_cursor  # noqa: F401 - the API's twin
from herdwick.storage.jobs import due_minute
from herdwick.storage.jobs import encode_cursor as id_cursor
from herdwick.storage.sql import q

_stale_decoder = msgspec.json.Decoder(list[StaleCall])
_EXEC_CURSOR = "e1."
TRIGGER_TRIES = 100
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _raw(text: str | None) -> msgspec.Raw | None:
    return None if text is None else msgspec.Raw(text.encode())


def _summary(r) -> ExecutionSummary:
    return ExecutionSummary(execution_id=r["execution_id"], job_id=r["job_id"],
                            scheduled_for=r["scheduled_for"], attempt=r["attempt"],
                            state=r["state"], started_at=r["started_at"],
                            finished_at=r["finished_at"], error=_raw(r["error"]))


def encode_cursor(scheduled_for: datetime, execution_id: uuid.UUID) -> str:
    micros = round((scheduled_for - _EPOCH).total_seconds() * 1e6)
    raw = struct.pack(">q", micros) + execution_id.bytes
    return _EXEC_CURSOR + base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, uuid.UUID]:
    """Raises ValueError for anything that is not a cursor we issued."""
    if not cursor.startswith(_EXEC_CURSOR):
        raise ValueError("not a cursor of this API")
    try:
        raw = base64.urlsafe_b64decode(cursor[len(_EXEC_CURSOR):] + "==")
    except (binascii.Error, ValueError):
        raise ValueError("not a cursor of this API") from None
    if len(raw) != 24:
        raise ValueError("not a cursor of this API")
    (micros,) = struct.unpack(">q", raw[:8])
    try:
        when = datetime.fromtimestamp(micros / 1e6, UTC)
    except (OverflowError, OSError, ValueError):
        raise ValueError("not a cursor of this API") from None
    execution_id = uuid.UUID(bytes=raw[8:])
    if encode_cursor(when, execution_id) != cursor:
        raise ValueError("not a cursor of this API")
    return when, execution_id


async def job_executions(db: Database, tenant_id: uuid.UUID, job_id: uuid.UUID,
                         after: tuple[datetime, uuid.UUID] | None,
                         limit: int) -> tuple[list[ExecutionSummary], str | None]:
    at, eid = after if after else (None, None)
    async with db.connection() as conn:
        rows = await conn.fetch(q("job_executions"), job_id, tenant_id, at, eid, limit + 1)
    items = [_summary(r) for r in rows[:limit]]
    more = len(rows) > limit
    return items, (encode_cursor(items[-1].scheduled_for, items[-1].execution_id)
                   if more else None)


async def get_execution(db: Database, tenant_id: uuid.UUID, execution_id: uuid.UUID) -> Execution:
    async with db.connection() as conn:
        row = await conn.fetchrow(q("get_execution"), execution_id, tenant_id)
        if row is None:
            raise NotFound(f"execution {execution_id} does not exist")
        attempts = await conn.fetch(q("execution_attempts"), execution_id, row["scheduled_for"])
    return Execution(
        execution_id=row["execution_id"], job_id=row["job_id"],
        scheduled_for=row["scheduled_for"], attempt=row["attempt"], state=row["state"],
        queued_at=row["queued_at"], started_at=row["started_at"],
        finished_at=row["finished_at"], error=_raw(row["error"]), result=_raw(row["result"]),
        attempts=[Attempt(attempt=a["attempt"], worker_id=a["worker_id"],
                          started_at=a["started_at"], finished_at=a["finished_at"],
                          outcome=a["outcome"], error=_raw(a["error"]),
                          lease_until=a["lease_until"]) for a in attempts],
        possible_duplicates=_stale_decoder.decode(row["stale_calls"]) if row["stale_calls"]
        else [])


async def dead_letters(db: Database, tenant_id: uuid.UUID, after: uuid.UUID | None,
                       limit: int) -> tuple[list[ExecutionSummary], str | None]:
    async with db.connection() as conn:
        rows = await conn.fetch(q("dead_letters"), tenant_id, after, limit + 1)
    items = [_summary(r) for r in rows[:limit]]
    more = len(rows) > limit
    return items, id_cursor(items[-1].execution_id) if more else None


async def _queue_due(conn, job_id: uuid.UUID, execution_id: uuid.UUID, scheduled_for: datetime,
                     attempt: int, when: datetime) -> None:
    await conn.execute(q("insert_retry_due"), [shard_of(job_id)], [due_minute(when)], [when],
                       [job_id], [execution_id], [scheduled_for], [attempt])


async def replay(db: Database, tenant_id: uuid.UUID, execution_id: uuid.UUID,
                 now: datetime) -> tuple[uuid.UUID, str]:
    """A dead execution runs again as the same execution, with the next attempt; its job id
    and pool."""
    async with db.transaction() as conn:
        row = await conn.fetchrow(q("lock_execution"), execution_id, tenant_id)
        if row is None:
            raise NotFound(f"execution {execution_id} does not exist")
        if row["state"] != "dead":
            raise Conflict(f"only a dead execution can be retried; this one is {row['state']}")
        if row["job_state"] in ("paused", "canceled"):
            raise Conflict(f"its job is {row['job_state']}")
        await conn.execute(q("requeue_execution"), execution_id, row["scheduled_for"])
        await _queue_due(conn, row["job_id"], execution_id, row["scheduled_for"],
                         row["attempt"] + 1, now)
    return row["job_id"], row["pool"]


async def trigger(db: Database, tenant_id: uuid.UUID, job_id: uuid.UUID, job_state: str,
                  now: datetime) -> tuple[uuid.UUID, datetime]:
    """Run once now, outside the schedule: an execution that the due index queues at once;
    its id, and its due time.

    A paused job may be triggered too (as a suspended Kubernetes CronJob or a
    paused Temporal schedule can): its first attempt runs now and the job stays
    paused; dispatch parks a retry of it until the resume, as any other.
    """
    if job_state not in ("active", "paused"):
        raise Conflict(f"a {job_state} job cannot be triggered")
    execution_id = uuid7(now)
    async with db.transaction() as conn:
        # An occurrence is unique by (job, scheduled_for): a trigger at an instant another
        # execution of the job already has (a second trigger in the same microsecond, or
        # the job's own due time) takes the next free microsecond.
        at = now
        for _ in range(TRIGGER_TRIES):
            if await conn.fetchval(q("insert_execution"), execution_id, job_id, tenant_id, at, 0,
                                   "retry_wait") is not None:
                break
            at += timedelta(microseconds=1)
        else:
            raise Conflict("this job has been triggered too often at this instant; retry")
        # Due at its own instant too: the due index's key holds one row a job an instant.
        await _queue_due(conn, job_id, execution_id, at, 1, at)
    return execution_id, at
