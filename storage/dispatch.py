"""The scheduler's reads and its fenced dispatch transaction."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import UTC, datetime

import msgspec

from herdwick.storage.db import Database, retrying
from herdwick.storage.jobs import due_minute
from herdwick.storage.sql import q

LOAD_LIMIT = 50_000
_EARLIEST = datetime.min.replace(tzinfo=UTC)


class DueRow(msgspec.Struct, frozen=True):
    next_run_at: datetime
    job_id: uuid.UUID
    tenant_id: str = ""  # UUID text: what the fair queue keys tenants by; "": a key alone
    pool: str = ""


class Claimed(msgspec.Struct, frozen=True, kw_only=True):
    """A due row this transaction took, with what dispatch needs of its job."""

    shard_id: int
    next_run_at: datetime
    job_id: uuid.UUID
    execution_id: uuid.UUID | None
    scheduled_for: datetime | None
    attempt: int | None
    tenant_id: uuid.UUID
    pool: str
    payload: str
    schedule: str
    timeout_s: int
    state: str
    max_attempts: int
    backoff_s: float
    target: str = ""  # an http job's URL
    dry_run: bool = False  # the job's flag or its tenant's: record occurrences, publish none
    sync: bool = False  # its tenant's durability is sync: the commit waits for the standbys


class NewExecution(msgspec.Struct, frozen=True):
    execution_id: uuid.UUID
    job_id: uuid.UUID
    tenant_id: uuid.UUID
    scheduled_for: datetime
    state: str  # queued | skipped | dry_run


class NextDue(msgspec.Struct, frozen=True):
    shard_id: int
    next_run_at: datetime
    job_id: uuid.UUID
    tenant_id: uuid.UUID | None = None  # the job's: the herd check counts the row for it


class Retry(msgspec.Struct, frozen=True):
    """A claimed row of an existing execution, with its due key (to park it again if need be)."""

    execution_id: uuid.UUID
    scheduled_for: datetime
    attempt: int
    shard_id: int
    next_run_at: datetime
    job_id: uuid.UUID


class Failed(msgspec.Struct, frozen=True):
    """A claimed row that could not be processed, and why (JSON text): fail_claimed records it."""

    row: Claimed
    error: str
    new_execution_id: uuid.UUID  # the dead execution of a new occurrence (unused for a retry)


class Plan(msgspec.Struct, kw_only=True):
    """What to write for a set of claimed rows, decided by the scheduler's pure planner."""

    executions: list[NewExecution] = []
    next_due: list[NextDue] = []
    job_next: list[tuple[uuid.UUID, datetime | None]] = []
    retries: list[Retry] = []
    replace: list[tuple[uuid.UUID, datetime]] = []  # overlap replace: (job, new scheduled_for)
    failed: list[Failed] = []


class Queued(msgspec.Struct, frozen=True):
    """An execution the transaction queued: to publish after commit."""

    execution_id: uuid.UUID
    job_id: uuid.UUID
    scheduled_for: datetime
    attempt: int
    deferrals: int = 0  # attempts put off so far: each raises the attempt limit by one


class Dispatched(msgspec.Struct, kw_only=True):
    held: set[int]  # shards whose lease checked out
    claimed: list[Claimed]
    queued: list[Queued]
    replaced: list[tuple[uuid.UUID, uuid.UUID]] = []  # (execution, job) canceled by a newer one
    failed: int = 0  # claimed rows recorded as failed (fail_claimed)
    next_due: list[NextDue] = []  # cron successors written: their shards hear of them


class DueKey(msgspec.Struct, frozen=True):
    shard_id: int
    next_run_at: datetime
    job_id: uuid.UUID


async def load_due(db: Database, shard_id: int, horizon: datetime,
                   near: datetime | None = None, read_until: datetime | None = None,
                   limit: int = LOAD_LIMIT) -> list[DueRow]:
    """Due rows up to `horizon`, leaving out those of due minutes up to `read_until`
    (an earlier load's horizon) that are not due by `near` (all of them when `near` is
    None); everything without `read_until`. Rows of those earlier minutes come as keys
    alone (no tenant or pool)."""
    if read_until is None:
        near, read_until = horizon, _EARLIEST
    async with db.connection() as conn:
        rows = await conn.fetch(q("load_due"), shard_id, horizon, near, read_until, limit)
    return [DueRow(next_run_at, job_id, "" if tenant_id is None else str(tenant_id), pool or "")
            for _, next_run_at, job_id, tenant_id, pool in rows]


async def job_classes(db: Database, job_ids: list[uuid.UUID]) -> dict[uuid.UUID, tuple[str, str]]:
    """Job id -> (tenant id as text, pool), for the jobs that exist."""
    async with db.connection() as conn:
        rows = await conn.fetch(q("job_classes"), job_ids)
    return {r["job_id"]: (str(r["tenant_id"]), r["pool"]) for r in rows}


def _claimed(row) -> Claimed:
    return Claimed(shard_id=row["shard_id"], next_run_at=row["next_run_at"],
                   job_id=row["job_id"], execution_id=row["execution_id"],
                   scheduled_for=row["scheduled_for"], attempt=row["attempt"],
                   tenant_id=row["tenant_id"], pool=row["pool"],
                   payload=row["payload"], schedule=row["schedule"],
                   timeout_s=row["timeout_s"], state=row["state"],
                   max_attempts=row["max_attempts"], backoff_s=row["backoff_s"],
                   target=row["target"], dry_run=row["dry_run"], sync=row["sync"])


async def dispatch(db: Database, node_id: str, revisions: dict[int, int], keys: list[DueKey],
                   now: datetime | None, plan: Callable[[list[Claimed]], Plan]) -> Dispatched:
    """One fenced transaction: claim the due rows of held shards, write `plan(claimed)`.

    Keys are claimed in primary-key order, so two transactions over
    overlapping rows lock them in the same order; a deadlock that happens
    anyway (or a serialization failure) is retried, bounded and jittered.
    """
    keys = sorted(keys, key=lambda k: (k.shard_id, k.next_run_at, k.job_id))
    return await retrying(lambda: _dispatch_once(db, node_id, revisions, keys, now, plan))


async def _dispatch_once(db: Database, node_id: str, revisions: dict[int, int],
                         keys: list[DueKey], now: datetime | None,
                         plan: Callable[[list[Claimed]], Plan]) -> Dispatched:
    shards = sorted(revisions)
    async with db.transaction() as conn:
        rows = await conn.fetch(
            q("claim_due"), node_id, shards, [revisions[s] for s in shards], now,
            [k.shard_id for k in keys], [due_minute(k.next_run_at) for k in keys],
            [k.next_run_at for k in keys], [k.job_id for k in keys])
        held = set(rows[0]["held"])
        claimed = [_claimed(r) for r in rows if r["job_id"] is not None]
        if not claimed:
            return Dispatched(held=held, claimed=[], queued=[])
        await _durable_enough(conn, claimed)
        decided = plan(claimed)
        new = await conn.fetchval(q("finish_dispatch"), now, *_finish_args(decided))
        queued = _queued(decided.executions, None if new is None else set(new))
        if decided.replace or decided.retries or decided.failed:
            await conn.execute(q("plan_by_key"))  # for the rest of this transaction
        replaced = []
        if decided.replace:
            replaced = [(r["execution_id"], r["job_id"]) for r in await conn.fetch(
                q("replace_previous"), [j for j, _ in decided.replace],
                [t for _, t in decided.replace], now)]
        if decided.retries:
            queued += [Queued(*r) for r in await conn.fetch(
                q("requeue_retries"), now, *_retry_args(decided.retries))]
        if decided.failed:
            await conn.execute(q("fail_claimed"), now, *_failed_args(decided.failed))
    return Dispatched(held=held, claimed=claimed, queued=queued, replaced=replaced,
                      failed=len(decided.failed), next_due=decided.next_due)


def _queued(executions: list[NewExecution], created: set[uuid.UUID] | None) -> list[Queued]:
    """The queued executions among those given, of those created (all, when None)."""
    return [Queued(e.execution_id, e.job_id, e.scheduled_for, 1, 0) for e in executions
            if e.state == "queued" and (created is None or e.execution_id in created)]


async def reject(db: Database, node_id: str, revisions: dict[int, int], keys: list[DueKey],
                 errors: list[str], now: datetime | None,
                 new_id: Callable[[], uuid.UUID]) -> int:
    """Claim these due rows (fenced, as dispatch does) and record each as failed with its error.

    For rows that a dispatch transaction cannot write at all, or that cannot
    even be loaded: they leave the due index with the reason on their
    execution, rather than failing every batch they are in. Returns how many
    were recorded.
    """
    why = {(k.shard_id, k.job_id, k.next_run_at): e for k, e in zip(keys, errors, strict=True)}
    shards = sorted(revisions)
    async with db.transaction() as conn:
        rows = await conn.fetch(
            q("claim_due"), node_id, shards, [revisions[s] for s in shards], now,
            [k.shard_id for k in keys], [due_minute(k.next_run_at) for k in keys],
            [k.next_run_at for k in keys], [k.job_id for k in keys])
        claimed = [_claimed(r) for r in rows if r["job_id"] is not None]
        failed = [Failed(c, why.get((c.shard_id, c.job_id, c.next_run_at), errors[0]), new_id())
                  for c in claimed]
        if not failed:
            return 0
        await _durable_enough(conn, claimed)
        await conn.execute(q("plan_by_key"))
        return await conn.fetchval(q("fail_claimed"), now, *_failed_args(failed))


async def _durable_enough(conn, claimed: list[Claimed]) -> None:
    """A sync tenant's rows among the claimed: this transaction commits with remote_apply.

    Decided on what claim_due read of the tenants, not on the scheduler's copy of their
    settings (a few seconds old): a tenant just made sync is never dispatched without it.
    The dispatcher sends sync tenants' work in transactions of its own, so this costs
    others nothing; a mixed batch (a setting that changed meanwhile) waits whole.
    """
    if any(c.sync for c in claimed):
        await conn.execute(q("commit_remote_apply"))


def _failed_args(failed: list[Failed]) -> tuple[list, ...]:
    return ([f.row.job_id for f in failed], [f.row.execution_id for f in failed],
            [f.row.scheduled_for if f.row.execution_id else f.row.next_run_at for f in failed],
            [f.new_execution_id for f in failed], [f.row.tenant_id for f in failed],
            [f.error for f in failed])


def _finish_args(plan: Plan) -> tuple[list, ...]:
    ex, nd, jn = plan.executions, plan.next_due, plan.job_next
    return (
        [e.execution_id for e in ex], [e.job_id for e in ex], [e.tenant_id for e in ex],
        [e.scheduled_for for e in ex], [e.state for e in ex],
        [n.shard_id for n in nd], [due_minute(n.next_run_at) for n in nd],
        [n.next_run_at for n in nd], [n.job_id for n in nd],
        [j for j, _ in jn], [t for _, t in jn],
        [n.tenant_id for n in nd],
    )


def _retry_args(rt: list[Retry]) -> tuple[list, ...]:
    return ([r.execution_id for r in rt], [r.scheduled_for for r in rt], [r.attempt for r in rt],
            [r.shard_id for r in rt], [r.next_run_at for r in rt], [r.job_id for r in rt])
