"""The coordinator: this node's membership and its fair share of the 256 shards.

Each pass (every RENEW_INTERVAL_S, jittered): heartbeat the node, renew the
leases it holds (a shard whose renewal does not come back is stepped down
from at once; so is every shard when the renewal's outcome is unknown),
give back shards above the fair share (256 split exactly over the live nodes) so a joining
node can take them, and claim free or expired shards up to the share. Each
claim bumps the shard's revision, the fencing token its dispatches carry.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from datetime import datetime

from herdwick import logs
from herdwick.actors.base import Actor, Supervisor, Tick
from herdwick.actors.messages import LeaseLost
from herdwick.clock import Clock, SteeredClock
from herdwick.errors import StorageUnavailable
from herdwick.ids import SHARD_COUNT
from herdwick.storage import leases as store
from herdwick.storage.db import Database
from herdwick.storage.leases import Lease

log = logs.get("herdwick.coordinator")

LEASE_S = 10.0
RENEW_INTERVAL_S = 3.0
NODE_TTL_S = 10.0


def fair_share(node_id: str, live: list[str]) -> int:
    """256 split exactly: the first (256 mod n) nodes by id take one shard more."""
    nodes = sorted(set(live) | {node_id})
    base, extra = divmod(SHARD_COUNT, len(nodes))
    return base + (1 if nodes.index(node_id) < extra else 0)


class Coordinator(Actor):
    """Owns `leases` (shard -> revision); starts and stops shard actors to match it."""

    name = "coordinator"

    def __init__(self, node_id: str, *, db: Database, clock: Clock, shards: Supervisor,
                 make_shard: Callable[[int, int], Actor], db_now: bool = False,
                 released: Callable[[set[int]], Awaitable[None]] | None = None) -> None:
        super().__init__(clock=clock)
        self.node_id = node_id
        self._db = db
        self._shards = shards
        self._make_shard = make_shard
        self._db_now = db_now
        self._released = released  # told of shards this node let go, lost or given back
        self.leases: dict[int, int] = {}

    def _now(self) -> datetime | None:
        return None if self._db_now else self.clock.now()

    async def on_start(self) -> None:
        await self.run_once()

    async def handle(self, msg: object | None) -> None:
        match msg:
            case Tick():
                await self.run_once()
            case LeaseLost(shard_ids=lost):
                await self._step_down(lost & set(self.leases))

    async def run_once(self) -> None:
        now = self._now()
        try:
            sent = time.monotonic()
            db_now = await store.heartbeat(self._db, self.node_id, now)
            if isinstance(self.clock, SteeredClock):
                self.clock.observe(db_now, sent, time.monotonic())
            await self._renew(now)
            live = await store.live_nodes(self._db, now, NODE_TTL_S)
        except StorageUnavailable as exc:
            log.warning("coordinator_unavailable", error=exc, held=len(self.leases))
            await self._step_down(set(self.leases))
            return
        share = fair_share(self.node_id, live)
        if len(self.leases) > share:
            await self._give_back(len(self.leases) - share)
        elif len(self.leases) < share:
            await self._claim(share - len(self.leases), now)

    async def _renew(self, now: datetime | None) -> None:
        held = [Lease(s, r) for s, r in self.leases.items()]
        kept = await store.renew(self._db, self.node_id, held, LEASE_S, now)
        lost = set(self.leases) - kept
        if lost:
            log.warning("shards_lost", shards=sorted(lost))
            await self._step_down(lost)

    async def _give_back(self, count: int) -> None:
        extra = sorted(self.leases)[-count:]
        leases = [Lease(s, self.leases[s]) for s in extra]
        await self._stop_shards(extra)
        await store.release(self._db, self.node_id, leases)
        log.info("shards_released", count=len(extra))

    async def _claim(self, count: int, now: datetime | None) -> None:
        claimed = await store.claim(self._db, self.node_id, count, LEASE_S, now)
        for lease in claimed:
            self.leases[lease.shard_id] = lease.revision
            await self._shards.start(f"shard-{lease.shard_id}",
                                     self._factory(lease.shard_id, lease.revision))
            log.debug("shard_claimed", shard=lease.shard_id, revision=lease.revision)
        if claimed:  # one line a round at info: a node starts by claiming up to 256
            log.info("shards_claimed", count=len(claimed), held=len(self.leases),
                     shards=_ranges(sorted(lease.shard_id for lease in claimed)))

    def _factory(self, shard_id: int, revision: int) -> Callable[[], Actor]:
        return lambda: self._make_shard(shard_id, revision)

    async def _stop_shards(self, shard_ids) -> None:
        for shard_id in shard_ids:
            self.leases.pop(shard_id, None)
        await self._shards.stop_many([f"shard-{shard_id}" for shard_id in shard_ids])
        if self._released is not None and shard_ids:
            await self._released(set(shard_ids))

    async def _step_down(self, shard_ids: set[int]) -> None:
        await self._stop_shards(sorted(shard_ids))

    async def release_all(self) -> None:
        """Shutdown: stop the shards, give every lease back, leave the membership."""
        leases = [Lease(s, r) for s, r in self.leases.items()]
        await self._stop_shards(list(self.leases))
        try:
            await store.release(self._db, self.node_id, leases)
            await store.leave(self._db, self.node_id)
        except StorageUnavailable as exc:
            log.warning("release_failed", error=exc)


def _ranges(ids: list[int]) -> str:
    """Sorted shard ids as compact ranges: 0-85,170."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
