"""The suite's own hygiene: a killed run's databases are dropped by the next run."""

from __future__ import annotations

import asyncio

import asyncpg

from tests.conftest import _HOST, _OWNER, _drop_orphans
from tests.services import Services


async def test_a_dead_runs_databases_are_dropped_and_no_one_elses(services: Services) -> None:
    dead = await asyncio.create_subprocess_exec("true")
    await dead.wait()  # its pid names a run that is over
    names = {"orphan": f"hw_t_{_HOST}_{dead.pid}_0badf00d",
             "ours": f"hw_t_{_OWNER}_0badf00d",
             "another_host": f"hw_t_{'0' if _HOST[0] != '0' else '1'}{_HOST[1:]}_{dead.pid}_0bad",
             "old_scheme": "hw_t_0badf00d0bad"}
    admin = await asyncpg.connect(services.admin_dsn)
    try:
        for name in names.values():
            await admin.execute(f'CREATE DATABASE "{name}"')
        await _drop_orphans(admin)
        left = {r["datname"] for r in await admin.fetch(
            "SELECT datname FROM pg_database WHERE datname = ANY($1)", list(names.values()))}
        assert left == {names["ours"], names["another_host"], names["old_scheme"]}
    finally:
        for name in names.values():
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()
