"""Fixtures of the fleet tests: a Postgres primary and streaming standby of the test's own."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.fleet.postgres_pair import PostgresPair, bin_dir


def _need_binaries() -> None:
    if bin_dir() is None:
        pytest.skip("no PostgreSQL binaries in /usr/lib/postgresql/*/bin "
                    "(apt-get install postgresql)")


@pytest.fixture
async def pair() -> AsyncIterator[PostgresPair]:
    """A primary (migrated) and an asynchronous streaming standby."""
    _need_binaries()
    started = await PostgresPair.start()
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture
async def sync_pair() -> AsyncIterator[PostgresPair]:
    """The same, with the standby synchronous for transactions that ask (remote_apply)
    and the server's default synchronous_commit = local."""
    _need_binaries()
    started = await PostgresPair.start(synchronous=True)
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture
async def linked_pair() -> AsyncIterator[PostgresPair]:
    """An asynchronous standby streaming through a link the test can stall and cut."""
    _need_binaries()
    started = await PostgresPair.start(link=True)
    try:
        yield started
    finally:
        await started.cut_replication()
        started.stop()
