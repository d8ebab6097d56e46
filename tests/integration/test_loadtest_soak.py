"""`herdwick loadtest soak` for a quarter of a minute, a small herd every 6 s: every job
succeeds, each sample and each row adds up, and the verdicts say what they judged."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import msgspec
import pytest

from herdwick.loadtest import soak
from tests.integration.report_checks import assert_self_contained, paths, text_of

pytestmark = pytest.mark.slow


async def test_a_quarter_minute_soak_adds_up(services, tmp_path: Path) -> None:
    page_path = tmp_path / "soak.html"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "herdwick.cli", "loadtest", "soak", "--minutes", "0.25",
        "--herd", "200", "--herd-every", "6", "--rate", "50", "--sample-every", "1",
        "--tenants", "2", "--workers", "1", "--json", "--report", str(page_path),
        "--no-progress", "--database-url", services.admin_dsn,
        "--redis-url", services.redis_url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout=100)
    report = msgspec.json.decode(stdout, type=soak.Report)
    # The verdicts may fail on a busy machine; the run must not lose a job.
    assert proc.returncode == (0 if report.passed else 1), stderr.decode()

    # 15 s of 50 jobs/s, and herds due at 0, 6 and 12 s: each row one herd.
    assert report.steady_jobs == 750 and report.herd_jobs == 3 * 200
    assert report.succeeded == report.steady_jobs + report.herd_jobs
    assert (report.lost, report.unfinished) == (0, 0) and report.history.sound
    rows = report.rows
    assert [(r.row, r.from_s, r.herd_jobs) for r in rows] == [(0, 0, 200), (1, 6, 200),
                                                              (2, 12, 200)]
    assert sum(r.steady_jobs for r in rows) == report.steady_jobs
    for row in rows:  # every job of a row leased, its lag ordered
        assert row.steady_lag.count == row.steady_jobs and row.herd_lag.count == row.herd_jobs
        for lag in (row.steady_lag, row.herd_lag):
            assert 0 <= lag.p50_ms <= lag.p99_ms <= lag.max_ms
        assert set(row.rss_mb) == {"scheduler", "worker"} and row.rss_mb["worker"] > 0
        assert {"scheduler", "worker", "postgres", "harness", "others"} <= set(row.cpu_share)

    samples = report.samples
    assert len(samples) == 15 and samples[-1].t_s >= 15
    leased_in_samples = sum(x.steady.count + x.herd.count for x in samples)
    assert 0.9 * report.succeeded <= leased_in_samples <= report.succeeded  # the rest: drain
    assert all(set(x.rss_mb) == {"scheduler-0", "worker-0"} for x in samples)
    assert all(x.events_len >= 0 and x.probe_ms >= 0 for x in samples)

    # 15 samples: 5 a third, enough to judge RSS; 3 rows are too few for the p99.
    assert set(report.rss.processes) == {"scheduler-0", "worker-0"}
    for flatness in report.rss.processes.values():
        assert flatness.points == 15 and flatness.flat is not None
        assert flatness.flat == (flatness.last_third <= flatness.bound)
    assert report.rss.flat == all(f.flat for f in report.rss.processes.values())
    assert report.p99.steady.points == 3 and report.p99.flat is None

    page = page_path.read_text()
    assert_self_contained(page)
    assert text_of(page) == soak.render_text(report)
    assert "p99 flat: not judged (too short)" in text_of(page)
    plotted = paths(page)  # a point a sample: throughput, RSS, the streams
    assert plotted["steady"] == plotted["herd"] == len(samples)
    assert plotted["scheduler-0"] == plotted["worker-0"] == plotted["events length"] == len(samples)
    assert plotted["steady p99"] == sum(1 for x in samples if x.steady.count)  # lag: when leased
