"""The herd simulator end to end: a tiny herd through a real `herdwick scheduler` process.

No speed is asserted here; the test checks that the report is whole and
adds up: every herd job on the streams exactly once, under its own tenant,
per-tenant counts summing to the herd, percentiles in order.
"""

from __future__ import annotations

import argparse

import asyncpg
import msgspec
import pytest
import redis.asyncio as aioredis

from herdwick.config import ConfigError
from herdwick.loadtest import herd
from herdwick.loadtest.herd import Options, Plan, Report
from herdwick.loadtest.jobs import tenant_counts
from herdwick.loadtest.measure import Lag
from herdwick.loadtest.report import Progress, render_json

pytestmark = pytest.mark.slow


def assert_ordered(lag: Lag) -> None:
    # -1: a stream ID has whole milliseconds, a background due time microseconds
    assert -1 <= lag.p50_ms <= lag.p95_ms <= lag.p99_ms <= lag.max_ms


async def leftovers(services, prefix_start: str = "hw_herd_") -> tuple[list[str], int]:
    admin = await asyncpg.connect(services.admin_dsn)
    try:
        names = [r["datname"] for r in await admin.fetch(
            "SELECT datname FROM pg_database WHERE datname LIKE $1", prefix_start + "%")]
    finally:
        await admin.close()
    client = aioredis.from_url(services.redis_url)
    try:
        keys = [k async for k in client.scan_iter(match="hwherd*", count=1000)]
        keys += [k async for k in client.scan_iter(match="hwraw*", count=1000)]
    finally:
        await client.aclose()
    return names, len(keys)


async def test_a_tiny_herd_is_reported_whole_and_consistent(services) -> None:
    before = await leftovers(services)
    plan = Plan(jobs=2_000, tenants=2, pools=2, skew=0.75, due_in_s=4, schedulers=1,
                rate=50, duration_s=2, timeout_s=60)
    report = await herd.run(Options(plan=plan, database_url=services.admin_dsn,
                                    redis_url=services.redis_url), Progress(None))

    h = report.herd
    assert h is not None and report.complete
    assert h.check.expected == h.check.seen == 2_000
    assert h.check.duplicates == h.check.missing == h.check.wrong_tenant == 0
    assert [t.expected for t in h.tenants] == [1_500, 500]  # the noisy tenant's 75 %
    assert [t.seen for t in h.tenants] == [t.expected for t in h.tenants]
    assert sum(t.lag.samples for t in h.tenants) == h.lag.samples == 2_000
    assert_ordered(h.lag)
    for tenant in h.tenants:
        assert_ordered(tenant.lag)
        assert tenant.lag.max_ms <= h.lag.max_ms
    assert 0 <= h.first_after_due_ms <= h.last_after_due_ms
    assert h.jobs_per_s > 0 and 0 < h.peak_per_s <= 2_000
    assert h.lead_s > 0  # moved before it fell due

    b = report.background
    assert b is not None and b.check.exact and b.check.expected == 100
    assert sum(t.seen for t in b.tenants) == b.lag.samples == 100
    assert_ordered(b.lag)

    cost = report.cost
    assert cost.processes == 1 and cost.jobs == 2_000
    assert cost.cpu_s > 0 and cost.window_s > 0
    assert len(cost.peak_rss_mb) == 1 and cost.peak_rss_mb[0] >= cost.baseline_rss_mb[0] > 0
    assert 0 < report.heap.getsizeof_bytes_per_entry < 1_000

    raw = report.raw
    assert raw is not None and raw.jobs == 2_000
    assert min(raw.dispatch_rows_per_s, raw.publish_entries_per_s, raw.xadd_entries_per_s) > 0
    assert {r.figure for r in report.ratios} >= {"jobs/s vs the slower raw stage"}

    text = herd.render_text(report)
    assert "exactly once" in text and "herd-01" in text
    assert "complete" in text.splitlines()[-1]
    again = msgspec.json.decode(render_json(report), type=Report)
    assert again.herd == report.herd

    assert await leftovers(services) == before  # databases dropped, keys deleted


def test_the_flags_become_options() -> None:
    parser = argparse.ArgumentParser()
    herd.add_arguments(parser)
    args = parser.parse_args(["--jobs", "10", "--skew", "0.5", "--schedulers", "2",
                              "--no-raw", "--database-url", "postgresql://u@127.0.0.1/x"])
    options = herd.options_from(args)
    assert options.plan == Plan(jobs=10, skew=0.5, schedulers=2, raw=False)
    assert options.database_url == "postgresql://u@127.0.0.1/x"


@pytest.mark.parametrize("url", ["postgresql://u@10.1.2.3/x", "redis://db.example.com:6379"])
async def test_only_loopback_targets_are_accepted(url: str) -> None:
    key = "database_url" if url.startswith("postgresql") else "redis_url"
    with pytest.raises(ConfigError, match="loopback"):
        await herd.run(Options(plan=Plan(jobs=1), **{key: url}), Progress(None))


def test_the_noisy_tenant_takes_its_share_and_the_rest_split_evenly() -> None:
    assert tenant_counts(100, 4, 0.5) == [50, 17, 17, 16]
    assert tenant_counts(10, 3, 0.0) == [4, 3, 3]
    assert sum(tenant_counts(100_000, 10, 0.37)) == 100_000
