"""Prometheus metrics: what a herd of three jobs moves, read back through /metrics as a
scraper reads it, and the ports that serve them.

Counters are per process and the suite runs many tests in one: each test compares
before and after.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import textwrap
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from herdwick import telemetry
from herdwick.clock import ManualClock
from herdwick.storage.protocol import Protocol
from tests.integration.gateway_client import ADMIN_TOKEN
from tests.integration.stack import advance, ready, submit

POOL = "emails"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(datetime.now(UTC).replace(microsecond=0))


def samples(text: str) -> dict[tuple, float]:
    """(sample name, sorted labels) -> value, as a scraper parses the exposition."""
    found = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            found[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return found


def value(found: dict, name: str, **labels) -> float:
    return found.get((name, tuple(sorted(labels.items()))), 0.0)


async def scrape(api) -> dict:
    resp = await api.client.get("/metrics", headers=ADMIN)
    assert resp.status == 200, await resp.text()
    assert resp.headers["Content-Type"].startswith("text/plain")
    return samples(await resp.text())


async def test_a_small_herd_moves_lag_outcomes_and_call_latencies(api, schedulers,
                                                                  redis_client, key_prefix,
                                                                  clock) -> None:
    tenant = telemetry.tenant_label(api.tenant_id)
    pool = telemetry.pool_label(POOL)
    before = await scrape(api)
    for _ in range(3):
        await submit(api, schedule={"delaySeconds": 1}, retry={"maxAttempts": 1})
    node = await schedulers()
    await advance(clock, 2, node)
    await node.settle()
    protocol = Protocol(redis_client, key_prefix)
    ids = [e["execution_id"] for e in await ready(redis_client, key_prefix)]
    assert len(ids) == 3
    for eid in ids:
        assert await protocol.lease(POOL, "w", 30, eid, 1) is not None
    for eid in ids[:2]:
        assert await protocol.complete(POOL, eid, 1, "w", "{}") is True
    assert await protocol.fail(POOL, ids[2], 1, "w", '{"type": "Boom"}', False) == "DEAD"
    await node.settle_events()
    await node.sample_streams()
    after = await scrape(api)

    def moved(name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    lag = "herdwick_dispatch_lag_seconds_count"
    assert moved(lag, stage="published", tenant=tenant, pool=pool) == 3
    assert moved(lag, stage="leased", tenant=tenant, pool=pool) == 3
    # Time is the test's clock: the jobs fell due a second before it was moved past them.
    assert moved("herdwick_dispatch_lag_seconds_bucket", stage="published", tenant=tenant,
                 pool=pool, le="0.5") == 0
    finished = "herdwick_executions_finished_total"
    assert moved(finished, tenant=tenant, pool=pool, outcome="succeeded") == 2
    assert moved(finished, tenant=tenant, pool=pool, outcome="dead") == 1
    assert moved("herdwick_dead_letters_total", tenant=tenant, pool=pool) == 1
    assert moved("herdwick_attempts_total", tenant=tenant, pool=pool, outcome="failed") == 1
    assert moved("herdwick_jobs_submitted_total", tenant=tenant) == 3
    assert moved("herdwick_api_request_seconds_count", route="/v1/jobs", method="POST",
                 status="201") == 3
    assert moved("herdwick_postgres_query_seconds_count", query="apply_events") >= 1
    assert moved("herdwick_redis_call_seconds_count", call="hw_publish") >= 1
    # Gauges: this node holds every shard; the test leased by id, never reading the stream.
    assert value(after, "herdwick_shards_owned") >= 256
    assert value(after, "herdwick_ready_depth", pool=pool) == 3
    assert ("herdwick_fair_queue_depth", (("pool", pool),)) in after


async def test_the_ready_gauges_count_what_waits_and_what_is_held(api, schedulers,
                                                                 redis_client, key_prefix,
                                                                 clock) -> None:
    pool = telemetry.pool_label(POOL)
    for _ in range(2):
        await submit(api, schedule={"delaySeconds": 1})
    node = await schedulers()
    await advance(clock, 2, node)
    await node.settle()
    await node.sample_streams()
    waiting = await scrape(api)
    # One worker reads one entry and holds it unacked.
    await redis_client.xreadgroup("workers", "w", {f"{key_prefix}:{{{POOL}}}:ready": ">"},
                                  count=1)
    await node.sample_streams()
    held = await scrape(api)
    assert (value(waiting, "herdwick_ready_depth", pool=pool),
            value(waiting, "herdwick_ready_pending", pool=pool)) == (2, 0)
    assert (value(held, "herdwick_ready_depth", pool=pool),
            value(held, "herdwick_ready_pending", pool=pool)) == (1, 1)


async def test_metrics_on_the_api_need_the_admin_token(api) -> None:
    assert (await api.client.get("/metrics")).status == 401
    assert (await api.client.get("/metrics", headers=api.auth())).status == 401


def test_labels_chosen_by_tenants_stop_growing_at_the_limit() -> None:
    label = telemetry._Bounded(2)
    assert [label(v) for v in ("a", "b", "c", "a", "d")] == ["a", "b", "other", "a", "other"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_a_worker_serves_its_metrics_on_metrics_port(services, key_prefix,
                                                           tmp_path: Path) -> None:
    (tmp_path / "handlers.py").write_text(textwrap.dedent("""
        import herdwick

        worker = herdwick.Worker(pool="emails")

        @worker.handler
        async def handle(ctx):
            return None
    """))
    port = _free_port()
    herdwick_cmd = Path(sys.executable).parent / "herdwick"
    env = {**os.environ, "HERDWICK_REDIS_URL": services.redis_url,
           "HERDWICK_KEY_PREFIX": key_prefix}
    proc = await asyncio.create_subprocess_exec(
        str(herdwick_cmd), "worker", "handlers:worker", "--metrics-port", str(port),
        "--metrics-host", "127.0.0.1", cwd=tmp_path, env=env, stderr=asyncio.subprocess.PIPE)
    try:
        text = await _get_when_up(f"http://127.0.0.1:{port}/metrics")
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(proc.communicate(), 15)
    assert proc.returncode == 0, stderr.decode()
    found = samples(text)
    assert value(found, "herdwick_worker_in_flight", pool="emails") == 0


async def test_a_busy_metrics_port_is_a_clear_error(services, key_prefix) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        herdwick_cmd = Path(sys.executable).parent / "herdwick"
        env = {**os.environ, "HERDWICK_REDIS_URL": services.redis_url}
        proc = await asyncio.create_subprocess_exec(
            str(herdwick_cmd), "http-worker", "--metrics-port", str(port), "--metrics-host",
            "127.0.0.1", env=env, stderr=asyncio.subprocess.PIPE)
        _, stderr = await asyncio.wait_for(proc.communicate(), 15)
    assert proc.returncode == 2
    assert f"--metrics-port {port}" in stderr.decode()


async def _get_when_up(url: str) -> str:
    async with aiohttp.ClientSession() as session:
        for _ in range(100):
            try:
                async with session.get(url) as resp:
                    return await resp.text()
            except aiohttp.ClientConnectionError:
                await asyncio.sleep(0.1)
    raise AssertionError(f"{url} never answered")
