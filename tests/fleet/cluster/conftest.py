"""The suite's own tests, run again on a Redis Cluster (tests/fleet/redis_cluster.py).

`services` is the suite's Postgres with a local 3-primary cluster (a replica each)
instead of the shared Redis, so every fixture that connects to Redis (redis_client,
the gateway, schedulers, SDK workers) speaks to the cluster through redis-py's cluster
client, as a deployment with HERDWICK_REDIS_URL=redis+cluster://... does. The test
modules here import chosen tests of tests/integration and tests/acceptance, each with
its module's fixtures: the same stories, on a cluster. One cluster serves a worker's
session; a test that kills a node starts its own.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.fleet.redis_cluster import LocalCluster
from tests.integration.conftest import api, schedulers  # noqa: F401 - fixtures, by name
from tests.services import Services


@pytest.fixture(scope="session")
async def local_cluster() -> AsyncIterator[LocalCluster]:
    cluster = await LocalCluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
async def own_cluster() -> AsyncIterator[LocalCluster]:
    """A cluster of the test's own: for a test that kills a node."""
    cluster = await LocalCluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
async def services(services: Services, local_cluster: LocalCluster) -> Services:
    on_cluster = Services()
    on_cluster.admin_dsn, on_cluster.redis_url = services.admin_dsn, local_cluster.url
    return on_cluster
