"""`herdwick loadtest e2e` on a tiny herd: every execution succeeds and the report adds up."""

from __future__ import annotations

import argparse

import pytest

from loadtest import e2e
from loadtest.herd import Progress

pytestmark = pytest.mark.slow


async def test_a_tiny_herd_goes_through_real_workers(services) -> None:
    parser = argparse.ArgumentParser()
    e2e.add_arguments(parser)
    args = parser.parse_args(["--jobs", "300", "--tenants", "3", "--workers", "1",
                              "--due-in", "3", "--timeout", "90",
                              "--database-url", services.admin_dsn,
                              "--redis-url", services.redis_url])
    report = await e2e.run(args, Progress(None))
    assert report.succeeded == report.jobs == 300
    lag = report.lease_lag_ms
    assert 0 <= lag["p50"] <= lag["p95"] <= lag["p99"] <= lag["max"]
    assert report.pg_transactions_per_execution > 0
    assert report.redis_commands_per_execution > 0
