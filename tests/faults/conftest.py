"""Each fault scenario's row goes to a file under pytest's base temp directory as it is
measured (the summary is tests/faults/table.py's); under xdist, a worker's base temp is a
folder of the run's, so it writes to the run's own."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator

import pytest

from tests.faults import harness, table


@pytest.fixture(scope="session", autouse=True)
def fault_table(tmp_path_factory: pytest.TempPathFactory) -> None:
    base = tmp_path_factory.getbasetemp()
    harness.TABLE_FILE = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) \
        / table.NAME


# What a hung scenario awaits: pytest-timeout's report shows only the event loop waiting
# in select(), so shortly before it fires, where each task waits goes to the test's stderr.
HANG_REPORT_BEFORE_S = 10.0


@pytest.fixture(autouse=True)
async def hang_report(request: pytest.FixtureRequest) -> AsyncIterator[None]:
    marker = request.node.get_closest_marker("timeout")
    timeout_s = float(marker.args[0] if marker and marker.args
                      else request.config.getini("timeout") or 0)
    if timeout_s <= HANG_REPORT_BEFORE_S:
        yield
        return

    async def report() -> None:
        await asyncio.sleep(timeout_s - HANG_REPORT_BEFORE_S)
        print(f"--- {request.node.name}: about to time out; where each task waits:",
              file=sys.stderr)
        for task in asyncio.all_tasks():
            if task is not asyncio.current_task():
                print(f"{task.get_name()}:", *_awaiting(task.get_coro()), sep="\n  ",
                      file=sys.stderr)
        sys.stderr.flush()

    reporter = asyncio.create_task(report(), name="hang report")
    try:
        yield
    finally:
        reporter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reporter


def _awaiting(coro: object) -> list[str]:
    """Where a task waits, outermost first: Task.print_stack shows only its first frame."""
    found, start = [], coro
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            found.append(f"{frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return found or [repr(start)]
