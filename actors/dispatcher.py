"""The dispatch actor: turns due rows into queued executions, one fenced transaction a batch.

Shard actors send it `Due` batches; it drains its mailbox into one batch
(so the busier it is, the bigger and cheaper its transactions: group
commit), runs storage.dispatch.dispatch - which holds every shard's lease
row FOR SHARE and checks the revision - then hands the queued executions to
their pools' queues. Shards whose lease did not check out are reported to
the coordinator, which steps down from them.

A batch may span shards: fencing stays per shard (each lease row is
checked), but one transaction per batch instead of per shard is what lets
one process dispatch a herd at tens of thousands a second.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from datetime import datetime

import msgspec

from herdwick import logs
from herdwick import schedule as sched
from herdwick.actors.base import Actor
from herdwick.actors.messages import Due, LeaseLost, Publish
from herdwick.actors.shard import to_us
from herdwick.clock import Clock
from herdwick.ids import uuid7
from herdwick.model import Schedule
from herdwick.storage import dispatch as store
from herdwick.storage.db import Database
from herdwick.storage.dispatch import Claimed, DueKey, NewExecution, NextDue, Plan, Retry
from herdwick.storage.hot import ReadyExecution

log = logs.get("herdwick.dispatch")

MAX_BATCH_KEYS = 5_000
_schedule_decoder = msgspec.json.Decoder(Schedule)


def plan(claimed: list[Claimed], now: datetime) -> Plan:
    """What to write for claimed due rows. Pure: the transaction calls it between its statements.

    - a retry row re-queues its execution at the row's attempt (finish_dispatch
      parks it instead while its job is paused, and drops it if the execution
      left retry_wait, e.g. its job was canceled);
    - a one-off runs once at its due time;
    - a cron occurrence follows its misfire policy when it is late (skip: the
      latest missed runs, the rest are recorded as skipped; catch_up: each,
      at most 100), and with overlap allow/replace its next occurrence goes
      into the due index now (forbid waits for completion); with replace it
      also cancels the job's still-unfinished earlier occurrences.
    New occurrences of jobs no longer active dispatch nothing.
    """
    out = Plan(executions=[], next_due=[], job_next=[], retries=[])
    for row in claimed:
        if row.execution_id is not None:
            # A retry, replay or trigger of an execution. Whether a pause holds it back is
            # decided in SQL, on the job's state as of finish_dispatch: row.state may predate
            # a pause that committed while claim_due waited for this row.
            out.retries.append(Retry(row.execution_id, row.scheduled_for, row.attempt,
                                     row.shard_id, row.next_run_at, row.job_id))
            continue
        if row.state != "active":
            continue
        schedule = _schedule_decoder.decode(row.schedule)
        if schedule.cron is None:
            # jobs.next_run_at keeps the due time until the execution ends
            # (complete_one_offs clears it): no jobs UPDATE on the herd's path.
            out.executions.append(_execution(row, row.next_run_at, "queued", now))
            continue
        _plan_cron(out, row, schedule, now)
    return out


def _execution(row: Claimed, when: datetime, state: str, now: datetime) -> NewExecution:
    return NewExecution(uuid7(now), row.job_id, row.tenant_id, when, state)


def _plan_cron(out: Plan, row: Claimed, schedule: Schedule, now: datetime) -> None:
    if row.next_run_at > now:
        to_run, skipped = [row.next_run_at], []
    else:
        to_run, skipped = sched.misfire_plan(schedule, row.next_run_at, now, job_id=row.job_id)
        if not to_run:
            to_run = [row.next_run_at]
    out.executions += [_execution(row, t, "queued", now) for t in to_run]
    out.executions += [_execution(row, t, "skipped", now) for t in skipped]
    if schedule.overlap == "replace":
        out.replace.append((row.job_id, to_run[-1]))
    after = max(now, to_run[-1])
    following = sched.next_fire_times(schedule, after, 1, job_id=row.job_id)
    nxt = following[0] if following else None
    out.job_next.append((row.job_id, nxt))
    if nxt is not None and schedule.overlap != "forbid":
        out.next_due.append(NextDue(row.shard_id, nxt, row.job_id))


def ready_executions(result: store.Dispatched) -> dict[str, Publish]:
    """The queued executions, grouped by pool, as the ready stream's contract fields."""
    jobs: dict[uuid.UUID, Claimed] = {c.job_id: c for c in result.claimed}
    by_pool: dict[str, tuple[list[ReadyExecution], list[int]]] = {}
    for q in result.queued:
        job = jobs[q.job_id]
        items, scheduled = by_pool.setdefault(job.pool, ([], []))
        items.append(ReadyExecution(
            execution_id=str(q.execution_id), attempt=q.attempt, job_id=str(q.job_id),
            tenant_id=str(job.tenant_id), scheduled_for=sched.format_utc(q.scheduled_for),
            payload=job.payload, timeout_seconds=job.timeout_s, max_attempts=job.max_attempts,
            backoff_ms=round(job.backoff_s * 1000)))
        scheduled.append(to_us(q.scheduled_for))
    return {pool: Publish(items, scheduled) for pool, (items, scheduled) in by_pool.items()}


class DispatchActor(Actor):
    """Owns nothing but its mailbox; each pass is one fenced transaction."""

    name = "dispatch"

    def __init__(self, *, db: Database, node_id: str, clock: Clock,
                 publish: Callable[[str, Publish], Awaitable[None]],
                 lease_lost: Callable[[LeaseLost], Awaitable[None]],
                 cancel: Callable[[str, str], Awaitable[None]] | None = None,
                 db_now: bool = False) -> None:
        super().__init__(clock=clock)
        self._db = db
        self._node_id = node_id
        self._publish = publish
        self._lease_lost = lease_lost
        self._cancel = cancel
        # True: leases are checked against the database clock (production);
        # False: against the injected clock (tests move time).
        self._db_now = db_now
        self.dispatched = 0

    async def handle(self, msg: object | None) -> None:
        batch = [msg, *self.drain_until_sync(10_000)]
        dues = [m for m in batch if isinstance(m, Due)]
        while dues:
            taken, dues = _take(dues, MAX_BATCH_KEYS)
            try:
                await self.run_once(taken)
            finally:  # committed or not: the shards may load their rows again
                for due in taken:
                    due.settled.set()

    async def run_once(self, dues: list[Due]) -> store.Dispatched:
        revisions: dict[int, int] = {}
        keys: list[DueKey] = []
        for due in dues:
            revisions[due.shard_id] = due.revision
            keys += due.keys
        now = self.clock.now()
        result = await store.dispatch(self._db, self._node_id, revisions, keys,
                                      None if self._db_now else now,
                                      lambda claimed: plan(claimed, now))
        lost = frozenset(revisions) - result.held
        if lost:
            log.warning("dispatch_fenced", shards=sorted(lost))
            await self._lease_lost(LeaseLost(lost))
        for pool, publish in ready_executions(result).items():
            await self._publish(pool, publish)
        if result.replaced and self._cancel is not None:
            pools = {c.job_id: c.pool for c in result.claimed}
            for execution_id, job_id in result.replaced:
                await self._cancel(pools[job_id], str(execution_id))
        self.dispatched += len(result.queued)
        return result


def _take(dues: list[Due], limit: int) -> tuple[list[Due], list[Due]]:
    taken, count = [], 0
    for i, due in enumerate(dues):
        if taken and count + len(due.keys) > limit:
            return taken, dues[i:]
        taken.append(due)
        count += len(due.keys)
    return taken, []
