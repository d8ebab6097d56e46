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
    # CPU by kind of process, per execution, and each kind's peak RSS.
    assert set(report.cpu.seconds) >= {"scheduler", "worker", "postgres", "harness"}
    assert report.cpu_us_per_execution["worker"] > 0
    assert report.cpu_us_per_execution["scheduler"] > 0
    assert report.peak_rss_mb["scheduler"] > 10 and report.peak_rss_mb["worker"] > 10
    assert "per execution, us:" in e2e.render_text(report)
    # What each execution wrote, the move of the herd left out: its execution inserted
    # once and its due row deleted once (unique per occurrence), an attempt row, the
    # one-off completed; WAL, and Redis commands and bytes both ways.
    writes = report.writes
    assert writes is not None and writes.executions == 300
    one = pytest.approx(1.0, abs=0.02)
    assert writes.tables["executions"].inserted == one
    assert 1.0 <= writes.tables["executions"].updated <= 2.0
    assert writes.tables["execution_attempts"].inserted == one
    assert writes.tables["due_index"].deleted == one
    assert writes.tables["due_index"].updated == 0  # the move is the tool's, not counted
    assert writes.tables["jobs"].updated == one
    assert writes.tables["executions"].index_entries_max > 0
    assert 4 <= writes.rows_written <= 8
    assert writes.wal_bytes > 0 and writes.wal_records > 0
    assert writes.redis_commands > 1 and writes.redis_in_bytes > 0 < writes.redis_out_bytes
    assert "writes per execution" in e2e.render_text(report)


async def test_a_tiny_cron_herd_writes_each_job_s_next_occurrence(services) -> None:
    args = e2e_args(services, "--jobs", "200", "--due-in", "3", "--cron")
    report = await e2e.run(args, Progress(None))
    assert report.cron and report.succeeded == report.jobs == 200
    assert report.history == e2e.History(succeeded_without_start=0, attempts_left_running=0)
    writes = report.writes
    assert writes is not None and writes.executions == 200
    one = pytest.approx(1.0, abs=0.02)
    # Dispatch took each occurrence's due row and wrote the next one; the job stays
    # active and its next_run_at moves: one update, not a completion.
    assert writes.tables["due_index"].deleted == one
    assert writes.tables["due_index"].inserted == one
    assert writes.tables["jobs"].updated == one
    assert "200 cron jobs due in one second" in e2e.render_text(report)


async def test_a_tiny_steady_rate_goes_through_real_workers(services) -> None:
    # A database with more history than retention's default: the run keeps it all.
    args = e2e_args(services, "--jobs", "0", "--rate", "50", "--duration", "2",
                    "--history-days", "35")
    report = await e2e.run(args, Progress(None))
    assert report.history_days == 35
    assert report.partitions >= 35 + 2  # today and tomorrow at least, beside the history
    assert f"{report.partitions} executions partitions, 35 of them past" in \
        e2e.render_text(report)
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
    assert report.writes is not None and report.writes.executions == 100
    assert report.writes.tables["executions"].inserted == pytest.approx(1.0, abs=0.02)
    assert "all 100 succeeded in Postgres" in e2e.render_text(report)


def _free_ports(count: int) -> int:
    """The first of `count` consecutive ports nothing listens on."""
    import random
    import socket

    for _ in range(50):
        base = random.randrange(20_000, 60_000)
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise AssertionError("no free ports")


async def test_the_lag_histogram_moves_on_metrics_port_during_a_run(services) -> None:
    import asyncio

    import aiohttp

    port = _free_ports(2)
    args = e2e_args(services, "--jobs", "0", "--rate", "100", "--duration", "4",
                    "--metrics-port", str(port))
    run = asyncio.create_task(e2e.run(args, Progress(None)))
    counts: list[float] = []
    async with aiohttp.ClientSession() as http:
        while not run.done():
            try:
                async with http.get(f"http://127.0.0.1:{port}/metrics") as resp:
                    text = await resp.text()
                counts.append(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                                  if line.startswith("herdwick_dispatch_lag_seconds_count{")
                                  and 'stage="leased"' in line))
            except aiohttp.ClientConnectionError:
                pass  # not up yet, or gone
            await asyncio.sleep(0.5)
    report = await run
    assert report.steady is not None and report.steady.succeeded == 400
    moving = [c for c in counts if 0 < c < 400]
    assert len(set(moving)) >= 2, counts  # seen at several points on its way up
    assert counts == sorted(counts), counts  # a count only grows
    # The run ends as the last success reaches Postgres, so the last scrape may come just
    # before the last few leases are counted.
    assert 300 <= max(counts) <= 400, counts


async def test_fail_first_makes_every_job_retry_once_and_times_each_retry(services) -> None:
    args = e2e_args(services, "--jobs", "100", "--due-in", "3", "--fail-first")
    report = await e2e.run(args, Progress(None))
    assert report.succeeded == report.jobs == 100
    assert report.history == e2e.History(succeeded_without_start=0, attempts_left_running=0)
    assert report.retried == 100
    gap = report.retry_gap_ms
    # No retry is leased before the delay hw_fail drew for it (at least half the backoff).
    assert gap is not None and 500 <= gap["min"] <= gap["p50"] <= gap["p99"] <= gap["max"]
    text = e2e.render_text(report)
    assert "a handler that fails each first attempt" in text
    assert "retries: 100 first attempts failed" in text
