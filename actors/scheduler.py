"""The scheduler process: coordinator, shard actors, dispatch actors, pool queues, notify.

    gateway --notify--> shard actors --Due--> dispatch actors --Publish--> pool queues --> Redis
                            ^  coordinator starts/stops them as leases come and go

Shutdown order matters: stop the shard actors (no more loading or popping),
let the dispatch actors finish the transaction in flight, let the pool
queues publish what was committed, then release the leases so other nodes
take the shards at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
import uuid
from datetime import datetime, timedelta

import redis.asyncio as aioredis

from herdwick import logs, redis_client, telemetry
from herdwick.actors.base import Supervisor, Tick, every, sync
from herdwick.actors.coordinator import RENEW_INTERVAL_S, Coordinator
from herdwick.actors.dispatcher import DispatchActor
from herdwick.actors.executions import ExecutionEvents
from herdwick.actors.fairqueue import FairQueue
from herdwick.actors.maintenance import INTERVAL_S as MAINTENANCE_INTERVAL_S
from herdwick.actors.maintenance import (
    RETENTION_INTERVAL_S,
    SIGNING_SYNC_S,
    Maintenance,
    Retain,
    SyncSigning,
)
from herdwick.actors.messages import (
    Announced,
    Forget,
    LeaseLost,
    NotifyDue,
    Publish,
    Ready,
    announced,
)
from herdwick.actors.reaper import INTERVAL_S as REAPER_INTERVAL_S
from herdwick.actors.reaper import Reaper
from herdwick.actors.shard import ShardActor
from herdwick.actors.sweeper import INTERVAL_S as SWEEPER_INTERVAL_S
from herdwick.actors.sweeper import Sweeper
from herdwick.clock import Clock, SteeredClock
from herdwick.config import Settings
from herdwick.errors import StorageUnavailable
from herdwick.metrics import Histogram
from herdwick.redis_client import REDIS_ERRORS
from herdwick.storage import keys, migrate
from herdwick.storage import tenants as tenant_store
from herdwick.storage.db import Database
from herdwick.storage.hot import HotTier, NotifyMessage, decode_notify
from herdwick.storage.protocol import Protocol
from herdwick.storage.retention import RetentionPolicy
from herdwick.storage.tenants import TenantLimits

log = logs.get("herdwick.scheduler")

DISPATCH_ACTORS = 2
POOLS_REFRESH_S = 1.0  # a new pool's events are read within this
GAUGES_S = 5.0  # the ready streams' depths are sampled this often, for the gauges
DB_POOL_MAX = 16
LIMITS_REFRESH_S = 2.0  # a tenant's new weight or quota reaches every node within this
LIMITS_LOOKBACK = timedelta(seconds=5)  # reread so a change that committed late is not missed
NOTIFY_RETRY_S = (0.5, 1.0, 2.0, 5.0)  # resubscribe backoff once Redis drops; jittered
NOTIFY_READ_S = 1.0  # longest notify read: how soon the listener sees a stop
STOP_TIMEOUT_S = 5.0  # an actor's clean stop at shutdown, before it is cancelled
# Dispatch actors and pool queues finish what they hold; the coordinator, a shard stop.
DRAIN_TIMEOUT_S = 10.0


def new_node_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Scheduler:
    """One scheduler node. `tick=False` leaves timers to the caller (tests send Tick)."""

    def __init__(self, settings: Settings, *, clock: Clock | None = None,
                 db: Database | None = None, redis: aioredis.Redis | None = None,
                 node_id: str | None = None, tick: bool = True,
                 dispatch_actors: int = DISPATCH_ACTORS) -> None:
        self.settings = settings
        # Unless a test injected one: Postgres's clock, read with every coordinator
        # heartbeat, so a host clock that is off moves no due time (herdwick/clock.py).
        self.clock = clock or SteeredClock()
        self.node_id = node_id or new_node_id()
        self._given_db, self._given_redis = db, redis
        self._tick = tick
        self._dispatch_count = dispatch_actors
        # Leases are checked against the database's clock unless a test injected one.
        self._db_now = clock is None
        self.lag: dict[str, Histogram] = {}  # tenant -> dispatch lag; written by fair queues
        # tenant id -> weight, quota and durability: written by _refresh_limits alone, read
        # by fair queues
        self.limits: dict[str, TenantLimits] = {}
        self._limits_seen: datetime | None = None
        self._order = settings.dispatch_order
        self._caps = settings.ready_caps
        self.db: Database | None = None
        self.hot: HotTier | None = None
        self.dispatchers: list[DispatchActor] = []
        self.coordinator: Coordinator | None = None
        self._core = Supervisor("scheduler")
        self._shards = Supervisor("shards")
        self._pools: dict[str, FairQueue] = {}
        self._tasks: list[asyncio.Task] = []  # the tickers
        self._notify: asyncio.Task | None = None
        self._stopping = asyncio.Event()  # ends the notify listener between two reads
        self._subscribed = asyncio.Event()  # test signal: the notify listener listens
        self._notify_marks: dict[str, asyncio.Future] = {}  # see sync_notifies
        self._ready_stats: dict[str, tuple[int, int]] = {}  # pool -> (depth, pending): gauges

    async def start(self) -> Scheduler:
        self.db = self._given_db or await Database.connect(
            self.settings.database_url, max_size=self.settings.db_pool_max or DB_POOL_MAX,
            generic_plans=True)
        async with self.db.connection() as conn:
            await migrate.check(conn)
        client = self._given_redis or redis_client.connect(self.settings.redis_url)
        self.hot = HotTier(client, self.settings.key_prefix)
        await self.hot.load_functions()
        await self.refresh_limits()
        await self._core.__aenter__()
        await self._shards.__aenter__()
        # One more than asked, the last for sync tenants' work alone: its commits wait for
        # the synchronous standbys, so no other tenant's dispatch waits behind them.
        for i in range(self._dispatch_count + 1):
            actor = DispatchActor(db=self.db, node_id=self.node_id, clock=self.clock,
                                  publish=self._publish, lease_lost=self._lease_lost,
                                  cancel=self._cancel_execution, announce=self._announce,
                                  db_now=self._db_now)
            self.dispatchers.append(actor)
            await self._core.start(f"dispatch-{i}", lambda a=actor: a, restart=True)
        # The sweeper's first pass (everything, on a prefix Redis has no epoch for) must be
        # over before any shard dispatches: it would take this node's own fresh
        # executions, committed and not yet published, for lost ones.
        await self._start_execution_tier(client)
        self.coordinator = Coordinator(self.node_id, db=self.db, clock=self.clock,
                                       shards=self._shards, make_shard=self._make_shard,
                                       db_now=self._db_now, released=self._released)
        await self._core.start("coordinator", lambda: self.coordinator)
        self.maintenance = Maintenance(db=self.db, clock=self.clock, redis=client,
                                       key_prefix=self.settings.key_prefix,
                                       retention=RetentionPolicy.from_settings(self.settings))
        await self._core.start("maintenance", lambda: self.maintenance)
        if self._tick:
            # By name, looked up at each tick: a crashed execution-tier actor is replaced.
            for interval_s, name in ((RENEW_INTERVAL_S, "coordinator"),
                                     (MAINTENANCE_INTERVAL_S, "maintenance"),
                                     (REAPER_INTERVAL_S, "reaper"),
                                     (SWEEPER_INTERVAL_S, "sweeper"),
                                     (POOLS_REFRESH_S, "events")):
                self._tasks.append(asyncio.create_task(
                    every(interval_s, lambda n=name: getattr(self, n).send(Tick()))))
            self._tasks.append(asyncio.create_task(every(LIMITS_REFRESH_S,
                                                         self._refresh_limits_quietly)))
            self._tasks.append(asyncio.create_task(every(
                SIGNING_SYNC_S, lambda: self.maintenance.send(SyncSigning()))))
            self._tasks.append(asyncio.create_task(every(
                RETENTION_INTERVAL_S, lambda: self.maintenance.send(Retain()))))
            self._tasks.append(asyncio.create_task(every(GAUGES_S, self.sample_streams)))
        self._notify = asyncio.create_task(self._listen_notify(client))
        telemetry.watch(self)
        log.info("scheduler_started", node=self.node_id, shards=len(self.coordinator.leases))
        return self

    async def _start_execution_tier(self, client: aioredis.Redis) -> None:
        self.protocol = Protocol(client, self.settings.key_prefix)
        # Each factory builds a new actor and makes it the one the scheduler points at:
        # the supervisor restarts a crashed actor by calling its factory again, and a
        # crashed instance is spent (its run loop has stopped for good). These three
        # talk to Redis, so a Redis restart or flush is what crashes them.
        await self._core.start("execution-events", self._new_events)
        await self._core.start("reaper", self._new_reaper)
        await self._core.start("sweeper", self._new_sweeper)

    def _new_events(self) -> ExecutionEvents:
        self.events = ExecutionEvents(db=self.db, hot=self.hot, protocol=self.protocol,
                                      node_id=self.node_id, clock=self.clock,
                                      db_now=self._db_now, announce=self._announce)
        return self.events

    def _new_reaper(self) -> Reaper:
        self.reaper = Reaper(hot=self.hot, protocol=self.protocol, clock=self.clock)
        return self.reaper

    def _new_sweeper(self) -> Sweeper:
        self.sweeper = Sweeper(db=self.db, hot=self.hot, clock=self.clock,
                               publish=self._publish, db_now=self._db_now)
        return self.sweeper

    async def sample_streams(self) -> None:
        """The ready streams' depths, for the gauges (read by scrapes, between samples)."""
        try:
            self._ready_stats = await self.hot.ready_stats(await self.hot.pools())
        except StorageUnavailable:
            self._ready_stats = {}  # unknown, not stale: the gauges go absent

    def gauges(self):
        """telemetry.GaugeSource: what this node owns, read at scrape time."""
        shards = self.shard_ids
        yield "herdwick_shards_owned", {}, len(shards)
        for shard_id in shards:
            actor = self.shard(shard_id)
            if actor is not None:
                yield "herdwick_shard_heap_entries", {"shard": str(shard_id)}, len(actor.heap)
        for queue in list(self._pools.values()):
            yield from queue.gauges()
        for pool, (depth, pending) in self._ready_stats.items():
            labels = {"pool": telemetry.pool_label(pool)}
            yield "herdwick_ready_depth", labels, depth
            yield "herdwick_ready_pending", labels, pending

    def _make_shard(self, shard_id: int, revision: int) -> ShardActor:
        dispatcher = self.dispatchers[shard_id % len(self.dispatchers)]
        return ShardActor(shard_id, revision, db=self.db, hand=self._hand, reject=dispatcher,
                          clock=self.clock)

    async def refresh_limits(self) -> int:
        """Tenants' weights and quotas changed since the last look (all, the first time);
        a change reaches every fair queue within LIMITS_REFRESH_S."""
        since = self._limits_seen and self._limits_seen - LIMITS_LOOKBACK
        changed, self._limits_seen = await tenant_store.limits_since(self.db, since)
        self.limits.update(changed)
        return len(changed)

    async def _refresh_limits_quietly(self) -> None:
        try:
            await self.refresh_limits()
        except StorageUnavailable as exc:
            log.warning("limits_refresh_failed", error=str(exc))

    async def _queue(self, pool: str) -> FairQueue:
        queue = self._pools.get(pool)
        if queue is None:
            default, caps = self._caps
            queue = FairQueue(pool, hot=self.hot, clock=self.clock,
                              dispatchers=self.dispatchers[:-1],
                              sync_dispatcher=self.dispatchers[-1], limits=self.limits,
                              lag=self.lag,
                              order=self._order, cap=caps.get(pool, default))
            self._pools[pool] = queue
            await self._core.start(f"pool-{pool}", lambda: queue)
        return queue

    async def _hand(self, pool: str, ready: Ready) -> None:
        await (await self._queue(pool)).send(ready)

    async def _released(self, shard_ids: set[int]) -> None:
        for queue in list(self._pools.values()):
            await queue.send(Forget(frozenset(shard_ids)))

    def shard(self, shard_id: int) -> ShardActor | None:
        return self._shards.actor(f"shard-{shard_id}")

    @property
    def shard_ids(self) -> set[int]:
        return set(self.coordinator.leases) if self.coordinator else set()

    async def _publish(self, pool: str, publish: Publish) -> None:
        await (await self._queue(pool)).send(publish)

    async def _cancel_execution(self, pool: str, execution_id: str) -> None:
        try:
            await self.protocol.cancel(pool, execution_id)
        except StorageUnavailable as exc:
            # Canceled in Postgres already: its events are fenced out; the worker
            # learns at its lease's end at the latest.
            log.warning("cancel_failed", execution=execution_id, error=exc)

    async def _lease_lost(self, lost: LeaseLost) -> None:
        await self.coordinator.send(lost)

    async def _listen_notify(self, client: aioredis.Redis) -> None:
        """Wake shard actors on the gateway's notifies; resubscribe when Redis drops.

        redis-py's listen() raises once its own reconnect attempts fail, and a bare
        listen loop would then end for good (no notify again, even after Redis is
        back) or, retried at once, spin. So: one warning a retry, backed off.
        Notifies are only a shortcut (shards re-read their near rows every
        NEAR_REREAD_S, and once more after each subscribe), so those missed while
        Redis is away delay nothing for long.
        """
        channel = keys.notify_channel(self.settings.key_prefix)
        failures = 0
        while not self._stopping.is_set():
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(channel)
                self._reread_all()
                self._subscribed.set()
                if failures:
                    log.info("notify_resubscribed", failures=failures)
                    failures = 0
                # Reads with a timeout, not listen(): cancelling a blocked pubsub read
                # can leave the task hanging in redis-py, so stop() sets _stopping and
                # the loop ends by itself within a read.
                while not self._stopping.is_set():
                    message = await pubsub.get_message(ignore_subscribe_messages=True,
                                                       timeout=NOTIFY_READ_S)
                    if message is not None and message.get("type") == "message":
                        self._wake_shards(message["data"])
                return
            except (*REDIS_ERRORS, OSError) as exc:
                error = str(exc)
                self._subscribed.clear()
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
            delay_s = NOTIFY_RETRY_S[min(failures, len(NOTIFY_RETRY_S) - 1)]
            failures += 1
            log.warning("notify_unavailable", error=error, retry_s=delay_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(),
                                       delay_s * (0.5 + random.random()))

    def _wake_shards(self, data: bytes) -> None:
        due: list[Announced] = []
        for note in decode_notify(data):
            if note.shard_id < 0:  # sync_notifies' mark
                if (mark := self._notify_marks.pop(note.job_id, None)) is not None:
                    mark.set_result(None)
            elif self.shard(note.shard_id) is not None:
                due.append(announced(note))
        self._announce(due)

    def _announce(self, due: list[Announced]) -> None:
        """Due rows to their shards' actors on this node, one message a shard (the
        notify channel's, and the dispatch actors' cron successors)."""
        by_shard: dict[int, list[tuple[int, int, str, str]]] = {}
        for shard_id, *entry in due:
            by_shard.setdefault(shard_id, []).append(tuple(entry))
        for shard_id, entries in by_shard.items():
            self._wake(shard_id, NotifyDue(entries))

    def _wake(self, shard_id: int, note: NotifyDue) -> None:
        """Due rows into their shard's heap, if this node holds the shard. A full mailbox
        drops the note: the shard then re-reads its near rows at its next load."""
        actor = self.shard(shard_id)
        if actor is not None and not actor.try_send(note):
            actor.mark_missed()

    def _reread_all(self) -> None:
        """Notifies published while this node was not subscribed are lost: every shard
        re-reads its near rows at its next load."""
        for shard_id in self.shard_ids:
            if (actor := self.shard(shard_id)) is not None:
                actor.mark_missed()

    async def settle_events(self) -> int:
        """Test signal: apply what is on the events streams now; returns how many events.

        The actor keeps reading on its own meanwhile, so a final Sync waits for any
        batch it took during this pass to be committed too.
        """
        await sync(self.events)
        await self.events.refresh_pools()
        total = 0
        while applied := await self.events.run_once():
            total += applied
        await sync(self.events)
        return total

    async def sync_notifies(self) -> None:
        """Test signal: every notify published before this call has reached its shard's
        mailbox. A mark for no shard (-1) goes through the channel after them."""
        token = uuid.uuid4().hex
        mark = self._notify_marks[token] = asyncio.get_running_loop().create_future()
        try:  # with Redis away, there is nothing to wait for
            await asyncio.wait_for(self._subscribed.wait(), 5)
            await self.hot.notify([NotifyMessage(-1, token, 0, "", "")])
            await asyncio.wait_for(mark, 5)
        except (TimeoutError, *REDIS_ERRORS, OSError):
            pass
        finally:
            self._notify_marks.pop(token, None)

    async def settle(self, rounds: int = 3) -> None:
        """Test signal: the notifies published so far are in their shards' mailboxes,
        every shard has handled a Tick after them, and what that made due has gone
        through the fair queues (a round each, `rounds` times), dispatch and publish."""
        await self.sync_notifies()
        shards = [self.shard(s) for s in sorted(self.shard_ids)]
        for actor in shards:
            if actor is not None:
                await actor.send(Tick())
        for actor in shards:
            if actor is not None:
                await sync(actor)
        for _ in range(rounds):
            for queue in list(self._pools.values()):
                await queue.send(Tick())  # a round now, whatever its last one found
                await sync(queue)
            for actor in self.dispatchers:
                await sync(actor)
        for queue in list(self._pools.values()):
            await sync(queue)

    @property
    def published(self) -> int:
        return sum(q.published for q in self._pools.values())

    async def stop(self) -> None:
        """Clean shutdown (SIGTERM): see the module docstring for the order.

        Each step stops its actors together, not one after another: with Postgres
        or Redis gone many may be crashed at once, and each would run out its own
        deadline in turn (128 shards times 5 s). Shards stop before the coordinator:
        it may be stepping down, stopping shards one by one itself, and cancelling
        it inside one of those stops would leave that shard running for good (the
        Supervisor has already let go of it). Stopped first, the shards' stops it
        has yet to make return at once, and the one in hand ends within
        STOP_TIMEOUT_S, inside the coordinator's longer deadline.
        """
        telemetry.unwatch(self)
        for task in self._tasks:  # tickers first: no Tick, so no new claim
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._stopping.set()
        if self._notify is not None:
            done, _ = await asyncio.wait({self._notify}, timeout=NOTIFY_READ_S + 1)
            if not done:  # a read redis-py would not give up: leave it to the loop's end
                self._notify.cancel()
        if self.coordinator is not None:
            await self._shards.stop_all(STOP_TIMEOUT_S)
            await self._core.stop("coordinator", timeout_s=DRAIN_TIMEOUT_S)
            await self._shards.stop_all(STOP_TIMEOUT_S)  # a claim it had in hand
            await self._core.stop_many([f"dispatch-{i}" for i in range(len(self.dispatchers))],
                                       timeout_s=DRAIN_TIMEOUT_S)
            await self._core.stop_many([f"pool-{pool}" for pool in self._pools],
                                       timeout_s=DRAIN_TIMEOUT_S)
            await self.coordinator.release_all()
        await self._core.stop_all(STOP_TIMEOUT_S)
        await self._core.__aexit__(None, None, None)
        await self._shards.__aexit__(None, None, None)
        if self._given_redis is None and self.hot is not None:
            await self.hot.client.aclose()
        if self._given_db is None and self.db is not None:
            await self.db.close()
        log.info("scheduler_stopped", node=self.node_id)

    def crash(self) -> None:
        """Die without releasing anything (fault tests): tasks cancelled, leases left to expire."""
        for task in self._tasks:
            task.cancel()
        if self._notify is not None:
            self._notify.cancel()
        for key in self._shards.keys():
            self._shards.cancel(key)
        for key in self._core.keys():
            self._core.cancel(key)
