"""Messages between the scheduler's actors: small frozen structs."""

from __future__ import annotations

import asyncio

import msgspec

from herdwick.storage.dispatch import DueKey
from herdwick.storage.hot import ReadyExecution


class NotifyDue(msgspec.Struct, frozen=True):
    """A near-due job announced by the gateway (gateway -> shard actor)."""

    job_id_int: int
    due_us: int


class Due(msgspec.Struct, frozen=True):
    """Due rows popped from one shard's heap (shard actor -> dispatcher).

    `settled` is set by the dispatcher once the batch's transaction ended
    (committed or not); the shard defers its reloads until then.
    """

    shard_id: int
    revision: int
    keys: list[DueKey]
    settled: asyncio.Event = msgspec.field(default_factory=asyncio.Event)


class Reject(msgspec.Struct, frozen=True):
    """Due rows one shard could not load, each with why (shard actor -> dispatcher)."""

    shard_id: int
    revision: int
    keys: list[DueKey]
    errors: list[str]  # JSON text, one per key


class Publish(msgspec.Struct, frozen=True):
    """Committed executions of one pool, to put on its ready stream (dispatcher -> pool queue)."""

    items: list[ReadyExecution]
    scheduled_us: list[int]  # per item, for the dispatch-lag histogram


class LeaseLost(msgspec.Struct, frozen=True):
    """The dispatch transaction found these shards no longer ours (dispatcher -> coordinator)."""

    shard_ids: frozenset[int]
