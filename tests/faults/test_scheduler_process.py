"""`herdwick scheduler` as a real process: SIGTERM releases its shards, SIGKILL does not."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import pytest

from herdwick.actors.base import Tick, sync
from herdwick.actors.scheduler import Scheduler
from herdwick.clock import ManualClock
from herdwick.config import Settings

pytestmark = pytest.mark.slow

STARTED = b"event=scheduler_started"


async def start_process(db_url: str, redis_url: str, key_prefix: str, **settings: str):
    """`herdwick scheduler` on the test's database and prefix; `settings` are more
    HERDWICK_* variables (ready_max="100" sets HERDWICK_READY_MAX)."""
    env = {**os.environ, "HERDWICK_DATABASE_URL": db_url, "HERDWICK_REDIS_URL": redis_url,
           "HERDWICK_KEY_PREFIX": key_prefix,
           **{f"HERDWICK_{name.upper()}": value for name, value in settings.items()}}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "herdwick.cli", "scheduler", env=env,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)

    async def until_started() -> None:
        while line := await proc.stderr.readline():
            if STARTED in line:
                return
        raise AssertionError("the scheduler exited before it started")

    await asyncio.wait_for(until_started(), timeout=60)
    return proc


async def owners(db) -> dict:
    async with db.connection() as conn:
        rows = await conn.fetch("SELECT owner, count(*) AS n FROM shard_leases GROUP BY owner")
    return {r["owner"]: r["n"] for r in rows}


async def test_sigterm_releases_every_shard_and_leaves(db_url, db, services, key_prefix) -> None:
    proc = await start_process(db_url, services.redis_url, key_prefix)
    try:
        held = await owners(db)
        assert len(held) == 1 and next(iter(held.values())) == 256 and None not in held
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), timeout=30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert await owners(db) == {None: 256}
    async with db.connection() as conn:
        assert await conn.fetchval("SELECT count(*) FROM scheduler_nodes") == 0


async def test_sigkill_leaves_leases_to_expire_then_they_are_taken_over(
        db_url, db, services, key_prefix, redis_client) -> None:
    proc = await start_process(db_url, services.redis_url, key_prefix)
    proc.kill()
    await proc.wait()
    [(dead_owner, count)] = (await owners(db)).items()
    assert dead_owner is not None and count == 256

    async with db.connection() as conn:
        db_now = await conn.fetchval("SELECT now()")
    clock = ManualClock(db_now)
    survivor = Scheduler(Settings(key_prefix=key_prefix), clock=clock, db=db,
                         redis=redis_client, node_id="survivor", tick=False)
    await survivor.start()
    try:
        assert survivor.shard_ids == set()  # the dead node's leases still run
        clock.advance(11)
        await survivor.coordinator.send(Tick())
        await sync(survivor.coordinator)
        assert len(survivor.shard_ids) == 256
    finally:
        await survivor.stop()
