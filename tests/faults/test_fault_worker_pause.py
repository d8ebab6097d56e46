"""A worker stops dead past its lease (SIGSTOP: a 40 s GC pause, a frozen VM), then resumes.

docs/operations.md, "Did my job run twice?": its leases lapse, the reaper
counts its attempts as expired and they run again on the other worker; when
it wakes, its handlers finish unaware and their complete (or the heartbeat
that comes first) is refused as LEASE_LOST, and the refusal is recorded on
the execution as a possible duplicate. No stale complete is accepted. Which
handlers began, the fault worker notes (tests/faults/fault_worker.py): a lease
granted as the process stopped, whose reply it reads only after the lease lapsed,
never runs (asked for again, it is refused) and leaves nothing to record.

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


async def lapsed(stack: Stack, worker: str) -> dict[tuple[str, int], bool]:
    """The stopped worker's attempts whose lease lapsed, each with whether its late call
    is recorded on the execution (stale_calls)."""
    async with stack.db.connection() as conn:
        rows = await conn.fetch(
            "SELECT a.execution_id::text AS execution_id, a.attempt, "
            "e.stale_calls::text AS stale FROM execution_attempts a "
            "JOIN executions e USING (execution_id, scheduled_for) "
            "WHERE a.worker_id LIKE $1 AND a.outcome = 'expired'", f"%{worker}%")
    return {(r["execution_id"], r["attempt"]): any(
                c["attempt"] == r["attempt"] and worker in c["workerId"]
                for c in json.loads(r["stale"] or "[]"))
            for r in rows}


async def test_a_worker_stopped_past_its_lease_then_resumed(db_url, services, key_prefix) -> None:
    seen: dict[str, object] = {}

    async def pause_a_worker(stack: Stack) -> None:
        seen["victim"] = victim = stack.rng.choice(stack.workers)
        seen["worker"] = stack.worker_id_of(victim)
        victim.proc.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(PAUSE_S)
        finally:
            victim.proc.send_signal(signal.SIGCONT)
        seen["resumed"] = time.time()

    async def figures() -> dict:
        seen["held"] = await first_attempts_after(stack, seen["worker"], seen["resumed"])
        seen["lapsed"] = await lapsed(stack, seen["worker"])
        began = stack.begun(seen["victim"])
        seen["begun"] = {k: v for k, v in seen["lapsed"].items() if k in began}
        return {"paused s": PAUSE_S, "its lapsed attempts": len(seen["lapsed"]),
                "of them begun": len(seen["begun"]),
                "of those recorded": sum(seen["begun"].values()), "held unleased": seen["held"]}

    async with Stack.up(db_url, services.redis_url, key_prefix) as stack:
        result = await stack.run("SIGSTOP worker 2x lease, SIGCONT", (0.3, 1.2),
                                 pause_a_worker, notes=figures)
    held, begun = seen["held"], seen["begun"]
    assert held == 0, (f"seed {result.seed}: {held} messages waited for the stopped worker "
                       "instead of being claimed by the other")
    result.assert_sound()
    assert begun, "the pause lapsed no lease of a handler that had begun"
    # Every handler that began under a lease that lapsed may have acted beside the next
    # attempt: its late call must be on record. A lapsed lease whose handler never began
    # (granted as the process stopped, its reply read too late) is no second run and is
    # recorded as nothing (docs/operations.md, "Did my job run twice?").
    unrecorded = sorted(k for k, recorded in begun.items() if not recorded)
    assert not unrecorded, (f"seed {result.seed}: {len(unrecorded)} of {len(begun)} lapsed "
                            f"attempts whose handler began left no record: {unrecorded[:3]}")
