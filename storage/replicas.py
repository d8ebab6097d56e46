"""Read replicas: their pools, and how far each has replayed the primary's WAL.

One sampling pass (`run_once(now)`, every SAMPLE_INTERVAL_S, jittered, from the
gateway's sampler task) asks the primary where its WAL ends and every replica how
far it has replayed, all at once, and keeps the primary's answers as a short
history of (when asked, position). A replica that has replayed position P has
every transaction that committed before any sample whose position is at most P
was asked; the latest such sample's time is the replica's `fresh_at`: on this
process's monotonic clock, the instant before which it misses no commit. Reads
then need no round trip of their own to judge a replica: gateway/reads.py
compares fresh_at with the time of the tenant's last write.

A replica is trusted only while it answers, is in recovery and streams from a
primary on the primary's timeline (when the role may see the timeline): a
promoted standby, or one left following a dead primary, serves nothing. The
history starts again when the primary's timeline changes (a failover).
"""

from __future__ import annotations

import asyncio
import collections
import time
import urllib.parse
from collections.abc import Callable, Iterable, Sequence

import asyncpg

from herdwick import logs
from herdwick.errors import StorageUnavailable
from herdwick.storage.db import Database
from herdwick.storage.sql import q

log = logs.get("herdwick.replicas")

SAMPLE_INTERVAL_S = (0.1, 0.2)  # between passes, drawn anew each time
SAMPLE_TIMEOUT_S = 1.0  # a server slower than this to say its position counts as down
POOL_MAX = 20  # each replica's pool: the gateway's reads spread over them
NOT_SAMPLED = "not sampled yet"


def name_of(url: str) -> str:
    """host:port/database of a URL, for logs and the metrics' label (never a password)."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or "localhost"
    return f"{host}:{parts.port or 5432}{parts.path or '/'}"


def fresh_at(history: Iterable[tuple[float, int]], replayed: int) -> float | None:
    """The latest time in `history` ((asked at, primary position), oldest first) whose
    position the replica has replayed: it has every commit made before then. None when
    it is behind all of them."""
    best = None
    for asked_at, position in history:
        if position <= replayed:
            best = asked_at
    return best


class Replica:
    """One read replica. Its fields are written by Replicas' sampling pass only (and
    set_down), read by the gateway's requests on the same loop."""

    def __init__(self, name: str, db: Database) -> None:
        self.name = name
        self.db = db
        self.up = False  # answered the last pass, in recovery, streaming on our timeline
        self.replayed: int | None = None
        self.fresh_at: float | None = None
        self.lag_bytes: int | None = None
        self.why = NOT_SAMPLED  # when not up: the reason, for the log


class Replicas:
    """The replicas of one gateway, and the primary's recent WAL positions."""

    def __init__(self, primary: Database, replicas: Sequence[Replica], *,
                 history_s: float, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._primary = primary
        self._monotonic = monotonic  # the clock run_once's `now` comes from
        self.replicas = list(replicas)
        self._history_s = history_s
        # (asked at, position), oldest first: appended by run_once only.
        self._history: collections.deque[tuple[float, int]] = collections.deque()
        self._timeline: int | None = None
        self._primary_up = True
        self._sampled = asyncio.Event()  # set and replaced after each pass: wait_fresh

    @classmethod
    async def connect(cls, primary: Database, urls: Sequence[str], *, history_s: float,
                      monotonic: Callable[[], float] = time.monotonic) -> Replicas:
        """Pools that open connections only when used: a replica down at start is a
        replica down, not a gateway that cannot start."""
        replicas = []
        try:
            for url in urls:
                replicas.append(Replica(name_of(url), await Database.connect(
                    url, min_size=0, max_size=POOL_MAX, replica=True)))
        except BaseException:
            for replica in replicas:
                await replica.db.close()
            raise
        return cls(primary, replicas, history_s=history_s, monotonic=monotonic)

    async def close(self) -> None:
        await asyncio.gather(*(r.db.close() for r in self.replicas))

    # --- one pass ---------------------------------------------------------------------

    async def run_once(self, now: float) -> None:
        """Sample the primary and every replica at once; `now` is monotonic, read just
        before asking (so the primary's answer is no older than it says)."""
        primary, *replayed = await asyncio.gather(
            self._ask_primary(), *(self._ask_replica(r) for r in self.replicas))
        if primary is not None:
            position, timeline = primary
            if timeline != self._timeline or (self._history and
                                               position < self._history[-1][1]):
                self._history.clear()  # a new primary: earlier positions say nothing of it
                self._timeline = timeline
            self._history.append((now, position))
        while self._history and self._history[0][0] < now - self._history_s:
            self._history.popleft()
        for replica, answer in zip(self.replicas, replayed, strict=True):
            self._judge(replica, answer)
        self._sampled.set()
        self._sampled = asyncio.Event()

    async def _ask_primary(self) -> tuple[int, int] | None:
        try:
            async with asyncio.timeout(SAMPLE_TIMEOUT_S), self._primary.connection() as conn:
                row = await conn.fetchrow(q("primary_wal_position"))
        except (StorageUnavailable, asyncpg.PostgresError, TimeoutError) as exc:
            if self._primary_up:
                log.warning("replica_sampling_failed", server="primary", error=str(exc))
            self._primary_up = False
            return None
        self._primary_up = True
        return row["position"], row["timeline"]

    async def _ask_replica(self, replica: Replica) -> asyncpg.Record | str:
        try:
            async with asyncio.timeout(SAMPLE_TIMEOUT_S), replica.db.connection() as conn:
                return await conn.fetchrow(q("replica_replay_position"))
        except (StorageUnavailable, asyncpg.PostgresError, TimeoutError) as exc:
            return f"unreachable: {type(exc).__name__}: {exc}"

    def _judge(self, replica: Replica, answer: asyncpg.Record | str) -> None:
        if isinstance(answer, str):
            why = answer
        elif not answer["standby"]:
            why = "not in recovery (promoted?)"
        elif not answer["streaming"]:
            why = "not streaming from a primary"
        elif answer["timeline"] is not None and self._timeline is not None \
                and answer["timeline"] != self._timeline:
            why = f"on timeline {answer['timeline']}, the primary on {self._timeline}"
        else:
            why = ""
        if why:
            self.set_down(replica, why)
            return
        replica.replayed = answer["replayed"]
        replica.fresh_at = fresh_at(self._history, replica.replayed)
        replica.lag_bytes = (max(0, self._history[-1][1] - replica.replayed)
                             if self._history else None)
        if not replica.up:
            log.info("replica_up", replica=replica.name)
        replica.up, replica.why = True, ""

    def set_down(self, replica: Replica, why: str) -> None:
        """Serve nothing from it until a pass finds it sound again (a read that failed on
        it says so at once, rather than at the next pass)."""
        if replica.up or replica.why == NOT_SAMPLED:  # once an outage, not once a pass
            log.warning("replica_down", replica=replica.name, why=why)
        replica.up, replica.why, replica.fresh_at = False, why, None

    # --- what reads and writes ask ----------------------------------------------------

    def fresh_since(self, cutoff: float) -> list[Replica]:
        """The replicas that miss no commit made before `cutoff` (monotonic)."""
        return [r for r in self.replicas
                if r.up and r.fresh_at is not None and r.fresh_at >= cutoff]

    async def wait_fresh(self, since: float, timeout_s: float) -> bool:
        """Until every replica misses no commit made before `since`, or `timeout_s` passes;
        True if they got there. (What a write waits for when it could not mark itself.)"""
        deadline = self._monotonic() + timeout_s
        while len(self.fresh_since(since)) < len(self.replicas):
            left = deadline - self._monotonic()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self._sampled.wait(), left)
            except TimeoutError:
                return False
        return True

    async def next_pass(self) -> None:
        """Test signal: until the pass under way (or the next one) has finished. Twice: a
        whole pass that began after the call."""
        await self._sampled.wait()

    def gauges(self):
        """telemetry.GaugeSource: each replica's lag, read at scrape time. Lag is absent
        for a replica down, or further behind than the history reaches."""
        now = self._monotonic()
        for replica in self.replicas:
            labels = {"replica": replica.name}
            yield "herdwick_replica_up", labels, 1.0 if replica.up else 0.0
            if replica.up and replica.fresh_at is not None:
                yield "herdwick_replica_lag_seconds", labels, max(0.0, now - replica.fresh_at)
            if replica.up and replica.lag_bytes is not None:
                yield "herdwick_replica_lag_bytes", labels, float(replica.lag_bytes)
