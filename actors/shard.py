"""The shard actor: the next minute or two of one shard's due work, in a min-heap.

Loader: a range scan of the shard's due_index up to now + LOOKAHEAD_S, in
whole minutes, deduplicated into the heap. What an earlier load read is not
read again: every writer of a due row within the horizon announces it (the
gateway's submits, resumes and triggers, the event folder's retries and
forbid-overlap successors, the dispatch's cron successors), so the heap holds
it already. So a shard loads only when a load can find something: when the
next minute enters its horizon (once a minute, at the shard's own point of a
LOAD_INTERVAL_S spread), and for lost announcements, whose rows due within
NEAR_S (overdue included) are read again, as keys alone (the jobs of the few
keys the shard does not hold are looked up), every NEAR_REREAD_S, at once
after a dropped notify or a new subscription, and when a hand-over lapsed. A
herd is read about once, and an idle shard reads about 7 times a minute, not 30.
Popper: wakes PREPARE_S before the heap top falls due (or on a notify), pops
every entry due by then and within HAND_SPAN_S after, and hands them to their
pools' fair queues (actors/fairqueue.py), which hold each until it is due and
send it on to the dispatch actors when the pool's stream has room. Handing over
early moves the Python work of a herd (a few us an entry, all in one event loop)
out of the due second, so its first dispatch does not wait behind the rest's
hand-over; handing a span over at once wakes a shard about once a second under
steady work, not once a job.

Heap entries are single ints, `due_us << 160 | class << 128 | job_id.int`, so
ordering by int is ordering by due time, and an entry costs one int object
(about 56 bytes) plus its heap and set slots. The class is the entry's
(tenant, pool), numbered in a small table of this shard's own.
"""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta

from herdwick import logs
from herdwick.actors.base import Actor, Tick
from herdwick.actors.messages import Handed, NotifyDue, Ready, Reject, item
from herdwick.clock import Clock, to_us
from herdwick.errors import row_error
from herdwick.ids import SHARD_COUNT
from herdwick.storage import dispatch as store
from herdwick.storage.db import Database
from herdwick.storage.dispatch import DueKey, DueRow
from herdwick.storage.jobs import due_minute

log = logs.get("herdwick.shard")

# A node's shards load spread over this much (each at its own point of it), and a load
# cut short by LOAD_LIMIT goes on this soon.
LOAD_INTERVAL_S = 2.0
LOOKAHEAD_S = 60.0
# Loads read whole minutes, up to the one a minute ahead, once: a row written due within
# this may fall in a minute its shard read already, so its writer announces it.
ANNOUNCE_S = 2 * LOOKAHEAD_S
# Rows an earlier load read are in the heap; only those due within NEAR_S are read again,
# to catch a row added behind the horizon whose notify was lost before it falls due:
# longer than a load interval and a deferred load's wait together.
NEAR_S = 10.0
# How often that re-read runs without a known loss: a lost notify's row starts at most
# this late (and a lapsed hand-over is handed again this much after HANDED_TTL_S).
NEAR_REREAD_S = 10.0
# A load while handed-over work still waits (for room on its stream, or for its
# dispatch transaction) re-reads it for nothing (a herd's backlog: a sixth of the
# scheduler's time). Loads wait for the shard's batches to settle, checking this
# often, at most MAX_DEFER_S.
DEFER_POLL_S = 0.25
DEFER_AT = 64  # unsettled items of a shard that defer its load
MAX_DEFER_S = 4.0
MAX_POP = 5_000  # entries per pass: bounds one hand-over
# After a pass, the next waits this long: jobs due across a second would otherwise wake
# every shard once per job and cross the fair queue one message each (a 300,000-job
# second took the scheduler 4 s to hand over); a few ms of lag buys batches.
POP_GATHER_S = 0.02
# How long before their due time entries go to the fair queue, which holds them until
# due: a herd due across one second is all handed over before its first job is due (a
# 100,000 herd's hand-over takes the loop about 0.4 s).
PREPARE_S = 1.0
# A pass also takes what falls due within this after PREPARE_S: under steady work (a few
# jobs a second a shard) a shard then wakes about once a second, not once a job (each
# wake a timer, a hand-over message and a fair-queue wake).
HAND_SPAN_S = 1.0
RECENT_TTL_S = 3 * LOAD_INTERVAL_S
# Work handed to the fair queue and not settled after this long is loaded and handed
# again: a hand-over lost on the way (a dispatch that died with its batch) would else
# hold its rows back until the shard moved. Handing twice is harmless: the fair queue
# drops what it holds already, and a dispatch claims each due row once.
HANDED_TTL_S = 10.0
_JOB_BITS = 128
_CLASS_BITS = 32
_JOB_MASK = (1 << _JOB_BITS) - 1
_CLASS_MASK = (1 << _CLASS_BITS) - 1
# An entry's key: the entry without its class, all a re-read row tells of it.
_KEY_MASK = ~(_CLASS_MASK << _JOB_BITS)

Hand = Callable[[str, Ready], Awaitable[None]]  # (pool, work) to that pool's fair queue


def load_phase(shard_id: int) -> float:
    """When in each load interval a shard loads, as a share of it: (0, 1]."""
    return (shard_id + 1) / SHARD_COUNT


def entry(due_us: int, job_id_int: int, cls: int = 0) -> int:
    return (due_us << _CLASS_BITS | cls) << _JOB_BITS | job_id_int


def entry_due_us(value: int) -> int:
    return value >> (_JOB_BITS + _CLASS_BITS)


class ShardActor(Actor):
    """Owns one shard's heap. Only its run loop touches heap, members, classes, recent."""

    def __init__(self, shard_id: int, revision: int, *, db: Database, hand: Hand,
                 reject: Actor, clock: Clock) -> None:
        super().__init__(clock=clock)
        self.name = f"shard-{shard_id}"
        self.shard_id = shard_id
        self.revision = revision
        self._db = db
        self._hand = hand
        self._reject_to = reject  # a dispatch actor: rows it cannot load are recorded there
        self.heap: list[int] = []
        self._members: set[int] = set()  # keys of what is in the heap, for dedup on reload
        self._classes: list[tuple[str, str]] = []  # class -> (tenant id, pool)
        self._class_of: dict[tuple[str, str], int] = {}
        self._recent: dict[int, int] = {}  # popped keys -> pop time (us, the clock's)
        # This shard's point of the LOAD_INTERVAL_S spread, after whatever makes it load.
        self._phase_us = int(LOAD_INTERVAL_S * 1e6 * load_phase(shard_id))
        self._next_load_us = 0
        self._next_pop_us = 0  # idle wakes for due entries no sooner than this
        self._load_due_since_us: int | None = None  # a load is due but deferred since then
        self._read_until: datetime | None = None  # the last whole load's horizon
        self._next_reread_us = 0  # the near rows are read again at the first load after
        # A notify of this shard's was dropped (a full mailbox, a lost subscription): the
        # next load re-reads the near rows. Written by the scheduler, on the same loop.
        self.missed_notify = False
        # Batches handed over whose work the fair queues have not settled yet.
        self._unsettled: list[Handed] = []
        # Popped keys -> their batch, while it is unsettled: a load that cannot wait
        # any longer (MAX_DEFER_S) skips them instead of handing a herd's backlog over
        # again every few seconds (a tenth of the scheduler and Postgres in a long drain).
        self._handed: dict[int, Handed] = {}
        self.notified = asyncio.Event()  # test signal: a notify was handled

    def idle_timeout(self) -> float | None:
        now_us = to_us(self.clock.now())
        wake_us = self._next_load_us
        if self.heap:
            wake_us = min(wake_us, max(entry_due_us(self.heap[0]) - int(PREPARE_S * 1e6),
                                       self._next_pop_us))
        return min(max(0.0, (wake_us - now_us) / 1e6), NEAR_REREAD_S)

    async def on_start(self) -> None:
        now = self.clock.now()
        await self.load(now)
        # A notify published between that read and this actor's first message (a shard
        # moving here from another node) may have reached neither: read the near rows
        # again at the next load.
        self.missed_notify = True
        # The next load comes at the shard's own share of the interval, so a node's shards
        # load spread over it, not all together every 2 s (that burst of loads was the
        # steady lag's p99: 64 ms in the second of it, 23 between).
        self._next_load_us = to_us(now) + self._phase_us

    async def handle(self, msg: object | None) -> None:
        now = self.clock.now()
        match msg:
            case NotifyDue(entries=entries):
                until_us = self._read_until_us(now)
                # Not checked against what was popped lately, as a load's rows are: a
                # row written again under a key just claimed (a retry parked, then
                # resumed) is new work; handing a row twice is harmless.
                for job, due, tenant, pool in entries:
                    if tenant and pool and due <= until_us:
                        self._push(entry(due, job, self._class(tenant, pool)))
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

    def mark_missed(self) -> None:
        """A notify of this shard's was lost (a full mailbox, a new subscription): its
        next load, soon, reads the near rows again. Called by the scheduler, on this loop."""
        self.missed_notify = True
        soon_us = to_us(self.clock.now()) + self._phase_us
        if soon_us < self._next_load_us:
            self._next_load_us = soon_us
            self.try_send(Tick())  # asleep until a later load: wait for this one instead

    def _read_until_us(self, now: datetime) -> int:
        """The end of what the loads have read: they read whole minutes, up to the one
        that holds the last horizon, and do not read them again (but for lost notifies).
        A row announced beyond it is left to the load that reaches its minute."""
        if self._read_until is None:
            return to_us(now) + int(LOOKAHEAD_S * 1e6)
        return to_us(due_minute(self._read_until)) + 60_000_000 - 1

    def _defer_load(self, now_us: int) -> bool:
        self._unsettled = [h for h in self._unsettled if h.pending(now_us, HANDED_TTL_S)]
        # Only many unsettled items defer (a herd's, due or about to be): a load re-reads
        # each of them for nothing, but steady work always has a few handed over early.
        if sum(h.remaining for h in self._unsettled) < DEFER_AT:
            self._load_due_since_us = None
            return False
        if self._load_due_since_us is None:
            self._load_due_since_us = now_us
        return now_us - self._load_due_since_us < MAX_DEFER_S * 1e6

    def _class(self, tenant: str, pool: str) -> int:
        cls = self._class_of.get((tenant, pool))
        if cls is None:
            cls = self._class_of[tenant, pool] = len(self._classes)
            self._classes.append((tenant, pool))
        return cls

    async def load(self, now: datetime) -> int:
        """One range scan into the heap; returns how many entries it added."""
        horizon = now + timedelta(seconds=LOOKAHEAD_S)
        now_us = to_us(now)
        # Settled batches are forgotten; lapsed ones (items left past HANDED_TTL_S) are
        # why their rows are read again now.
        handed, lapsed = self._handed, False
        self._handed = {}
        for value, batch in handed.items():
            if batch.pending(now_us, HANDED_TTL_S):
                self._handed[value] = batch
            elif batch.remaining > 0:
                lapsed = True
        reread = self.missed_notify or lapsed or now_us >= self._next_reread_us
        if reread:
            self.missed_notify = False
            self._next_reread_us = now_us + int(NEAR_REREAD_S * 1e6)
        rows = await store.load_due(self._db, self.shard_id, horizon,
                                    now + timedelta(seconds=NEAR_S) if reread else None,
                                    self._read_until)
        cut_short = len(rows) >= store.LOAD_LIMIT  # it covered less: read the rest soon
        if not cut_short:
            self._read_until = horizon
        self._forget_old_recent(now)
        added = 0
        bad: list[DueRow] = []
        unknown: list[tuple[int, int, DueRow]] = []  # (due, job, row): keys not held
        for row in rows:
            if row.next_run_at.tzinfo is None:  # asyncpg's -infinity: no time to run it at
                bad.append(row)
                continue
            due_us, job = to_us(row.next_run_at), row.job_id.int
            key = entry(due_us, job)
            if key in self._members or key in self._recent or key in self._handed:
                continue
            if not row.tenant_id:
                unknown.append((due_us, job, row))
            elif self._push(entry(due_us, job, self._class(row.tenant_id, row.pool))):
                added += 1
        if unknown:  # a job gone since has no class, and no row to dispatch either
            classes = await store.job_classes(self._db, [row.job_id for _, _, row in unknown])
            for due_us, job, row in unknown:
                if (found := classes.get(row.job_id)) is not None and self._push(
                        entry(due_us, job, self._class(*found))):
                    added += 1
        self._next_load_us = self._next_load_at(now_us, cut_short)
        self._load_due_since_us = None
        if bad:
            await self._reject(bad)
        return added

    def _next_load_at(self, now_us: int, cut_short: bool) -> int:
        """When a load can next find something: the rest of a cut-short read, the next
        minute entering the horizon (at this shard's point of the spread), or the next
        re-read of near rows, whichever comes first."""
        if cut_short or self._read_until is None:
            return now_us + int(LOAD_INTERVAL_S * 1e6)
        # Horizon now + LOOKAHEAD_S reaches the minute after the last one read then.
        next_minute_us = (to_us(due_minute(self._read_until)) + 60_000_000
                          - int(LOOKAHEAD_S * 1e6) + self._phase_us)
        return max(now_us, min(next_minute_us, self._next_reread_us))

    async def _reject(self, rows: list[DueRow]) -> None:
        keys = [DueKey(self.shard_id, r.next_run_at, r.job_id) for r in rows]
        error = row_error("UnloadableDueRow", "its due time is not a finite time")
        await self._reject_to.send(Reject(self.shard_id, self.revision, keys,
                                          [error] * len(keys)))

    def _push(self, value: int) -> bool:
        key = value & _KEY_MASK
        if key in self._members:
            return False
        self._members.add(key)
        heapq.heappush(self.heap, value)
        return True

    def pop_due(self, now: datetime, limit: int = MAX_POP,
                ahead_s: float = PREPARE_S + HAND_SPAN_S) -> dict[str, list[tuple[str, int, int]]]:
        """What is due within `ahead_s`, by pool: (tenant id, fair-queue item, entry key),
        in due order."""
        stamp = to_us(now)
        horizon_us = stamp + int(ahead_s * 1e6)
        by_pool: dict[str, list[tuple[str, int]]] = {}
        popped = 0
        while self.heap and entry_due_us(self.heap[0]) <= horizon_us and popped < limit:
            value = heapq.heappop(self.heap)
            key = value & _KEY_MASK
            self._members.discard(key)
            self._recent[key] = stamp
            tenant, pool = self._classes[value >> _JOB_BITS & _CLASS_MASK]
            by_pool.setdefault(pool, []).append(
                (tenant, item(entry_due_us(value), self.shard_id, value & _JOB_MASK), key))
            popped += 1
        return by_pool

    async def dispatch_due(self, now: datetime) -> None:
        while by_pool := self.pop_due(now):
            self._next_pop_us = to_us(now) + int(POP_GATHER_S * 1e6)
            for pool, popped in by_pool.items():
                handed = Handed(len(popped), to_us(now))
                self._unsettled.append(handed)
                for _, _, key in popped:
                    self._handed[key] = handed
                items = [(tenant, work) for tenant, work, _ in popped]
                await self._hand(pool, Ready(self.shard_id, self.revision, items, handed))

    def _forget_old_recent(self, now: datetime) -> None:
        cutoff = to_us(now) - RECENT_TTL_S * 1e6
        for value in [v for v, t in self._recent.items() if t < cutoff]:
            del self._recent[value]
