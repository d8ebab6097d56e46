"""The fair-queue actor: one pool's due work, waiting its turn for room on the pool's stream.

    shard actors --Ready--> fair queue --Due--> dispatch actors --Publish--> fair queue --> Redis

Shards hand it the work that fell due; it holds it per tenant and, whenever
the pool's ready stream has room, picks what goes next by the policy of
actors/fairness.py (weights, deficit round robin) and each tenant's
dispatch-rate quota, and sends that to a dispatch actor, whose fenced
transaction creates the executions. Their Publish comes back here and goes
on the stream.

Room is the stream's bound (hw_admit): at most `cap` entries not yet
delivered to a worker, counting the slots already granted to any
scheduler's fair queue and not yet published. So a pool whose workers are
slow or gone backs up only itself, Redis holds a bounded number of entries
however much falls due, and several schedulers together keep one bound.
What does not fit stays in Postgres as due_index rows, untouched until it
is dispatched: a restart, a scheduler's death or an empty Redis loses
nothing (the shard's next owner loads the rows again) and duplicates nothing
(the dispatch transaction deletes a row once).

Fairness across schedulers: each fair queue is fair among the tenants of
its node's shards, and the 256 shards split every tenant's jobs evenly over
the nodes (by a hash of the job id), so together they give each tenant its
share; quotas are exact across nodes (one token bucket a tenant, in Redis).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Mapping

from herdwick import logs, telemetry
from herdwick.actors.base import Actor, Tick
from herdwick.actors.fairness import DrrPolicy, FifoPolicy
from herdwick.actors.messages import (
    Due,
    Forget,
    Handed,
    Publish,
    Ready,
    due_bound,
    item_due_us,
    item_key,
    item_shard,
)
from herdwick.clock import Clock, to_us
from herdwick.errors import StorageUnavailable
from herdwick.metrics import Histogram
from herdwick.storage.hot import HotTier, TokenAsk
from herdwick.storage.tenants import TenantLimits

log = logs.get("herdwick.fairqueue")

ROUND_MAX = 5_000  # items a round asks room for: one dispatch transaction's worth
# The first round after the queue ran dry asks for this few, and each round after it
# twice as many while the backlog lasts: the earliest due work of a herd goes in a small
# transaction that commits in milliseconds, not behind the largest one. (The dispatcher
# gathers what arrives meanwhile, so the transactions after it are large all the same.)
FIRST_ROUND = 64
WAIT_S = 0.02  # after a round that found no room (or no tokens), look again this soon
# Fewer due items than FIRST_ROUND wait this long for more before their round: steady
# work due a few ms apart goes in one transaction, not one a job (at 1,000 jobs/s a
# round each cost the scheduler and Postgres more than the herd's work per job).
ROUND_GATHER_S = 0.01
# About 8 s in all, within the sweeper's 10 s grace: a Redis refusing writes for a few
# seconds (at its maxmemory, failing over) gets this batch once it takes writes again,
# at its own attempt, instead of the sweeper republishing it as the next one.
PUBLISH_RETRIES_S = (0.05, 0.2, 0.5, 1.0, 2.0, 2.0, 2.0)
ORDERS = ("fair", "fifo")
# How long sync tenants sit out when their dispatcher's mailbox is full (their commits
# wait for a standby that is slow or gone).
SYNC_BEHIND_S = 0.2
_NO_LIMITS = TenantLimits()


class FairQueue(Actor):
    """Owns one pool's waiting work, its grants and its lag histograms."""

    def __init__(self, pool: str, *, hot: HotTier, clock: Clock,
                 dispatchers: list[Actor], limits: Mapping[str, TenantLimits],
                 lag: dict[str, Histogram], order: str = "fair", cap: int = 0,
                 sync_dispatcher: Actor | None = None) -> None:
        super().__init__(clock=clock)
        if order not in ORDERS:
            raise ValueError(f"dispatch order must be one of {ORDERS}, not {order!r}")
        self.name = f"pool-{pool}"
        self.pool = pool
        self._hot = hot
        self._dispatchers = itertools.cycle(dispatchers)
        # Sync tenants' work (their commits wait for the standbys) goes to this one alone,
        # so a slow or absent standby holds back only them. None: with the others.
        self._sync_dispatcher = sync_dispatcher
        # Read only: the scheduler replaces entries as tenants' settings change.
        self._limits = limits
        self._fair = order == "fair"
        policy = DrrPolicy if self._fair else FifoPolicy
        self._policy = policy(lambda tenant: self._limits.get(tenant, _NO_LIMITS).weight)
        self._cap = cap  # 0: hw_admit's default, from the workers' lease rate
        self._queued: dict[int, Handed] = {}  # item -> its shard's batch, until settled
        self._revisions: dict[int, int] = {}  # shard -> latest revision handed over
        self._release = 0  # slots granted and not used: given back at the next hw_admit
        self._next_round = 0.0  # monotonic: no round before, after finding no room
        self._due_seen: float | None = None  # monotonic: when a short round's work was due
        self._round = FIRST_ROUND  # what the next round asks for at most
        self._blocked: dict[str, float] = {}  # tenant -> monotonic time its tokens refill
        # Shared with the scheduler for reporting: written here only, read by reporters.
        self.lag = lag
        self.published = 0
        self.granted = 0  # stream slots hw_admit granted this queue: read by tests
        self.cap_seen = 0  # the bound at the last hw_admit
        self._pool_label = telemetry.pool_label(pool)

    def gauges(self):
        yield "herdwick_fair_queue_depth", {"pool": self._pool_label}, self._policy.backlog

    @property
    def backlog(self) -> int:
        return self._policy.backlog

    def idle_timeout(self) -> float | None:
        earliest = self._policy.earliest()
        if earliest is None:
            return None
        # Work handed over before it falls due waits for its due time, by the clock that
        # decides it (the shards' own), then for the next round.
        until_due = (item_due_us(earliest) - to_us(self.clock.now())) / 1e6
        now = time.monotonic()
        gathered = self._due_seen + ROUND_GATHER_S - now if self._due_seen is not None else 0.0
        return max(0.0, until_due, gathered, self._next_round - now)

    def _due_bound(self) -> int:
        return due_bound(to_us(self.clock.now()))

    async def handle(self, msg: object | None) -> None:
        now_please = False
        for m in [msg, *self.drain_until_sync(10_000)]:
            match m:
                case Ready():
                    self._take_in(m)
                case Publish():
                    await self._publish(m)
                case Forget(shard_ids=gone):
                    self.forget_shards(lambda shard: shard not in gone)
                case Tick():
                    now_please = True  # tests: a round now, whatever the last one found
                case None:
                    pass
        if self._policy.backlog and (now_please or self._round_now()):
            await self.run_once()

    def _round_now(self) -> bool:
        """Whether a round is due: room may have come back, and enough work is due, or
        some has waited ROUND_GATHER_S for more."""
        now = time.monotonic()
        if now < self._next_round:
            return False
        due = self._policy.due(self._due_bound(), FIRST_ROUND)
        if not due:
            self._due_seen = None
            return False
        if due >= FIRST_ROUND:
            return True
        if self._due_seen is None:
            self._due_seen = now
        return now >= self._due_seen + ROUND_GATHER_S

    def _take_in(self, ready: Ready) -> None:
        self._revisions[ready.shard_id] = ready.revision
        duplicates = 0
        for tenant, work in ready.items:
            if work in self._queued:  # reloaded while it waits or is being dispatched
                duplicates += 1
                continue
            self._queued[work] = ready.handed
            self._policy.add(tenant, work)
        ready.handed.remaining -= duplicates

    async def run_once(self) -> int:
        """One round: ask for room, pick by policy and quota, send to a dispatcher."""
        bound = self._due_bound()
        want = self._policy.due(bound, self._round)
        self._due_seen = None
        if not want:
            return 0
        try:
            admission = await self._hot.admit(self.pool, want, self._cap, self._release)
        except StorageUnavailable as exc:
            log.warning("admit_failed", pool=self.pool, error=str(exc))
            self._next_round = time.monotonic() + 1.0
            return 0
        self._release = 0
        self.cap_seen = admission.cap
        granted = admission.granted
        self.granted += granted
        picked = await self._pick(granted, bound) if granted else []
        self._release += granted - len(picked)
        if picked:
            self._send(picked, len(picked))
        if len(picked) < want:  # no room, or no tokens, for the rest yet
            self._next_round = time.monotonic() + WAIT_S
        self._round = (min(ROUND_MAX, self._round * 2) if self._policy.due(bound, 1)
                       else FIRST_ROUND)
        return len(picked)

    async def _pick(self, budget: int, bound: int) -> list[tuple[str, int]]:
        now = time.monotonic()
        self._blocked = {t: until for t, until in self._blocked.items() if until > now}
        if not self._fair:
            return self._policy.take(budget, bound=bound)
        picked = self._policy.take(budget, self._eligible, bound)
        limited = {}
        for tenant, _ in picked:
            rate = self._limits.get(tenant, _NO_LIMITS).rate
            if rate is not None:
                limited[tenant] = limited.get(tenant, 0) + 1
        if not limited:
            return picked
        kept = await self._within_quota(picked, limited)
        if len(kept) < budget:  # what a tenant out of tokens left goes to the others
            kept += self._policy.take(budget - len(kept), self._unlimited_eligible, bound)
        return kept

    def _eligible(self, tenant: str) -> bool:
        return tenant not in self._blocked

    def _unlimited_eligible(self, tenant: str) -> bool:
        return (tenant not in self._blocked
                and self._limits.get(tenant, _NO_LIMITS).rate is None)

    async def _within_quota(self, picked: list[tuple[str, int]],
                            limited: dict[str, int]) -> list[tuple[str, int]]:
        tenants = sorted(limited)
        asks = [TokenAsk(t, limited[t], self._limits[t].rate, self._limits[t].bucket_size)
                for t in tenants]
        try:
            replies = await self._hot.take_tokens(asks)
        except StorageUnavailable as exc:
            log.warning("tokens_failed", pool=self.pool, error=str(exc))
            replies = [(0, 1000)] * len(asks)
        allowed = {t: granted for t, (granted, _) in zip(tenants, replies, strict=True)}
        now = time.monotonic()
        for t, (granted, wait_ms) in zip(tenants, replies, strict=True):
            if granted < limited[t]:
                self._blocked[t] = now + max(wait_ms, 1) / 1000
        kept, back = [], {}
        for tenant, work in picked:  # in due order: a limited tenant keeps its earliest
            if tenant in allowed:
                if allowed[tenant] == 0:
                    back.setdefault(tenant, []).append(work)
                    continue
                allowed[tenant] -= 1
            kept.append((tenant, work))
        for tenant, items in back.items():
            self._policy.put_back(tenant, items)
        return kept

    def _send(self, picked: list[tuple[str, int]], slots: int) -> None:
        if self._sync_dispatcher is None:
            self._send_to(next(self._dispatchers), picked, slots)
            return
        sync = [p for p in picked if self._limits.get(p[0], _NO_LIMITS).sync]
        if len(sync) < len(picked):
            rest = [p for p in picked if not self._limits.get(p[0], _NO_LIMITS).sync]
            self._send_to(next(self._dispatchers), rest, len(rest))
        if sync:
            if not self._send_to(self._sync_dispatcher, sync, len(sync), hold_round=False):
                # Behind on the standbys: their tenants sit out a while, so their share of
                # the rounds meanwhile goes to the others instead of being picked in vain.
                until = time.monotonic() + SYNC_BEHIND_S
                self._blocked.update({tenant: until for tenant, _ in sync})

    def _send_to(self, dispatcher: Actor, picked: list[tuple[str, int]], slots: int, *,
                 hold_round: bool = True) -> bool:
        works = sorted(work for _, work in picked)  # primary-key order: fewer lock waits
        shards = {item_shard(w) for w in works}
        due = Due(self.pool, {s: self._revisions[s] for s in shards},
                  [item_key(w) for w in works], works, slots)
        if dispatcher.stopped or not dispatcher.try_send(due):
            # Its mailbox is full: dispatch is behind. Hand it back and wait a round.
            for tenant, work in picked:
                self._policy.put_back(tenant, [work])
            self._release += slots
            if hold_round:
                self._next_round = time.monotonic() + WAIT_S
            return False
        return True

    async def _publish(self, publish: Publish) -> None:
        slots = sum(d.slots for d in publish.dues)
        if publish.items or slots:
            await self._put_on_stream(publish, slots)
        for due in publish.dues:
            self._settle(due.items)

    async def _put_on_stream(self, publish: Publish, slots: int) -> None:
        for delay in (*PUBLISH_RETRIES_S, None):
            try:
                await self._hot.publish({self.pool: publish.items}, {self.pool: slots})
                break
            except StorageUnavailable as exc:
                if delay is None:
                    # Committed in Postgres, not in Redis: the sweeper republishes these.
                    log.error("publish_dropped", pool=self.pool, count=len(publish.items),
                              error=str(exc))
                    return
                await asyncio.sleep(delay)
        now_us = to_us(self.clock.now())
        exported: dict[str, object] = {}  # tenant -> its Prometheus child, for this batch
        for execution, scheduled_us in zip(publish.items, publish.scheduled_us, strict=True):
            lag_s = (now_us - scheduled_us) / 1e6
            hist = self.lag.get(execution.tenant_id)
            if hist is None:
                hist = self.lag[execution.tenant_id] = Histogram()
            hist.observe(lag_s)
            if execution.attempt == 1:  # a retry's lag is its backoff, not dispatch's
                child = exported.get(execution.tenant_id)
                if child is None:
                    child = exported[execution.tenant_id] = telemetry.DISPATCH_LAG.labels(
                        "published", telemetry.tenant_label(execution.tenant_id),
                        self._pool_label)
                child.observe(lag_s)
        self.published += len(publish.items)

    def _settle(self, works: list[int]) -> None:
        for work in works:
            handed = self._queued.pop(work, None)
            if handed is not None:
                handed.remaining -= 1

    def forget_shards(self, keep: Callable[[int], bool]) -> int:
        """Drop the waiting work of shards this node no longer holds: their new owner loads
        it again. (Work already sent to a dispatcher is fenced out there.)"""
        dropped = self._policy.drop(lambda w: keep(item_shard(w)))
        self._settle(dropped)
        return len(dropped)
