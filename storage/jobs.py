"""Jobs: the write path (batched insert with due_index and idempotency) and reads."""

from __future__ import annotations

import base64
import binascii
import uuid
from datetime import datetime, timedelta

import asyncpg
import msgspec

from herdwick.errors import Conflict, NotFound, QuotaExceeded, VersionMismatch
from herdwick.ids import uuid7
from herdwick.model import (
    FieldChange,
    Job,
    RetryPolicy,
    Revision,
    Schedule,
    ScheduleOut,
    Target,
)
from herdwick.storage.db import Database, retrying
from herdwick.storage.sql import q

IDEMPOTENCY_TTL = timedelta(hours=24)
QUOTA_RETRY_AFTER_S = 60
_LIVE = ("active", "paused")  # the states max_active_jobs counts
_CURSOR_PREFIX = "j1."

_schedule_decoder = msgspec.json.Decoder(Schedule)
_labels_decoder = msgspec.json.Decoder(dict[str, str])
_encode = msgspec.json.Encoder().encode


class NewJob(msgspec.Struct, frozen=True, kw_only=True):
    """One job ready to insert: validated, with its first due time computed."""

    job_id: uuid.UUID
    name: str
    target_type: str
    target_ref: str
    pool: str
    payload: str  # JSON text
    schedule: str  # JSON text of the normalised Schedule
    max_attempts: int
    backoff_s: float
    timeout_s: int
    next_run_at: datetime
    shard_id: int
    labels: str = "{}"  # JSON text
    dry_run: bool = False


class NewIdempotency(msgspec.Struct, frozen=True, kw_only=True):
    key: str
    request_hash: bytes
    response: bytes  # the 201 body to replay
    # The same with the herd warning, stored if the herd count says so. Which second it
    # names is known only in the statement, which writes that second's HerdCheck label
    # over the placeholder at byte offset warned_second_at.
    response_warned: bytes
    warned_second_at: int


class HerdCheck(msgspec.Struct, frozen=True, kw_only=True):
    """The herd warning's question: in which of these seconds are most of the tenant's jobs due?"""

    seconds: list[datetime]  # whole seconds
    in_request: list[int]  # the request's own jobs due in each
    labels: list[str]  # each second as the warning names it
    limit: int  # a second with this many jobs warns; counting stops there


class IdempotencyRecord(msgspec.Struct, frozen=True, kw_only=True):
    request_hash: bytes
    status: int
    response: bytes
    expires_at: datetime


class InsertOutcome(msgspec.Struct, frozen=True, kw_only=True):
    inserted: bool  # false: the idempotency key was already held, nothing written
    # Of the HerdCheck's seconds, the one with the most jobs (None when none was checked),
    # and how many: the request's and the tenant's active ones, counted up to its limit.
    herd_second: datetime | None
    herd_total: int


class Submission(msgspec.Struct, frozen=True):
    """One request's jobs and its herd question, among those inserted together."""

    jobs: list[NewJob]
    herd: HerdCheck | None = None


async def insert_jobs(
    db: Database,
    tenant_id: uuid.UUID,
    jobs: list[NewJob],
    *,
    now: datetime,
    idempotency: NewIdempotency | None = None,
    max_active_jobs: int | None = None,
    herd: HerdCheck | None = None,
    sync: bool = False,
) -> InsertOutcome:
    """Insert jobs, their due_index rows and the idempotency record atomically.

    A tenant with max_active_jobs takes a per-tenant advisory lock and counts
    first; unlimited tenants (the common case) pay one statement, no lock.
    Without `herd` no second is checked. `sync` (a sync tenant's): the commit
    answers once the synchronous standbys have applied it; a transaction of its
    own, so only those submits pay its round trips.
    """
    [outcome] = await insert_submissions(db, tenant_id, [Submission(jobs, herd)], now=now,
                                         idempotency=idempotency,
                                         max_active_jobs=max_active_jobs, sync=sync)
    return outcome


async def insert_submissions(
    db: Database,
    tenant_id: uuid.UUID,
    submissions: list[Submission],
    *,
    now: datetime,
    idempotency: NewIdempotency | None = None,
    max_active_jobs: int | None = None,
    sync: bool = False,
) -> list[InsertOutcome]:
    """Several requests' jobs in one statement (insert_jobs's, all or nothing), each
    request's herd answered on its own; an idempotency record only with one request.
    The quota counts them all together."""
    if idempotency is not None and len(submissions) != 1:
        raise ValueError("an idempotency record belongs to one request")
    jobs = [j for sub in submissions for j in sub.jobs]
    args = _insert_args(tenant_id, jobs, now, idempotency, submissions)
    if max_active_jobs is None and not sync:
        async with db.connection() as conn:
            row = await conn.fetchrow(q("insert_jobs"), *args)
    else:
        async with db.transaction() as conn:
            if sync:
                await conn.execute(q("commit_remote_apply"))
            if max_active_jobs is not None:
                await _within_quota(conn, tenant_id, len(jobs), max_active_jobs)
            row = await conn.fetchrow(q("insert_jobs"), *args)
    herds = {r: (second, total) for r, second, total
             in zip(row["herd_requests"], row["herd_seconds"], row["herd_totals"], strict=True)}
    return [InsertOutcome(inserted=row["inserted"], herd_second=herds.get(i, (None, 0))[0],
                          herd_total=herds.get(i, (None, 0))[1])
            for i in range(len(submissions))]


async def _within_quota(conn, tenant_id: uuid.UUID, adding: int, max_active_jobs: int) -> None:
    """Under the tenant's quota lock (held to the commit), or QuotaExceeded."""
    await conn.execute(q("tenant_quota_lock"), tenant_id)
    live = await conn.fetchval(q("quota_live"), tenant_id)
    if live is None:  # no count kept: the quota was lifted after this key was cached
        live = await conn.fetchval(q("count_live_jobs"), tenant_id)
    if live + adding > max_active_jobs:
        raise QuotaExceeded(
            f"the tenant has {live} active or paused jobs; max_active_jobs is "
            f"{max_active_jobs}", QUOTA_RETRY_AFTER_S)


def _insert_args(tenant_id: uuid.UUID, jobs: list[NewJob], now: datetime,
                 idem: NewIdempotency | None,
                 submissions: list[Submission]) -> tuple[object, ...]:
    herds = [(i, sub.herd) for i, sub in enumerate(submissions) if sub.herd is not None]
    limit = herds[0][1].limit if herds else 0
    return (
        tenant_id,
        idem.key if idem else None,
        idem.request_hash if idem else None,
        idem.response if idem else None,
        now,
        now + IDEMPOTENCY_TTL,
        [j.job_id for j in jobs],
        [j.name for j in jobs],
        [j.target_type for j in jobs],
        [j.target_ref for j in jobs],
        [j.pool for j in jobs],
        [j.payload for j in jobs],
        [j.schedule for j in jobs],
        [j.max_attempts for j in jobs],
        [j.backoff_s for j in jobs],
        [j.timeout_s for j in jobs],
        [j.next_run_at for j in jobs],
        [j.shard_id for j in jobs],
        [due_minute(j.next_run_at) for j in jobs],
        [s for _, h in herds for s in h.seconds],
        [n for _, h in herds for n in h.in_request],
        limit,
        [label for _, h in herds for label in h.labels],
        idem.response_warned if idem else None,
        idem.warned_second_at + 1 if idem else None,  # SQL's overlay counts from 1
        [j.labels for j in jobs],
        [j.dry_run for j in jobs],
        [i for i, h in herds for _ in h.seconds],
    )


def due_minute(when: datetime) -> datetime:
    return when.replace(second=0, microsecond=0)


async def get_idempotency(db: Database, tenant_id: uuid.UUID, key: str) -> IdempotencyRecord | None:
    async with db.connection() as conn:
        row = await conn.fetchrow(q("get_idempotency"), tenant_id, key)
    if row is None:
        return None
    return IdempotencyRecord(request_hash=bytes(row["request_hash"]), status=row["status"],
                             response=bytes(row["response"]), expires_at=row["expires_at"])


def job_from_row(row: asyncpg.Record) -> Job:
    return Job(
        job_id=row["job_id"],
        name=row["name"],
        target=Target(type=row["target_type"], ref=row["target_ref"]),
        payload=msgspec.Raw(row["payload"].encode()),
        schedule=ScheduleOut.of(_schedule_decoder.decode(row["schedule"])),
        retry=RetryPolicy(max_attempts=row["max_attempts"], backoff_seconds=row["backoff_s"]),
        timeout_seconds=row["timeout_s"],
        labels=_labels_decoder.decode(row["labels"]),
        dry_run=row["dry_run"],
        state=row["state"],
        next_run_at=row["next_run_at"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        version=row["version"],
    )


async def get_job(db: Database, tenant_id: uuid.UUID, job_id: uuid.UUID) -> Job:
    async with db.connection() as conn:
        row = await conn.fetchrow(q("get_job"), tenant_id, job_id)
    if row is None:
        raise NotFound(f"job {job_id} does not exist")
    return job_from_row(row)


def encode_cursor(job_id: uuid.UUID) -> str:
    return _CURSOR_PREFIX + base64.urlsafe_b64encode(job_id.bytes).decode().rstrip("=")


def decode_cursor(cursor: str) -> uuid.UUID:
    """Raises ValueError for anything that is not a cursor we issued."""
    if not cursor.startswith(_CURSOR_PREFIX) or len(cursor) != len(_CURSOR_PREFIX) + 22:
        raise ValueError("not a cursor of this API")
    body = cursor[len(_CURSOR_PREFIX):]
    try:
        raw = base64.urlsafe_b64decode(body + "==")
    except (binascii.Error, ValueError):
        raise ValueError("not a cursor of this API") from None
    if len(raw) != 16 or encode_cursor(uuid.UUID(bytes=raw)) != cursor:
        raise ValueError("not a cursor of this API")
    return uuid.UUID(bytes=raw)


async def list_jobs(db: Database, tenant_id: uuid.UUID, *, state: str | None,
                    after: uuid.UUID | None, limit: int, name_contains: str | None = None,
                    name: str | None = None,
                    labels: dict[str, str] | None = None) -> tuple[list[Job], str | None]:
    """One page, newest first, and the cursor of the next page (None at the end).
    name_contains: only jobs whose name holds this text, in any case; name: only jobs of
    exactly this name; labels: only jobs carrying every one of these pairs."""
    wanted = _encode({str(tenant_id): labels}).decode() if labels else None
    async with db.connection() as conn:
        rows = await conn.fetch(q("list_jobs"), tenant_id, state, after, limit + 1,
                                name_contains, name, wanted)
    jobs = [job_from_row(r) for r in rows[:limit]]
    more = len(rows) > limit
    return jobs, encode_cursor(jobs[-1].job_id) if more else None


class Transition(msgspec.Struct, frozen=True, kw_only=True):
    """What a state change does, decided by the caller from the locked job."""

    state: str
    next_run_at: datetime | None
    clear_due: str | None = None  # "occurrences" | "all" | None
    add_due: tuple[int, datetime] | None = None  # (shard_id, next_run_at)
    unpark_retries: bool = False  # resume: retries dispatch parked while paused are due again
    cancel_executions: bool = False
    skipped: tuple[datetime, ...] = ()  # resume: occurrences recorded as skipped executions


class Transitioned(msgspec.Struct, frozen=True, kw_only=True):
    """A transition's outcome, and what the caller tells others after the commit."""

    job: Job  # as it now is
    canceled: list[uuid.UUID] = []  # executions canceled: their workers must be told
    due: list[tuple[int, uuid.UUID, datetime]] = []  # (shard_id, job_id, due) for the notify


async def transition_job(db: Database, tenant_id: uuid.UUID, job_id: uuid.UUID, now: datetime,
                         decide) -> Transitioned:
    """Lock the job, let `decide(job, schedule) -> Transition | None` choose, apply it atomically.

    decide returns None for a no-op (e.g. pausing a paused job) and raises
    Conflict for a transition the state forbids. Lock order is due rows, then
    the job row: the dispatcher's order, so the two cannot deadlock.
    """
    return await retrying(lambda: _transition_once(db, tenant_id, job_id, now, decide))


async def _transition_once(db: Database, tenant_id: uuid.UUID, job_id: uuid.UUID, now: datetime,
                           decide) -> Transitioned:
    async with db.transaction() as conn:
        await conn.execute(q("lock_due_rows"), job_id)
        row = await conn.fetchrow(q("lock_job"), tenant_id, job_id)
        if row is None:
            raise NotFound(f"job {job_id} does not exist")
        job = job_from_row(row)
        change = decide(job, _schedule_decoder.decode(row["schedule"]))
        if change is None:
            return Transitioned(job=job)
        canceled: list[uuid.UUID] = []
        due: list[tuple[int, uuid.UUID, datetime]] = []
        if change.cancel_executions:
            canceled = [r["execution_id"] for r in
                        await conn.fetch(q("cancel_job_executions"), job_id, now)]
        if change.clear_due == "occurrences":
            await conn.execute(q("delete_due_occurrences"), job_id)
        elif change.clear_due == "all":
            await conn.execute(q("delete_due_all"), job_id)
        if change.unpark_retries:
            due += [(r["shard_id"], job_id, r["next_run_at"])
                    for r in await conn.fetch(q("unpark_due_retries"), job_id)]
        if change.skipped:
            await conn.execute(q("insert_skipped"), [uuid7(now) for _ in change.skipped],
                               job_id, tenant_id, list(change.skipped), now)
        if change.add_due is not None:
            shard_id, when = change.add_due
            await conn.execute(q("insert_due"), shard_id, due_minute(when), when, job_id,
                               tenant_id)
            due.append((shard_id, job_id, when))
        ends = job.state in _LIVE and change.state not in _LIVE
        updated = await conn.fetchrow(q("set_job_state"), tenant_id, job_id, change.state,
                                      change.next_run_at, now, ends)
        return Transitioned(job=job_from_row(updated), canceled=canceled, due=due)



class Updated(msgspec.Struct, frozen=True, kw_only=True):
    job: Job  # as it now is
    due: list[tuple[int, uuid.UUID, datetime]] = []  # (shard_id, job_id, due) for the notify


async def update_job(db: Database, tenant_id: uuid.UUID, job_id: uuid.UUID, *,
                     versions: set[int], new: NewJob, schedule_changed: bool,
                     revised_by: str, changes: str, now: datetime) -> Updated:
    """Apply a validated PATCH if the job is still at one of `versions`, with its revision.

    Raises VersionMismatch if it is not (another PATCH, a pause, a completion came
    first), Conflict if it is canceled or completed. A schedule change moves the
    pending occurrence's due row and jobs.next_run_at in this one transaction. A
    cron job with overlap forbid whose occurrence is running has no due row: its
    successor is computed, from the new schedule, when that occurrence ends.
    """
    return await retrying(lambda: _update_once(db, tenant_id, job_id, versions, new,
                                               schedule_changed, revised_by, changes, now))


async def _update_once(db: Database, tenant_id: uuid.UUID, job_id: uuid.UUID, versions: set[int],
                       new: NewJob, schedule_changed: bool, revised_by: str, changes: str,
                       now: datetime) -> Updated:
    async with db.transaction() as conn:
        await conn.execute(q("lock_due_rows"), job_id)  # the dispatcher's lock order
        row = await conn.fetchrow(q("lock_job"), tenant_id, job_id)
        if row is None:
            raise NotFound(f"job {job_id} does not exist")
        if row["version"] not in versions:
            raise VersionMismatch(f"the job is at version {row['version']}, not the one "
                                  "If-Match names", row["version"])
        if row["state"] in ("canceled", "completed"):
            raise Conflict(f"a {row['state']} job cannot be changed")
        due: list[tuple[int, uuid.UUID, datetime]] = []
        if schedule_changed:
            pending = await conn.fetch(q("take_due_occurrences"), job_id)
            forbid_running = (not pending and row["next_run_at"] is not None
                              and _schedule_decoder.decode(row["schedule"]).cron is not None)
            if row["state"] == "active" and not forbid_running:
                await conn.execute(q("insert_due"), new.shard_id, due_minute(new.next_run_at),
                                   new.next_run_at, job_id, tenant_id)
                due.append((new.shard_id, job_id, new.next_run_at))
        updated = await conn.fetchrow(
            q("update_job"), tenant_id, job_id, new.name, new.target_type, new.target_ref,
            new.pool, new.payload, new.schedule, new.max_attempts, new.backoff_s, new.timeout_s,
            new.labels, schedule_changed, new.next_run_at, now, new.dry_run)
        await conn.execute(q("insert_revision"), job_id, updated["version"], tenant_id, now,
                           revised_by, changes)
        return Updated(job=job_from_row(updated), due=due)


_REVISION_CURSOR = "r1."
_MAX_VERSION = 2**31 - 1
_changes_decoder = msgspec.json.Decoder(dict[str, FieldChange])


def encode_revision_cursor(version: int) -> str:
    return f"{_REVISION_CURSOR}{version}"


def decode_revision_cursor(cursor: str) -> int:
    """Raises ValueError for anything that is not a cursor we issued."""
    body = cursor[len(_REVISION_CURSOR):]
    if (not cursor.startswith(_REVISION_CURSOR) or not body.isascii() or not body.isdigit()
            or body.startswith("0") or not 1 <= int(body) <= _MAX_VERSION):
        raise ValueError("not a cursor of this API")
    return int(body)


async def job_revisions(db: Database, tenant_id: uuid.UUID, job_id: uuid.UUID,
                        before: int | None, limit: int) -> tuple[list[Revision], str | None]:
    async with db.connection() as conn:
        rows = await conn.fetch(q("job_revisions"), job_id, tenant_id, before, limit + 1)
    items = [Revision(version=r["version"], revised_at=r["revised_at"],
                      revised_by=r["revised_by"], changes=_changes_decoder.decode(r["changes"]))
             for r in rows[:limit]]
    more = len(rows) > limit
    return items, encode_revision_cursor(items[-1].version) if more else None
