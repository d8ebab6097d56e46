"""The hot tier: calls into the Redis functions of lua/, batched.

Nothing here mutates hot state itself: that is the functions' job.
"""

from __future__ import annotations

import re
from importlib.resources import files

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from herdwick import logs, redis_client, telemetry
from herdwick.errors import StorageUnavailable
from herdwick.redis_client import REDIS_ERRORS
from herdwick.storage import keys

log = logs.get("herdwick.hot")

LIBRARY = files("herdwick.lua") / "herdwick.lua"  # package data: a wheel carries it
# The version the library in this release declares (hw_version answers it).
LIBRARY_VERSION = int(re.search(r"^local LIBRARY_VERSION = '(\d+)'", LIBRARY.read_text(),
                                re.MULTILINE).group(1))
PUBLISH_CHUNK = 500  # executions per FCALL: bounds the time one call holds the server


class ReadyExecution(msgspec.Struct, frozen=True, kw_only=True):
    """One execution to put on its pool's ready stream (contract fields)."""

    execution_id: str
    attempt: int
    job_id: str
    tenant_id: str
    scheduled_for: str  # RFC 3339 UTC
    payload: str  # JSON text
    timeout_seconds: int
    max_attempts: int = 5  # hot state only (hw_fail decides retry or dead), not on the stream
    backoff_ms: int = 10_000
    target: str = ""  # an http job's URL (the stream field `target`); empty for a queue


    @property
    def idempotency_key(self) -> str:
        return f"{self.job_id}:{self.scheduled_for}"

    def args(self) -> list[str]:
        return [self.execution_id, str(self.attempt), self.job_id, self.tenant_id,
                self.scheduled_for, self.payload, str(self.timeout_seconds),
                self.idempotency_key, str(self.max_attempts), str(self.backoff_ms),
                *((self.target,) if self.target else ())]


class Admission(msgspec.Struct, frozen=True, kw_only=True):
    """hw_admit's answer: slots granted; the bound, the undelivered and reserved now."""

    granted: int
    cap: int
    waiting: int
    reserved: int


class TokenAsk(msgspec.Struct, frozen=True):
    tenant_id: str
    want: int
    rate: float  # tokens a second
    burst: float


_publish_encoder = msgspec.msgpack.Encoder()


def publish_arg(items: list[ReadyExecution]) -> bytes:
    """hw_publish's one argument: every execution's 10 strings (11 with a target), as a
    MessagePack array."""
    return _publish_encoder.encode([item.args() for item in items])


class NotifyMessage(msgspec.Struct, frozen=True, array_like=True):
    """A near-due submission, so the owning shard adds it to its heap at once."""

    shard_id: int
    job_id: str
    next_run_at_us: int  # microseconds: the heap key must match the due row exactly
    tenant_id: str = ""  # what the shard's fair queue orders it by (empty: an older gateway)
    pool: str = ""


_notify_encoder = msgspec.json.Encoder()
_notify_decoder = msgspec.json.Decoder(list[NotifyMessage])


def decode_notify(data: bytes) -> list[NotifyMessage]:
    return _notify_decoder.decode(data)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class HotTier:
    """A Redis client and key prefix, with herdwick's calls on them."""

    def __init__(self, client: aioredis.Redis, prefix: str) -> None:
        self.client = client
        self.prefix = prefix
        self._groups: set[str] = set()

    async def load_functions(self) -> None:
        """FUNCTION LOAD REPLACE: every process ships the same library, so the last wins."""
        try:
            await self.client.function_load(LIBRARY.read_text(), replace=True)
        except REDIS_ERRORS as exc:
            raise StorageUnavailable(f"redis: cannot load functions: {exc}") from exc

    async def ensure_functions(self) -> int:
        """Load the library on each primary that has none, or an older one; returns how
        many it loaded. A node that joined a cluster (a resharding moved slots to it) or
        a server that restarted from a disk file without functions would otherwise
        answer every FCALL with an error. One hw_version a primary: cheap enough for
        every sweep. A newer library is left alone (a rolling upgrade's)."""
        loaded = 0
        for node in self._primaries():
            target = {} if node is None else {"target_nodes": node}
            try:
                try:
                    have = _text(await self.client.execute_command("FCALL", "hw_version", 0,
                                                                   **target))
                except ResponseError:  # no such function: no library at all
                    have = "0"
                if not have.isdigit() or int(have) < LIBRARY_VERSION:
                    await self.client.execute_command("FUNCTION", "LOAD", "REPLACE",
                                                      LIBRARY.read_text(), **target)
                    loaded += 1
                    log.warning("functions_loaded", node=getattr(node, "name", "redis"),
                                had=have, version=LIBRARY_VERSION)
            except REDIS_ERRORS as exc:
                raise StorageUnavailable(f"redis: cannot check functions: {exc}") from exc
        return loaded

    def _primaries(self) -> list:
        """Each primary of a cluster; [None] (the one server) otherwise."""
        return self.client.get_primaries() if redis_client.is_cluster(self.client) else [None]

    async def ensure_group(self, pool: str) -> None:
        """The ready stream's consumer group, from id 0 so nothing published before is missed."""
        if pool in self._groups:
            return
        try:
            await self.client.sadd(keys.pools_set(self.prefix), pool)
            await self.client.xgroup_create(keys.ready_stream(self.prefix, pool),
                                            keys.WORKERS_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise StorageUnavailable(f"redis: cannot create the group: {exc}") from exc
        except REDIS_ERRORS as exc:
            raise StorageUnavailable(f"redis: cannot create the group: {exc}") from exc
        self._groups.add(pool)

    async def publish(self, batches: dict[str, list[ReadyExecution]],
                      filled: dict[str, int] | None = None) -> int:
        """Publish executions, grouped by pool, in one pipeline; returns how many were added.

        `filled` gives back, per pool, the stream slots hw_admit granted for them.
        """
        filled = filled or {}
        for pool in batches:
            await self.ensure_group(pool)
        pipe = self.client.pipeline(transaction=False)
        for pool, items in batches.items():
            base = keys.pool_base(self.prefix, pool)
            slots = filled.get(pool, 0)
            if not items and slots:
                pipe.fcall("hw_publish", 1, base, publish_arg([]), slots)
            for start in range(0, len(items), PUBLISH_CHUNK):
                chunk = items[start:start + PUBLISH_CHUNK]
                pipe.fcall("hw_publish", 1, base, publish_arg(chunk), slots if start == 0 else 0)
        try:
            with telemetry.timed_redis("hw_publish"):
                results = await pipe.execute()
        except REDIS_ERRORS as exc:
            raise StorageUnavailable(f"redis: publish failed: {exc}") from exc
        return sum(int(r) for r in results)

    async def admit(self, pool: str, want: int, cap: int = 0, release: int = 0) -> Admission:
        """Ask for up to `want` slots of the pool's ready stream (hw_admit)."""
        try:
            with telemetry.timed_redis("hw_admit"):
                reply = await self.client.fcall("hw_admit", 1, keys.pool_base(self.prefix, pool),
                                                want, cap, release)
        except REDIS_ERRORS as exc:
            raise StorageUnavailable(f"redis: hw_admit failed: {exc}") from exc
        granted, cap_now, waiting, reserved = (int(v) for v in reply)
        return Admission(granted=granted, cap=cap_now, waiting=waiting, reserved=reserved)

    async def take_tokens(self, asks: list[TokenAsk]) -> list[tuple[int, int]]:
        """Each tenant's dispatch tokens, one hw_take a bucket, in one round trip:
        (granted, ms until the next token) per ask."""
        if not asks:
            return []
        pipe = self.client.pipeline(transaction=False)
        for ask in asks:
            pipe.fcall("hw_take", 1, keys.tenant_bucket(self.prefix, ask.tenant_id), ask.want,
                       repr(ask.rate), repr(ask.burst))
        try:
            with telemetry.timed_redis("hw_take"):
                replies = await pipe.execute()
        except REDIS_ERRORS as exc:
            raise StorageUnavailable(f"redis: hw_take failed: {exc}") from exc
        return [(int(granted), int(wait_ms)) for granted, wait_ms in replies]

    async def put_tokens(self, returns: list[tuple[str, int, float]]) -> None:
        """Tokens taken and not used, back to (tenant, count, burst)'s bucket."""
        if not returns:
            return
        pipe = self.client.pipeline(transaction=False)
        for tenant_id, count, burst in returns:
            pipe.fcall("hw_put", 1, keys.tenant_bucket(self.prefix, tenant_id), count,
                       repr(burst))
        try:
            with telemetry.timed_redis("hw_put"):
                await pipe.execute()
        except REDIS_ERRORS as exc:
            raise StorageUnavailable(f"redis: hw_put failed: {exc}") from exc

    async def events_behind_ms(self, pool: str, group: str) -> int:
        """How old the pool's oldest event not yet applied by `group` is (Redis server
        ms); 0 when every event is applied."""
        stream = keys.events_stream(self.prefix, pool)
        try:
            (seconds, micros), groups = await self.client.time(), await self.client.xinfo_groups(
                stream)
            mine = [g for g in groups if _text(g["name"]) == group]
            if not mine:
                return 0
            oldest = None
            if int(mine[0]["pending"]):
                summary = await self.client.xpending(stream, group)
                oldest = summary["min"]
            if oldest is None and mine[0].get("lag"):
                after = await self.client.xrange(stream, "(" + _text(mine[0]["last-delivered-id"]),
                                                 "+", count=1)
                oldest = after[0][0] if after else None
        except ResponseError:
            return 0  # no stream or group yet: nothing to apply
        except REDIS_ERRORS as exc:
            raise StorageUnavailable(f"redis: {exc}") from exc
        if oldest is None:
            return 0
        now_ms = int(seconds) * 1000 + int(micros) // 1000
        return max(0, now_ms - int(_text(oldest).partition("-")[0]))

    async def ready_stats(self, pools: list[str]) -> dict[str, tuple[int, int]]:
        """Of each pool's ready stream: (entries no worker has read, entries read and not
        acked), in one round trip; a pool whose stream or group is missing is left out."""
        pipe = self.client.pipeline(transaction=False)
        for pool in pools:
            pipe.xinfo_groups(keys.ready_stream(self.prefix, pool))
        try:
            with telemetry.timed_redis("xinfo_groups"):
                replies = await pipe.execute(raise_on_error=False)
        except REDIS_ERRORS as exc:
            raise StorageUnavailable(f"redis: {exc}") from exc
        stats = {}
        for pool, groups in zip(pools, replies, strict=True):
            if isinstance(groups, Exception):
                continue
            for group in groups:
                if _text(group["name"]) == keys.WORKERS_GROUP:
                    stats[pool] = (int(group.get("lag") or 0), int(group["pending"]))
        return stats

    async def pools(self) -> list[str]:
        """Every pool that has had work published, on any node."""
        try:
            members = await self.client.smembers(keys.pools_set(self.prefix))
        except REDIS_ERRORS as exc:
            raise StorageUnavailable(f"redis: {exc}") from exc
        return sorted(p.decode() for p in members)

    def forget_groups(self) -> None:
        """After Redis lost its data: recreate groups (and the pool set) on next publish."""
        self._groups.clear()

    async def hot_attempts(self, items: list[tuple[str, str]]) -> list[int | None]:
        """The attempt in hot state of each (pool, execution_id); None where there is none."""
        pipe = self.client.pipeline(transaction=False)
        for pool, execution_id in items:
            pipe.hget(keys.hot_state(self.prefix, pool, execution_id), "attempt")
        try:
            found = await pipe.execute()
        except REDIS_ERRORS as exc:
            raise StorageUnavailable(f"redis: {exc}") from exc
        return [None if v is None else int(v) for v in found]

    async def ensure_epoch(self, value: str) -> bool:
        """True if the epoch key was missing (and is now `value`): Redis lost its data."""
        try:
            return bool(await self.client.set(keys.epoch_key(self.prefix), value, nx=True))
        except REDIS_ERRORS as exc:
            raise StorageUnavailable(f"redis: {exc}") from exc

    async def notify(self, messages: list[NotifyMessage]) -> None:
        """Best effort: a lost notify only waits for the next load."""
        if messages:
            await self.client.publish(keys.notify_channel(self.prefix),
                                      _notify_encoder.encode(messages))
