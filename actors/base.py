"""The actor kernel: an Actor owns its state and a bounded mailbox; a Supervisor runs actors.

An actor handles one message at a time in its own task, so nothing else ever
touches its state: other code talks to it only through `send`. A full
mailbox makes `send` wait (backpressure), never grow without bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Awaitable, Callable

import msgspec

from herdwick import logs
from herdwick.clock import Clock, SystemClock
from herdwick.errors import StorageUnavailable

log = logs.get("herdwick.actors")

MAILBOX_SIZE = 1024
RESTART_BACKOFF_S = (0.1, 0.5, 2.0, 5.0)


class Stop(msgspec.Struct, frozen=True):
    """Finish what is in hand and exit the run loop."""


class Tick(msgspec.Struct, frozen=True):
    """Periodic work is a message: the ticker sends it, tests send it by hand."""


class Sync:
    """Test signal: `done` is set once every message sent before it has been handled."""

    def __init__(self) -> None:
        self.done = asyncio.Event()


async def sync(actor: Actor, timeout_s: float = 30.0) -> None:
    if actor.stopped:
        return
    signal = Sync()
    await actor.send(signal)
    if actor.stopped:  # it stopped while we queued: nothing will answer but this
        actor._release_syncs()
    await asyncio.wait_for(signal.done.wait(), timeout_s)


class Actor:
    """Subclasses implement `handle(msg)`; `idle_timeout()` may bound the wait for a message.

    When the wait times out, `handle(None)` runs: that is how an actor wakes
    for a deadline (a heap top falling due) without a separate timer task.
    """

    name = "actor"

    def __init__(self, *, clock: Clock | None = None, mailbox_size: int = MAILBOX_SIZE) -> None:
        self.clock = clock or SystemClock()
        # Written by any task through send(); read only by this actor's run loop.
        self.mailbox: asyncio.Queue[object] = asyncio.Queue(maxsize=mailbox_size)
        self.ready = asyncio.Event()
        self.stopped = False

    async def send(self, msg: object) -> None:
        await self.mailbox.put(msg)

    def try_send(self, msg: object) -> bool:
        """Deliver if there is room; for best-effort messages (notify) that may be dropped."""
        try:
            self.mailbox.put_nowait(msg)
        except asyncio.QueueFull:
            return False
        return True

    def idle_timeout(self) -> float | None:
        return None

    async def on_start(self) -> None:
        """Runs before the first message; `start()` returns once it has."""

    async def on_stop(self) -> None:
        """Runs after the loop ends, on Stop, cancellation or crash."""

    async def quiesce(self) -> None:
        """Before a Sync is answered: finish work this actor left running in the background."""

    async def handle(self, msg: object | None) -> None:
        raise NotImplementedError

    async def run(self) -> None:
        # A supervisor may run a crashed actor again (a factory that hands back the one
        # instance other actors hold, e.g. the dispatchers): a crash is not a Stop.
        self.stopped = False
        await self.on_start()
        self.ready.set()
        try:
            while not self.stopped:
                msg = await self._next()
                if isinstance(msg, Stop):
                    self.stopped = True
                    break
                if isinstance(msg, Sync):
                    await self.quiesce()
                    msg.done.set()
                    continue
                await self.handle(msg)
        finally:
            self.stopped = True
            self._release_syncs()
            await self.on_stop()

    def _release_syncs(self) -> None:
        """A stopped actor handles nothing more: answer the Syncs waiting behind its Stop.

        Every other message stays, in order: a crashed actor that is run again (the
        dispatchers are) handles them then. Dropping them stranded work: a Due's items
        stay held by their fair queue until settled, and a reload of them counts as a
        duplicate, so those rows waited until their shards moved to another node.
        """
        kept = []
        while not self.mailbox.empty():
            msg = self.mailbox.get_nowait()
            if isinstance(msg, Sync):
                msg.done.set()
            else:
                kept.append(msg)
        for msg in kept:
            self.mailbox.put_nowait(msg)

    async def _next(self) -> object | None:
        timeout = self.idle_timeout()
        if timeout is None:
            return await self.mailbox.get()
        if timeout <= 0 or not self.mailbox.empty():
            return self._take_nowait()
        # asyncio.timeout, not wait_for: 3.11's wait_for wraps the get in a Task of its
        # own each time, and every shard waits with a timeout, many times a second.
        try:
            async with asyncio.timeout(timeout):
                return await self.mailbox.get()
        except TimeoutError:
            return None

    def _take_nowait(self) -> object | None:
        try:
            return self.mailbox.get_nowait()
        except asyncio.QueueEmpty:
            return None

    def drain_until_sync(self, limit: int) -> list[object]:
        """What waits in the mailbox, up to `limit` messages, without blocking.

        Stops before a Sync or Stop, which the run loop must see in order.
        """
        taken = []
        while len(taken) < limit and not self.mailbox.empty():
            head = self.mailbox._queue[0]  # asyncio.Queue keeps its items in a deque
            if isinstance(head, Sync | Stop):
                break
            taken.append(self.mailbox.get_nowait())
        return taken


class Supervisor:
    """Runs actors in one TaskGroup; restarts a crashed actor with backoff and logs why.

    Restarting builds a fresh actor from its factory, so a crash never leaves
    half-updated state behind: the new one reloads what it needs.
    """

    def __init__(self, name: str = "supervisor") -> None:
        self.name = name
        self._group = asyncio.TaskGroup()
        self._tasks: dict[str, asyncio.Task] = {}
        self._current: dict[str, Actor] = {}
        self._stopping: set[str] = set()  # keys whose stop is under way: never restarted
        self._entered = False
        self.restarted = asyncio.Event()  # test signal: set each time an actor is rebuilt

    async def __aenter__(self) -> Supervisor:
        await self._group.__aenter__()
        self._entered = True
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop_all()
        await self._group.__aexit__(*exc)

    def actor(self, key: str) -> Actor | None:
        return self._current.get(key)

    async def start(self, key: str, factory: Callable[[], Actor], *,
                    restart: bool = True) -> Actor:
        """Start an actor under `key`; returns once it is ready."""
        first = factory()
        self._current[key] = first
        crashed = asyncio.Event()
        self._tasks[key] = self._group.create_task(
            self._keep(key, factory, first, restart, crashed), name=f"{self.name}:{key}")
        # Ready, or its first start crashed (it keeps restarting in the background: a
        # process must come up, and say why, even while one actor cannot), or it ended.
        waits = {asyncio.create_task(first.ready.wait()), asyncio.create_task(crashed.wait())}
        await asyncio.wait({*waits, self._tasks[key]}, return_when=asyncio.FIRST_COMPLETED)
        for wait in waits:
            wait.cancel()
        return first

    async def _keep(self, key: str, factory: Callable[[], Actor], actor: Actor,
                    restart: bool, crashed: asyncio.Event) -> None:
        failures = 0
        while True:
            try:
                await actor.run()
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                crashed.set()
                delay = RESTART_BACKOFF_S[min(failures, len(RESTART_BACKOFF_S) - 1)]
                again = restart and key not in self._stopping
                if isinstance(exc, StorageUnavailable):
                    # Postgres or Redis is away: a line a retry says it; a traceback
                    # a retry per actor would bury everything else in the log.
                    log.warning("actor_unavailable", actor=key, error=str(exc),
                                restart=again, delay_s=delay)
                else:
                    log.exception("actor_crashed", actor=key, restart=again, delay_s=delay)
                if not again:
                    return
                failures += 1
                await asyncio.sleep(delay * (0.5 + random.random()))
                if key in self._stopping:
                    return
                actor = factory()
                self._current[key] = actor
                self.restarted.set()

    async def stop(self, key: str, timeout_s: float = 5.0) -> None:
        """Send Stop and wait for the actor to finish; cancel it past the deadline.

        An actor not in its run loop (crashed and waiting out its restart backoff,
        or not through on_start) holds no work to finish, and a Stop would not reach
        it: it is cancelled at once. If this call is cancelled, so is the actor.
        """
        task = self._tasks.pop(key, None)
        actor = self._current.pop(key, None)
        if task is None or actor is None:
            return
        self._stopping.add(key)
        try:
            if task.done():
                return
            if actor.stopped or not actor.ready.is_set():
                await _cancelled(task)
                return
            with contextlib.suppress(asyncio.QueueFull):
                actor.mailbox.put_nowait(Stop())
            try:
                done, _ = await asyncio.wait({task}, timeout=timeout_s)
            except asyncio.CancelledError:
                task.cancel()
                raise
            if not done:
                await _cancelled(task)
        finally:
            self._stopping.discard(key)

    async def stop_many(self, keys: list[str], timeout_s: float = 5.0) -> None:
        """Stop these actors at once, each under the deadline (not one after another)."""
        await asyncio.gather(*(self.stop(key, timeout_s) for key in keys))

    def cancel(self, key: str) -> None:
        """Kill without a clean stop: what a crash looks like (fault tests)."""
        task = self._tasks.pop(key, None)
        self._current.pop(key, None)
        if task is not None:
            task.cancel()

    async def stop_all(self, timeout_s: float = 5.0) -> None:
        await self.stop_many(list(self._tasks), timeout_s)

    def keys(self) -> list[str]:
        return list(self._tasks)


async def _cancelled(task: asyncio.Task) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def every(interval_s: float, send: Callable[[], Awaitable[None]],
                jitter: float = 0.1) -> None:
    """A ticker: calls `send` every interval, jittered so nodes do not beat in step."""
    while True:
        await asyncio.sleep(interval_s * (1 - jitter + 2 * jitter * random.random()))
        await send()
