"""`herdwick loadtest noisy-neighbour` on a tiny herd: the report adds up, and with fair
queuing the quiet tenants are served ahead of the noisy tenant's backlog.

The ready stream's bound is made small so most of the herd waits in the fair queue,
as a large herd does with the default bound; no speed is asserted.
"""

from __future__ import annotations

import argparse

import msgspec
import pytest

from herdwick.loadtest import noisy
from herdwick.loadtest.report import Progress
from tests.integration.report_checks import assert_plots_match, assert_self_contained, page_of

pytestmark = pytest.mark.slow


def noisy_args(services, *flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    noisy.add_arguments(parser)
    return parser.parse_args([
        "--jobs", "1500", "--quiet-tenants", "3", "--quiet-jobs", "20", "--workers", "1",
        # 1,000 jobs/s of workers against 1,560 due in one second: a backlog however fast
        # the machine (at 10 ms a handler, 2,000/s, a quick run drained as they came due)
        "--concurrency", "20", "--handler-ms", "20", "--ready-max", "40", "--due-in", "3",
        "--timeout", "120", "--database-url", services.admin_dsn,
        "--redis-url", services.redis_url, *flags])


async def test_quiet_tenants_are_served_ahead_of_a_noisy_backlog(services) -> None:
    report = await noisy.run(noisy_args(services), Progress(None))
    assert report.history.sound
    assert report.noisy.lag.started == 1500
    assert [t.started for t in report.quiet_tenants] == [20, 20, 20]
    assert report.quiet.started == 60
    # Fair queuing serves each quiet tenant in the first rounds, while the noisy
    # tenant's backlog takes the whole drain (first-in first-out spreads the quiet
    # tenants' leases over it: their p99 near the noisy tenant's).
    assert report.quiet.p99_ms < report.noisy.lag.p50_ms
    assert 0 < report.quiet_jain_index <= 1
    assert 0 < report.noisy.share_of_pool <= 1
    assert report.capacity_per_s == 1000
    assert report.streams.samples > 0 and report.redis_memory.peak_bytes > 0
    assert msgspec.json.decode(msgspec.json.encode(report), type=noisy.Report) == report
    text = noisy.render_text(report)
    assert "fair queuing on" in text and "noisy drain" in text
    # --report's plots: each group's leases second by second, every one of them once
    timeline = report.timeline
    assert timeline is not None
    assert {s.name: sum(x.count for x in s.seconds) for s in timeline.series} == {
        "noisy": 1500, "quiet": 60}
    page = page_of(report, text, timeline)
    assert_self_contained(page)
    assert_plots_match(page, timeline)


def test_jain_index_is_one_when_alike_and_one_over_n_when_one_takes_all() -> None:
    assert noisy.jain_index([3.0, 3.0, 3.0, 3.0]) == pytest.approx(1.0)
    assert noisy.jain_index([5.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)


def test_bad_flags_are_refused() -> None:
    parser = argparse.ArgumentParser()
    noisy.add_arguments(parser)
    with pytest.raises(noisy.ConfigError, match="noisy-neighbour"):
        noisy.plan_from(parser.parse_args(["--jobs", "0"]))
