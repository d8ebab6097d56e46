"""Concurrent single submits of one tenant, inserted together.

A submit without an Idempotency-Key joins its tenant's lane: at most IN_FLIGHT
inserts of the lane run at once in this process, and whatever arrived while they
ran goes next as one statement (storage/jobs.py insert_submissions): one commit,
one WAL flush, for many requests. There is no timer: alone, a submit goes at
once, as before; batches form only while the lane's inserts are in flight, which
is when a commit a request is what holds the rate back.

Each request keeps its own answer, given only after the statement committed: its
201 with its own herd warning (each request's seconds are counted on their own),
or an error of its own. A statement Postgres refuses, or one over the tenant's
quota together, is tried again one request at a time, so one request's bad value,
or the quota's last free place, is that request's alone; a Postgres that is away
is every waiting request's 503, with nothing written.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import deque
from dataclasses import dataclass, field

from herdwick import telemetry
from herdwick.clock import Clock
from herdwick.errors import QuotaExceeded, Rejected
from herdwick.storage import jobs as store
from herdwick.storage.db import Database
from herdwick.storage.jobs import InsertOutcome, Submission

IN_FLIGHT = 8  # a tenant's inserts at once in one gateway process (its pool holds 20)
MAX_JOBS = 500  # jobs of one coalesced statement: bounds its time and its arrays


@dataclass
class _Waiting:
    submission: Submission
    answer: asyncio.Future


@dataclass
class _Lane:
    """One tenant's submits: written by insert() and the lane's flush tasks only."""

    waiting: deque[_Waiting] = field(default_factory=deque)
    running: int = 0


class Coalescer:
    """Owned by the gateway's context; one per process."""

    def __init__(self, db: Database, clock: Clock, in_flight: int = IN_FLIGHT,
                 max_jobs: int = MAX_JOBS) -> None:
        self._db = db
        self._clock = clock
        self._in_flight = in_flight
        self._max_jobs = max_jobs
        self._lanes: dict[uuid.UUID, _Lane] = {}
        self._tasks: set[asyncio.Task] = set()
        self.statements = 0  # inserts sent, coalesced or not: read by tests

    async def insert(self, tenant_id: uuid.UUID, submission: Submission, *,
                     max_active_jobs: int | None, sync: bool) -> InsertOutcome:
        """The request's jobs inserted, alone or with others of the tenant's; returns once
        they are committed."""
        lane = self._lanes.setdefault(tenant_id, _Lane())
        answer = asyncio.get_running_loop().create_future()
        lane.waiting.append(_Waiting(submission, answer))
        if lane.running < self._in_flight:
            lane.running += 1
            task = asyncio.create_task(self._drain(tenant_id, lane, max_active_jobs, sync))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return await answer

    async def _drain(self, tenant_id: uuid.UUID, lane: _Lane, max_active_jobs: int | None,
                     sync: bool) -> None:
        try:
            while lane.waiting:
                batch = self._take(lane)
                if batch:
                    await self._flush(tenant_id, batch, max_active_jobs, sync)
        finally:
            lane.running -= 1
            if not lane.running and not lane.waiting:
                self._lanes.pop(tenant_id, None)

    def _take(self, lane: _Lane) -> list[_Waiting]:
        """The next statement's requests: in arrival order, up to MAX_JOBS jobs (a
        request larger than that goes alone); those whose caller left are dropped."""
        batch: list[_Waiting] = []
        jobs = 0
        while lane.waiting:
            head = lane.waiting[0]
            if head.answer.done():  # its request was cancelled: nobody waits for it
                lane.waiting.popleft()
                continue
            size = len(head.submission.jobs)
            if batch and jobs + size > self._max_jobs:
                break
            batch.append(lane.waiting.popleft())
            jobs += size
        return batch

    async def _flush(self, tenant_id: uuid.UUID, batch: list[_Waiting],
                     max_active_jobs: int | None, sync: bool) -> None:
        self.statements += 1
        try:
            outcomes = await store.insert_submissions(
                self._db, tenant_id, [w.submission for w in batch], now=self._clock.now(),
                max_active_jobs=max_active_jobs, sync=sync)
        except (Rejected, QuotaExceeded) as exc:
            if len(batch) == 1:
                _fail(batch[0], exc)
                return
            for one in batch:  # each request's own answer
                await self._flush(tenant_id, [one], max_active_jobs, sync)
            return
        except BaseException as exc:
            for waiting in batch:
                _fail(waiting, exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        telemetry.SUBMIT_COALESCED.observe(len(batch))
        for waiting, outcome in zip(batch, outcomes, strict=True):
            if not waiting.answer.done():
                waiting.answer.set_result(outcome)


def _fail(waiting: _Waiting, exc: BaseException) -> None:
    if waiting.answer.done():
        return
    if isinstance(exc, asyncio.CancelledError):
        waiting.answer.cancel()
    else:
        waiting.answer.set_exception(exc)
