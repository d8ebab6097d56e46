"""Waiting for a run's executions to succeed in Postgres, herd and steady jobs apart.

Shared by the scenarios that run jobs through real workers (e2e, noisy-neighbour).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import uuid
from collections.abc import Callable
from datetime import datetime

import msgspec

from herdwick.loadtest.background import Background
from herdwick.loadtest.driver import Child, RunFailed, check_alive, running
from herdwick.loadtest.measure import StreamSampler
from herdwick.storage.db import Database

POLL_S = 0.1
# Until the workers' group has been delivered every job, none can have succeeded
# all: Postgres is counted this seldom then (a count costs it ~9 ms at 50,000 rows,
# 9 % of a core at POLL_S), and every POLL_S after.
UNDELIVERED_POLL_S = 1.0

# The tool's own statement (storage/ has no counts for a load test). Herd and steady
# jobs are told apart by job id ($1: measure.lease_lags_by_kind).
_DONE_SQL = """
SELECT count(*) FILTER (WHERE state = 'succeeded' AND job_id < $1),
       count(*) FILTER (WHERE state = 'succeeded' AND job_id >= $1)
FROM executions"""

# Gaps in the history an owner reads: a success that never started, an attempt
# left running after its execution moved on.
_HISTORY_SQL = """
SELECT (SELECT count(*) FROM executions WHERE state = 'succeeded' AND started_at IS NULL),
       (SELECT count(*) FROM execution_attempts a
        JOIN executions e USING (execution_id, scheduled_for)
        WHERE a.outcome = 'running' AND (e.state <> 'running' OR e.attempt <> a.attempt))"""


class History(msgspec.Struct, frozen=True, kw_only=True):
    """What the run's history shows that it should not; both 0 in a sound run."""

    succeeded_without_start: int
    attempts_left_running: int

    @property
    def sound(self) -> bool:
        return self.succeeded_without_start == 0 and self.attempts_left_running == 0


async def history_of(db: Database) -> History:
    async with db.connection() as conn:
        unstarted, left_running = await conn.fetchrow(_HISTORY_SQL)
    return History(succeeded_without_start=unstarted, attempts_left_running=left_running)


def uuid7_floor(at: datetime) -> uuid.UUID:
    """Below every UUIDv7 made at or after `at` (herdwick.ids.uuid7's layout)."""
    return uuid.UUID(int=int(at.timestamp() * 1000) << 80)


class Outcomes:
    """What Postgres says has succeeded, herd and steady apart; polled by until_done.

    `steady_jobs` is None until the generator has made its last job; `steady_of` says
    how many of the generator's first n jobs are to succeed (all of them unless some
    cannot: loadtest http's jobs for targets that are down).
    """

    def __init__(self, db: Database, herd_jobs: int, steady_from: uuid.UUID,
                 steady_of: Callable[[int], int] = lambda made: made) -> None:
        self._db, self._steady_from = db, steady_from
        self.steady_of = steady_of
        self.herd_jobs = herd_jobs
        self.steady_jobs: int | None = None
        self.herd = self.steady = 0
        self.herd_done_at: float | None = None  # wall clock, when all had succeeded
        self.steady_done_at: float | None = None
        self.polls = 0

    async def poll(self) -> bool:
        async with self._db.connection() as conn:
            self.herd, self.steady = await conn.fetchrow(_DONE_SQL, self._steady_from)
        self.polls += 1
        now = time.time()
        if self.herd_done_at is None and self.herd >= self.herd_jobs:
            self.herd_done_at = now
        if (self.steady_done_at is None and self.steady_jobs is not None
                and self.steady >= self.steady_jobs):
            self.steady_done_at = now
        return self.herd_done_at is not None and self.steady_done_at is not None

    def detail(self) -> str:
        steady = "-" if self.steady_jobs is None else self.steady_jobs
        return f"succeeded: herd {self.herd}/{self.herd_jobs}  steady {self.steady}/{steady}"


async def until_done(outcomes: Outcomes, sampler: StreamSampler, background: Background,
                      generator: asyncio.Task | None, alive: Callable[[], None],
                      deadline: float) -> None:
    polled = 0.0
    while True:
        if generator is None:
            outcomes.steady_jobs = 0
        elif generator.done():
            alive()  # a generator that failed made fewer jobs than it should have
            outcomes.steady_jobs = outcomes.steady_of(background.made)
        made = None if outcomes.steady_jobs is None else outcomes.herd_jobs + outcomes.steady_jobs
        if (made is not None and await sampler.delivered() >= made) or \
                time.perf_counter() - polled >= UNDELIVERED_POLL_S:
            polled = time.perf_counter()
            if await outcomes.poll():
                return
        alive()
        if time.perf_counter() > deadline:
            raise RunFailed(f"not all succeeded before the timeout: {outcomes.detail()}")
        await asyncio.sleep(POLL_S)


async def drain(outcomes: Outcomes, sampler: StreamSampler, background: Background,
                rate: float, procs: list[Child], deadline: float) -> None:
    """The stream sampler, and the steady generator when `rate` > 0, until every job has
    succeeded (until_done); a dead child or a failed helper fails it at once."""
    async with contextlib.AsyncExitStack() as stack:
        helpers = [await stack.enter_async_context(sampler.sampling())]
        generator = None
        if rate > 0:
            generator = await stack.enter_async_context(
                running(background.run(), "the steady generator"))
            helpers.append(generator)
        await until_done(outcomes, sampler, background, generator,
                         functools.partial(check_alive, procs, helpers), deadline)
