"""The worker SDK (CONTRACT.md "Worker protocol"): run an async handler on a pool's executions.

    worker = herdwick.Worker("redis://127.0.0.1:6379/0", "emails", concurrency=10)

    @worker.handler
    async def send(ctx: herdwick.Context) -> dict:
        ...                      # ctx.payload, ctx.attempt, ctx.idempotency_key, ...
        return {"sent": True}    # return = complete; raise = fail; raise Permanent = dead
                                 # raise RetryAfter(60) = fail, next attempt in >= 60 s
                                 # raise Defer(30) = put off 30 s, not counted as an attempt

    await worker.run()           # until worker.stop(), or the `stop` event given to run()

Who owns what: the read loop alone reads the ready stream, claims messages
whose reader died and counts free slots (`_free`); every execution releases
its slot when it ends. Each leased attempt is an `_Execution`: its handler's
task, plus callbacks and timers for its lease, timeout and report (no task
of its own: at thousands of attempts a second, tasks are the cost). Every
Redis call but the blocking read goes through one coalescing pipeline.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import logging
import os
import random
import socket
import time
import urllib.parse
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import msgspec
import redis.asyncio as aioredis
from redis import exceptions as redis_errors
from redis.exceptions import RedisError, ResponseError

from herdwick import logs, redis_client, telemetry
from herdwick.config import DEFAULT_KEY_PREFIX
from herdwick.model import POOL_PATTERN, valid_pool
from herdwick.redis_client import REDIS_ERRORS
from herdwick.storage import keys

log = logs.get("herdwick.worker")

DEFAULT_CONCURRENCY = 10
DEFAULT_LEASE_S = 30.0
DEFAULT_GRACE_S = 30.0
READ_BLOCK_MS = 1000  # longest XREADGROUP BLOCK (stop() wakes it sooner: _Reader)
READ_RETRY_S = 1.0  # pause after a failed read before the next
UNBLOCK_RETRY_S = 0.05  # stop() re-sends CLIENT UNBLOCK this often until the read returns
ERROR_MESSAGE_MAX_BYTES = 4096
MAX_PIPELINE = 1000  # calls per pipeline: bounds one round trip, and the server's time on it
# complete/fail are fenced, so resending one is safe: a refused report (Redis away or
# full) is sent at least this many times, and again for as long as the lease holds, since
# one that never lands means the attempt runs again once the lease lapses.
REPORT_ATTEMPTS = 3
REPORT_RETRY_S = 0.2  # times the tries so far, up to REPORT_RETRY_MAX_S, jittered
REPORT_RETRY_MAX_S = 1.0
# The refusals that pass by themselves (Redis away, full, loading, failing over): only
# these are resent past the first tries. Any other (a reply out of contract) would only
# come again.
_PASSING = (redis_errors.ConnectionError, redis_errors.TimeoutError, OSError,
            redis_errors.OutOfMemoryError, redis_errors.BusyLoadingError,
            redis_errors.ReadOnlyError, redis_errors.TryAgainError,
            redis_errors.ClusterDownError, redis_errors.MasterDownError)
SETTLE_S = 5.0  # how long a cancelled handler may take to unwind before it is abandoned
# Completions are kept this long (at most EVIDENCE_MAX of them, about 0.7 KB each) to be
# sent again if Redis comes back empty before their events reached Postgres: well past
# the events' usual lag of under a second (a few seconds in a herd).
EVIDENCE_S = 30.0
EVIDENCE_MAX = 20_000
EPOCH_POLL_S = 1.0  # how often a worker looks whether Redis lost its data (the epoch key)
EPOCH_STOP_S = 2.0  # at shutdown, how long the epoch watcher may take to finish its look
RECOVER_CHUNK = 500  # completions per hw_recover call
GIVE_UP_LEASE_S = "0.001"  # the renewal a worker that stepped down sends: ends the lease

REDIS_URL_ENV = "HERDWICK_REDIS_URL"
KEY_PREFIX_ENV = "HERDWICK_KEY_PREFIX"

Handler = Callable[["Context"], Awaitable[Any]]

_LEASE_LOST = "LEASE_LOST"
_encode = msgspec.json.Encoder().encode


class Permanent(Exception):
    """Raise from a handler to fail the attempt without retry: it dead-letters at once."""


class RetryAfter(Exception):
    """Raise from a handler to fail the attempt and retry no sooner than `seconds` from now.

    The job's backoff still applies when it is longer (a downstream's Retry-After,
    say); the attempt counts against maxAttempts like any failure.
    """

    def __init__(self, seconds: float, message: str = "") -> None:
        super().__init__(message or f"retry after {seconds:g} s")
        self.seconds = max(0.0, float(seconds))


class Defer(Exception):
    """Raise from a handler to put the attempt off for `seconds` without counting it.

    For work that was not tried at all (its downstream is known to be down): the
    execution waits in retry_wait and comes back as a new attempt, which does not
    use up one of maxAttempts. The message is recorded as the execution's error.
    """

    def __init__(self, seconds: float, message: str = "") -> None:
        super().__init__(message or f"deferred for {seconds:g} s")
        self.seconds = max(0.0, float(seconds))


class LeaseLost(Exception):
    """The attempt's lease is gone (expired, taken over, canceled): stop working on it."""


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _status(reply: Any) -> str | None:
    return _text(reply) if isinstance(reply, bytes | str) else None


class _Message(msgspec.Struct, frozen=True, kw_only=True):
    """One entry of the ready stream; the fields a lease needs are checked before leasing."""

    message_id: str
    execution_id: str
    attempt: int
    fields: dict[str, str]

    def ids(self) -> dict[str, str | int]:
        """What a log line about this attempt carries, so one search finds them all."""
        return {"execution_id": self.execution_id, "attempt": self.attempt,
                "job_id": self.fields.get("job_id", ""),
                "tenant_id": self.fields.get("tenant_id", "")}

    @classmethod
    def parse(cls, message_id: bytes | str, raw: dict | None) -> _Message | None:
        try:  # bytes, as the worker's client returns them: decoded without a call each
            fields = {k.decode(): v.decode() for k, v in (raw or {}).items()}
        except AttributeError:
            fields = {_text(k): _text(v) for k, v in raw.items()}
        try:
            return cls(message_id=_text(message_id), execution_id=fields["execution_id"],
                       attempt=int(fields["attempt"]), fields=fields)
        except (KeyError, ValueError):
            return None


class _Pipeline:
    """Coalesces concurrent commands into one pipeline per round trip.

    `submit()` queues a command and returns a future of its reply;
    `submit_item()` queues one item of a batch function (hw_complete_batch),
    so that the items queued meanwhile go as one call. `run()`, a task owned
    by Worker.run, sends whatever queued while the previous pipeline was in
    flight and resolves the futures. Leases, reports and acks so cost O(1)
    round trips and O(1) commands per batch rather than per job, on one
    connection whatever the concurrency (redis-py's pool refuses, rather
    than queues, past its connection limit).
    """

    def __init__(self, client: aioredis.Redis) -> None:
        self._client = client
        self._loop = asyncio.get_running_loop()
        # Appended by submit() and submit_item(), taken by run().
        self._queue: list[tuple[tuple, asyncio.Future | list[asyncio.Future]]] = []
        self._items: dict[tuple, list[tuple[tuple, asyncio.Future]]] = {}
        self._wake = asyncio.Event()
        self._closed = False  # set by close(): run() returns at its next turn

    def submit(self, *args: Any) -> asyncio.Future:
        """Queue one command; a Redis error reply or a failed round trip lands as RedisError."""
        future = self._loop.create_future()
        self._queue.append((args, future))
        self._wake.set()
        return future

    def submit_item(self, head: tuple, *item: Any) -> asyncio.Future:
        """Queue `item` for the call `head + items...`, whose reply has one element per item."""
        future = self._loop.create_future()
        self._items.setdefault(head, []).append((item, future))
        self._wake.set()
        return future

    async def run(self) -> None:
        while not self._closed:
            await self._wake.wait()
            self._wake.clear()
            while (self._queue or self._items) and not self._closed:
                self._fold_items()
                batch = self._queue[:MAX_PIPELINE]
                del self._queue[:MAX_PIPELINE]
                await self._send(batch)

    def close(self) -> None:
        """Stop run() without relying on cancellation alone: a cancel that lands as a
        Redis call returns can be lost inside the client, and the task would wait here
        for ever (a `herdwick dev` that never stopped). Nothing queued is sent."""
        self._closed = True
        self._wake.set()

    def _fold_items(self) -> None:
        for head, items in self._items.items():
            for start in range(0, len(items), MAX_PIPELINE):
                chunk = items[start:start + MAX_PIPELINE]
                self._queue.append(((*head, *(a for item, _ in chunk for a in item)),
                                    [future for _, future in chunk]))
        self._items.clear()

    async def _send(self, batch: list[tuple[tuple, asyncio.Future | list[asyncio.Future]]]) -> None:
        pipe = self._client.pipeline(transaction=False)
        for args, _ in batch:
            pipe.execute_command(*args)
        try:
            with telemetry.timed_redis("worker_pipeline"):
                replies = await pipe.execute(raise_on_error=False)
        except REDIS_ERRORS as exc:
            replies = [exc] * len(batch)
        except BaseException:  # cancelled at shutdown: nobody is left to answer them
            for _, futures in batch:
                for future in futures if isinstance(futures, list) else [futures]:
                    future.cancel()
            raise
        for (args, futures), reply in zip(batch, replies, strict=True):
            if isinstance(futures, list):
                if not isinstance(reply, list) or len(reply) != len(futures):
                    # An error, or a library that is not ours: fail each item, never this task.
                    error = reply if isinstance(reply, Exception) else \
                        RedisError(f"{args[1]!r} replied {reply!r:.100}")
                    reply = [error] * len(futures)
                for future, element in zip(futures, reply, strict=True):
                    _resolve(future, element)
            else:
                _resolve(futures, reply)


def _resolve(future: asyncio.Future, reply: Any) -> None:
    if future.done():  # its caller was cancelled
        return
    if isinstance(reply, Exception):
        future.set_exception(reply)
    else:
        future.set_result(reply)


def _retrieve(future: asyncio.Future) -> None:
    """Done callback of a fire-and-forget call: its failure is logged, not left unretrieved."""
    if not future.cancelled() and (exc := future.exception()) is not None:
        log.warning("redis_call_failed", error=exc)


class _Metrics:
    """This worker's Prometheus children, looked up once (an attempt costs two updates)."""

    def __init__(self, pool: str) -> None:
        label = telemetry.pool_label(pool)
        self.handler = telemetry.WORKER_HANDLER.labels(label)
        self._attempts = {outcome: telemetry.WORKER_ATTEMPTS.labels(label, outcome)
                          for outcome in _OUTCOMES}

    def ended(self, outcome: str) -> None:
        self._attempts[outcome].inc()


_OUTCOMES = ("completed", "retry", "dead", "deferred", "lease_lost", "unreported")


class _Evidence:
    """This worker's recent completions, kept until Postgres surely has them (EVIDENCE_S).

    A completion lives in Redis (its `completed` event) until the event actor folds it
    into Postgres. If Redis loses its data in between, Postgres would still have the
    execution running and the sweeper would run it again; sent again with hw_recover
    once the worker sees Redis's new epoch, it is recorded rather than re-run. A complete
    refused as LEASE_LOST is kept too: if Redis lost the lease, the work was done all the
    same; if the lease passed to another attempt, Postgres's fence refuses it again.
    """

    def __init__(self) -> None:
        # (execution_id, attempt) -> the 8 hw_recover fields, oldest first; monotonic times
        self._items: collections.OrderedDict[tuple[str, int], tuple[float, tuple]] = \
            collections.OrderedDict()

    def add(self, message: _Message, result_json: bytes, handler_s: float) -> None:
        finished_ms = int(time.time() * 1000)
        f = message.fields
        self._items[message.execution_id, message.attempt] = (time.monotonic(), (
            message.execution_id, message.attempt, f.get("job_id", ""), f.get("tenant_id", ""),
            f.get("scheduled_for", ""), finished_ms - int(handler_s * 1000), finished_ms,
            result_json))
        if len(self._items) > EVIDENCE_MAX:
            self._items.popitem(last=False)

    def recent(self) -> list[tuple]:
        """What is still worth sending: the completions of the last EVIDENCE_S."""
        oldest = time.monotonic() - EVIDENCE_S
        while self._items:
            key, (at, _) = next(iter(self._items.items()))
            if at >= oldest:
                break
            del self._items[key]
        return [fields for _, fields in self._items.values()]


class _Calls:
    """The worker-side FCALLs on one pool, as the contract lists them, queued on the pipeline."""

    def __init__(self, client: aioredis.Redis, pipeline: _Pipeline, base: str, ready: str,
                 worker_id: str, lease_s: float, pool: str) -> None:
        self.client = client
        self.pipeline = pipeline
        self.base = base
        self.ready = ready
        self.worker_id = worker_id
        self.lease_arg = f"{lease_s:g}"
        self.metrics = _Metrics(pool)
        self.evidence = _Evidence()

    async def lease_many(self, messages: list[_Message]) -> list[int | None]:
        """Lease a batch in one call; RedisError if the call failed (then none is leased)."""
        args = [a for m in messages for a in (m.execution_id, m.attempt)]
        replies = await self.pipeline.submit("FCALL", "hw_lease_batch", 1, self.base,
                                             self.worker_id, self.lease_arg, *args)
        if not isinstance(replies, list) or len(replies) != len(messages):
            raise RedisError(f"hw_lease_batch replied {replies!r:.100}")
        return [_until(r) for r in replies]

    async def recover(self) -> int:
        """Send the recent completions again (hw_recover); -> how many Redis lacked."""
        items = self.evidence.recent()
        replies = await asyncio.gather(*(
            self.pipeline.submit("FCALL", "hw_recover", 1, self.base, self.worker_id,
                                 *(v for item in items[i:i + RECOVER_CHUNK] for v in item))
            for i in range(0, len(items), RECOVER_CHUNK)))
        return sum(int(r) for r in replies)

    def ack(self, message_ids: list) -> None:
        """XACK, fire and forget: a lost ack only means a later claim, which meets LEASE_LOST."""
        self.pipeline.submit("XACK", self.ready, keys.WORKERS_GROUP,
                             *message_ids).add_done_callback(_retrieve)

    def give_up(self, execution_id: str, attempt: int) -> None:
        """A heartbeat of a millisecond, fire and forget: what a worker that stepped down
        says, so that Redis records the stall or lets the lease go at once."""
        self.pipeline.submit("FCALL", "hw_heartbeat", 1, self.base, execution_id, attempt,
                             self.worker_id, GIVE_UP_LEASE_S).add_done_callback(_retrieve)

    def heartbeat(self, execution_id: str, attempt: int) -> asyncio.Future:
        """-> lease_until_ms, or LEASE_LOST (see _until)."""
        return self.pipeline.submit("FCALL", "hw_heartbeat", 1, self.base, execution_id, attempt,
                                    self.worker_id, self.lease_arg)

    def report(self, execution_id: str, attempt: int,
               outcome: _Completed | _Failed) -> asyncio.Future:
        """hw_complete or hw_fail -> OK | retry_at_ms | DEAD | LEASE_LOST."""
        match outcome:
            case _Completed(result_json):
                return self.pipeline.submit_item(
                    ("FCALL", "hw_complete_batch", 1, self.base, self.worker_id),
                    execution_id, attempt, result_json)
            case _Failed(error_json, retryable, 0, False):
                return self.pipeline.submit("FCALL", "hw_fail", 1, self.base, execution_id,
                                            attempt, self.worker_id, error_json, int(retryable))
            case _Failed(error_json, retryable, min_delay_ms, deferred):
                return self.pipeline.submit("FCALL", "hw_fail", 1, self.base, execution_id,
                                            attempt, self.worker_id, error_json, int(retryable),
                                            min_delay_ms, int(deferred))


def _until(reply: Any) -> int | None:
    """A lease or heartbeat reply: lease_until_ms, or None for LEASE_LOST."""
    if _status(reply) == _LEASE_LOST:
        return None
    return int(reply)


def _said(outcome: _Completed | _Failed, reply: Any) -> str:
    status = _status(reply)
    if status == _LEASE_LOST:
        return "lease_lost"
    if isinstance(outcome, _Completed):
        return "completed"
    if outcome.deferred:
        return "deferred"
    return "dead" if status == "DEAD" else "retry"


class _Lease:
    """The lease on one attempt, renewed on a timer every lease/3 and by ctx.heartbeat().

    A timer, not a task: most attempts end long before their first renewal,
    and a task each would cost more than a no-op handler. `lost` only ever
    goes from False to True. The local deadline is counted from when the
    last successful call was sent, so it never outlives the server's: once it
    passes without a renewal the outcome is unknown, and we step down
    (STYLE.md: losing a lease is the default).
    """

    def __init__(self, calls: _Calls, message: _Message, lease_s: float, sent_at: float,
                 loop: asyncio.AbstractEventLoop) -> None:
        self._calls = calls
        self._message = message
        self._lease_s = lease_s
        # Given, not looked up: on 3.11 each get_running_loop() is a getpid() system call,
        # 5 % of a worker's busy time when asked once an attempt.
        self._loop = loop
        self.deadline = sent_at + lease_s  # loop.time()
        self.lost = False
        self._timer: asyncio.TimerHandle | None = None
        self._on_lost: Callable[[], None] | None = None  # set while kept

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    async def renew(self) -> None:
        if self.lost:
            raise LeaseLost(self._message.execution_id)
        sent_at = self._loop.time()
        until = _until(await self._calls.heartbeat(self._message.execution_id,
                                                   self._message.attempt))
        if until is None:
            self.lost = True
            raise LeaseLost(self._message.execution_id)
        self.deadline = max(self.deadline, sent_at + self._lease_s)

    def keep(self, on_lost: Callable[[], None]) -> None:
        """Renew every lease/3 until release(); call on_lost once the lease is lost."""
        self._on_lost = on_lost
        self._arm()

    def release(self) -> None:
        self._on_lost = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm(self) -> None:
        delay = min(self._lease_s / 3, max(0.0, self.deadline - self._loop.time()))
        self._timer = self._loop.call_later(delay, self._beat)

    def _beat(self) -> None:
        self._timer = None
        if self._on_lost is None:
            return
        if self.lost:  # ctx.heartbeat() found out first
            self._lose()
        elif self._loop.time() >= self.deadline:
            log.warning("lease_lapsed", **self._message.ids())
            # Tell Redis too (a renewal of a millisecond): a lease that lapsed there is
            # refused and recorded as a possible duplicate (this handler may have acted
            # before it stalled); one still live there ends now, for the reaper.
            self._calls.give_up(self._message.execution_id, self._message.attempt)
            self._lose()
        else:
            sent_at = self._loop.time()
            self._calls.heartbeat(self._message.execution_id, self._message.attempt) \
                .add_done_callback(lambda reply: self._renewed(reply, sent_at))

    def _renewed(self, reply: asyncio.Future, sent_at: float) -> None:
        if reply.cancelled():
            return
        exc = reply.exception()
        if self._on_lost is None:  # released meanwhile
            return
        if exc is not None:
            log.warning("heartbeat_failed", **self._message.ids(), error=exc)
        elif _until(reply.result()) is None:
            self.lost = True
        else:
            self.deadline = max(self.deadline, sent_at + self._lease_s)
        if self.lost:
            self._lose()
        else:
            self._arm()

    def _lose(self) -> None:
        self.lost = True
        log.info("lease_lost", **self._message.ids())
        on_lost, self._on_lost = self._on_lost, None
        if on_lost is not None:
            on_lost()


@dataclass(frozen=True, slots=True, kw_only=True)
class Context:
    """What a handler gets: one attempt of one execution."""

    payload: Any  # the job's payload, decoded from JSON
    attempt: int  # from 1; the fencing token
    execution_id: str
    job_id: str
    tenant_id: str
    idempotency_key: str  # job_id + ":" + scheduled_for: the same on every attempt
    scheduled_for: datetime  # aware, UTC
    timeout_s: float  # the handler is cancelled and failed past this
    payload_json: str = ""  # the payload as its JSON text, as stored
    target: str = ""  # an http job's URL (the http pool's entries carry it); else ""
    _lease: _Lease = field(repr=False)

    async def heartbeat(self) -> None:
        """Extend the lease now (it is also extended every lease/3); raises LeaseLost if lost."""
        await self._lease.renew()

    @classmethod
    def build(cls, message: _Message, lease: _Lease, decode: bool = True) -> Context:
        f = message.fields
        payload = msgspec.json.decode(f["payload"]) if decode else None
        return cls(payload=payload, attempt=message.attempt,
                   execution_id=message.execution_id, job_id=f["job_id"],
                   tenant_id=f["tenant_id"], idempotency_key=f["idempotency_key"],
                   scheduled_for=datetime.fromisoformat(f["scheduled_for"]),
                   timeout_s=float(f["timeout_seconds"]), payload_json=f["payload"],
                   target=f.get("target", ""), _lease=lease)


class _Completed(msgspec.Struct, frozen=True):
    result_json: bytes


class _Failed(msgspec.Struct, frozen=True):
    error_json: bytes
    retryable: bool
    min_delay_ms: int = 0  # RetryAfter: the least wait before the next attempt
    deferred: bool = False  # Defer: put off for exactly min_delay_ms, not counted


def _error(kind: str, message: str, details: dict | None = None) -> bytes:
    data = message.encode()[:ERROR_MESSAGE_MAX_BYTES].decode(errors="ignore")
    return _encode({"type": kind, "message": data, **(details or {})})


def _outcome_of(work: asyncio.Task) -> _Completed | _Failed:
    """A finished handler task -> what to report. Cancellation is handled by the caller."""
    exc = work.exception()
    if exc is None:
        try:
            return _Completed(_encode(work.result()))
        except (TypeError, msgspec.EncodeError) as bad:
            # A deterministic bug, and the handler's side effects already ran: no retry.
            return _Failed(_error("ResultNotSerializable", str(bad)), retryable=False)
    # An exception's `error_details` (a dict: an HTTP status, say) goes into the error.
    details = getattr(exc, "error_details", None)
    error = _error(type(exc).__name__, str(exc), details if isinstance(details, dict) else None)
    if isinstance(exc, Defer):
        return _Failed(error, retryable=True, min_delay_ms=round(exc.seconds * 1000),
                       deferred=True)
    if isinstance(exc, RetryAfter):
        return _Failed(error, retryable=True, min_delay_ms=round(exc.seconds * 1000))
    return _Failed(error, retryable=not isinstance(exc, Permanent))


class _Execution:
    """One leased attempt: its handler task under its lease and timeout, then its report.

    Driven by callbacks on the handler task and by timers, so an attempt
    costs one task, the handler's own. It ends (`on_end`) once its outcome
    is reported, or with nothing reported when the lease was lost or the
    worker abandoned it at shutdown (the lease then lapses for the reaper).
    """

    def __init__(self, calls: _Calls, message: _Message, lease: _Lease,
                 on_end: Callable[[_Execution], None], decode: bool = True,
                 timeout_grace_s: float = 0.0) -> None:
        self._calls = calls
        self.message = message
        self._lease = lease
        self._on_end = on_end
        self._loop = lease.loop
        self._work: asyncio.Task | None = None
        self._timer: asyncio.TimerHandle | None = None  # the timeout, then the settle wait
        self._timed_out = 0.0  # the timeout that ran out, if one did
        self._abandoned = False
        self._reporting = False
        self._tries = 0
        self.ended = False
        self._decode = decode
        self._grace_s = timeout_grace_s

    def start(self, handler: Handler) -> None:
        try:
            ctx = Context.build(self.message, self._lease, self._decode)
        except (KeyError, ValueError, msgspec.DecodeError) as exc:
            self._report(_Failed(_error("MalformedMessage", repr(exc)), retryable=False))
            return
        self._began = time.perf_counter()
        self._work = self._loop.create_task(handler(ctx), name=f"herdwick:{ctx.execution_id}")
        self._work.add_done_callback(self._handler_done)
        if ctx.timeout_s > 0:
            self._timer = self._loop.call_later(ctx.timeout_s + self._grace_s, self._time_out,
                                                ctx.timeout_s)
        self._lease.keep(self._cancel_work)

    def abandon(self) -> None:
        """Shutdown past its grace: cancel the handler, stop renewing, report nothing."""
        if self.ended or self._reporting:
            return  # a report in flight finishes on its own
        self._abandoned = True
        self._lease.release()
        self._cancel_work()

    def _time_out(self, timeout_s: float) -> None:
        log.warning("handler_timeout", **self.message.ids(), timeout_s=timeout_s)
        self._timed_out = timeout_s
        self._cancel_work()

    def _cancel_work(self) -> None:
        """Cancel the handler and give it SETTLE_S to unwind before going on without it."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_later(SETTLE_S, self._unsettled)
        self._work.cancel()

    def _unsettled(self) -> None:
        self._timer = None
        log.error("handler_ignores_cancel", task=self._work.get_name())
        self._finish()

    def _handler_done(self, work: asyncio.Task) -> None:
        if not work.cancelled():
            work.exception()  # retrieved: an outcome is reported, never logged as lost
        if not self._reporting and not self.ended:
            self._finish()

    def _finish(self) -> None:
        """The handler finished (or would not): report what it came to, if it is ours to."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._lease.release()
        self._calls.metrics.handler.observe(time.perf_counter() - self._began)
        outcome = self._outcome()
        if outcome is None:
            self._calls.metrics.ended("lease_lost" if self._lease.lost else "unreported")
            self._end()
        else:
            self._report(outcome)

    def _outcome(self) -> _Completed | _Failed | None:
        work = self._work
        if self._lease.lost or self._abandoned:
            return None  # no longer ours to report / the lease will lapse
        if self._timed_out:
            return _Failed(_error("Timeout", f"handler ran over {self._timed_out:g} s"),
                           retryable=True)
        if work.cancelled():  # by the handler itself: nothing it did is known to have finished
            return _Failed(_error("Cancelled", "the handler was cancelled"), retryable=True)
        return _outcome_of(work)

    def _report(self, outcome: _Completed | _Failed) -> None:
        self._reporting = True
        m = self.message
        self._calls.report(m.execution_id, m.attempt, outcome).add_done_callback(
            lambda reply: self._reported(reply, outcome))

    def _reported(self, reply: asyncio.Future, outcome: _Completed | _Failed) -> None:
        m = self.message
        if reply.cancelled():  # shutdown cancelled the pipeline: the lease lapses
            self._end()
            return
        exc = reply.exception()
        if exc is None:
            said = _said(outcome, reply.result())
            self._calls.metrics.ended(said)
            if isinstance(outcome, _Completed):
                self._calls.evidence.add(m, outcome.result_json, time.perf_counter() - self._began)
            # debug: one line per execution would cost more than the execution at 5,000/s
            if log.is_enabled(logging.DEBUG):
                log.debug("execution_" + said, **m.ids())
        else:
            self._tries += 1
            delay_s = min(REPORT_RETRY_S * self._tries, REPORT_RETRY_MAX_S) \
                * random.uniform(0.5, 1.0)
            holds = self._loop.time() + delay_s < self._lease.deadline
            if self._tries < REPORT_ATTEMPTS or (isinstance(exc, _PASSING) and holds):
                if self._tries == 1:  # once: an outage would log each execution every second
                    log.warning("report_failed", **m.ids(), error=exc)
                self._loop.call_later(delay_s, self._report, outcome)
                return
            # The lease lapses and the reaper counts the attempt as failed.
            self._calls.metrics.ended("unreported")
            log.error("report_abandoned", **m.ids(), tries=self._tries, error=exc)
        self._end()

    def _end(self) -> None:
        if not self.ended:
            self.ended = True
            self._on_end(self)


class _Reader:
    """XREADGROUP on a connection of its own, which stop() wakes with CLIENT UNBLOCK.

    Why not cancel the blocked read: on Python 3.11 redis-py writes commands
    under asyncio.wait_for, which swallows a cancel that lands as the write
    completes, so the read runs out its BLOCK anyway; and a read cancelled
    after the server answered strands its entries in the pending list.
    Unblocked, XREADGROUP returns what it has (usually nothing) at once.

    On a Redis Cluster both connections go to the node serving the stream's
    slot; after a failover or a resharding the read fails (connection refused,
    MOVED), the cluster client learns the new owner, and the next read asks it.
    """

    def __init__(self, client: redis_client.Client, stream: str, worker_id: str) -> None:
        self._client = client
        self._stream = stream
        self._worker_id = worker_id
        self._conn: aioredis.Redis | None = None
        self._control: redis_client.Client | None = None  # sends CLIENT UNBLOCK to _conn's node
        self._conn_id: int | None = None  # CLIENT ID of _conn; None after a failure, 0 denied

    async def _connect(self) -> aioredis.Redis:
        if self._conn is None:
            self._conn = redis_client.node_client_for(self._client, self._stream)
            self._control = redis_client.node_client_for(self._client, self._stream) \
                if redis_client.is_cluster(self._client) else self._client
            self._conn_id = None
        if self._conn_id is None:
            try:
                self._conn_id = await self._conn.client_id()
            except ResponseError:  # an ACL without CLIENT: stop() waits out the BLOCK instead
                self._conn_id = 0
        return self._conn

    async def read(self, count: int, block_ms: int, stopping: asyncio.Event) -> list:
        try:
            conn = await self._connect()
        except REDIS_ERRORS:
            await self._reset()
            raise
        read = asyncio.ensure_future(self._xreadgroup(conn, count, block_ms))
        stopped = asyncio.ensure_future(stopping.wait())
        try:
            await asyncio.wait({read, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
        while self._conn_id and not read.done():  # stopping: wake it (again, if not blocked yet)
            try:
                await self._control.client_unblock(self._conn_id)
            except REDIS_ERRORS:
                break
            await asyncio.wait({read}, timeout=UNBLOCK_RETRY_S)
        try:
            return await read
        except REDIS_ERRORS:
            await self._reset()
            raise

    async def _reset(self) -> None:
        """After a failure: redis-py may reconnect under a new id, and on a cluster the
        stream may have moved. A keyed call through the cluster client follows MOVED
        and updates its map of the slots, so the next connection goes to the owner."""
        self._conn_id = None
        if not redis_client.is_cluster(self._client):
            return
        await self.close()
        self._conn = self._control = None
        with contextlib.suppress(*REDIS_ERRORS):
            await self._client.xlen(self._stream)

    async def _xreadgroup(self, conn: aioredis.Redis, count: int, block_ms: int) -> list:
        reply = await conn.xreadgroup(keys.WORKERS_GROUP, self._worker_id,
                                      {self._stream: ">"}, count=count, block=block_ms)
        if isinstance(reply, dict):  # RESP3: {stream: [[entry, ...]]}
            return [entry for batch in reply.values() for entry in batch[0]]
        return [entry for _, batch in reply or [] for entry in batch]  # RESP2

    async def close(self) -> None:
        for conn in {id(c): c for c in (self._conn, self._control)
                     if c is not None and c is not self._client}.values():
            with contextlib.suppress(*REDIS_ERRORS, OSError):
                await conn.aclose()


def _redacted(url: str) -> str:
    """The URL without its password, for logs."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rpartition("@")[2]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urllib.parse.urlunsplit(parts._replace(netloc=user + netloc))


def _default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


class Worker:
    """Leases a pool's executions from Redis and runs one async handler on each.

    Run once: `await worker.run()` returns after `stop()` (or the `stop`
    event), once in-flight handlers finished or their grace ran out.

    redis_url: the scheduler's Redis (HERDWICK_REDIS_URL when not given; `herdwick dev`
    prints it). pool: the queue name that jobs target. concurrency: handlers running at
    once (and so messages leased at once). key_prefix: the scheduler's
    HERDWICK_KEY_PREFIX (that variable, else "hw", when not given). worker_id: the
    consumer name and lease owner (default host:pid:random). lease_s: the lease each
    attempt takes and renews every lease_s/3; messages idle longer than it are claimed
    from dead readers. batch: most messages per read (default concurrency). grace_s: how
    long stop() lets in-flight handlers finish. redis: a client to use instead of one
    from redis_url (not closed here).
    """

    def __init__(self, redis_url: str | None = None, pool: str | None = None,
                 concurrency: int = DEFAULT_CONCURRENCY, *, key_prefix: str | None = None,
                 worker_id: str | None = None, lease_s: float = DEFAULT_LEASE_S,
                 batch: int | None = None, grace_s: float = DEFAULT_GRACE_S,
                 redis: aioredis.Redis | None = None) -> None:
        if pool is None or not valid_pool(pool):
            raise ValueError(f"pool must be a queue name ({POOL_PATTERN}), not {pool!r}")
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if lease_s <= 0 or grace_s < 0:
            raise ValueError("lease_s must be positive and grace_s not negative")
        self.redis_url = redis_url or None
        self.pool = pool
        self.concurrency = concurrency
        self.key_prefix = key_prefix or None
        self.worker_id = worker_id or _default_worker_id()
        self.lease_s = float(lease_s)
        self.batch = min(batch or concurrency, concurrency)
        self.grace_s = float(grace_s)
        self._given_client = redis
        self._handler: Handler | None = None
        self._stopping = asyncio.Event()
        self._wake = asyncio.Event()  # set on stop and whenever a slot frees
        self._done = asyncio.Event()
        self._started = False
        self._free = concurrency  # written by the read loop and by ending executions
        # (execution_id, attempt) -> its _Execution, while it runs here. hw_lease lets a holder
        # lease again (it only extends), so a message of ours claimed back after a lost XACK
        # must not run twice. Owned by run(): drained or abandoned there.
        self._executions: dict[tuple[str, int], _Execution] = {}
        self._idle = asyncio.Event()  # set while nothing runs
        self._idle.set()
        self._claim_cursor = "0-0"
        # False: handlers get payload None and read payload_json (the http pool, which
        # sends the JSON text as it is, spares a decode per delivery).
        self.decode_payload = True
        # Past the job's timeout, how long the handler is given before it is cancelled: the
        # http pool enforces the timeout itself and reports a classified error, so a busy
        # event loop must not let this timer beat the handler's own.
        self.timeout_grace_s = 0.0

    def gauges(self):
        yield ("herdwick_worker_in_flight", {"pool": telemetry.pool_label(self.pool)},
               len(self._executions))

    def configure(self, *, redis_url: str | None = None, key_prefix: str | None = None) -> None:
        """Set the Redis URL and key prefix before run() (`herdwick worker`'s flags do)."""
        if self._started:
            raise RuntimeError("configure() a Worker before it runs")
        self.redis_url = redis_url or self.redis_url
        self.key_prefix = key_prefix or self.key_prefix

    def _resolve(self) -> tuple[str, str]:
        url = self.redis_url or os.environ.get(REDIS_URL_ENV)
        if not url and self._given_client is None:
            raise RuntimeError(f"no Redis URL: pass one to Worker() or set {REDIS_URL_ENV}")
        return url or "", self.key_prefix or os.environ.get(KEY_PREFIX_ENV) or DEFAULT_KEY_PREFIX

    def handler(self, fn: Handler) -> Handler:
        """Decorator: register the one async function that runs every execution."""
        if not inspect.iscoroutinefunction(fn):
            raise TypeError("a herdwick handler must be an async function")
        if self._handler is not None:
            raise RuntimeError("this Worker already has a handler")
        self._handler = fn
        return fn

    async def stop(self) -> None:
        """Stop reading, and return once run() has drained (within grace_s)."""
        self._request_stop()
        if self._started:
            await self._done.wait()

    def _request_stop(self) -> None:
        self._stopping.set()
        self._wake.set()

    async def run(self, stop: asyncio.Event | None = None) -> None:
        if self._handler is None:
            raise RuntimeError("no handler: decorate an async function with @worker.handler")
        if self._started:
            raise RuntimeError("a Worker runs once")
        url, prefix = self._resolve()
        self._started = True
        self._ready = keys.ready_stream(prefix, self.pool)
        client = self._given_client or redis_client.connect(url)
        pipeline = _Pipeline(client)
        calls = _Calls(client, pipeline, keys.pool_base(prefix, self.pool),
                       self._ready, self.worker_id, self.lease_s, self.pool)
        telemetry.watch(self)
        reader = _Reader(client, self._ready, self.worker_id)
        flusher = asyncio.create_task(pipeline.run())
        epochs = asyncio.create_task(self._watch_epoch(calls, keys.epoch_key(prefix)))
        watcher = asyncio.create_task(self._watch(stop)) if stop is not None else None
        log.info("worker_started", pool=self.pool, worker_id=self.worker_id,
                 concurrency=self.concurrency, lease_s=self.lease_s,
                 redis=_redacted(url) if url else "(client given)", key_prefix=prefix)
        grace_s = self.grace_s
        try:
            await self._ensure_group(client)
            await self._check_library(client)
            await self._read_loop(calls, reader)
        except asyncio.CancelledError:
            grace_s = 0.0
            raise
        finally:
            if watcher is not None:
                watcher.cancel()
            # The epoch watcher ends between two calls (a call cancelled mid-flight can
            # leave its connection unclosed); it is cancelled only if it does not.
            self._request_stop()
            await asyncio.wait([epochs], timeout=EPOCH_STOP_S)
            epochs.cancel()
            await asyncio.gather(epochs, return_exceptions=True)
            await self._drain(grace_s)
            pipeline.close()
            flusher.cancel()
            await asyncio.gather(flusher, return_exceptions=True)
            await reader.close()
            if self._given_client is None:
                await client.aclose()
            telemetry.unwatch(self)
            log.info("worker_stopped", pool=self.pool, worker_id=self.worker_id)
            self._done.set()

    async def _watch_epoch(self, calls: _Calls, epoch_key: str) -> None:
        """Every EPOCH_POLL_S: has Redis a new epoch, i.e. did it lose its data? Then the
        recent completions go again (before the sweeper, which waits for them, re-runs
        what Postgres still has running). A missing epoch waits for a scheduler to set one.
        They go again, too, when another server process now serves the pool's keys (its
        run_id changed): a failover (a cluster's replica promoted) or a restart from disk
        may lack the last completions the old process acknowledged, while the epoch
        key, older, survived."""
        seen = serving = None
        while not self._stopping.is_set():
            try:
                epoch = await calls.pipeline.submit("GET", epoch_key)
                now_serving = await self._serving(calls)
            except REDIS_ERRORS:
                epoch = now_serving = None  # unreachable, or restarting: look again
            if epoch is not None:
                if seen is not None and epoch != seen:
                    await self._recover(calls)
                elif serving is not None and now_serving != serving:
                    await self._recover(calls, after="failover")
                seen, serving = epoch, now_serving
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(),
                                       EPOCH_POLL_S * random.uniform(0.8, 1.0))

    async def _serving(self, calls: _Calls) -> str | None:
        """The run_id of the server process that serves this pool's keys now."""
        client = calls.client
        try:
            if redis_client.is_cluster(client):
                info = await client.info("server",
                                         target_nodes=client.get_node_from_key(self._ready))
            else:
                info = await calls.pipeline.submit("INFO", "server")
        except ResponseError:  # an ACL without INFO: the epoch alone tells a loss
            return None
        return info.get("run_id") if isinstance(info, dict) else None

    async def _recover(self, calls: _Calls, after: str = "data_lost") -> None:
        try:
            recovered = await calls.recover()
        except REDIS_ERRORS as exc:  # the sweeper re-runs them: at least once, still
            log.warning("recover_failed", pool=self.pool, error=exc)
            return
        if after == "data_lost" or recovered:
            log.warning("completions_recovered", pool=self.pool, count=recovered, after=after,
                        hint="Redis lost completions it had acknowledged; these were sent "
                             "again")

    async def _watch(self, stop: asyncio.Event) -> None:
        await stop.wait()
        self._request_stop()

    async def _check_library(self, client: aioredis.Redis) -> None:
        """Say so when no scheduler has loaded herdwick's functions on this Redis.

        The usual cause is a worker pointed at another Redis than the scheduler's:
        it would wait for work forever without a word. It keeps waiting (a
        scheduler may start later), but the log says what to check.
        """
        try:
            await client.fcall("hw_version", 0)
        except ResponseError:
            log.warning("functions_missing", pool=self.pool,
                        hint="no herdwick scheduler has loaded its functions on this Redis; "
                             "is this the scheduler's HERDWICK_REDIS_URL?")
        except REDIS_ERRORS:
            pass  # unreachable: the read loop says so, and retries

    async def _ensure_group(self, client: aioredis.Redis) -> None:
        try:
            await client.xgroup_create(self._ready, keys.WORKERS_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    # --- reading ---------------------------------------------------------------------------

    async def _read_loop(self, calls: _Calls, reader: _Reader) -> None:
        loop = asyncio.get_running_loop()
        claim_s = self.lease_s / 2
        next_claim = loop.time()  # at start: take over what a dead predecessor read
        while (free := await self._wait_for_slots()) > 0:
            try:
                if loop.time() >= next_claim:
                    entries, more = await self._claim(calls.client, free)
                    next_claim = loop.time() + (0 if more else claim_s * random.uniform(0.8, 1))
                else:
                    block_ms = max(1, min(READ_BLOCK_MS, int((next_claim - loop.time()) * 1000)))
                    entries = await reader.read(free, block_ms, self._stopping)
                if entries:
                    await self._start(calls, entries)
            except REDIS_ERRORS as exc:
                await self._read_failed(calls.client, exc)

    async def _wait_for_slots(self) -> int:
        """Free slots to fill (at most a batch); 0 once stopping."""
        while self._free == 0 and not self._stopping.is_set():
            self._wake.clear()
            await self._wake.wait()
        return 0 if self._stopping.is_set() else min(self._free, self.batch)

    async def _claim(self, client: aioredis.Redis, count: int) -> tuple[list, bool]:
        """XAUTOCLAIM messages read but never leased (their reader died); -> (entries, more)."""
        cursor, entries, *_ = await client.xautoclaim(
            self._ready, keys.WORKERS_GROUP, self.worker_id, int(self.lease_s * 1000),
            start_id=self._claim_cursor, count=count)
        self._claim_cursor = _text(cursor)
        if entries:
            log.info("messages_claimed", pool=self.pool, count=len(entries))
        return entries, self._claim_cursor != "0-0"

    async def _read_failed(self, client: aioredis.Redis, exc: RedisError) -> None:
        if "NOGROUP" in str(exc):  # the stream went away (FLUSHALL, a new Redis): recreate it
            log.warning("group_missing", pool=self.pool)
            try:
                await self._ensure_group(client)
                return
            except REDIS_ERRORS as again:
                exc = again
        log.warning("read_failed", pool=self.pool, error=exc)
        try:
            await asyncio.wait_for(self._stopping.wait(), READ_RETRY_S)
        except TimeoutError:
            pass

    # --- leasing and running -----------------------------------------------------------------

    async def _start(self, calls: _Calls, entries: list) -> None:
        """Lease a batch, start what we got, then XACK every message that is settled."""
        messages, settled = [], []
        for message_id, raw in entries:
            message = _Message.parse(message_id, raw)
            if message is None:
                log.error("message_malformed", pool=self.pool, message_id=_text(message_id))
                settled.append(message_id)
            elif (message.execution_id, message.attempt) in self._executions:
                settled.append(message_id)
            else:
                messages.append(message)
        loop = asyncio.get_running_loop()
        sent_at = loop.time()
        replies = await self._lease(calls, messages) if messages else []
        for message, reply in zip(messages, replies, strict=True):
            settled.append(message.message_id)
            if reply is None:
                log.debug("lease_refused", **message.ids())
            else:
                self._spawn(calls, message, _Lease(calls, message, self.lease_s, sent_at, loop))
        if settled:
            calls.ack(settled)

    async def _lease(self, calls: _Calls, messages: list[_Message]) -> list[int | None]:
        """hw_lease_batch, asked again once if the call failed: Redis may have granted the
        leases and the reply been lost (a timeout that fired as the loop woke from a
        pause, a dropped connection). Asked again, a lease this worker holds is renewed,
        not granted twice; one that lapsed meanwhile is refused, and its handler never
        runs. A second failure raises: every message stays pending, for XAUTOCLAIM, and
        the read loop pauses before reading again."""
        try:
            return await calls.lease_many(messages)
        except REDIS_ERRORS as exc:
            log.warning("lease_call_failed", pool=self.pool, messages=len(messages), error=exc)
        return await calls.lease_many(messages)

    def _spawn(self, calls: _Calls, message: _Message, lease: _Lease) -> None:
        assert self._handler is not None
        execution = _Execution(calls, message, lease, self._ended, self.decode_payload,
                               self.timeout_grace_s)
        self._executions[message.execution_id, message.attempt] = execution
        self._free -= 1
        self._idle.clear()
        execution.start(self._handler)

    def _ended(self, execution: _Execution) -> None:
        self._executions.pop((execution.message.execution_id, execution.message.attempt), None)
        self._free += 1
        self._wake.set()
        if not self._executions:
            self._idle.set()

    async def _drain(self, grace_s: float) -> None:
        """Let in-flight handlers finish within grace_s; past it, abandon them (leases lapse)."""
        if not self._executions:
            return
        log.info("worker_draining", pool=self.pool, in_flight=len(self._executions),
                 grace_s=grace_s)
        if grace_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), grace_s)
        if self._executions:
            log.warning("grace_expired", pool=self.pool, cancelled=len(self._executions))
            for execution in list(self._executions.values()):
                execution.abandon()
            # Abandoned handlers get SETTLE_S; a report in flight, its retries.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), SETTLE_S + REPORT_ATTEMPTS)
