"""How the scenarios show a run: a progress line on stderr, text tables and JSON reports."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TextIO

import msgspec

from herdwick.loadtest.measure import Lag, RedisMemory

PROGRESS_EVERY_S = 1.0
MB = 1024 * 1024


class Progress:
    """One line a second on a stream (stderr in the command); silent without one.

    The run sets `phase` and `detail` (a callable for the phase's counters); the
    ticker task reads them. One event loop, so no locking.
    """

    def __init__(self, stream: TextIO | None, label: str = "herd") -> None:
        self._stream = stream
        self._label = label
        self._start = time.perf_counter()
        self.phase = "setup"
        self.detail: Callable[[], str] = lambda: ""

    def set(self, phase: str, detail: Callable[[], str] | None = None) -> None:
        self.phase, self.detail = phase, detail or (lambda: "")

    def say(self, text: str) -> None:
        if self._stream is not None:
            self._stream.write(text + "\n")
            self._stream.flush()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(PROGRESS_EVERY_S)
            elapsed = time.perf_counter() - self._start
            self.say(f"{self._label} {elapsed:6.1f}s  {self.phase:<13} {self.detail()}")


def render_json(report: msgspec.Struct) -> str:
    """Indented, for a reader; `msgspec.json.decode(text, type=Report)` reads it back."""
    return msgspec.json.format(msgspec.json.encode(report).decode(), indent=2) + "\n"


def lag_header(name: str = "lag (ms)") -> str:
    return (f"  {name:<12} {'expected':>8} {'seen':>8} {'p50':>8} {'p95':>8} "
            f"{'p99':>8} {'max':>8}")


def lag_row(name: str, expected: int, seen: int, lag: Lag) -> str:
    return (f"  {name:<12} {expected:>8} {seen:>8} {lag.p50_ms:>8.0f} {lag.p95_ms:>8.0f} "
            f"{lag.p99_ms:>8.0f} {lag.max_ms:>8.0f}")


def memory_line(m: RedisMemory) -> str:
    return (f"  Redis used_memory (whole server): peak {m.peak_bytes / MB:.1f} MB, "
            f"{m.growth_bytes / MB:+.1f} MB on {m.baseline_bytes / MB:.1f} MB before the load "
            f"({m.samples} samples, every {m.every_s:g} s)")
