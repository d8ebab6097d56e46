"""The actor kernel: one message at a time, bounded mailboxes, restart after a crash."""

from __future__ import annotations

import asyncio

import pytest

from herdwick.actors.base import Actor, Supervisor, Tick, sync


class Recorder(Actor):
    name = "recorder"

    def __init__(self, log: list, crash_on: object = None, gate: asyncio.Event | None = None):
        super().__init__(mailbox_size=2)
        self.log = log
        self.crash_on = crash_on
        self.gate = gate
        self.busy = False

    async def handle(self, msg: object | None) -> None:
        assert not self.busy, "two messages handled at once"
        self.busy = True
        try:
            if self.gate is not None:
                await self.gate.wait()
            if msg == self.crash_on:
                raise RuntimeError("boom")
            self.log.append(msg)
        finally:
            self.busy = False


async def test_messages_are_handled_in_order_one_at_a_time() -> None:
    log: list = []
    async with Supervisor() as sup:
        actor = await sup.start("r", lambda: Recorder(log))
        for i in range(10):
            await actor.send(i)
        await sync(actor)
    assert log == list(range(10))


async def test_a_full_mailbox_makes_senders_wait() -> None:
    gate = asyncio.Event()
    async with Supervisor() as sup:
        actor = await sup.start("r", lambda: Recorder([], gate=gate))
        for i in range(3):  # one in hand, two in the mailbox
            await actor.send(i)
        blocked = asyncio.create_task(actor.send(99))
        await asyncio.sleep(0)
        assert not blocked.done()
        assert actor.try_send(100) is False
        gate.set()
        await asyncio.wait_for(blocked, timeout=5)


async def test_a_crashed_actor_is_restarted_fresh(caplog: pytest.LogCaptureFixture) -> None:
    logs: list[list] = []

    def factory() -> Recorder:
        logs.append([])
        return Recorder(logs[-1], crash_on="poison")

    async with Supervisor() as sup:
        first = await sup.start("r", factory)
        await first.send("a")
        await first.send("poison")
        await asyncio.wait_for(sup.restarted.wait(), timeout=5)
        second = sup.actor("r")
        assert second is not first
        await second.send("b")
        await sync(second)
    assert logs == [["a"], ["b"]]
    assert "event=actor_crashed actor=r" in caplog.text


async def test_start_returns_when_an_actor_s_first_start_crashes() -> None:
    """A sweeper whose first pass meets a bad row must not hold the process's start."""
    starts = 0

    class FailsToStart(Recorder):
        async def on_start(self) -> None:
            nonlocal starts
            starts += 1
            if starts == 1:
                raise RuntimeError("a row it cannot read")

    log: list = []
    async with Supervisor() as sup:
        await asyncio.wait_for(sup.start("r", lambda: FailsToStart(log)), timeout=5)
        await asyncio.wait_for(sup.restarted.wait(), timeout=5)
        again = sup.actor("r")
        await again.send("b")
        await sync(again)
    assert log == ["b"]
    assert starts == 2


async def test_stopping_actors_in_restart_backoff_is_immediate(caplog) -> None:
    """Postgres gone: every shard crashed and waits to restart. A stop must not wait out
    each one's deadline in turn, nor restart it after."""
    from herdwick.errors import StorageUnavailable

    class Unavailable(Recorder):
        async def on_start(self) -> None:
            raise StorageUnavailable("postgres unavailable: ConnectionRefusedError")

    built = 0

    def factory() -> Recorder:
        nonlocal built
        built += 1
        return Unavailable([])

    async with Supervisor() as sup:
        for i in range(50):
            await sup.start(f"s{i}", factory)
        loop = asyncio.get_running_loop()
        began = loop.time()
        await asyncio.wait_for(sup.stop_all(timeout_s=5), timeout=5)
        assert loop.time() - began < 1.0
        assert sup.keys() == []  # their tasks ended: none can be rebuilt
    assert built == 50
    assert "event=actor_unavailable actor=s0" in caplog.text
    assert "Traceback" not in caplog.text  # one line a retry, not a traceback


async def test_an_actor_reused_by_its_factory_runs_again_after_a_crash() -> None:
    log: list = []
    actor = Recorder(log, crash_on="poison")
    async with Supervisor() as sup:
        await sup.start("r", lambda: actor)
        await actor.send("poison")
        await asyncio.wait_for(sup.restarted.wait(), timeout=5)
        await actor.send("b")
        await sync(actor)
    assert log == ["b"]


async def test_stop_lets_the_message_in_hand_finish() -> None:
    gate = asyncio.Event()
    log: list = []
    async with Supervisor() as sup:
        actor = await sup.start("r", lambda: Recorder(log, gate=gate))
        await actor.send(Tick())
        stopping = asyncio.create_task(sup.stop("r"))
        await asyncio.sleep(0)
        gate.set()
        await stopping
    assert log == [Tick()]
    assert actor.stopped


async def test_a_sync_queued_behind_a_stop_is_answered() -> None:
    from herdwick.actors.base import Stop, Sync

    gate = asyncio.Event()
    async with Supervisor() as sup:
        actor = await sup.start("r", lambda: Recorder([], gate=gate))
        await actor.send(Tick())  # in hand, waiting on the gate
        await actor.send(Stop())
        late = Sync()
        await actor.send(late)
        gate.set()
        await asyncio.wait_for(late.done.wait(), timeout=5)
        await sync(actor)  # a stopped actor: returns at once


def test_claimed_shards_are_logged_as_ranges() -> None:
    from herdwick.actors.coordinator import _ranges

    assert _ranges([0, 1, 2, 3, 5, 7, 8, 255]) == "0-3,5,7-8,255"
    assert _ranges([4]) == "4"
    assert _ranges([]) == ""


def test_a_steered_clock_keeps_the_database_s_time_whatever_the_wall_clock_does(
        monkeypatch) -> None:
    """A scheduler's SteeredClock: Postgres's reading, carried by the monotonic clock.
    The wall clock jumping ahead moves it not at all; a slow reading is not taken; a
    reading that would take it back holds it until it catches up."""
    import time as time_module
    from datetime import UTC, datetime, timedelta

    from herdwick import clock as clock_module
    from herdwick.clock import SteeredClock

    mono = [1000.0]
    monkeypatch.setattr(time_module, "monotonic", lambda: mono[0])
    steered = SteeredClock()
    db_time = datetime(2026, 12, 6, 12, 0, 0, tzinfo=UTC)
    steered.observe(db_time, 999.99, 1000.01)  # a 20 ms round trip, mid-point 1000.0
    assert steered.now() == db_time

    class Ahead(datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime.now(tz) + timedelta(seconds=30)

    monkeypatch.setattr(clock_module, "datetime", Ahead)  # the wall clock steps ahead
    mono[0] += 2.5
    assert steered.now() == db_time + timedelta(seconds=2.5)

    steered.observe(db_time + timedelta(seconds=100), 1002.0, 1003.0)  # a 1 s trip: ignored
    assert steered.now() == db_time + timedelta(seconds=2.5)

    steered.observe(db_time + timedelta(seconds=2.4), 1002.5, 1002.5)  # 100 ms back
    assert steered.now() == db_time + timedelta(seconds=2.5)  # held, never backwards
    mono[0] += 0.2
    assert steered.now() == db_time + timedelta(seconds=2.6)


async def test_an_actor_run_again_after_a_crash_keeps_what_waited_in_its_mailbox(
        caplog: pytest.LogCaptureFixture) -> None:
    """The dispatchers are run again as the same instance: the messages queued behind the
    one that crashed are handled after the restart, not dropped (a dropped Due stranded
    its rows in the fair queue until their shards moved)."""
    log: list = []
    actor = Recorder(log, crash_on="poison")
    actor.mailbox = asyncio.Queue(maxsize=8)
    for msg in ("poison", "a", "b"):  # all waiting before it handles the first
        actor.try_send(msg)
    async with Supervisor() as sup:
        await sup.start("r", lambda: actor)
        await asyncio.wait_for(sup.restarted.wait(), timeout=5)
        actor.crash_on = None
        await sync(actor)
    assert log == ["a", "b"]
    assert "event=actor_crashed actor=r" in caplog.text
