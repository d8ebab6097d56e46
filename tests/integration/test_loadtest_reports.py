"""`herdwick loadtest ... --report FILE.html` and the progress bar, as a person runs them: the
page holds the figures the command printed and plots its seconds; the bar goes to stderr
only when asked for (or on a terminal), and never into the report on stdout."""

from __future__ import annotations

import asyncio
import html
import sys
from pathlib import Path

import msgspec
import pytest

from herdwick.loadtest import e2e, herd, submit
from tests.integration.report_checks import assert_plots_match, assert_self_contained, text_of

pytestmark = pytest.mark.slow


async def loadtest(services, *flags: str, timeout_s: float = 100) -> tuple[bytes, str]:
    """`herdwick loadtest FLAGS` in a process of its own: its stdout and stderr."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "herdwick.cli", "loadtest", *flags,
        "--database-url", services.admin_dsn, "--redis-url", services.redis_url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout=timeout_s)
    assert proc.returncode == 0, stderr.decode()
    return stdout, stderr.decode()


def cell(value: object) -> str:
    return f">{html.escape(str(value))}<"


async def test_an_e2e_report_holds_the_printed_figures_and_plots_every_second(
        services, tmp_path: Path) -> None:
    page_path = tmp_path / "e2e.html"
    stdout, stderr = await loadtest(
        services, "e2e", "--jobs", "300", "--due-in", "3", "--tenants", "3", "--workers", "1",
        "--timeout", "90", "--json", "--report", str(page_path), "--progress")
    report = msgspec.json.decode(stdout, type=e2e.Report)  # the bar kept out of stdout
    raw = msgspec.json.decode(stdout)  # each figure as the JSON wrote it
    assert report.succeeded == 300 and report.history.sound
    assert "e2e draining" in stderr and "/300 [" in stderr  # forced on, though not a tty

    page = page_path.read_text()
    assert_self_contained(page)
    shown = text_of(page)  # the text report, as it prints without --json
    assert shown.startswith("herdwick loadtest e2e: 1 scheduler, 1 worker process(es)")
    assert f"all succeeded in Postgres {raw['last_succeeded_after_due_s']} s after due " \
           f"({raw['jobs_per_s']:,} jobs/s end to end)" in shown
    for value in (raw["jobs_per_s"], raw["last_succeeded_after_due_s"],
                  raw["lease_lag_ms"]["p99"], raw["redis_commands_per_execution"]):
        assert cell(value) in page
    assert "--jobs 300" in page and "--report" in page
    timeline = report.timeline
    assert timeline is not None and [s.name for s in timeline.series] == ["herd"]
    assert sum(s.count for s in timeline.series[0].seconds) == 300  # every lease, once
    assert_plots_match(page, timeline)


async def test_a_herd_report_plots_the_stream_entries_by_second(services, tmp_path) -> None:
    page_path = tmp_path / "herd.html"
    stdout, stderr = await loadtest(
        services, "herd", "--jobs", "500", "--tenants", "2", "--pools", "2", "--due-in", "3",
        "--rate", "50", "--duration", "2", "--no-raw", "--timeout", "60", "--json",
        "--report", str(page_path), "--no-progress")
    report = msgspec.json.decode(stdout, type=herd.Report)
    raw = msgspec.json.decode(stdout)
    assert report.complete
    assert "\r" not in stderr and "on the streams" not in stderr  # --no-progress

    page = page_path.read_text()
    assert_self_contained(page)
    assert text_of(page) == herd.render_text(report)
    for value in (raw["herd"]["lag"]["p99_ms"], raw["herd"]["jobs_per_s"],
                  raw["cost"]["cpu_s"], raw["cost"]["cpu_s_per_1000"]):
        assert cell(value) in page
    timeline = report.timeline
    assert timeline is not None
    counts = {s.name: sum(x.count for x in s.seconds) for s in timeline.series}
    assert counts == {"herd": 500, "background": 100}
    assert_plots_match(page, timeline)


async def test_submit_has_no_bar_without_a_terminal_and_reports_each_phase(
        services, tmp_path) -> None:
    page_path = tmp_path / "submit.html"
    stdout, stderr = await loadtest(
        services, "submit", "--clients", "2", "--batch-clients", "1", "--batch-size", "10",
        "--duration", "1", "--warmup", "0.2", "--phases", "http-single,raw-batch", "--json",
        "--report", str(page_path), timeout_s=60)
    report = msgspec.json.decode(stdout, type=submit.Report)
    raw = msgspec.json.decode(stdout)
    assert report.passed
    assert "api: 1 process(es)" in stderr  # what it says still goes to stderr
    assert "\r" not in stderr and "warm-up" not in stderr  # but no bar: not a terminal

    page = page_path.read_text()
    assert_self_contained(page)
    for phase, written in zip(report.phases, raw["phases"], strict=True):
        assert cell(written["jobs_per_s"]) in page
        assert cell(written["latency"]["p99_ms"]) in page
        assert cell(written["cpu"]["loadgen_s"]) in page  # CPU per process
        # the seconds hold every job the measured window counted
        assert sum(s.count for s in phase.per_second) == phase.ok * phase.jobs_per_request
    timeline = submit.timeline_of(report)
    assert [s.name for s in timeline.series] == ["http-single", "raw-batch"]
    assert_plots_match(page, timeline)

