"""The worker protocol's Redis functions (lua/herdwick.lua), as typed async calls.

Thin on purpose: the functions decide everything (fencing on the attempt,
lease deadlines on the Redis server's clock, retry or dead); these wrappers
only spell the FCALL and turn its reply into Python. The scheduler's reaper
and execution-event actor use them, and so do tests that play a worker.

redis-py hands FCALL's status replies back as the status text, bytes or str
by the client's decode_responses (b"OK", "LEASE_LOST", never True: FCALL has
no response callback), and integers as int, under RESP2 and RESP3 alike.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from herdwick import telemetry
from herdwick.errors import HerdwickError, StorageUnavailable
from herdwick.redis_client import REDIS_ERRORS
from herdwick.storage import keys

LEASE_LOST = "LEASE_LOST"
DEAD: Literal["DEAD"] = "DEAD"
OK = "OK"
SETTLED_CHUNK = 1_000  # execution ids per hw_settled call


class UnexpectedReply(HerdwickError):
    """A function answered outside its contract: the loaded library is not ours."""


class Event(msgspec.Struct, frozen=True, kw_only=True):
    """One entry of a pool's events stream (lua/herdwick.lua lists the fields by type)."""

    type: str  # leased | completed | failed | expired | canceled | stale
    execution_id: str
    attempt: int
    job_id: str
    tenant_id: str
    scheduled_for: str  # RFC 3339 UTC, as published
    worker_id: str  # '' on a canceled event with no holder
    at_ms: int  # Redis server time
    lease_until_ms: int | None = None  # leased
    result: str | None = None  # completed: JSON text as the worker gave it
    error: str | None = None  # failed, expired: JSON text
    retryable: bool | None = None  # failed, expired
    outcome: str | None = None  # failed, expired: retry | dead
    retry_at_ms: int | None = None  # failed, expired with outcome retry
    started_ms: int | None = None  # completed, failed, expired: the attempt's first lease
    deferred: bool | None = None  # failed: put off, not counted against max_attempts
    call: str | None = None  # stale: the refused call (heartbeat | complete | fail)
    stream_id: str = ""  # the entry's id, for ack_events (a batch call's events share one)


# One event, or a batch call's events; their values are all strings.
_event_decoder = msgspec.json.Decoder(Event | list[Event], strict=False)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _status(reply: Any) -> str | None:
    return _text(reply) if isinstance(reply, bytes | str) else None


def _int_or_lost(reply: Any, function: str) -> int | None:
    if isinstance(reply, int) and not isinstance(reply, bool):
        return reply
    if _status(reply) == LEASE_LOST:
        return None
    raise UnexpectedReply(f"{function} replied {reply!r}")


def _entries(reply: Any) -> Iterator[tuple[Any, dict | None]]:
    """(id, fields) pairs of an XREADGROUP reply, whatever its shape.

    RESP2 gives [[stream, [(id, fields), ...]]]; redis-py's RESP3 parser gives
    {stream: [[(id, fields), ...]]}, one list deeper. Walk down to the pairs.
    """
    groups = reply.values() if isinstance(reply, dict) else [g[1] for g in reply or ()]
    stack = list(groups)
    while stack:
        items = stack.pop(0)
        for item in items:
            if isinstance(item, tuple | list) and len(item) == 2 and \
                    isinstance(item[0], bytes | str) and not isinstance(item[1], list):
                yield item[0], item[1]
            else:
                stack.append(item)


def _events(stream_id: bytes | str, fields: dict) -> list[Event]:
    """The events of one entry, each carrying the entry's id (several share it)."""
    sid = _text(stream_id)
    data = fields.get(b"e") if isinstance(stream_id, bytes) else fields.get("e")
    if data is None:  # an entry of library version 4 or older: one field per value
        decoded = {_text(k): _text(v) for k, v in fields.items()}
        decoded["stream_id"] = sid
        return [msgspec.convert(decoded, Event, strict=False)]
    try:
        got = _event_decoder.decode(data)
    except msgspec.DecodeError:  # not UTF-8 (a worker's result, say): keep what can be read
        got = _event_decoder.decode(data.decode(errors="replace"))
    events = got if isinstance(got, list) else [got]
    for event in events:
        msgspec.structs.force_setattr(event, "stream_id", sid)
    return events


def _stream_id(text: str) -> tuple[int, int]:
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def _lease_s(lease_s: float) -> str:
    return str(int(lease_s)) if float(lease_s).is_integer() else repr(float(lease_s))


@contextmanager
def _unavailable(what: str) -> Iterator[None]:
    """Times the call (herdwick_redis_call_seconds) and translates a failure."""
    try:
        with telemetry.timed_redis(what):
            yield
    except REDIS_ERRORS as exc:
        raise StorageUnavailable(f"redis: {what} failed: {exc}") from exc


class Protocol:
    """A Redis client and key prefix, with the worker protocol's calls on them."""

    def __init__(self, client: aioredis.Redis, prefix: str) -> None:
        self.client = client
        self.prefix = prefix

    def _base(self, pool: str) -> str:
        return keys.pool_base(self.prefix, pool)

    async def _fcall(self, function: str, pool: str, *args: Any) -> Any:
        with _unavailable(function):
            return await self.client.fcall(function, 1, self._base(pool), *args)

    async def lease(self, pool: str, worker_id: str, lease_s: float, execution_id: str,
                    attempt: int) -> int | None:
        """lease_until_ms, or None if the attempt is not ours to take (LEASE_LOST)."""
        reply = await self._fcall("hw_lease", pool, worker_id, _lease_s(lease_s),
                                  execution_id, attempt)
        return _int_or_lost(reply, "hw_lease")

    async def lease_many(self, pool: str, worker_id: str, lease_s: float,
                         executions: Sequence[tuple[str, int]]) -> list[int | None]:
        """lease() for a batch of (execution_id, attempt), in one round trip."""
        pipe = self.client.pipeline(transaction=False)
        for execution_id, attempt in executions:
            pipe.fcall("hw_lease", 1, self._base(pool), worker_id, _lease_s(lease_s),
                       execution_id, attempt)
        with _unavailable("hw_lease"):
            replies = await pipe.execute()
        return [_int_or_lost(r, "hw_lease") for r in replies]

    async def heartbeat(self, pool: str, execution_id: str, attempt: int, worker_id: str,
                        lease_s: float) -> int | None:
        """The extended lease_until_ms, or None: the lease is lost, stop working."""
        reply = await self._fcall("hw_heartbeat", pool, execution_id, attempt, worker_id,
                                  _lease_s(lease_s))
        return _int_or_lost(reply, "hw_heartbeat")

    async def complete(self, pool: str, execution_id: str, attempt: int, worker_id: str,
                       result_json: str) -> bool:
        """True if recorded; False on LEASE_LOST (someone else owns the outcome)."""
        reply = await self._fcall("hw_complete", pool, execution_id, attempt, worker_id,
                                  result_json)
        status = _status(reply)
        if status == OK:
            return True
        if status == LEASE_LOST:
            return False
        raise UnexpectedReply(f"hw_complete replied {reply!r}")

    async def fail(self, pool: str, execution_id: str, attempt: int, worker_id: str,
                   error_json: str, retryable: bool) -> int | Literal["DEAD"] | None:
        """retry_at_ms, "DEAD" (no more attempts), or None on LEASE_LOST."""
        reply = await self._fcall("hw_fail", pool, execution_id, attempt, worker_id,
                                  error_json, "1" if retryable else "0")
        if _status(reply) == DEAD:
            return DEAD
        return _int_or_lost(reply, "hw_fail")

    async def expire(self, pool: str, limit: int) -> list[str]:
        """Settle up to `limit` lapsed leases as failed attempts; their execution ids."""
        reply = await self._fcall("hw_expire", pool, limit)
        return [_text(execution_id) for execution_id in reply]

    async def cancel(self, pool: str, execution_id: str) -> None:
        """Cancel the execution's current attempt; its holder gets LEASE_LOST next call."""
        reply = await self._fcall("hw_cancel", pool, execution_id)
        if _status(reply) != OK:
            raise UnexpectedReply(f"hw_cancel replied {reply!r}")

    async def pools(self) -> list[str]:
        """Every pool with published work (the set at keys.pools_set)."""
        with _unavailable("pools"):
            members = await self.client.smembers(keys.pools_set(self.prefix))
        return sorted(_text(m) for m in members)

    async def ensure_events_group(self, pool: str, group: str) -> None:
        """XGROUP CREATE ... MKSTREAM from the start of the stream; an existing group is fine."""
        with _unavailable("xgroup create"):
            try:
                await self.client.xgroup_create(keys.events_stream(self.prefix, pool), group,
                                                id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    async def read_events(self, pool: str, group: str, consumer: str, count: int,
                          block_ms: int | None, *, from_id: str = ">") -> list[Event]:
        """Up to `count` events for `consumer`; block_ms None = don't block (0 blocks forever).

        from_id ">" reads new entries; "0" re-reads this consumer's unacked ones,
        which is how a restarted consumer replays what it had not committed.
        A missing group (Redis restarted empty) is recreated and read at once.
        """
        stream = keys.events_stream(self.prefix, pool)
        with _unavailable("xreadgroup"):
            try:
                reply = await self.client.xreadgroup(group, consumer, {stream: from_id},
                                                     count=count, block=block_ms)
            except ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                await self.ensure_events_group(pool, group)
                reply = await self.client.xreadgroup(group, consumer, {stream: from_id},
                                                     count=count, block=block_ms)
        events, trimmed = [], []
        for stream_id, fields in _entries(reply):
            if fields is None:  # trimmed while pending: nothing left to apply
                trimmed.append(stream_id)
                continue
            events += _events(stream_id, fields)
        if trimmed:
            await self.ack_events(pool, group, [_text(i) for i in trimmed])
        return events

    async def claim_stale_events(self, pool: str, group: str, consumer: str, min_idle_ms: int,
                                 count: int) -> list[Event]:
        """XAUTOCLAIM events another consumer read but never acked (its node died)."""
        stream = keys.events_stream(self.prefix, pool)
        with _unavailable("xautoclaim"):
            try:
                reply = await self.client.xautoclaim(stream, group, consumer, min_idle_ms,
                                                     start_id="0-0", count=count)
            except ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                return []
        return [e for stream_id, fields in reply[1] if fields for e in _events(stream_id, fields)]

    async def ack_events(self, pool: str, group: str, ids: Sequence[str],
                         settled: Sequence[str] = ()) -> int:
        """XACK after the events are committed, then XDEL them, in one round trip; with
        `settled`, the execution ids whose final outcome was among them (hw_settled).

        One group reads the events stream, so an acked entry is needed by no
        one: deleting it keeps the stream's length bounded by what is unapplied.
        Returns how many were pending.
        """
        ids = list(dict.fromkeys(ids))  # the events of one entry share its id
        if not ids:
            return 0
        stream = keys.events_stream(self.prefix, pool)
        with _unavailable("xack"):
            pipe = self.client.pipeline(transaction=False)
            pipe.xack(stream, group, *ids)
            pipe.xdel(stream, *ids)
            base = keys.pool_base(self.prefix, pool)
            for start in range(0, len(settled), SETTLED_CHUNK):
                pipe.fcall("hw_settled", 1, base, *settled[start:start + SETTLED_CHUNK])
            acked, *_ = await pipe.execute()
        return acked

    async def trim_ready(self, pool: str, group: str = keys.WORKERS_GROUP) -> int:
        """Drop ready entries every worker is done with: delivered, and not pending.

        The cut is the oldest pending entry, or the group's last delivered one;
        entries not yet delivered are never trimmed. Returns how many went.
        """
        stream = keys.ready_stream(self.prefix, pool)
        with _unavailable("xtrim"):
            try:
                groups = await self.client.xinfo_groups(stream)
            except ResponseError:
                return 0  # no stream yet
            mine = [g for g in groups if _text(g["name"]) == group]
            if not mine:
                return 0
            cut = _text(mine[0]["last-delivered-id"])
            if int(mine[0]["pending"]):
                summary = await self.client.xpending(stream, group)
                if summary["min"] is not None:  # else acked since XINFO: nothing pending
                    cut = min(cut, _text(summary["min"]), key=_stream_id)
            if cut == "0-0":
                return 0
            return await self.client.xtrim(stream, minid=cut, approximate=False)
