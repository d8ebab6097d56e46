"""Retention: executions older than the horizon leave by whole days, archived first.

A day's two partitions (executions_YYYYMMDD, execution_attempts_YYYYMMDD) leave once the
whole day is older than HERDWICK_RETENTION_DAYS, in steps, each recorded in
retention_archives and each safe to repeat:

1. claimed: a row names the day's archive;
2. detached: both partitions leave their tables in one short transaction, which rolls
   back if any execution of the day is unfinished (that day is kept, and says why). From
   here nothing the application runs can change the day's rows;
3. exported to the target's staging directory, and uploaded (data object, then manifest);
4. recorded archived (url, counts, sha256);
5. dropped, and recorded dropped in the same commit.

A pass starts by finishing the days an earlier one left detached (a crash, a target that
failed), from their records. A detached day cannot change, so its archive is the same
bytes under the same key however often it is written. All of a pass's statements run on
the connection that holds the retention lease (a session advisory lock): if that
connection goes, so do the lease and every later write of the pass.

Executions in the default partition for a day before the horizon (a past runAt, skipped
occurrences recorded late, rows that arrived after their day was dropped) are moved to a
partition of their own by the partition function, then leave like any other day, under
the next archive name of that day. A day with unfinished executions there stays until
they finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import date, datetime, timedelta
from pathlib import Path
from typing import Literal

import asyncpg
import msgspec

from herdwick import logs
from herdwick.config import Settings
from herdwick.errors import HerdwickError, StorageUnavailable
from herdwick.storage.archive import (
    DATA_SUFFIX,
    FORMAT,
    MANIFEST_SUFFIX,
    ArchiveUnavailable,
    DataFile,
    Manifest,
    Target,
    encode_manifest,
    open_target,
    read_lines,
)
from herdwick.storage.db import Database, translated
from herdwick.storage.sql import q

log = logs.get("herdwick.retention")

# A detach takes the parent tables' ACCESS EXCLUSIVE lock (Postgres cannot detach
# CONCURRENTLY beside a default partition), and while it waits in the lock queue every
# dispatch and event write queues behind it: so it waits briefly, and tries again a few
# times in the pass, rather than stall the hot path for seconds.
LOCK_TIMEOUT_MS = 200
DETACH_TRIES = 10
DETACH_RETRY_S = (0.5, 1.5)  # jittered pause between tries
EXPORT_BATCH = 2_000  # lines fetched and compressed at a time
REASON_MAX = 1_000

Source = Literal["partition", "detached", "default"]
Result = Literal["dropped", "kept", "failed"]
Step = Callable[[str, "Day"], Awaitable[None]]


class RetentionPolicy(msgspec.Struct, frozen=True, kw_only=True):
    days: int
    archive_url: str
    s3_endpoint: str | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> RetentionPolicy:
        return cls(days=settings.retention_days, archive_url=settings.archive_url,
                   s3_endpoint=settings.archive_s3_endpoint)


class Day(msgspec.Struct, frozen=True, kw_only=True):
    """A day before the horizon and where its rows are: an attached partition, a partition
    an earlier pass detached, or the default partition."""

    day: date
    source: Source
    executions: int
    unfinished: int
    name: str  # its archive's name: the objects <name>.jsonl.gz and <name>.manifest.json

    @property
    def partition(self) -> str:
        return "executions_default" if self.source == "default" else f"executions_{self.digits}"

    @property
    def digits(self) -> str:
        return self.day.strftime("%Y%m%d")


class Outcome(msgspec.Struct, frozen=True, kw_only=True):
    day: date
    name: str
    partition: str
    result: Result
    executions: int
    attempts: int = 0
    url: str | None = None
    sha256: str | None = None
    reason: str | None = None


class PassReport(msgspec.Struct, frozen=True, kw_only=True):
    leased: bool  # false: another node held the retention lease, and this pass did nothing
    first_day_kept: date
    outcomes: list[Outcome] = []


class _Kept(HerdwickError):
    """A day that stays for now (unfinished executions): recorded, not an error."""


class _Built(msgspec.Struct, frozen=True):
    path: Path
    executions: int
    attempts: int
    bytes: int
    sha256: str


def first_day_kept(now: datetime, days: int) -> date:
    """The oldest UTC day kept: a day leaves once all of it is more than `days` days old,
    so between `days` and `days` + 1 days of history stay."""
    return (now - timedelta(days=days)).date()


def _for_day(name: str, digits: str) -> str:
    if not (len(digits) == 8 and digits.isdigit()):
        raise ValueError(f"not a day's digits: {digits!r}")
    return q(name).replace("{day}", digits)


def _archive_name(digits: str, earlier: int) -> str:
    return f"executions_{digits}" + (f"_{earlier + 1}" if earlier else "")


# --- what is due --------------------------------------------------------------------------


async def plan(db: Database, now: datetime, days: int) -> list[Day]:
    """The days a pass would archive and drop, or keep, now: what `--dry-run` shows."""
    async with db.connection() as conn:
        return await _plan(conn, first_day_kept(now, days))


async def _plan(conn: asyncpg.Connection, horizon: date) -> list[Day]:
    pending = await conn.fetch(q("retention_pending"))
    detached = {r["day"] for r in pending}
    attached = await conn.fetch(q("retention_partitions"), horizon)
    default = [r for r in await conn.fetch(q("retention_default_days"), horizon)
               if r["day"] not in detached]  # they follow once that day's table is dropped
    records = await conn.fetch(q("retention_records"),
                               [r["day"] for r in (*attached, *default)])
    found: list[Day] = []
    for row in pending:
        digits = row["day"].strftime("%Y%m%d")
        try:
            counts = await conn.fetchrow(_for_day("retention_day_rows", digits))
        except asyncpg.UndefinedTableError:  # dropped by hand: its export will say so
            counts = {"executions": 0, "unfinished": 0}
        found.append(Day(day=row["day"], source="detached", executions=counts["executions"],
                         unfinished=counts["unfinished"], name=row["name"]))
    for rows, source in ((attached, "partition"), (default, "default")):
        for row in rows:
            of_day = [r for r in records if r["day"] == row["day"]]
            under_way = [r["name"] for r in of_day if not r["dropped"]]
            name = under_way[0] if under_way else _archive_name(
                row["day"].strftime("%Y%m%d"), len(of_day))
            found.append(Day(day=row["day"], source=source, executions=row["executions"],
                             unfinished=row["unfinished"], name=name))
    return sorted(found, key=lambda d: (d.day, d.source))


# --- a pass -------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _lease(db: Database) -> AsyncIterator[asyncpg.Connection | None]:
    """The connection that holds the retention lease for the pass, or None if another
    session holds it. The pool keeps sessions as they are (db._keep_session), so the lock
    is released here: unlocked after a clean pass, and after anything else the session is
    ended outright, whatever state the connection was left in."""
    async with db.connection() as conn:
        if not await conn.fetchval(q("retention_lock")):
            yield None
            return
        try:
            yield conn
        except BaseException:
            conn.terminate()
            raise
        await conn.fetchval(q("retention_unlock"))


async def run_pass(db: Database, policy: RetentionPolicy, now: datetime, *,
                   target: Target | None = None, lock_timeout_ms: int = LOCK_TIMEOUT_MS,
                   on_step: Step | None = None) -> PassReport:
    """One retention pass, if this session gets the lease. `on_step(step, day)` is a test
    signal, awaited after each step of each day (detached, uploaded, archived, dropped)."""
    horizon = first_day_kept(now, policy.days)
    own = target is None
    target = target or open_target(policy.archive_url, s3_endpoint=policy.s3_endpoint)
    try:
        async with _lease(db) as conn:
            if conn is None:
                log.info("retention_lease_busy")
                return PassReport(leased=False, first_day_kept=horizon)
            with translated():
                outcomes = await _pass(conn, target, horizon, now, lock_timeout_ms, on_step)
            return PassReport(leased=True, first_day_kept=horizon, outcomes=outcomes)
    finally:
        if own:
            await target.close()


async def _pass(conn: asyncpg.Connection, target: Target, horizon: date, now: datetime,
                lock_timeout_ms: int, on_step: Step | None) -> list[Outcome]:
    await _adopt_default_days(conn, horizon)
    days = await _plan(conn, horizon)
    if not days:
        return []
    try:
        await target.check()
    except ArchiveUnavailable as exc:
        log.warning("retention_target_unavailable", target=target.url, error=str(exc))
        return [await _failed(conn, d, str(exc), now) for d in days]
    outcomes = []
    for day in days:
        try:
            outcomes.append(await _retire(conn, target, day, now, lock_timeout_ms, on_step))
        except _Kept as kept:
            outcomes.append(await _kept(conn, day, str(kept), now))
        except StorageUnavailable:
            raise  # the lease's connection is gone: the pass is over
        except Exception as exc:  # one day's failure is that day's: recorded; the rest go on
            if not isinstance(exc, ArchiveUnavailable | asyncpg.PostgresError):
                log.exception("retention_day_crashed", day=day.day, archive=day.name)
            outcomes.append(await _failed(conn, day, f"{type(exc).__name__}: {exc}", now))
    log.info("retention_pass", first_day_kept=horizon,
             dropped=sum(o.result == "dropped" for o in outcomes),
             kept=sum(o.result == "kept" for o in outcomes),
             failed=sum(o.result == "failed" for o in outcomes))
    return outcomes


async def _adopt_default_days(conn: asyncpg.Connection, horizon: date) -> None:
    """Give each old day the default partition caught a partition of its own (the partition
    function moves its rows there), so that it leaves like any other day."""
    for row in await conn.fetch(q("retention_default_days"), horizon):
        if row["unfinished"]:
            # Only days whose rows are all finished: the move is a DELETE and an INSERT,
            # and an update racing it would miss a row that is still changing.
            continue
        try:
            await conn.fetchval(q("ensure_execution_partitions"), row["day"], 1)
        except asyncpg.PostgresError as exc:  # it stays in the default partition: reported
            log.warning("retention_default_day_failed", day=row["day"], error=str(exc))


async def _retire(conn: asyncpg.Connection, target: Target, day: Day, now: datetime,
                  lock_timeout_ms: int, on_step: Step | None) -> Outcome:
    await conn.execute(q("retention_claim"), day.name, day.day)
    if day.source == "default":
        raise _Kept(f"{day.unfinished} unfinished executions of the day in "
                    "executions_default: kept until they finish")
    if day.source == "partition":
        if day.unfinished:
            raise _Kept(f"{day.unfinished} unfinished executions (queued, running or "
                        f"retry_wait) in {day.partition}: kept until they finish")
        await _detach_patiently(conn, day, now, lock_timeout_ms)
    await _signal(on_step, "detached", day)
    built = await _export(conn, target, day)
    manifest = Manifest(format=FORMAT, name=day.name, day=day.day,
                        data=day.name + DATA_SUFFIX, executions=built.executions,
                        attempts=built.attempts, bytes=built.bytes, sha256=built.sha256)
    url = await target.put(day.name + DATA_SUFFIX, built.path)
    await target.put(day.name + MANIFEST_SUFFIX,
                     await _staged(target, day.name + MANIFEST_SUFFIX, encode_manifest(manifest)))
    await _signal(on_step, "uploaded", day)
    await conn.execute(q("retention_archived"), day.name, url, built.executions,
                       built.attempts, built.bytes, built.sha256, now)
    await _signal(on_step, "archived", day)
    async with conn.transaction():
        await conn.execute(q("retention_lock_timeout"), str(lock_timeout_ms))
        await conn.execute(_for_day("retention_drop", day.digits))
        await conn.execute(q("retention_dropped"), day.name, now)
    await _signal(on_step, "dropped", day)
    log.info("retention_day_dropped", day=day.day, archive=day.name, url=url,
             executions=built.executions, attempts=built.attempts)
    return Outcome(day=day.day, name=day.name, partition=day.partition, result="dropped",
                   executions=built.executions, attempts=built.attempts, url=url,
                   sha256=built.sha256)


async def _detach_patiently(conn: asyncpg.Connection, day: Day, now: datetime,
                            lock_timeout_ms: int) -> None:
    for tries in range(1, DETACH_TRIES + 1):
        try:
            await _detach(conn, day, now, lock_timeout_ms)
            return
        except asyncpg.LockNotAvailableError:
            if tries == DETACH_TRIES:
                raise
            log.info("retention_detach_busy", day=day.day, tries=tries)
            await asyncio.sleep(random.uniform(*DETACH_RETRY_S))


async def _detach(conn: asyncpg.Connection, day: Day, now: datetime,
                  lock_timeout_ms: int) -> None:
    """Detach the day's partitions, unless an execution of it is unfinished once the lock
    is held (a dead letter retried since the plan): then nothing changes and it is kept."""
    async with conn.transaction():
        await conn.execute(q("retention_lock_timeout"), str(lock_timeout_ms))
        await conn.execute(_for_day("retention_detach", day.digits))
        unfinished = await conn.fetchval(_for_day("retention_unfinished", day.digits))
        if unfinished:
            raise _Kept(f"{unfinished} unfinished executions (queued, running or "
                        f"retry_wait) in {day.partition}: kept until they finish")
        await conn.execute(q("retention_detached"), day.name, now)


async def _export(conn: asyncpg.Connection, target: Target, day: Day) -> _Built:
    path = target.staging() / f".{day.name}{DATA_SUFFIX}.{uuid.uuid4().hex}.tmp"
    data = await asyncio.to_thread(DataFile, path)
    try:
        attempts = 0
        async with conn.transaction(readonly=True):  # a cursor lives in a transaction
            batch: list[bytes] = []
            async for row in conn.cursor(_for_day("retention_export", day.digits),
                                         prefetch=EXPORT_BATCH):
                batch.append(row["line"].encode())
                attempts += row["attempts"]
                if len(batch) >= EXPORT_BATCH:
                    await asyncio.to_thread(data.write, batch)
                    batch = []
            await asyncio.to_thread(data.write, batch)
            stored = await conn.fetchval(_for_day("retention_attempt_rows", day.digits))
        if stored != attempts:
            raise _Kept(f"{stored - attempts} attempt rows of {day.day} have no execution in "
                        f"{day.partition}: kept, so that none is lost")
        size, sha256 = await asyncio.to_thread(data.finish)
    except BaseException:
        await asyncio.to_thread(data.discard)
        raise
    return _Built(path, data.lines, attempts, size, sha256)


async def _staged(target: Target, key: str, content: bytes) -> Path:
    path = target.staging() / f".{key}.{uuid.uuid4().hex}.tmp"
    await asyncio.to_thread(path.write_bytes, content)
    return path


async def _signal(on_step: Step | None, step: str, day: Day) -> None:
    if on_step is not None:
        await on_step(step, day)


async def _kept(conn: asyncpg.Connection, day: Day, reason: str, now: datetime) -> Outcome:
    log.info("retention_day_kept", day=day.day, archive=day.name, reason=reason)
    return await _not_dropped(conn, day, reason, now, "kept")


async def _failed(conn: asyncpg.Connection, day: Day, reason: str, now: datetime) -> Outcome:
    log.warning("retention_day_failed", day=day.day, archive=day.name, error=reason)
    return await _not_dropped(conn, day, reason, now, "failed")


async def _not_dropped(conn: asyncpg.Connection, day: Day, reason: str, now: datetime,
                       result: Result) -> Outcome:
    """A day this pass leaves: why, on its record."""
    await conn.execute(q("retention_claim"), day.name, day.day)
    await conn.execute(q("retention_failed"), day.name, reason[:REASON_MAX], now)
    return Outcome(day=day.day, name=day.name, partition=day.partition, result=result,
                   executions=day.executions, reason=reason)


# --- reading back -------------------------------------------------------------------------


async def read_day(target: Target, day: date) -> AsyncIterator[bytes]:
    """Every archived execution of a day, one JSON line each, from each of its archives in
    order, each checked against its manifest first."""
    prefix = f"executions_{day.strftime('%Y%m%d')}"
    manifests = [k for k in await target.keys(prefix) if k.endswith(MANIFEST_SUFFIX)]
    for key in sorted(manifests, key=lambda k: (len(k), k)):  # _2 before _10
        manifest = msgspec.json.decode(await target.get(key), type=Manifest)
        for line in read_lines(await target.get(manifest.data), manifest):
            yield line
