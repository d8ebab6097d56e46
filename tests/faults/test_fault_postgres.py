"""Postgres fails mid-herd: its connections are cut (tests/proxy.py in front of it for the
schedulers and the api: every open connection drops and new ones are refused for a few
seconds), or the server itself crashes and restarts (a private one,
tests/faults/postgres_server.py: every backend quits at once and the restart runs
crash recovery).

docs/operations.md: submits answer 503 and write nothing, actors retry with
backoff; nothing is lost, work is late; nothing needs an operator.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from tests.faults.harness import Stack
from tests.faults.postgres_server import PostgresServer
from tests.proxy import Proxy

pytestmark = pytest.mark.slow

CUT_S = (1.5, 3.0)
DOWN_S = (1.0, 3.0)  # from the crash to the restart's first accepted connection, plus ~0.1 s
STUCK_AFTER_S = 20.0  # a few seconds' outage recovers well within this, or not at all


async def test_postgres_connections_cut_mid_herd(db_url, services, key_prefix) -> None:
    proxy = Proxy(db_url)
    await proxy.start()
    cut: dict[str, float] = {}

    async def cut_postgres(stack: Stack) -> None:
        cut["s"] = round(stack.rng.uniform(*CUT_S), 1)
        await proxy.cut()
        await asyncio.sleep(cut["s"])
        await proxy.restore()

    try:
        async with Stack.up(db_url, services.redis_url, key_prefix, api=True,
                            scheduler_db_url=proxy.dsn(), api_db_url=proxy.dsn()) as stack:
            stack.steady_via_api = True
            result = await stack.run(
                "Postgres connections cut mid-herd", (0.2, 1.0), cut_postgres,
                notes=lambda: {"cut s": cut["s"], "api answers": dict(stack.steady_statuses)},
                drain_timeout_s=STUCK_AFTER_S)
    finally:
        await proxy.close()
    # A submit during the cut is refused whole (503), never half written.
    assert set(stack.steady_statuses) <= {201, 503}, stack.steady_statuses
    result.assert_sound()


@pytest.fixture
async def postgres_server() -> AsyncIterator[PostgresServer]:
    server = await PostgresServer.start()
    try:
        yield server
    finally:
        server.stop()


async def test_postgres_crashed_and_restarted_mid_herd(
        postgres_server, services, key_prefix) -> None:
    down: dict[str, float] = {}

    async def crash_and_restart(stack: Stack) -> None:
        down["s"] = round(stack.rng.uniform(*DOWN_S), 1)
        await postgres_server.crash_restart(down["s"])

    async with Stack.up(postgres_server.dsn, services.redis_url, key_prefix,
                        api=True, http=True) as stack:
        stack.steady_via_api = True
        result = await stack.run(
            "Postgres crashed and restarted mid-herd", (0.2, 1.0), crash_and_restart,
            notes=lambda: {"down s": down["s"], "api answers": dict(stack.steady_statuses)},
            drain_timeout_s=STUCK_AFTER_S)
    # Submits meet refused connections (503) while it is down: each whole or absent.
    assert set(stack.steady_statuses) <= {201, 503}, stack.steady_statuses
    assert stack.steady_statuses.get(201), stack.steady_statuses
    result.assert_sound()
