"""The execution-event actor: workers' outcomes from every pool's events stream into Postgres.

Reads `P:{pool}:events` in a consumer group (every scheduler node is one
consumer, so nodes share the work), applies each batch in one statement per
lane (storage/executions.py), and acks only after commit: a crash replays
the batch rather than losing it, and every write is fenced by attempt and
moves state only forward, so the replay changes nothing.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import NamedTuple

import msgspec

from herdwick import logs, telemetry
from herdwick import schedule as sched
from herdwick.actors.base import Actor, Tick
from herdwick.actors.messages import Announced, announced
from herdwick.actors.shard import ANNOUNCE_S
from herdwick.clock import Clock, to_us
from herdwick.errors import Rejected, row_error
from herdwick.ids import shard_of
from herdwick.model import Schedule
from herdwick.redis_client import REDIS_ERRORS
from herdwick.storage import executions as store
from herdwick.storage.db import Database
from herdwick.storage.executions import AttemptRow, ExecutionUpdate, StaleCall, Successor
from herdwick.storage.hot import HotTier, NotifyMessage
from herdwick.storage.protocol import Event, Protocol

log = logs.get("herdwick.executions")

GROUP = "scheduler"
# An entry holds one event, or a worker's batch call's (up to a thousand): each pool's
# read asks for as many entries as make about BATCH_EVENTS at the density seen last.
BATCH_EVENTS = 2_000
MAX_READ_ENTRIES = 2_000
FIRST_DENSITY = 100.0  # events an entry, until a read tells
# A batch commits as this many transactions at once, an execution's events always in
# the same one (by id): one transaction is one Postgres backend, i.e. at most one core.
LANES = 2
# A consumer that has not acked for this long is taken to be dead, and its events are
# applied by another node (harmless if it was only slow: every write is fenced). A killed
# scheduler's executions so wait this long, not the 30 s this was, to show their outcomes.
STALE_MS = 10_000
IDLE_POLL_S = 0.05  # after an empty pass; a busy stream is read back to back
# A read at least this large is a busy stream: its `leased` events whose attempt has no
# later event in the read wait for the next read, which comes at once and most often
# holds the attempt's outcome, so the two become one update of the execution (and one
# insert of its attempt) instead of two of each. Held once at most; a smaller read,
# as in a quiet hour, applies its leases at once.
CARRY_MIN_EVENTS = BATCH_EVENTS // 4
_schedule_decoder = msgspec.json.Decoder(Schedule)
_encode = msgspec.json.Encoder().encode

_STATE_OF = {"leased": "running", "completed": "succeeded"}
_OUTCOME_OF = {"leased": "running", "completed": "succeeded", "failed": "failed",
               "expired": "expired", "canceled": "canceled"}


def _at(ms: int | None) -> datetime | None:
    return None if ms is None else datetime.fromtimestamp(ms / 1000, UTC)


def _jsonb(text: str | None) -> str | None:
    """A worker's result or error as Postgres's jsonb takes it; else as a JSON string.

    The protocol cannot stop a worker in another language from reporting
    text that is not JSON, and one such event must not fail every batch.
    """
    if text is None:
        return None
    try:
        msgspec.json.decode(text)
    except msgspec.DecodeError:
        text = _encode(text).decode()
    return text.replace("\\u0000", "\\ufffd")  # jsonb refuses NUL in strings


def _execution_state(event: Event) -> str | None:
    if event.type in _STATE_OF:
        return _STATE_OF[event.type]
    if event.type in ("failed", "expired"):
        return "dead" if event.outcome == "dead" else "retry_wait"
    return None  # canceled: the API already wrote it


def final(event: Event) -> bool:
    """The attempt's last word: its execution ends here (done, dead or canceled)."""
    return (event.type in ("completed", "canceled")
            or (event.type in ("failed", "expired") and event.outcome == "dead"))


def collapse(events: list[Event]) -> tuple[list[ExecutionUpdate], list[AttemptRow]]:
    """Fold a batch, in stream order, into one update per execution and one row per attempt.

    A statement may touch a row only once, and the events of one attempt
    (leased, then completed) belong in one final state. Of several attempts
    of one execution, the latest wins the execution row. Stale calls are
    not state: stale_calls() takes them.
    """
    times: dict[str, datetime] = {}  # a herd's events share a few scheduled_for values
    updates: dict[str, ExecutionUpdate] = {}
    attempts: dict[tuple[str, int], AttemptRow] = {}
    for event in events:
        if event.type == "stale":
            continue
        scheduled_for = times.get(event.scheduled_for)
        if scheduled_for is None:
            scheduled_for = times[event.scheduled_for] = \
                datetime.fromisoformat(event.scheduled_for)
        error = _jsonb(event.error)
        _fold_attempt(attempts, event, scheduled_for, error)
        state = _execution_state(event)
        if state is None:
            continue
        current = updates.get(event.execution_id)
        if current is not None and current.attempt > event.attempt:
            continue
        if current is None or current.attempt < event.attempt:
            current = updates[event.execution_id] = ExecutionUpdate(
                execution_id=event.execution_id, scheduled_for=scheduled_for,
                attempt=event.attempt, state=state, job_id=event.job_id,
                deferrals=current.deferrals if current is not None else 0)
        _fold_update(current, event, state, error)
    return list(updates.values()), list(attempts.values())


def lone_leases(events: list[tuple[str, Event]]) -> list[tuple[str, Event]]:
    """The `leased` events whose attempt has no other event in the batch, in stream order."""
    seen: collections.Counter = collections.Counter(
        (e.execution_id, e.attempt) for _, e in events)
    return [(p, e) for p, e in events
            if e.type == "leased" and seen[(e.execution_id, e.attempt)] == 1]


def stale_calls(events: list[Event]) -> list[StaleCall]:
    """The batch's refused calls from lapsed or replaced attempts (rare: usually none)."""
    return [StaleCall(execution_id=e.execution_id,
                      scheduled_for=datetime.fromisoformat(e.scheduled_for)
                      if e.scheduled_for else None,
                      attempt=e.attempt, worker_id=e.worker_id, call=e.call or "",
                      at_ms=e.at_ms)
            for e in events if e.type == "stale"]


def _fold_update(update: ExecutionUpdate, event: Event, state: str, error: str | None) -> None:
    update.state = state
    if event.type == "leased":
        update.lease_owner = event.worker_id
        update.lease_until_ms = event.lease_until_ms
        update.started_ms = update.started_ms or event.at_ms
    elif event.deferred:  # put off, never tried: no start, and one more attempt allowed
        update.deferrals += 1
        update.error = error
        update.retry_at = _at(event.retry_at_ms)
    else:
        # An outcome says when its attempt started and who held it: its `leased` event
        # may be applied later, or by another node, and an execution must not end
        # without a start or name another attempt's worker.
        update.started_ms = update.started_ms or event.started_ms
        if event.worker_id and event.type != "canceled":
            update.lease_owner = event.worker_id
        update.finished_ms = event.at_ms
        if event.type == "completed":
            update.result = _jsonb(event.result)
        else:
            update.error = error
            update.retry_at = _at(event.retry_at_ms)


def _fold_attempt(rows: dict, event: Event, scheduled_for: datetime,
                  error: str | None) -> None:
    key = (event.execution_id, event.attempt)
    row = rows.get(key)
    if row is None:
        row = rows[key] = AttemptRow(execution_id=event.execution_id, attempt=event.attempt,
                                     scheduled_for=scheduled_for)
    row.worker_id = row.worker_id or event.worker_id or None
    row.outcome = "deferred" if event.deferred else _OUTCOME_OF.get(event.type, row.outcome)
    if event.type == "leased":
        row.started_ms = row.started_ms or event.at_ms
        row.lease_until_ms = row.lease_until_ms or event.lease_until_ms
    else:
        row.started_ms = row.started_ms or event.started_ms
        row.finished_ms = event.at_ms
        row.error = error or row.error


def next_after(now: datetime):
    """A forbid-overlap job's next occurrence: the first after now (overlaps are skipped)."""
    def compute(job_id: uuid.UUID, schedule_json: str) -> datetime | None:
        schedule = _schedule_decoder.decode(schedule_json)
        times = sched.next_fire_times(schedule, now, 1, job_id=job_id)
        return times[0] if times else None
    return compute


class ExecutionEvents(Actor):
    """Its mailbox is the events streams; Tick refreshes the set of pools to read.

    One batch commits in the background (`_committing`) while the next is
    read and folded, so Postgres and this process work at once; run_once
    starts a batch only after the one before it committed. A batch commits
    in LANES transactions at once, split by execution id, so one execution's
    events still apply in stream order. On a busy stream an attempt's lone
    `leased` event waits one read for its outcome (CARRY_MIN_EVENTS), so most
    executions are written once, not twice. (Tests call run_once beside the
    actor's own loop; every write is fenced and moves state only forward, so
    two callers' batches may commit in any order.)
    """

    name = "execution-events"

    def __init__(self, *, db: Database, hot: HotTier, protocol: Protocol, node_id: str,
                 clock: Clock, db_now: bool = False,
                 announce: Callable[[list[Announced]], None] | None = None) -> None:
        super().__init__(clock=clock)
        self._db = db
        self._hot = hot
        self._announce_here = announce  # to this node's shard actors
        self._protocol = protocol
        self._node_id = node_id
        self._db_now = db_now
        self._pools: list[str] = []
        self._busy = False
        self._replay = True
        self._committing: list[asyncio.Task] = []  # oldest first
        # Lone `leased` events of the last read, applied with the next (run_once writes
        # and reads it); their entries are acked only then, so a crash replays them.
        self._carried: list[tuple[str, Event]] = []
        self._density: dict[str, float] = {}  # pool -> events an entry, smoothed
        self.applied = 0  # events applied; read by tests and reports
        self.stale_recorded = 0  # possible duplicates recorded; read by tests

    def idle_timeout(self) -> float | None:
        return 0 if self._busy else IDLE_POLL_S

    async def on_start(self) -> None:
        # After a (re)start, first re-read what this consumer had read but not acked.
        self._replay = True
        self._carried = []  # unacked, so the replay reads them again
        await self.refresh_pools()

    async def on_stop(self) -> None:
        with contextlib.suppress(Exception):  # a failed commit is replayed at the next start
            await self.quiesce()

    async def quiesce(self) -> None:
        """Wait for the batches committing in the background; a failure is raised here."""
        while self._committing:
            await self._committing.pop(0)

    async def handle(self, msg: object | None) -> None:
        if isinstance(msg, Tick):
            await self.refresh_pools()
            await self.claim_stale()
        elif not self._pools:
            await self.refresh_pools()  # nothing published anywhere yet: look each pass
        self._busy = await self.run_once() > 0

    async def refresh_pools(self) -> None:
        pools = await self._hot.pools()
        for pool in sorted(set(pools) - set(self._pools)):
            await self._protocol.ensure_events_group(pool, GROUP)
        self._pools = sorted(pools)

    async def run_once(self) -> int:
        """Read one batch from every pool and start committing it (then ack it); -> its size.

        Returns once the previous batch is committed; a pass that finds nothing
        also waits for the batch in flight, so 0 means everything read is applied.
        """
        if not self._pools:
            await self.quiesce()
            return 0
        replayed = False
        if self._replay:  # "0" re-reads our own unacked entries: the batch in flight too
            await self.quiesce()
            self._carried = []
            events = await self._read("0")
            replayed = self._replay = bool(events)
            if not events:
                events = await self._read(">")
        else:
            events = await self._read(">")
        carried = [] if replayed or len(events) < CARRY_MIN_EVENTS else lone_leases(events)
        if carried:
            held = {id(e) for _, e in carried}
            events = [pe for pe in events if id(pe[1]) not in held]
        events, self._carried = self._carried + events, carried
        lanes = [self._fold(lane) for lane in _lanes(events)]
        await self.quiesce()
        if events:
            hold = frozenset(e.stream_id for _, e in carried)
            self._committing.append(asyncio.create_task(self._commit(events, lanes, hold)))
        return len(events) + len(carried)

    async def _read(self, from_id: str) -> list[tuple[str, Event]]:
        events: list[tuple[str, Event]] = []
        for pool in self._pools:
            got = await self._protocol.read_events(pool, GROUP, self._node_id,
                                                   self._count(pool), None, from_id=from_id)
            self._learn(pool, got)
            events += [(pool, e) for e in got]
        return events

    def _count(self, pool: str) -> int:
        density = self._density.get(pool, FIRST_DENSITY)
        return max(1, min(MAX_READ_ENTRIES, round(BATCH_EVENTS / density)))

    def _learn(self, pool: str, got: list[Event]) -> None:
        if got:
            entries = len({e.stream_id for e in got})
            seen = self._density.get(pool, FIRST_DENSITY)
            self._density[pool] = (seen + len(got) / entries) / 2

    async def claim_stale(self) -> int:
        """Take over what a dead node's consumer read and never applied."""
        await self.quiesce()
        events: list[tuple[str, Event]] = []
        for pool in self._pools:
            got = await self._protocol.claim_stale_events(pool, GROUP, self._node_id, STALE_MS,
                                                          self._count(pool))
            events += [(pool, e) for e in got]
        if events:
            await self._commit(events, [self._fold([e for _, e in events])])
        return len(events)

    def _fold(self, events: list[Event]) -> _Folded:
        updates, attempts = collapse(events)
        now = self.clock.now()
        return _Folded(updates, attempts, None if self._db_now else now, now,
                       stale_calls(events))

    async def _commit(self, events: list[tuple[str, Event]], lanes: list[_Folded],
                      hold: frozenset[str] = frozenset()) -> None:
        """Apply the lanes at once, then ack: a crash before the ack replays, harmlessly.

        Acks wait for every lane: the events of one entry (a batch call's) may
        be split over lanes. Entries in `hold` have events carried to the next
        batch, which acks them.
        """
        successors = await asyncio.gather(*(self._apply(f) for f in lanes))
        await self._announce(events, lanes, [s for lane in successors for s in lane])
        stale = [c for f in lanes for c in f.stale]
        if stale:
            for tenant_id, call in await store.record_stale_calls(self._db, stale):
                self.stale_recorded += 1
                telemetry.POSSIBLE_DUPLICATES.labels(telemetry.tenant_label(tenant_id), call).inc()
                log.warning("stale_call", tenant_id=tenant_id, call=call)
        export(events)
        for pool in {p for p, _ in events}:
            mine = [e for p, e in events if p == pool]
            await self._protocol.ack_events(pool, GROUP,
                                            [e.stream_id for e in mine if e.stream_id not in hold],
                                            [e.execution_id for e in mine if final(e)])
        self.applied += len(events)


    async def _announce(self, events: list[tuple[str, Event]], lanes: list[_Folded],
                        successors: list[Successor]) -> None:
        """The due rows just committed (retries, deferrals, forbid-overlap successors) go
        into their shards' heaps now, as a submit's job does: shards re-read their near
        rows only every NEAR_REREAD_S, so one left to that would start up to that late.
        Best effort, as the gateway's: when the publish fails, this node's own shards
        still get theirs; another node's wait for that re-read. A retry whose update the
        fence refused has no due row; its entry is claimed as nothing."""
        horizon = self.clock.now() + timedelta(seconds=ANNOUNCE_S)
        where = {e.execution_id: (e.tenant_id, pool) for pool, e in events}
        notes = [NotifyMessage(shard_of(uuid.UUID(u.job_id)), u.job_id, to_us(u.retry_at),
                               *where[u.execution_id])
                 for f in lanes for u in f.updates
                 if u.state == "retry_wait" and u.retry_at is not None
                 and u.retry_at <= horizon and u.execution_id in where]
        notes += [NotifyMessage(shard_of(s.job_id), str(s.job_id), to_us(s.next_run_at),
                                str(s.tenant_id), s.pool)
                  for s in successors if s.next_run_at <= horizon]
        if not notes:
            return
        try:
            await self._hot.notify(notes)
        except (*REDIS_ERRORS, OSError) as exc:
            log.warning("notify_failed", count=len(notes), error=exc)
            if self._announce_here is not None:
                self._announce_here([announced(n) for n in notes])

    async def _apply(self, folded: _Folded) -> list[Successor]:
        """Apply a folded batch; if Postgres refuses something in it, isolate what it refuses.

        Halves by execution until the refused execution is alone (the statements
        are fenced and move state only forward, so re-applying a half that had
        partly committed changes nothing), then applies that one without the
        text a worker supplied (worker id, result, error) and with the refusal as
        its error: its outcome still lands, and the reason is on the row.
        """
        try:
            return (await store.apply(self._db, folded.updates, folded.attempts, folded.now,
                                      shard_of, next_after(folded.clock_now))).successors
        except Rejected as exc:
            ids = sorted({u.execution_id for u in folded.updates}
                         | {a.execution_id for a in folded.attempts})
            if len(ids) == 1:
                return await self._apply_stripped(folded, ids[0], exc)
            half = set(ids[:len(ids) // 2])
            successors = []
            for part in (half, set(ids) - half):
                successors += await self._apply(_Folded(
                    [u for u in folded.updates if u.execution_id in part],
                    [a for a in folded.attempts if a.execution_id in part],
                    folded.now, folded.clock_now, []))
            return successors

    async def _apply_stripped(self, folded: _Folded, execution_id: str,
                              exc: Rejected) -> list[Successor]:
        error = row_error("EventRejected", str(exc))
        log.error("event_rejected", execution_id=execution_id, error=str(exc))
        updates = [msgspec.structs.replace(u, lease_owner=None, result=None, error=error)
                   for u in folded.updates]
        attempts = [msgspec.structs.replace(a, worker_id=None, error=error)
                    for a in folded.attempts]
        try:
            return (await store.apply(self._db, updates, attempts, folded.now, shard_of,
                                      next_after(folded.clock_now))).successors
        except Rejected as again:  # nothing of it can be stored: say so and go on
            log.error("event_dropped", execution_id=execution_id, error=str(again))
            return []


def export(events: list[tuple[str, Event]]) -> None:
    """A committed batch into the Prometheus counters, one increment per distinct label set
    (a replayed batch counts again: at-least-once, like the events)."""
    counts: collections.Counter = collections.Counter()
    lags: dict[tuple[str, str], list[float]] = {}
    for pool, e in events:
        kind = e.type
        if kind == "stale":
            continue
        key = (e.tenant_id, pool)
        if kind == "leased":
            if e.attempt == 1 and e.scheduled_for:
                lags.setdefault(key, []).append(e.at_ms / 1000 - _epoch_s(e.scheduled_for))
            continue
        outcome = "deferred" if e.deferred else _OUTCOME_OF.get(kind, kind)
        counts[(telemetry.ATTEMPTS, key, outcome)] += 1
        if kind == "completed":
            counts[(telemetry.EXECUTIONS, key, "succeeded")] += 1
        elif kind == "canceled":
            counts[(telemetry.EXECUTIONS, key, "canceled")] += 1
        elif e.outcome == "dead":
            counts[(telemetry.EXECUTIONS, key, "dead")] += 1
            counts[(telemetry.DEAD_LETTERS, key, None)] += 1
        elif not e.deferred:
            counts[(telemetry.RETRIES, key, None)] += 1
    for (metric, (tenant, pool), outcome), n in counts.items():
        labels = (telemetry.tenant_label(tenant), telemetry.pool_label(pool))
        metric.labels(*labels, *(() if outcome is None else (outcome,))).inc(n)
    for (tenant, pool), values in lags.items():
        child = telemetry.DISPATCH_LAG.labels("leased", telemetry.tenant_label(tenant),
                                              telemetry.pool_label(pool))
        for value in values:
            child.observe(max(value, 0.0))


@functools.lru_cache(maxsize=1024)  # a herd's events share a few scheduled_for values
def _epoch_s(scheduled_for: str) -> float:
    return datetime.fromisoformat(scheduled_for).timestamp()


def _lanes(events: list[tuple[str, Event]]) -> list[list[Event]]:
    lanes: list[list[Event]] = [[] for _ in range(LANES)]
    for _, event in events:
        lanes[hash(event.execution_id) % LANES].append(event)
    return [lane for lane in lanes if lane]


class _Folded(NamedTuple):
    updates: list[ExecutionUpdate]
    attempts: list[AttemptRow]
    now: datetime | None  # for SQL: None = the database's clock
    clock_now: datetime  # for the next occurrence of forbid-overlap jobs
    stale: list[StaleCall]  # recorded after the lanes commit
