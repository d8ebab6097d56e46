"""Failover: the primary dies (kill -9 of every process), the standby is promoted, and
herdwick's processes find the new primary by themselves through a DSN that names both
hosts with target_session_attrs=read-write (docs/operations.md, "Failover").

The drill does it in the middle of a herd, with a real `herdwick scheduler` and two
`herdwick worker` processes running, then reads the whole history on the new primary:
no job lost, no occurrence executed twice as two executions, and how long dispatch
stopped. What the standby had not replayed at the kill (the replication lag, measured
just before it) is lost with the old primary: dispatches in it run again, and the
workers' own counts show how many.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from datetime import UTC, datetime

import pytest

from herdwick.errors import StorageUnavailable
from herdwick.loadtest.driver import (
    SchedulerProcess,
    WorkerProcess,
    child_env,
    children,
    leases_settled,
)
from herdwick.loadtest.jobs import due_second, move_herd, parking_time
from herdwick.model import TenantSpec
from herdwick.storage.db import Database
from herdwick.storage.hot import HotTier
from herdwick.storage.tenants import create_tenant
from tests.faults.harness import DB_DOWN, ROOT, insert, make_jobs
from tests.fleet.drill_worker import executions_key, runs_key

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("fleet")]

HERD = 3_000
POOL = "faults"  # tests/faults/harness.make_jobs's pool
WORKERS = 2
CONCURRENCY = 50
DUE_IN_S = 3.0  # from the move: every shard has loaded the herd by its due second
KILL_AFTER_DUE_S = 0.5  # mid-herd: dispatch is under way
BEHIND_S = 0.5  # the stalled standby's lag at the kill: from the herd's due second
DETECT_S = 1.0  # from the kill to the promotion: what noticing the dead primary takes
DRAIN_TIMEOUT_S = 60.0
POLL_S = 0.2

# The drill's own reads of the history on the new primary.
_UNFINISHED_SQL = """
SELECT count(*) FROM jobs j WHERE j.name = $1 AND NOT EXISTS (
    SELECT 1 FROM executions e WHERE e.job_id = j.job_id AND e.state = 'succeeded')"""
_DUPLICATES_SQL = """
SELECT (SELECT count(*) FROM (SELECT 1 FROM executions GROUP BY job_id, scheduled_for
                              HAVING count(*) > 1) AS twice) AS occurrences_twice,
       (SELECT count(*) FROM (SELECT 1 FROM executions e JOIN jobs j USING (job_id)
                              WHERE j.name = $1 GROUP BY e.job_id
                              HAVING count(*) > 1) AS twice) AS one_offs_twice"""
_RESUMED_SQL = "SELECT min(queued_at) FROM executions WHERE queued_at > $1"
_QUEUED_SQL = "SELECT count(*) FROM executions"
_KNOWN_SQL = "SELECT count(*) FROM executions WHERE execution_id = ANY($1::uuid[])"
HERD_NAME = "fault-herd"  # what make_jobs names them


async def test_a_pool_reconnects_to_the_promoted_standby_by_itself(pair) -> None:
    db = await Database.connect(pair.failover_dsn, min_size=2, max_size=4)
    try:
        async with db.connection() as conn:
            assert await conn.fetchval("SELECT pg_is_in_recovery()") is False
        pair.kill_primary()
        with pytest.raises(StorageUnavailable):  # the standby is read-only: refused too
            async with db.connection() as conn:
                await conn.fetchval("SELECT 1")
        await pair.promote()
        deadline = time.monotonic() + 10
        while True:
            try:
                async with db.connection() as conn:
                    port = conn._addr[1]
                    await conn.execute("CREATE TABLE written_after_failover (x int)")
                break
            except StorageUnavailable:
                assert time.monotonic() < deadline, "no connection to the new primary"
                await asyncio.sleep(POLL_S)
        assert port == pair.standby.port
    finally:
        await db.close()


async def test_a_pool_reaches_the_promoted_standby_while_the_old_primary_hangs(pair) -> None:
    """A primary that hangs (every process stopped: connections open, nothing answers)
    rather than refusing. asyncpg alone gives a DSN's hosts one timeout together, which
    the hung host would use up, and the standby would never be tried; herdwick gives each
    host its own (storage/db.py HostByHost), and tries the one that answered last first."""
    db = await Database.connect(pair.failover_dsn, min_size=1, max_size=4,
                                command_timeout_s=1.0)
    try:
        pair.freeze_primary()
        await pair.promote()
        began = time.monotonic()
        while True:
            try:
                async with db.connection() as conn:
                    await conn.execute("CREATE TABLE written_after_failover (x int)")
                    port = conn._addr[1]
                break
            except StorageUnavailable:  # the pooled connection to the hung host, first
                assert time.monotonic() - began < 15, "no connection to the new primary"
        assert port == pair.standby.port
        # New connections go to the new primary first: no wait for the hung host again.
        began = time.monotonic()
        async with db.connection() as one, db.connection() as two:
            assert {one._addr[1], two._addr[1]} == {pair.standby.port}
        assert time.monotonic() - began < 1.0
    finally:
        db.pool.terminate()  # its connection to the hung host would hold close() up


async def _poll(db: Database, sql: str, *args) -> object:
    """One value, or None while Postgres is away."""
    with contextlib.suppress(*DB_DOWN):
        async with db.connection() as conn:
            return await conn.fetchval(sql, *args)
    return None


async def test_failover_drill_mid_herd(pair, services, redis_client, key_prefix) -> None:
    """The standby streams as it does on a quiet network: it has all but the last few
    milliseconds at the kill."""
    figures = await drill(pair, services.redis_url, redis_client, key_prefix, behind_s=0.0)
    assert figures["lost (herd jobs never succeeded)"] == 0


async def test_failover_drill_with_the_standby_behind(linked_pair, services, redis_client,
                                                      key_prefix) -> None:
    """The link to the standby stalls as the herd falls due and the primary dies half a
    second later: every dispatch of that half second is lost with it. Those jobs' due
    rows are back on the new primary, so they dispatch again: run twice, lost never."""
    figures = await drill(linked_pair, services.redis_url, redis_client, key_prefix,
                          behind_s=BEHIND_S)
    assert figures["lag at the kill (bytes)"] > 0
    assert figures["lost (herd jobs never succeeded)"] == 0
    assert figures["executions run that the new primary never had"] > 0


async def drill(pair, redis_url: str, redis_client, key_prefix: str, *,
                behind_s: float) -> dict[str, object]:
    """The herd due, the primary killed KILL_AFTER_DUE_S into it (the link to the standby
    stalled `behind_s` before, if at all), the standby promoted DETECT_S later; the
    history read once the herd has drained. Prints and returns the figures."""
    dsn = pair.failover_dsn
    db = await Database.connect(dsn, min_size=1, max_size=4)
    try:
        created = await create_tenant(db, TenantSpec(name="drill"), datetime.now(UTC))
        parked = parking_time()
        await insert(db, created.tenant_id, make_jobs(HERD_NAME, HERD, parked))
        scheduler_env = child_env(HERDWICK_DATABASE_URL=dsn,
                                  HERDWICK_REDIS_URL=redis_url,
                                  HERDWICK_KEY_PREFIX=key_prefix, HERDWICK_READY_MAX="auto",
                                  PYTHONPATH=str(ROOT))
        worker_env = child_env(HW_LOADTEST_REDIS_URL=redis_url,
                               HW_LOADTEST_PREFIX=key_prefix, HW_LOADTEST_POOL=POOL,
                               HW_LOADTEST_CONCURRENCY=str(CONCURRENCY), PYTHONPATH=str(ROOT))
        async with contextlib.AsyncExitStack() as stack:
            started = await asyncio.gather(
                stack.enter_async_context(children(SchedulerProcess, 1, ["scheduler"],
                                                   scheduler_env)),
                *(stack.enter_async_context(children(
                    WorkerProcess, 1, ["worker", "tests.fleet.drill_worker:worker"],
                    worker_env)) for _ in range(WORKERS)))
            processes = [p for group in started for p in group]
            await leases_settled(db, processes[:1], time.perf_counter() + 30)

            due = due_second(DUE_IN_S)
            assert await move_herd(db, parked, due, hot=HotTier(redis_client, key_prefix)) == HERD
            await pair.start_heartbeat()  # the lag in seconds, to within 50 ms
            await pair.caught_up()  # the herd is on the standby: what follows is dispatch
            kill_at = due.timestamp() + KILL_AFTER_DUE_S
            if behind_s:
                await asyncio.sleep(max(0.0, kill_at - behind_s - time.time()))
                pair.stall_replication()
            await asyncio.sleep(max(0.0, kill_at - time.time()))

            before = await _poll(db, _QUEUED_SQL)
            lag = await pair.lag()
            killed_at = datetime.now(UTC)
            pair.kill_primary()
            if behind_s:
                await pair.cut_replication()  # what the link held dies with the primary
            await asyncio.sleep(DETECT_S)
            promoted_at = datetime.now(UTC)  # asked; the promotion itself takes ~0.1 s
            promote_s = await pair.promote()

            deadline = time.monotonic() + DRAIN_TIMEOUT_S
            while (unfinished := await _poll(db, _UNFINISHED_SQL, HERD_NAME)) != 0:
                for proc in processes:
                    proc.check_alive()  # nothing restarted them: they reconnect by themselves
                if time.monotonic() > deadline:
                    break
                await asyncio.sleep(POLL_S)
            drained_at = datetime.now(UTC)

        async with db.connection() as conn:
            duplicates = await conn.fetchrow(_DUPLICATES_SQL, HERD_NAME)
            resumed = await conn.fetchval(_RESUMED_SQL, killed_at)
        ran: dict[bytes, bytes] = await redis_client.hgetall(runs_key(key_prefix))
        run_ids = [m.decode() for m in await redis_client.smembers(executions_key(key_prefix))]
        async with db.connection() as conn:
            known = await conn.fetchval(_KNOWN_SQL, run_ids)
    finally:
        await db.close()

    figures = {
        "standby behind by design (s)": behind_s,
        "herd": HERD,
        "dispatched before the kill": before,
        "lag at the kill (bytes)": lag.bytes,
        "lag at the kill (s)": round(lag.seconds, 3),
        "promotion s": round(promote_s, 2),
        "dispatch resumed s after the kill": (round((resumed - killed_at).total_seconds(), 2)
                                              if resumed else None),
        "dispatch resumed s after the promotion": (
            round((resumed - promoted_at).total_seconds(), 2) if resumed else None),
        "drained s after the kill": round((drained_at - killed_at).total_seconds(), 1),
        "lost (herd jobs never succeeded)": unfinished,
        "occurrences executed as two executions": duplicates["occurrences_twice"],
        "one-offs with two executions": duplicates["one_offs_twice"],
        "executions run that the new primary never had": len(run_ids) - known,
        "occurrences run more than once": sum(1 for n in ran.values() if int(n) > 1),
    }
    print("\nfailover drill: " + "; ".join(f"{k} {v}" for k, v in figures.items()), flush=True)
    assert duplicates["occurrences_twice"] == 0 and duplicates["one_offs_twice"] == 0
    assert resumed is not None
    return figures
