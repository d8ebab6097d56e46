"""The jobs a load test inserts: tenants, rows the gateway would write, and a herd's timing.

A herd is inserted parked a day ahead (invisible to the shards, which look a
minute ahead), then moved in one statement to a whole second a few seconds
ahead, so every shard has loaded it before it falls due: what is measured is
dispatch, not the insert.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta

import msgspec

from herdwick.clock import to_us
from herdwick.gateway.submit import prepare
from herdwick.ids import shard_of, uuid7
from herdwick.loadtest.driver import RunFailed
from herdwick.model import DEFAULT_RETRY, JobSpec, RetryPolicy, Schedule, Target, TenantSpec
from herdwick.ssrf import Network
from herdwick.storage.db import Database
from herdwick.storage.hot import HotTier, NotifyMessage
from herdwick.storage.jobs import NewJob, due_minute, insert_jobs
from herdwick.storage.tenants import create_tenant

PAYLOAD = b'{"user": "user42@example.com", "template": "welcome", "tags": ["a", "b"]}'
INSERT_BATCH = 1_000  # jobs per insert_jobs call
INSERT_CONNECTIONS = 4
PARK_AHEAD = timedelta(days=1)  # far past the shards' lookahead: invisible until moved


class TenantRef(msgspec.Struct, frozen=True):
    tenant_id: uuid.UUID
    name: str

    @property
    def key(self) -> bytes:  # as it appears in a stream entry's tenant_id field
        return str(self.tenant_id).encode()


def pool_names(count: int) -> list[str]:
    return [f"loadtest-{i}" for i in range(count)]


def tenant_counts(total: int, tenants: int, skew: float) -> list[int]:
    """The noisy first tenant takes `skew` of the total; the rest split what is left evenly."""
    if skew > 0 and tenants > 1:
        noisy = round(total * skew)
        return [noisy, *even_split(total - noisy, tenants - 1)]
    return even_split(total, tenants)


def even_split(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


async def create_tenants(db: Database, count: int) -> list[TenantRef]:
    """`count` tenants with the defaults, named herd-00, herd-01, ..."""
    return await create_tenants_of(db, [TenantSpec(name=f"herd-{i:02d}") for i in range(count)])


async def create_tenants_of(db: Database, specs: list[TenantSpec]) -> list[TenantRef]:
    now = datetime.now(UTC)
    tenants = []
    for spec in specs:
        created = await create_tenant(db, spec, now)
        tenants.append(TenantRef(created.tenant_id, spec.name))
    return tenants


class JobFactory:
    """NewJobs from one template per pool (then one per http URL), each prepared by the
    gateway's own `prepare`; job i takes template i modulo their number.

    A job differs from its template only in id, shard and due time, so the rows
    are what the gateway would insert for the same body. `allow` is the gateway's
    HERDWICK_HTTP_ALLOW, which the URLs must pass.
    """

    def __init__(self, pools: Sequence[str] = (), *, urls: Sequence[str] = (),
                 allow: tuple[Network, ...] = (), cron: bool = False,
                 retry: RetryPolicy = DEFAULT_RETRY) -> None:
        now = datetime.now(UTC)
        schedule = cron_schedule(now) if cron else Schedule(delay_seconds=60)
        self._templates = [_template(Target(type="queue", ref=pool), now, (), schedule,
                                     retry=retry) for pool in pools]
        self._templates += [_template(Target(type="http", ref=url), now, allow, schedule,
                                      "loadtest-http", retry) for url in urls]

    def make(self, index: int, due: datetime, now: datetime) -> NewJob:
        job_id = uuid7(now)
        return msgspec.structs.replace(self._templates[index % len(self._templates)],
                                       job_id=job_id, shard_id=shard_of(job_id), next_run_at=due)


def cron_schedule(now: datetime) -> Schedule:
    """Hourly in a zone with summer time, as a top-of-the-hour herd's jobs are, but at the
    minute half an hour from `now`: a job's first occurrence is wherever the test puts it,
    and its next one (which dispatch computes and writes) falls outside the run."""
    return Schedule(cron=f"{(now.minute + 30) % 60} * * * *", tz="Europe/London")


def _template(target: Target, now: datetime, allow: tuple[Network, ...], schedule: Schedule,
              name: str = "loadtest-herd", retry: RetryPolicy = DEFAULT_RETRY) -> NewJob:
    spec = JobSpec(name=name, target=target, schedule=schedule, payload=msgspec.Raw(PAYLOAD),
                   retry=retry)
    prepared = prepare(spec, now=now, allow=allow)
    if prepared.job is None:
        raise RunFailed(f"the job template does not validate: {prepared.errors}")
    return prepared.job


Batch = tuple[TenantRef, list[NewJob]]


def herd_batches(factory: JobFactory, tenants: list[TenantRef], counts: list[int],
                 due: datetime, spread: bool = False) -> list[Batch]:
    """Every tenant's share of the herd, due at `due`, cut into insert batches; with
    `spread`, each tenant's jobs evenly over the second from `due`, so every tenant's
    jobs interleave with every other's by due time."""
    now = datetime.now(UTC)
    batches: list[Batch] = []
    index = 0
    for tenant, count in zip(tenants, counts, strict=True):
        jobs = [factory.make(index + i, due + timedelta(microseconds=i * 1_000_000 // count)
                             if spread else due, now) for i in range(count)]
        index += count
        batches += [(tenant, jobs[i:i + INSERT_BATCH]) for i in range(0, count, INSERT_BATCH)]
    return batches


async def insert_batches(db: Database, batches: list[Batch], connections: int,
                         on_inserted: Callable[[int], None]) -> None:
    """insert_jobs for every batch, `connections` at a time."""
    pending = iter(batches)

    async def worker() -> None:
        for tenant, jobs in pending:  # one shared iterator: each batch goes to one worker
            outcome = await insert_jobs(db, tenant.tenant_id, jobs, now=datetime.now(UTC))
            if not outcome.inserted:
                raise RunFailed("insert_jobs wrote nothing for a batch")
            on_inserted(len(jobs))

    async with asyncio.TaskGroup() as tg:
        for _ in range(connections):
            tg.create_task(worker())


def parking_time() -> datetime:
    return (datetime.now(UTC) + PARK_AHEAD).replace(microsecond=0)


def due_second(due_in_s: float) -> datetime:
    """The first whole second at least `due_in_s` from now."""
    return datetime.fromtimestamp(math.ceil(time.time() + due_in_s), UTC)


# The tool's own statement on its scratch database: storage/ has no query that moves a
# herd in time, and none should exist outside a load test.
# Only the due rows move: dispatch reads the due time from due_index. With `jobs_too` their
# jobs' next_run_at moves as well (the move costs about twice as much): a one-off is
# completed only by the execution at its next_run_at (apply_events), so a run that
# measures what finishing costs (loadtest e2e) needs the jobs where a real herd has them.
# Rows parked within the second from $3 keep their offset in it: $1 is a whole second, so
# every moved row stays in its minute.
_MOVE_DUE = """
WITH moved AS (
    UPDATE due_index
    SET next_run_at = $1::timestamptz + (next_run_at - $3::timestamptz), due_minute = $2
    WHERE next_run_at >= $3 AND next_run_at < $3::timestamptz + interval '1 second'
    RETURNING shard_id, job_id, next_run_at
), jobs_moved AS (
    UPDATE jobs j SET next_run_at = m.next_run_at FROM moved m
    WHERE $4 AND j.job_id = m.job_id
)
SELECT m.shard_id, m.job_id, m.next_run_at, j.tenant_id, j.pool
FROM moved m JOIN jobs j USING (job_id)"""


async def move_herd(db: Database, parked_at: datetime, due: datetime, *,
                    jobs_too: bool = False, hot: HotTier | None = None) -> int:
    """One statement: every due row parked in the second from `parked_at` falls due in the
    second from `due`, at the same offset (and its job's next_run_at with `jobs_too`).

    With `hot`, the moved rows are then announced to their shards, a thousand a message,
    as the gateway announces a batch submit due this soon: the shards read the herd's
    minute already, and would otherwise find it only at their next re-read of near rows."""
    async with db.connection() as conn:
        moved = await conn.fetch(_MOVE_DUE, due, due_minute(due), parked_at, jobs_too)
        # Its table counters reach pg_stat_user_tables now, not up to 10 s later: the
        # write profile leaves the move out (loadtest/writes.py).
        await conn.execute("SELECT pg_stat_force_next_flush()")
    if hot is not None:
        notes = [NotifyMessage(r["shard_id"], str(r["job_id"]), to_us(r["next_run_at"]),
                               str(r["tenant_id"]), r["pool"]) for r in moved]
        for i in range(0, len(notes), INSERT_BATCH):
            await hot.notify(notes[i:i + INSERT_BATCH])
    return len(moved)
