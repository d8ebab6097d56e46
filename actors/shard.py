"""The shard actor: the next minute or two of one shard's due work, in a min-heap.

Loader: every LOAD_INTERVAL_S, one range scan of the shard's due_index up to
now + LOOKAHEAD_S (overdue included), deduplicated into the heap.
Dispatcher: wakes when the heap top falls due (or on a notify), pops every due
entry and sends them to a dispatch actor, which writes them in a fenced,
batched transaction.

Heap entries are single ints, `due_us << 128 | job_id.int`, so ordering by
int is ordering by (due time, job id) and an entry costs one int object
(about 48 bytes) plus its heap and set slots. Retries carry an execution
id and attempt; those few live in a side dict.
"""

from __future__ import annotations

import asyncio
import heapq
import time
import uuid
from datetime import UTC, datetime, timedelta

from herdwick import logs
from herdwick.actors.base import Actor, Tick
from herdwick.actors.messages import Due, NotifyDue, Reject
from herdwick.clock import Clock
from herdwick.errors import row_error
from herdwick.storage import dispatch as store
from herdwick.storage.db import Database
from herdwick.storage.dispatch import DueKey, DueRow

log = logs.get("herdwick.shard")

LOAD_INTERVAL_S = 2.0
LOOKAHEAD_S = 60.0
# A load while popped rows still wait for their dispatch transaction re-reads
# them for nothing (a herd's backlog: a sixth of the scheduler's time). Loads
# wait for the shard's batches to settle, checking this often, at most MAX_DEFER_S.
DEFER_POLL_S = 0.25
MAX_DEFER_S = 4.0
MAX_POP = 5_000  # entries per Due message: bounds one dispatch transaction
RECENT_TTL_S = 3 * LOAD_INTERVAL_S
_JOB_BITS = 128
_JOB_MASK = (1 << _JOB_BITS) - 1
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def to_us(when: datetime) -> int:
    delta = when - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def from_us(us: int) -> datetime:
    return _EPOCH + timedelta(microseconds=us)


def entry(due_us: int, job_id_int: int) -> int:
    return due_us << _JOB_BITS | job_id_int


def entry_due_us(item: int) -> int:
    return item >> _JOB_BITS


class ShardActor(Actor):
    """Owns one shard's heap. Only its run loop touches heap, members, retries, recent."""

    def __init__(self, shard_id: int, revision: int, *, db: Database, dispatcher: Actor,
                 clock: Clock) -> None:
        super().__init__(clock=clock)
        self.name = f"shard-{shard_id}"
        self.shard_id = shard_id
        self.revision = revision
        self._db = db
        self._dispatcher = dispatcher
        self.heap: list[int] = []
        self._members: set[int] = set()  # what is in the heap, for dedup on reload
        self._retries: dict[int, DueRow] = {}  # heap entry -> its retry row
        self._recent: dict[int, float] = {}  # popped entries -> monotonic pop time
        self._next_load_us = 0
        self._load_due_since_us: int | None = None  # a load is due but deferred since then
        # Due batches sent and not yet settled; set by the dispatcher, pruned here.
        self._unsettled: list[Due] = []
        self.notified = asyncio.Event()  # test signal: a notify was handled

    def idle_timeout(self) -> float | None:
        now_us = to_us(self.clock.now())
        wake_us = self._next_load_us
        if self.heap:
            wake_us = min(wake_us, entry_due_us(self.heap[0]))
        return min(max(0.0, (wake_us - now_us) / 1e6), LOAD_INTERVAL_S)

    async def on_start(self) -> None:
        await self.load(self.clock.now())

    async def handle(self, msg: object | None) -> None:
        now = self.clock.now()
        match msg:
            case NotifyDue(job_id_int=job, due_us=due):
                if due <= to_us(now) + LOOKAHEAD_S * 1e6:
                    self._push(entry(due, job))
                self.notified.set()
            case Tick() | None:
                pass
        now_us = to_us(now)
        if now_us >= self._next_load_us:
            if self._defer_load(now_us):
                self._next_load_us = now_us + int(DEFER_POLL_S * 1e6)
            else:
                await self.load(now)
        await self.dispatch_due(now)

    def _defer_load(self, now_us: int) -> bool:
        self._unsettled = [d for d in self._unsettled if not d.settled.is_set()]
        if not self._unsettled:
            self._load_due_since_us = None
            return False
        if self._load_due_since_us is None:
            self._load_due_since_us = now_us
        return now_us - self._load_due_since_us < MAX_DEFER_S * 1e6

    async def load(self, now: datetime) -> int:
        """One range scan into the heap; returns how many entries it added."""
        rows = await store.load_due(self._db, self.shard_id, now + timedelta(seconds=LOOKAHEAD_S))
        self._forget_old_recent()
        added = 0
        bad: list[DueRow] = []
        for row in rows:
            if row.next_run_at.tzinfo is None:  # asyncpg's -infinity: no time to run it at
                bad.append(row)
                continue
            item = entry(to_us(row.next_run_at), row.job_id.int)
            if item in self._recent:
                continue
            if self._push(item):
                added += 1
                if row.execution_id is not None:
                    self._retries[item] = row
        self._next_load_us = to_us(now) + int(LOAD_INTERVAL_S * 1e6)
        self._load_due_since_us = None
        if bad:
            await self._reject(bad)
        return added

    async def _reject(self, rows: list[DueRow]) -> None:
        keys = [DueKey(self.shard_id, r.next_run_at, r.job_id) for r in rows]
        error = row_error("UnloadableDueRow", "its due time is not a finite time")
        await self._dispatcher.send(Reject(self.shard_id, self.revision, keys,
                                           [error] * len(keys)))

    def _push(self, item: int) -> bool:
        if item in self._members:
            return False
        self._members.add(item)
        heapq.heappush(self.heap, item)
        return True

    def pop_due(self, now: datetime, limit: int = MAX_POP) -> list[DueKey]:
        now_us = to_us(now)
        keys = []
        stamp = time.monotonic()
        while self.heap and entry_due_us(self.heap[0]) <= now_us and len(keys) < limit:
            item = heapq.heappop(self.heap)
            self._members.discard(item)
            self._retries.pop(item, None)
            self._recent[item] = stamp
            keys.append(DueKey(self.shard_id, from_us(entry_due_us(item)),
                               uuid.UUID(int=item & _JOB_MASK)))
        return keys

    async def dispatch_due(self, now: datetime) -> None:
        while keys := self.pop_due(now):
            due = Due(self.shard_id, self.revision, keys)
            self._unsettled.append(due)
            await self._dispatcher.send(due)

    def _forget_old_recent(self) -> None:
        cutoff = time.monotonic() - RECENT_TTL_S
        for item in [i for i, t in self._recent.items() if t < cutoff]:
            del self._recent[item]
