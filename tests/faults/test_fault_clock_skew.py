"""One scheduler's clock jumps a few seconds ahead mid-herd (tests/faults/skewed_scheduler.py
injects it into the real process with SIGUSR1).

Shard leases run on Postgres's clock and worker leases on Redis's, so the
skew cannot put two holders on one shard or one attempt. When work is due is
the scheduler's own judgement, on its SteeredClock: Postgres's clock, read
with every heartbeat and carried by the monotonic clock in between, so a
wall clock that jumps ahead moves nothing. Nothing starts early ("started
early": a first lease before the due time, Redis's clock against the
occurrence's scheduled_for), as it did by up to the skew before.
"""

from __future__ import annotations

import signal

import pytest

from tests.faults.harness import SEED_ENV, Stack, seeded
from tests.faults.skewed_scheduler import SKEW_ENV

pytestmark = pytest.mark.slow

SKEW_S = (2.0, 4.0)


async def early_starts(stack: Stack) -> tuple[int, float]:
    """Executions whose first attempt began before their due time, and the most early (s)."""
    async with stack.db.connection() as conn:
        row = await conn.fetchrow(
            "SELECT count(*) AS n, coalesce(max(extract(epoch FROM e.scheduled_for "
            "- a.started_at)), 0) AS most FROM executions e JOIN execution_attempts a "
            "USING (execution_id, scheduled_for) WHERE a.attempt = 1 "
            "AND a.started_at < e.scheduled_for - interval '50 milliseconds'")
    return row["n"], round(float(row["most"]), 2)


async def test_one_scheduler_s_clock_skewed_ahead(db_url, services, key_prefix,
                                                  monkeypatch) -> None:
    seen: dict[str, object] = {}
    skew_s = 0.0

    async def skew(stack: Stack) -> None:
        stack.schedulers[0].proc.send_signal(signal.SIGUSR1)

    async def figures() -> dict:
        seen["early"], seen["most"] = await early_starts(stack)
        return {"skew s": skew_s, "started early": seen["early"],
                "most early s": seen["most"]}

    # The launcher reads the skew from its environment, so it is drawn before the stack
    # starts, from the seed the stack then uses (and prints).
    seed, rng = seeded()
    skew_s = round(rng.uniform(*SKEW_S), 1)
    monkeypatch.setenv(SKEW_ENV, str(skew_s))
    monkeypatch.setenv(SEED_ENV, str(seed))
    async with Stack.up(db_url, services.redis_url, key_prefix, skewed=1) as stack:
        result = await stack.run(f"one scheduler's clock +{skew_s:g}s", (0.0, 1.0), skew,
                                 notes=figures)
    result.assert_sound()
    assert seen["early"] == 0, f"{seen['early']} started early, by up to {seen['most']} s"
