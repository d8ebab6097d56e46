"""Clocks. Every component takes one, so tests move time instead of sleeping."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Protocol

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def to_us(when: datetime) -> int:
    """Microseconds since the Unix epoch, exactly (no float on the way)."""
    delta = when - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def from_us(us: int) -> datetime:
    return _EPOCH + timedelta(microseconds=us)


class Clock(Protocol):
    def now(self) -> datetime:
        """The current instant, aware, in UTC."""
        ...


class SystemClock:
    def now(self) -> datetime:
        return datetime.now(UTC)


class SteeredClock:
    """The database's clock, carried between readings by this host's monotonic clock.

    A scheduler decides on its own clock when work is due, so a host whose wall clock
    runs ahead (or is stepped: NTP, a VM resumed) would publish early by its error. The
    coordinator reads Postgres's clock with every heartbeat (observe); between
    readings, time moves by time.monotonic(), which no step of the wall clock moves.
    Until the first reading it is the wall clock. It never goes backwards: a reading
    that would (a round trip's error, a few ms) holds it until it catches up.
    """

    MAX_ROUND_TRIP_S = 0.5  # a slower reading says too little about when it was taken

    def __init__(self) -> None:
        self._anchor: datetime | None = None  # the database's time at _anchor_mono
        self._anchor_mono = 0.0
        self._last = datetime(1970, 1, 1, tzinfo=UTC)  # the latest now() returned

    def now(self) -> datetime:
        if self._anchor is None:
            current = datetime.now(UTC)
        else:
            current = self._anchor + timedelta(seconds=time.monotonic() - self._anchor_mono)
        if current < self._last:
            return self._last
        self._last = current
        return current

    def observe(self, reference: datetime, sent_mono: float, received_mono: float) -> None:
        """The database said `reference` during a round trip over [sent, received]
        (time.monotonic() values)."""
        trip = received_mono - sent_mono
        if trip < 0 or trip > self.MAX_ROUND_TRIP_S:
            return
        self._anchor = reference.astimezone(UTC)
        self._anchor_mono = sent_mono + trip / 2

class ManualClock:
    """A clock that moves only when told to."""

    def __init__(self, start: datetime) -> None:
        if start.tzinfo is None:
            raise ValueError("ManualClock needs an aware start time")
        self._now = start.astimezone(UTC)

    def now(self) -> datetime:
        return self._now

    def advance(self, seconds: float) -> datetime:
        self._now += timedelta(seconds=seconds)
        return self._now

    def set(self, when: datetime) -> datetime:
        self._now = when.astimezone(UTC)
        return self._now
