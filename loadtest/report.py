"""How the scenarios show a run: a progress bar on stderr, text tables and JSON reports."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable
from typing import TextIO

import msgspec
from tqdm import tqdm

from herdwick.loadtest.measure import Lag, RedisMemory

PROGRESS_EVERY_S = 0.5
DUE_TICK_LATE_S = 0.005  # the tick at the due time comes just after it
MB = 1024 * 1024

# tqdm's monitor thread wakes every 10 s to fix bars that stopped refreshing; ours is
# refreshed by its own ticker, and a load generator wants no thread it did not ask for.
tqdm.monitor_interval = 0


class Progress:
    """A progress bar on a stream (stderr in the command): the run's phase and its counts,
    jobs done of the total and their rate (tqdm). Silent without a stream; without a bar
    (`bar=False`, or None and the stream is not a terminal) only `say` lines are written.

    The run sets the phase with `set`: `done` reads a counter the run keeps anyway
    (jobs inserted, entries seen, successes its own poll counted), `detail` says more
    in words. The ticker task (`run`) reads them every PROGRESS_EVERY_S: it never asks a
    server anything itself. One event loop, so no locking.
    """

    def __init__(self, stream: TextIO | None, label: str = "herd", *,
                 bar: bool | None = None) -> None:
        self._stream = stream
        self._label = label
        self.bar_on = stream is not None and (_is_terminal(stream) if bar is None else bar)
        self._bar: tqdm | None = None
        self.phase = "setup"
        self.detail: Callable[[], str] = lambda: ""
        self._done: Callable[[], int] | None = None
        self._due_at: float | None = None

    def set(self, phase: str, detail: Callable[[], str] | None = None, *,
            done: Callable[[], int] | None = None, total: int | None = None,
            due_at: float | None = None) -> None:
        """A new phase; with `due_at` (wall clock, s), it shows as "waiting for due" until
        then."""
        self.phase, self.detail = phase, detail or (lambda: "")
        self._done, self._due_at = done, due_at
        if not self.bar_on:
            return
        if self._bar is None:
            self._bar = tqdm(file=self._stream, unit=" jobs", leave=False, mininterval=0,
                             miniters=1, dynamic_ncols=True, delay=PROGRESS_EVERY_S)
        bar = self._bar
        # Described before the reset, which draws it: no flash of the last phase at 0.
        bar.bar_format = (None if done is not None and total
                          else "{desc}: {n_fmt}{unit} [{elapsed}, {rate_fmt}{postfix}]"
                          if done is not None else "{desc} [{elapsed}{postfix}]")
        bar.set_description_str(f"{self._label} {self._label_now()}", refresh=False)
        bar.set_postfix_str(self.detail(), refresh=False)
        bar.total = total or None
        bar.reset()  # reset(total=None) would keep the last total: it is set above
        self.tick()

    def _label_now(self) -> str:
        if self._due_at is not None and time.time() < self._due_at:
            return f"waiting for due ({self._due_at - time.time():.1f} s)"
        return self.phase

    def tick(self) -> None:
        bar = self._bar
        if bar is None:
            return
        bar.set_description_str(f"{self._label} {self._label_now()}", refresh=False)
        bar.set_postfix_str(self.detail(), refresh=False)
        done = self._done() if self._done is not None else 0
        if done > bar.n:
            bar.update(done - bar.n)  # refreshes, and feeds tqdm's rate
        else:
            bar.n = done
            bar.refresh()

    def say(self, text: str) -> None:
        if self._stream is None:
            return
        if self._bar is not None:
            tqdm.write(text, file=self._stream)  # above the bar, which is drawn again
        else:
            self._stream.write(text + "\n")
        self._stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    async def run(self) -> None:
        """Ticks until cancelled, then clears the bar (before the report is printed)."""
        try:
            while True:
                await asyncio.sleep(self.next_tick_in())
                self.tick()
        finally:
            self.close()

    def next_tick_in(self) -> float:
        """PROGRESS_EVERY_S, or less to draw the bar as the due time passes: its label turns
        from waiting to the phase then, however soon after it the phase ends."""
        if self._due_at is not None and self._bar is not None:
            until_due = self._due_at - time.time()
            if 0 < until_due < PROGRESS_EVERY_S:
                return until_due + DUE_TICK_LATE_S
        return PROGRESS_EVERY_S

    @classmethod
    def of_args(cls, args: argparse.Namespace, label: str) -> Progress:
        """On stderr; --progress / --no-progress, else a bar when stderr is a terminal."""
        return cls(sys.stderr, label, bar=getattr(args, "progress", None))


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed, or not a file
        return False


def add_report_flags(parser: argparse.ArgumentParser) -> None:
    """--report and --progress / --no-progress, as every load test takes them."""
    a = parser.add_argument
    a("--report", metavar="FILE.html",
      help="also write the run's figures, with lag and throughput over time plotted, to "
           "FILE.html: one self-contained page (no script, nothing fetched)")
    a("--progress", action=argparse.BooleanOptionalAction, default=None,
      help="a progress bar on stderr (phase, jobs done of the total, rate): on by default "
           "when stderr is a terminal; --progress forces it, --no-progress turns it off")


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
