"""`herdwick loadtest e2e` on a tiny herd and a tiny steady rate: every execution succeeds
and the report adds up."""

from __future__ import annotations

import argparse

import msgspec
import pytest

from herdwick.loadtest import e2e
from herdwick.loadtest.report import Progress

pytestmark = pytest.mark.slow


def e2e_args(services, *flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    e2e.add_arguments(parser)
    return parser.parse_args([*flags, "--tenants", "3", "--workers", "1", "--timeout", "90",
                              "--database-url", services.admin_dsn,
                              "--redis-url", services.redis_url])


def assert_ordered(lag: dict[str, float]) -> None:
    assert 0 <= lag["p50"] <= lag["p95"] <= lag["p99"] <= lag["max"]


async def test_a_tiny_herd_goes_through_real_workers(services) -> None:
    # Two schedulers share the events stream: the history must still have no gaps.
    args = e2e_args(services, "--jobs", "300", "--due-in", "3", "--schedulers", "2")
    report = await e2e.run(args, Progress(None))
    assert report.succeeded == report.jobs == 300
    assert report.history == e2e.History(succeeded_without_start=0, attempts_left_running=0)
    assert report.lease_lag_ms is not None
    assert_ordered(report.lease_lag_ms)
    assert report.steady is None
    assert report.streams.samples > 0
    assert report.pg_transactions_per_execution > 0
    assert report.redis_commands_per_execution > 0


async def test_a_tiny_steady_rate_goes_through_real_workers(services) -> None:
    args = e2e_args(services, "--jobs", "0", "--rate", "50", "--duration", "2")
    report = await e2e.run(args, Progress(None))
    steady = report.steady
    assert steady is not None
    assert steady.succeeded == steady.jobs == report.succeeded == 100
    assert report.jobs == 0 and report.lease_lag_ms is None
    assert_ordered(steady.lease_lag_ms)
    assert 0 < steady.last_succeeded_after_last_due_s < 30
    streams = report.streams
    assert streams.samples >= 4  # two seconds of steady jobs, sampled every 0.5 s
    assert 0 <= streams.events_len_last <= streams.events_len_max
    assert report.pg_transactions_per_execution > 0
    assert report.redis_commands_per_execution > 0
    assert msgspec.json.decode(msgspec.json.encode(report), type=e2e.Report) == report
    assert "all 100 succeeded in Postgres" in e2e.render_text(report)
