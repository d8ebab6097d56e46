"""Messages between the scheduler's actors: small frozen structs."""

from __future__ import annotations

import uuid

import msgspec

from herdwick.clock import from_us
from herdwick.storage.dispatch import DueKey
from herdwick.storage.hot import NotifyMessage, ReadyExecution

_JOB_BITS = 128
_SHARD_BITS = 8
_JOB_MASK = (1 << _JOB_BITS) - 1


def item(due_us: int, shard_id: int, job_id_int: int) -> int:
    """A fair queue's unit of work: a due row as an int whose high bits are its due time,
    so ints sort by due time (then shard, then job)."""
    return (due_us << _SHARD_BITS | shard_id) << _JOB_BITS | job_id_int


def due_bound(now_us: int) -> int:
    """The least item not yet due at `now_us`: every item below it is due."""
    return item(now_us + 1, 0, 0)


def item_due_us(work: int) -> int:
    return work >> (_SHARD_BITS + _JOB_BITS)


def item_key(work: int) -> DueKey:
    head = work >> _JOB_BITS
    return DueKey(head & 0xFF, from_us(head >> _SHARD_BITS), uuid.UUID(int=work & _JOB_MASK))


def item_shard(work: int) -> int:
    return work >> _JOB_BITS & 0xFF


# A due row as announced: (shard id, job id as int, due time in us, tenant id, pool).
Announced = tuple[int, int, int, str, str]


def announced(note: NotifyMessage) -> Announced:
    """A notify as its shard's actor takes it (the channel's, or one that could not be
    published, handed to this node's shards directly)."""
    return (note.shard_id, uuid.UUID(note.job_id).int, note.next_run_at_us, note.tenant_id,
            note.pool)


class NotifyDue(msgspec.Struct, frozen=True):
    """Due rows just written, announced to their shard's actor (gateway, event folder and
    dispatch -> shard actor): (job id as int, due time in us, tenant id, pool) each. An
    empty tenant or pool (a gateway of an older release) is left to the next re-read."""

    entries: list[tuple[int, int, str, str]]


class Handed:
    """One shard's batch of due work in the fair queues' hands.

    The fair queues lower `remaining` as its items are dispatched or found to
    be duplicates; the shard defers its reloads while any of its batches has
    items left (reloading them would only hand them over again). Written by the
    fair queues, read by the shard: one event loop, so no lock.
    """

    __slots__ = ("remaining", "since")

    def __init__(self, remaining: int, since_us: int = 0) -> None:
        self.remaining = remaining
        self.since = since_us  # when it was handed over, by the shard's clock

    def pending(self, now_us: int, ttl_s: float) -> bool:
        """Items left, and handed over less than ttl_s ago: past that, the shard may hand
        them again (a lost hand-over must not hold its rows back for good)."""
        return self.remaining > 0 and now_us - self.since < ttl_s * 1e6


class Ready(msgspec.Struct, frozen=True):
    """Due work of one shard for one pool, in due order (shard actor -> fair queue)."""

    shard_id: int
    revision: int
    items: list[tuple[str, int]]  # (tenant id, fair-queue item: see actors.fairqueue.item)
    handed: Handed


class Due(msgspec.Struct, frozen=True):
    """A fair queue's pick for one pool, to dispatch in one fenced transaction
    (fair queue -> dispatcher). The dispatcher answers with a Publish carrying it."""

    pool: str
    revisions: dict[int, int]  # shard -> the revision its keys were loaded under
    keys: list[DueKey]
    items: list[int]  # the same work as fair-queue items, for the fair queue to settle
    slots: int  # stream slots hw_admit granted for it: given back when it is published


class Reject(msgspec.Struct, frozen=True):
    """Due rows one shard could not load, each with why (shard actor -> dispatcher)."""

    shard_id: int
    revision: int
    keys: list[DueKey]
    errors: list[str]  # JSON text, one per key


class Publish(msgspec.Struct, frozen=True):
    """Committed executions of one pool, to put on its ready stream, and the Dues they came
    from (dispatcher -> fair queue). The sweeper's republishes come from no Due."""

    items: list[ReadyExecution]
    scheduled_us: list[int]  # per item, for the dispatch-lag histogram
    dues: list[Due] = []


class Forget(msgspec.Struct, frozen=True):
    """These shards left this node: drop their waiting work (scheduler -> fair queue)."""

    shard_ids: frozenset[int]


class LeaseLost(msgspec.Struct, frozen=True):
    """The dispatch transaction found these shards no longer ours (dispatcher -> coordinator)."""

    shard_ids: frozenset[int]
