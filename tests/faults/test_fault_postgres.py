"""Postgres connections cut mid-herd (tests/proxy.py in front of it for the schedulers and
the api): every open connection drops and new ones are refused for a few seconds.

docs/operations.md: submits answer 503 and write nothing, actors retry with
backoff; nothing is lost, work is late. A Postgres restart (a private server)
is not run here: the suite's embedded Postgres takes seconds to start, which
the fault suite's budget cannot spare; the cut is what a restart looks like
to the processes, without the server's own recovery.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.faults.harness import NotDrained, Stack
from tests.proxy import Proxy

pytestmark = pytest.mark.slow

CUT_S = (1.5, 3.0)
STUCK_AFTER_S = 20.0  # a few seconds' cut recovers well within this, or not at all


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
            try:
                result = await stack.run(
                    "Postgres connections cut mid-herd", (0.2, 1.0), cut_postgres,
                    notes=lambda: {"cut s": cut["s"],
                                   "api answers": dict(stack.steady_statuses)},
                    drain_timeout_s=STUCK_AFTER_S)
            except NotDrained as stuck:
                # Known, measured, seed-dependent (so not a strict xfail): seed 661436286
                # stuck 3 runs of 3, 19-50 herd jobs; seed 397100423 recovered in 9.8 s.
                # The rows sit overdue in due_index on shards a live scheduler holds and are
                # never dispatched. Consistent with actors/shard.py: rows handed to a
                # dispatch that died with Postgres stay in the shard's _handed (remaining >
                # 0), and every later load skips them while that shard actor lives.
                pytest.xfail(f"stuck recovery after a Postgres cut: {stuck}".splitlines()[0])
    finally:
        await proxy.close()
    # A submit during the cut is refused whole (503), never half written.
    assert set(stack.steady_statuses) <= {201, 503}, stack.steady_statuses
    result.assert_sound()
