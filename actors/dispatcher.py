"""The dispatch actor: turns due rows into queued executions, one fenced transaction a batch.

The pools' fair queues send it `Due` batches (the work they picked for room on
their streams); it drains its mailbox into one batch (so the busier it is, the
bigger and cheaper its transactions: group commit), runs
storage.dispatch.dispatch - which holds every shard's lease row FOR SHARE and
checks the revision - then hands the queued executions back to their pools'
fair queues to publish, with the Dues they settle. Shards whose lease did not
check out are reported to the coordinator, which steps down from them. Shard
actors send it `Reject`s: rows they could not load.

A batch may span shards: fencing stays per shard (each lease row is
checked), but one transaction per batch instead of per shard is what lets
one process dispatch a herd at tens of thousands a second.

A transaction that fails may still have committed: the connection can die
after Postgres took the COMMIT and before its answer arrived. Its rows then
are gone from due_index, so no shard dispatches them again, and its
executions wait queued, published by no one (the sweeper would find them
only after its 10 s grace). So the jobs of a batch that failed are kept in
doubt, and once Postgres answers again their executions queued since are
published as they are: hw_publish adds an attempt Redis already has only
once, so whatever had been published is not published twice.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta

import msgspec

from herdwick import logs
from herdwick import schedule as sched
from herdwick.actors.base import Actor
from herdwick.actors.messages import Announced, Due, LeaseLost, Publish, Reject
from herdwick.actors.shard import ANNOUNCE_S
from herdwick.clock import Clock, to_us
from herdwick.errors import Rejected, row_error
from herdwick.ids import uuid7
from herdwick.model import Schedule
from herdwick.storage import dispatch as store
from herdwick.storage import sweep
from herdwick.storage.db import Database
from herdwick.storage.dispatch import (
    Claimed,
    DueKey,
    Failed,
    NewExecution,
    NextDue,
    Plan,
    Retry,
)
from herdwick.storage.hot import ReadyExecution

log = logs.get("herdwick.dispatch")

MAX_BATCH_KEYS = 5_000
IN_DOUBT_RETRY_S = 0.5  # how often, with nothing else to do, it asks Postgres again
# Executions queued this long before a failure are not its: room for clocks (queued_at is
# Postgres's in production) and for a transaction that waited on locks.
IN_DOUBT_MARGIN_S = 30.0
_schedule_decoder = msgspec.json.Decoder(Schedule)


def plan(claimed: list[Claimed], now: datetime) -> Plan:
    """What to write for claimed due rows. Pure: the transaction calls it between its statements.

    - a retry row re-queues its execution at the row's attempt (requeue_retries
      parks it instead while its job is paused, and drops it if the execution
      left retry_wait, e.g. its job was canceled);
    - a one-off runs once at its due time;
    - a cron occurrence follows its misfire policy when it is late (skip: the
      latest missed runs, the rest are recorded as skipped; catch_up: each,
      at most 100), and with overlap allow/replace its next occurrence goes
      into the due index now (forbid waits for completion); with replace it
      also cancels the job's still-unfinished earlier occurrences.
    A dry run (the job's flag or its tenant's) records each occurrence it would
    have queued as a dry_run execution instead, publishes nothing, and goes on at
    once to the next occurrence (there is nothing to overlap with, so forbid and
    replace act as allow).
    New occurrences of jobs no longer active dispatch nothing. A row that cannot
    be planned (its stored schedule no longer evaluates, say) goes to `failed`
    with the reason, and the rest are planned as if it were not there.
    """
    out = Plan(executions=[], next_due=[], job_next=[], retries=[], failed=[])
    for row in claimed:
        try:
            _plan_row(out, row, now)  # appends only once nothing more can raise
        except Exception as exc:  # one bad row must not stop the batch: recorded on it
            out.failed.append(Failed(row, row_error("DispatchFailed", exc), uuid7(now)))
    return out


def _plan_row(out: Plan, row: Claimed, now: datetime) -> None:
    if row.execution_id is not None:
        # A retry, replay or trigger of an execution. Whether a pause holds it back is
        # decided in SQL, on the job's state as of requeue_retries: row.state may predate
        # a pause that committed while claim_due waited for this row.
        out.retries.append(Retry(row.execution_id, row.scheduled_for, row.attempt,
                                 row.shard_id, row.next_run_at, row.job_id))
        return
    if row.state != "active":
        return
    schedule = _schedule_decoder.decode(row.schedule)
    if schedule.cron is None:
        # jobs.next_run_at keeps the due time until the execution ends
        # (complete_one_offs clears it): no jobs UPDATE on the herd's path.
        out.executions.append(_execution(row, row.next_run_at, _run_state(row), now))
        return
    _plan_cron(out, row, schedule, now)


def _run_state(row: Claimed) -> str:
    return "dry_run" if row.dry_run else "queued"


def _execution(row: Claimed, when: datetime, state: str, now: datetime) -> NewExecution:
    return NewExecution(uuid7(now), row.job_id, row.tenant_id, when, state)


def _plan_cron(out: Plan, row: Claimed, schedule: Schedule, now: datetime) -> None:
    # Everything that can raise comes before the first append: a row that fails adds nothing.
    if row.next_run_at > now:
        to_run, skipped = [row.next_run_at], []
    else:
        to_run, skipped = sched.misfire_plan(schedule, row.next_run_at, now, job_id=row.job_id)
        if not to_run:
            to_run = [row.next_run_at]
    following = sched.next_fire_times(schedule, max(now, to_run[-1]), 1, job_id=row.job_id)
    nxt = following[0] if following else None
    out.executions += [_execution(row, t, _run_state(row), now) for t in to_run]
    out.executions += [_execution(row, t, "skipped", now) for t in skipped]
    if schedule.overlap == "replace" and not row.dry_run:
        out.replace.append((row.job_id, to_run[-1]))
    out.job_next.append((row.job_id, nxt))
    if nxt is not None and (schedule.overlap != "forbid" or row.dry_run):
        out.next_due.append(NextDue(row.shard_id, nxt, row.job_id, row.tenant_id))


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
            payload=job.payload, timeout_seconds=job.timeout_s,
            max_attempts=job.max_attempts + q.deferrals, backoff_ms=round(job.backoff_s * 1000),
            target=job.target))
        scheduled.append(to_us(q.scheduled_for))
    return {pool: Publish(items, scheduled) for pool, (items, scheduled) in by_pool.items()}


class DispatchActor(Actor):
    """Owns nothing but its mailbox; each pass is one fenced transaction."""

    name = "dispatch"

    def __init__(self, *, db: Database, node_id: str, clock: Clock,
                 publish: Callable[[str, Publish], Awaitable[None]],
                 lease_lost: Callable[[LeaseLost], Awaitable[None]],
                 cancel: Callable[[str, str], Awaitable[None]] | None = None,
                 announce: Callable[[list[Announced]], None] | None = None,
                 db_now: bool = False) -> None:
        super().__init__(clock=clock)
        self._db = db
        self._node_id = node_id
        self._publish = publish
        self._lease_lost = lease_lost
        self._cancel = cancel
        # Due rows to this node's shard actors: a cron successor is in the heap at once,
        # not at the shard's next re-read of its near rows.
        self._announce = announce
        # True: leases are checked against the database clock (production);
        # False: against the injected clock (tests move time).
        self._db_now = db_now
        self.dispatched = 0
        self.failed = 0  # due rows recorded as failed: read by tests and reports
        # Jobs of batches whose transaction failed, and when: this one instance is run
        # again after a crash (the scheduler's factory hands it back), so they outlive it.
        self._in_doubt: list[tuple[datetime, list[uuid.UUID]]] = []
        self.resolved = 0  # executions published after their commit was in doubt

    def idle_timeout(self) -> float | None:
        return IN_DOUBT_RETRY_S if self._in_doubt else None

    async def on_start(self) -> None:
        await self._resolve_in_doubt()

    async def handle(self, msg: object | None) -> None:
        batch = [] if msg is None else [msg, *self.drain_until_sync(10_000)]
        dues = [m for m in batch if isinstance(m, Due)]
        taken: list[Due] = []
        try:
            await self._resolve_in_doubt()  # first: a failure here settles `dues` too
            for reject in [m for m in batch if isinstance(m, Reject)]:
                await self.reject(reject.shard_id, reject.revision, reject.keys,
                                  reject.errors)
            while dues:
                taken, rest = _take(dues, MAX_BATCH_KEYS)
                await self.run_once(taken)
                dues, taken = rest, []
        except BaseException:
            # The batch in hand may have committed (see the module docstring); none of
            # the Dues drained behind it did. The fair queues settle them all (rows that
            # stayed due are loaded again by their shards) and give back their stream
            # slots. Settling is idempotent.
            if taken:
                self._in_doubt.append((self.clock.now(),
                                       sorted({k.job_id for d in taken for k in d.keys})))
            for pool, pool_dues in _by_pool(dues).items():
                await self._publish(pool, Publish([], [], pool_dues))
            raise

    async def _resolve_in_doubt(self) -> None:
        """Publish what the batches in doubt committed; raises while Postgres is away."""
        if not self._in_doubt:
            return
        since = min(at for at, _ in self._in_doubt) - timedelta(seconds=IN_DOUBT_MARGIN_S)
        job_ids = sorted({j for _, ids in self._in_doubt for j in ids})
        rows = await sweep.queued_of_jobs(self._db, job_ids, since)
        self._in_doubt = []
        by_pool: dict[str, list[sweep.Unfinished]] = {}
        for row in rows:
            by_pool.setdefault(row.pool, []).append(row)
        for pool, items in sorted(by_pool.items()):
            await self._publish(pool, Publish([sweep.ready(r, r.attempt) for r in items],
                                              [to_us(r.scheduled_for) for r in items]))
        self.resolved += len(rows)
        log.warning("dispatch_in_doubt_resolved", jobs=len(job_ids), published=len(rows))

    async def run_once(self, dues: list[Due]) -> store.Dispatched:
        revisions: dict[int, int] = {}
        keys: list[DueKey] = []
        for due in dues:
            revisions.update(due.revisions)
            keys += due.keys
        now = self.clock.now()
        result = await self._dispatch(revisions, keys, now)
        lost = frozenset(revisions) - result.held
        if lost:
            log.warning("dispatch_fenced", shards=sorted(lost))
            await self._lease_lost(LeaseLost(lost))
        ready = ready_executions(result)
        pool_dues = _by_pool(dues)
        for pool in sorted(set(ready) | set(pool_dues)):
            publish = ready.get(pool, Publish([], []))
            await self._publish(pool, Publish(publish.items, publish.scheduled_us,
                                              pool_dues.get(pool, [])))
        # Only when a successor or a replaced run needs it: not for a herd of one-offs.
        pools = {c.job_id: c.pool for c in result.claimed} \
            if result.next_due or result.replaced else {}
        if result.next_due and self._announce is not None:
            near = now + timedelta(seconds=ANNOUNCE_S)  # an hourly herd's: the loads'
            self._announce([(due.shard_id, due.job_id.int, to_us(due.next_run_at),
                             str(due.tenant_id or ""), pools[due.job_id])
                            for due in result.next_due if due.next_run_at <= near])
        if result.replaced and self._cancel is not None:
            for execution_id, job_id in result.replaced:
                await self._cancel(pools[job_id], str(execution_id))
        self.dispatched += len(result.queued)
        self.failed += result.failed
        return result

    async def _dispatch(self, revisions: dict[int, int], keys: list[DueKey],
                        now: datetime) -> store.Dispatched:
        """One transaction; if Postgres refuses what it writes, halves until the rows it
        refuses are alone, and records those as failed (O(bad * log n) transactions)."""
        db_now = None if self._db_now else now
        try:
            return await store.dispatch(self._db, self._node_id, revisions, keys, db_now,
                                        lambda claimed: plan(claimed, now))
        except Rejected as exc:
            if len(keys) == 1:
                recorded = await self.reject_rows(
                    revisions, keys, [row_error("DispatchRejected", str(exc))])
                return store.Dispatched(held=set(revisions), claimed=[], queued=[],
                                        failed=recorded)
            half = len(keys) // 2
            first = await self._dispatch(revisions, keys[:half], now)
            second = await self._dispatch(revisions, keys[half:], now)
            return store.Dispatched(
                held=first.held & second.held, claimed=first.claimed + second.claimed,
                queued=first.queued + second.queued, replaced=first.replaced + second.replaced,
                failed=first.failed + second.failed, next_due=first.next_due + second.next_due)

    async def reject(self, shard_id: int, revision: int, keys: list[DueKey],
                     errors: list[str]) -> int:
        """Due rows a shard could not even load: recorded as failed, out of the due index."""
        recorded = await self.reject_rows({shard_id: revision}, keys, errors)
        self.failed += recorded
        return recorded

    async def reject_rows(self, revisions: dict[int, int], keys: list[DueKey],
                          errors: list[str]) -> int:
        now = self.clock.now()
        for key, error in zip(keys, errors, strict=True):
            log.error("row_rejected", shard=key.shard_id, job_id=key.job_id,
                      due=str(key.next_run_at), error=error)
        try:
            recorded = await store.reject(self._db, self._node_id, revisions, keys, errors,
                                          None if self._db_now else now, lambda: uuid7(now))
        except Rejected as exc:  # cannot even record it: leave the row, say so, go on
            log.error("row_reject_failed", count=len(keys), error=str(exc))
            return 0
        return recorded


def _take(dues: list[Due], limit: int) -> tuple[list[Due], list[Due]]:
    taken, count = [], 0
    for i, due in enumerate(dues):
        if taken and count + len(due.keys) > limit:
            return taken, dues[i:]
        taken.append(due)
        count += len(due.keys)
    return taken, []


def _by_pool(dues: list[Due]) -> dict[str, list[Due]]:
    by_pool: dict[str, list[Due]] = {}
    for due in dues:
        by_pool.setdefault(due.pool, []).append(due)
    return by_pool
