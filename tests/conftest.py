"""Fixtures over real Postgres and Redis.

Each test gets its own database, cloned from a template migrated once per
session (CREATE DATABASE ... TEMPLATE), and its own Redis key prefix.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import socket
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import asyncpg
import pytest
import redis.asyncio as aioredis

from herdwick.clock import ManualClock
from herdwick.redis_client import connect as connect_redis
from herdwick.storage import migrate
from herdwick.storage.db import Database
from tests.services import Services, with_database

T0 = datetime(2026, 12, 2, 12, 0, 0, tzinfo=UTC)

# The suite runs on two xdist workers (pyproject.toml addopts). Tests that start the real
# processes and judge how fast they recover or drain would slow each other down if two
# ran at once, so each family below runs on one worker, one test at a time; everything
# else is spread over both.
TEST_DB_POOL_MAX = 6

_GROUPS = (
    ("faults", ("tests/faults/", "tests/fleet/")),
    ("processes", ("tests/docs/", "tests/browser/", "tests/packaging/", "tests/acceptance/",
                   "tests/integration/test_loadtest_", "tests/integration/test_dev.py",
                   "tests/fuzz/")),
)


def pytest_configure(config: pytest.Config) -> None:
    """Under xdist, the controller finds (or starts) Postgres and Redis once and hands
    them to its workers through the environment they inherit: two workers starting
    embedded servers in one folder would fight over it."""
    # The two workers' process stacks share one Postgres (often max_connections 100): at
    # the defaults (api 20, scheduler 16) two of them at once, with a killed one's
    # backends not yet gone, can run out. Every process a test starts inherits this.
    os.environ.setdefault("HERDWICK_DB_POOL_MAX", str(TEST_DB_POOL_MAX))
    if os.environ.get("PYTEST_XDIST_WORKER") or not getattr(config.option, "numprocesses", 0):
        return
    found = asyncio.run(Services().find())
    os.environ["HERDWICK_TEST_DATABASE_URL"] = found.admin_dsn
    os.environ["HERDWICK_TEST_REDIS_URL"] = found.redis_url
    config.stash[_SHARED_SERVICES] = found


def pytest_unconfigure(config: pytest.Config) -> None:
    found = config.stash.get(_SHARED_SERVICES, None)
    if found is not None:
        found.stop()


_SHARED_SERVICES = pytest.StashKey[Services]()


def _xdist_family(nodeid: str) -> str | None:
    for group, prefixes in _GROUPS:
        if nodeid.startswith(prefixes):
            return group
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        group = _xdist_family(item.nodeid)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


# The marks above do not by themselves keep a family on one worker. --dist loadgroup
# learns a test's group from an "@group" suffix that xdist's worker-side
# pytest_collection_modifyitems writes into item._nodeid, and (1) pytest 9.2's
# Item.nodeid reads item._id instead, so the suffix never shows (pytest-xdist issue
# 1386, open; 3.8.0 is the latest release); (2) even before, xdist's hook ran ahead of
# this one (its worker plugin registers after this conftest loads, and pluggy calls the
# later one first), so it never saw these marks. So the
# controller's scheduler takes the family straight from the node id's path, as the
# marks do; any other test keeps xdist's own grouping. tests/fleet's own
# xdist_group("fleet") is thereby folded into "faults", as _GROUPS says.
@pytest.hookimpl(optionalhook=True)  # optional: under `-p no:xdist` the hook does not exist
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class FamilyScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _xdist_family(nodeid) or super()._split_scope(nodeid)

    return FamilyScheduling(config, log)


@pytest.fixture(scope="session")
async def services() -> AsyncIterator[Services]:
    found = await Services().find()
    try:
        yield found
    finally:
        found.stop()


# Test databases are named for the run that made them (host and pid), so that a run
# that was killed (Ctrl-C, a timeout) leaves databases the next run can tell are orphans.
_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:6]
_OWNER = f"{_HOST}_{os.getpid()}"
_OWNED = re.compile(r"^hw_(?:t|tpl)_([0-9a-f]{6})_(\d+)_[0-9a-f]+$")


def _orphaned(name: str) -> bool:
    """A test database of this host whose run is no longer alive."""
    owned = _OWNED.match(name)
    if owned is None or owned.group(1) != _HOST:
        return False  # not ours to judge: another host's, or named before this scheme
    try:
        os.kill(int(owned.group(2)), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


async def _drop_orphans(admin: asyncpg.Connection) -> None:
    names = await admin.fetch("SELECT datname FROM pg_database WHERE datname LIKE 'hw\\_%'")
    for row in names:
        if _orphaned(row["datname"]):
            await admin.execute(f'DROP DATABASE IF EXISTS "{row["datname"]}" WITH (FORCE)')


@pytest.fixture(scope="session")
async def template_db(services: Services) -> AsyncIterator[str]:
    name = f"hw_tpl_{_OWNER}_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(services.admin_dsn)
    try:
        await _drop_orphans(admin)
        await admin.execute(f'CREATE DATABASE "{name}"')
        await migrate.apply(with_database(services.admin_dsn, name))
        yield name
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


class DatabaseFactory:
    """Clones the template ahead of need and drops used clones in the background.

    CREATE DATABASE costs ~0.5 s of server fsync; overlapping it with the
    tests' own awaits takes it off the critical path. Owned by the session
    fixture; tests only call take() and give_back().
    """

    READY = 3

    def __init__(self, admin_dsn: str, template: str) -> None:
        self._admin_dsn = admin_dsn
        self._template = template
        self._ready: asyncio.Queue[str] = asyncio.Queue(maxsize=self.READY)
        self._tasks: set[asyncio.Task] = set()
        self._creating: str | None = None  # the clone the producer is making, not yet queued
        self._producer = asyncio.create_task(self._produce())

    async def _sql(self, statement: str) -> None:
        admin = await asyncpg.connect(self._admin_dsn)
        try:
            await admin.execute(statement)
        finally:
            await admin.close()

    async def _produce(self) -> None:
        while True:
            name = self._creating = f"hw_t_{_OWNER}_{uuid.uuid4().hex[:8]}"
            await self._sql(f'CREATE DATABASE "{name}" TEMPLATE "{self._template}"')
            await self._ready.put(name)
            self._creating = None

    async def take(self) -> str:
        return await asyncio.wait_for(self._ready.get(), timeout=60)

    def give_back(self, name: str) -> None:
        task = asyncio.create_task(self._sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        self._producer.cancel()
        await asyncio.gather(self._producer, return_exceptions=True)
        if self._creating is not None:  # cancelled while creating or queueing it
            self.give_back(self._creating)
        while not self._ready.empty():
            self.give_back(self._ready.get_nowait())
        await asyncio.gather(*self._tasks, return_exceptions=True)


@pytest.fixture(scope="session")
async def databases(services: Services, template_db: str) -> AsyncIterator[DatabaseFactory]:
    factory = DatabaseFactory(services.admin_dsn, template_db)
    try:
        yield factory
    finally:
        await factory.close()


@pytest.fixture
async def db_url(services: Services, databases: DatabaseFactory) -> AsyncIterator[str]:
    name = await databases.take()
    try:
        yield with_database(services.admin_dsn, name)
    finally:
        databases.give_back(name)


@pytest.fixture
async def db(db_url: str) -> AsyncIterator[Database]:
    database = await Database.connect(db_url, min_size=1, max_size=4)
    try:
        yield database
    finally:
        await database.close()


@pytest.fixture
def key_prefix() -> str:
    return f"hwt:{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def redis_client(services: Services, key_prefix: str) -> AsyncIterator[aioredis.Redis]:
    client = connect_redis(services.redis_url)
    try:
        yield client
    finally:
        keys = [k async for k in client.scan_iter(match=f"{key_prefix}:*", count=1000)]
        if keys:
            await client.delete(*keys)
        await client.aclose()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(T0)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    from tests.faults import table  # the harness's imports, only once the run is over

    table.summarise(terminalreporter, config)
