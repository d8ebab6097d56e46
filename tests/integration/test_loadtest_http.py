"""`herdwick loadtest http` on tiny herds: every healthy callback arrives and succeeds, and a
down target's breaker opens without burning attempts once open."""

from __future__ import annotations

import argparse
import asyncio
import time

import msgspec
import pytest

from herdwick.config import ConfigError
from herdwick.loadtest import http, receiver
from herdwick.loadtest.report import Progress
from tests.integration.report_checks import assert_plots_match, assert_self_contained, page_of

pytestmark = pytest.mark.slow


def http_args(services, *flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    http.add_arguments(parser)
    return parser.parse_args([*flags, "--due-in", "3", "--timeout", "60",
                              "--database-url", services.admin_dsn,
                              "--redis-url", services.redis_url])


def assert_ordered(lag: http.Lag) -> None:
    assert 0 <= lag.p50_ms <= lag.p95_ms <= lag.p99_ms <= lag.max_ms


async def test_a_tiny_herd_is_delivered_to_two_receivers(services) -> None:
    args = http_args(services, "--jobs", "300", "--targets", "2", "--tenants", "2")
    report = await http.run(args, Progress(None))
    assert report.callbacks == report.healthy_herd_jobs == 300
    assert report.callbacks_per_s is not None and report.callbacks_per_s > 0
    assert report.history.sound
    assert [t.up for t in report.targets] == [True, True]
    for target in report.targets:
        # Split in turn: each receiver got its half, each exactly once, all signed and due.
        assert target.executions == target.succeeded == 150
        assert target.deliveries == 150
        assert target.burned == 0 and target.deferred_circuit_open == 0
        assert target.arrival_lag is not None and target.arrival_lag.samples == 150
        assert_ordered(target.arrival_lag)
    assert report.arrival_lag is not None and report.arrival_lag.samples == 300
    assert report.lease_lag_ms is not None
    assert 0 <= report.lease_lag_ms["p50"] <= report.lease_lag_ms["max"]
    cpu = report.cpu.seconds
    assert {"http-worker", "scheduler", "receiver", "harness"} <= set(cpu)
    assert cpu["http-worker"] > 0
    assert report.cpu_per_1000_callbacks["http-worker"] > 0
    drain = report.drain_cpu
    assert 0 < drain.window_s <= report.cpu.window_s
    assert drain.seconds["http-worker"] <= cpu["http-worker"]
    assert drain.runqueue_wait_s.get("http-worker", 0) >= 0
    text = http.render_text(report)
    assert "300 callbacks succeeded" in text and "callbacks/s" in text
    assert msgspec.json.decode(msgspec.json.encode(report), type=http.Report) == report
    # --report's plots: the arrivals second by second from the due second, each once
    timeline = report.timeline
    assert timeline is not None and [s.name for s in timeline.series] == ["herd"]
    assert sum(x.count for x in timeline.series[0].seconds) == 300
    assert timeline.series[0].seconds[0].t_s >= 0  # none arrived before it was due
    page = page_of(report, text, timeline)
    assert_self_contained(page)
    assert_plots_match(page, timeline)


async def test_a_down_target_opens_its_breaker_and_burns_nothing_once_open(services) -> None:
    # Enough jobs that leases go on after the first failures have opened the breaker;
    # a cooldown longer than the run, so no half-open probe is sent meanwhile.
    args = http_args(services, "--jobs", "1200", "--targets", "2", "--down-targets", "1",
                     "--concurrency", "64", "--breaker-cooldown", "60")
    report = await http.run(args, Progress(None))
    up, down = report.targets
    assert up.up and not down.up
    assert report.callbacks == up.succeeded == up.executions == 600
    assert up.burned == 0
    assert down.succeeded == 0 and down.executions == 600
    assert down.burned > 0  # the deliveries admitted before it opened
    assert down.burned_on_open_breaker == 0
    assert down.burned_after_cooldown == 0
    assert down.deferred_circuit_open > 0
    assert down.burned + down.deferrals >= down.executions
    assert down.opened_after_due_s is not None
    assert report.history.sound
    assert "0 of them on an open breaker" in http.render_text(report)


def test_the_flags_leave_a_healthy_target(services) -> None:
    with pytest.raises(ConfigError, match="healthy target"):
        http.plan_from(http_args(services, "--targets", "2", "--down-targets", "2"))
    with pytest.raises(ConfigError, match="nothing to run"):
        http.plan_from(http_args(services, "--jobs", "0"))


def test_healthy_jobs_are_counted_as_the_factory_splits_them() -> None:
    plan = http.Plan(targets=3, down_targets=1)
    # job i goes to target i % 3; targets 0 and 1 are up
    assert [plan.healthy_of(n) for n in range(7)] == [0, 1, 2, 2, 3, 4, 4]


async def test_the_receiver_answers_pipelined_requests_and_records_their_due_times(
        tmp_path) -> None:
    record = receiver.Record()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: receiver.Responder(record), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    body = b'{"a": 1}'
    request = (b"POST /hook HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n"
               b"Herdwick-Scheduled-For: 2026-12-04T10:00:00Z\r\n\r\n%s") % (len(body), body)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        # Two at once, the second cut mid-body: both answered, in order, on one connection.
        writer.write(request + request[:-3])
        await writer.drain()
        writer.write(request[-3:])
        answers = b""
        while answers.count(b"200 OK") < 2:
            answers += await asyncio.wait_for(reader.read(4096), 5)
        writer.write(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n")
        assert b"411" in await asyncio.wait_for(reader.read(4096), 5)
        assert await asyncio.wait_for(reader.read(4096), 5) == b""  # closed after it
        writer.close()
    finally:
        server.close()
    assert answers.endswith(b"\r\n\r\nok")
    path = str(tmp_path / "r.bin")
    record.write(path)
    seen = receiver.read_record(path)
    due = 1796378400.0  # 2026-12-04T10:00:00Z
    assert [d for _, d in seen] == [due, due]  # the refused one is not counted
    assert all(abs(arrived - time.time()) < 60 for arrived, _ in seen)


async def test_the_raw_limit_drains_the_same_deliveries_through_the_http_worker_alone(
        services) -> None:
    args = http_args(services, "--jobs", "300", "--raw-limit")
    report = await http.run(args, Progress(None))
    raw = report.raw_limit
    assert raw is not None and raw.deliveries == 300
    assert raw.callbacks_per_s > 0 and raw.worker_cpu_per_1000_s > 0
    assert raw.receiver_cpu_per_1000_s > 0
    assert "raw limit, one http-worker alone" in http.render_text(report)
    assert msgspec.json.decode(msgspec.json.encode(report), type=http.Report) == report
