"""The http pool end to end: gateway -> scheduler -> http worker -> a real local receiver.

Receivers are aiohttp servers on 127.0.0.1, so the gateway and the worker
allow 127.0.0.0/8 unless a test says otherwise. Due times move on the fake
clock; retry and deferral times come from the Redis server's clock, so the
fake clock starts at real time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

import pytest
from aiohttp import web
from aiohttp.abc import AbstractResolver
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import herdwick
from herdwick import telemetry
from herdwick.clock import ManualClock
from herdwick.http_worker import BreakerPolicy, HttpWorker
from tests.integration.conftest import Api, tenant_api
from tests.integration.stack import advance, submit

LOCAL = ("127.0.0.0/8",)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(datetime.now(UTC).replace(microsecond=0))


@dataclass
class Received:
    headers: dict[str, str]
    body: bytes
    at: float


@dataclass
class Receiver:
    """A real HTTP server: answers each POST with the next of `replies` (then 200 ok)."""

    port: int = 0
    replies: list[Callable[[], web.StreamResponse]] = field(default_factory=list)
    hang: asyncio.Event | None = None  # set: requests wait on it (a hung receiver)
    got: list[Received] = field(default_factory=list)
    arrived: asyncio.Condition = field(default_factory=asyncio.Condition)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        async with self.arrived:
            self.got.append(Received(dict(request.headers), body,
                                     asyncio.get_running_loop().time()))
            self.arrived.notify_all()
        if self.hang is not None:
            await self.hang.wait()
        if self.replies:
            return self.replies.pop(0)()
        return web.Response(text="ok")

    async def wait_for(self, n: int, within_s: float = 10.0) -> list[Received]:
        async with self.arrived:
            await asyncio.wait_for(self.arrived.wait_for(lambda: len(self.got) >= n), within_s)
        return self.got


@contextlib.asynccontextmanager
async def serving(receiver: Receiver, port: int = 0) -> AsyncIterator[Receiver]:
    app = web.Application()
    app.router.add_post("/{tail:.*}", receiver.handle)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    receiver.port = site._server.sockets[0].getsockname()[1]
    try:
        yield receiver
    finally:
        if receiver.hang is not None:
            receiver.hang.set()
        await runner.cleanup()


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    async with serving(Receiver()) as r:
        yield r


@pytest.fixture
async def api(db_url, services, key_prefix, clock) -> AsyncIterator[Api]:
    async with tenant_api(db_url, services.redis_url, key_prefix, clock,
                          http_allow=LOCAL) as holder:
        yield holder


@contextlib.asynccontextmanager
async def http_worker(redis_client, key_prefix, *, allow=LOCAL, **options
                      ) -> AsyncIterator[HttpWorker]:
    import ipaddress

    options.setdefault("breaker", BreakerPolicy(failures=3, window_s=30, cooldown_s=0.3,
                                                max_cooldown_s=1))
    worker = HttpWorker(redis=redis_client, key_prefix=key_prefix,
                        allow=[ipaddress.ip_network(c) for c in allow], **options)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        yield worker
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


def http_job(url: str, **overrides) -> dict:
    body = {"target": {"type": "http", "ref": url}, "schedule": {"delaySeconds": 1},
            "payload": {"order": 42, "note": "café"},
            "retry": {"maxAttempts": 3, "backoffSeconds": 1}}
    body.update(overrides)
    return body


async def run_due(node, clock, seconds: float = 2) -> None:
    await advance(clock, seconds, node)
    await node.settle()


async def execution_of(api: Api, job_id: str) -> dict:
    resp = await api.client.get(f"/v1/jobs/{job_id}/executions", headers=api.auth())
    assert resp.status == 200, await resp.text()
    items = (await resp.json())["items"]
    assert len(items) == 1, items
    resp = await api.client.get(f"/v1/executions/{items[0]['executionId']}",
                                headers=api.auth())
    return await resp.json()


async def settled(api: Api, node, job_id: str, states: set[str],
                  within_s: float = 10.0) -> dict:
    """The job's execution once its events are applied and it is in one of `states`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while True:
        await node.settle_events()
        found = await execution_of(api, job_id)
        if found["state"] in states or loop.time() > deadline:
            assert found["state"] in states, found
            return found
        await asyncio.sleep(0.05)


async def secret_of(api: Api) -> str:
    resp = await api.client.post(f"/v1/tenants/{api.tenant_id}:rotate-secret",
                                 json={"overlapSeconds": 0},
                                 headers={"Authorization": "Bearer test-admin-token-0123456789"})
    assert resp.status == 200, await resp.text()
    return (await resp.json())["signingSecret"]


async def test_a_delivery_carries_the_contract_headers_and_a_signature_that_verifies(
        api, schedulers, receiver, redis_client, key_prefix, clock) -> None:
    secret = await secret_of(api)
    job = await submit(api, **http_job(receiver.url))
    node = await schedulers()
    async with http_worker(redis_client, key_prefix):
        await run_due(node, clock)
        got = (await receiver.wait_for(1))[0]
        done = await settled(api, node, job["jobId"], {"succeeded"})

    h = got.headers
    assert json.loads(got.body) == {"order": 42, "note": "café"}
    assert h["Content-Type"] == "application/json"
    assert h["Idempotency-Key"] == f"{job['jobId']}:{done['scheduledFor']}"
    assert h["Herdwick-Execution-Id"] == done["executionId"]
    assert h["Herdwick-Attempt"] == "1"
    assert h["Herdwick-Scheduled-For"] == done["scheduledFor"]
    herdwick.verify_signature(secret, h["Herdwick-Signature"], got.body)
    with pytest.raises(herdwick.SignatureError):
        herdwick.verify_signature(secret, h["Herdwick-Signature"], got.body + b" ")
    assert done["result"] == {"status": 200, "body": "ok"}


async def test_a_500_then_a_200_succeeds_on_attempt_2_with_the_same_idempotency_key(
        api, schedulers, receiver, redis_client, key_prefix, clock) -> None:
    receiver.replies.append(lambda: web.Response(status=500, text="boom"))
    job = await submit(api, **http_job(receiver.url))
    node = await schedulers()
    async with http_worker(redis_client, key_prefix):
        await run_due(node, clock)
        await receiver.wait_for(1)
        waiting = await settled(api, node, job["jobId"], {"retry_wait"})
        assert waiting["error"]["class"] == "server_error"
        assert waiting["error"]["status"] == 500
        assert "500 Internal Server Error" in waiting["error"]["message"]
        await run_due(node, clock, 3)  # past the 1 s backoff
        first, second = await receiver.wait_for(2)
        done = await settled(api, node, job["jobId"], {"succeeded"})
    assert done["attempt"] == 2
    assert first.headers["Idempotency-Key"] == second.headers["Idempotency-Key"]
    assert [first.headers["Herdwick-Attempt"], second.headers["Herdwick-Attempt"]] == ["1", "2"]
    assert [a["outcome"] for a in done["attempts"]] == ["failed", "succeeded"]


async def test_a_404_dead_letters_at_once(api, schedulers, receiver, redis_client, key_prefix,
                                          clock) -> None:
    receiver.replies.append(lambda: web.Response(status=404, text="no such hook"))
    job = await submit(api, **http_job(receiver.url))
    node = await schedulers()
    async with http_worker(redis_client, key_prefix):
        await run_due(node, clock)
        dead = await settled(api, node, job["jobId"], {"dead"})
    assert dead["attempt"] == 1
    assert dead["error"]["class"] == "client_error"
    assert dead["error"]["status"] == 404
    assert "no such hook" in dead["error"]["message"]


async def test_a_redirect_is_not_followed(api, schedulers, receiver, redis_client, key_prefix,
                                          clock) -> None:
    receiver.replies.append(lambda: web.Response(status=302,
                                                 headers={"Location": receiver.url + "2"}))
    job = await submit(api, **http_job(receiver.url))
    node = await schedulers()
    async with http_worker(redis_client, key_prefix):
        await run_due(node, clock)
        dead = await settled(api, node, job["jobId"], {"dead"})
    assert len(receiver.got) == 1
    assert dead["error"]["class"] == "redirect"


async def test_a_429_with_retry_after_holds_the_next_attempt_back(
        api, schedulers, receiver, redis_client, key_prefix, clock, db) -> None:
    receiver.replies.append(lambda: web.Response(status=429, headers={"Retry-After": "120"}))
    job = await submit(api, **http_job(receiver.url))
    node = await schedulers()
    async with http_worker(redis_client, key_prefix):
        await run_due(node, clock)
        waiting = await settled(api, node, job["jobId"], {"retry_wait"})
    assert waiting["error"]["class"] == "rate_limited"
    assert waiting["error"]["retryAfterSeconds"] == 120
    async with db.connection() as conn:
        due = await conn.fetchval("SELECT next_run_at FROM due_index WHERE execution_id = $1",
                                  waiting["executionId"])
    failed_at = datetime.fromisoformat(waiting["attempts"][0]["finishedAt"])
    assert (due - failed_at).total_seconds() >= 119.9  # not the 1 s backoff


async def test_a_hung_receiver_times_out_and_is_retried(api, schedulers, receiver, redis_client,
                                                        key_prefix, clock) -> None:
    receiver.hang = asyncio.Event()
    job = await submit(api, **http_job(receiver.url, timeoutSeconds=1))
    node = await schedulers()
    async with http_worker(redis_client, key_prefix):
        await run_due(node, clock)
        waiting = await settled(api, node, job["jobId"], {"retry_wait"})
    assert waiting["error"]["class"] == "timeout"
    assert waiting["attempts"][0]["outcome"] == "failed"


async def test_a_timeout_stays_classified_when_the_event_loop_runs_late(
        api, schedulers, receiver, redis_client, key_prefix, clock) -> None:
    """A loop stalled past the job's timeout wakes with both timers due; the request's
    own timeout must be the one that counts, so the error still names its class."""
    receiver.hang = asyncio.Event()
    job = await submit(api, **http_job(receiver.url, timeoutSeconds=1))
    node = await schedulers()
    async with http_worker(redis_client, key_prefix):
        await run_due(node, clock)
        await receiver.wait_for(1)
        time.sleep(1.5)  # noqa: ASYNC251 - the stall under test: the whole loop stops
        waiting = await settled(api, node, job["jobId"], {"retry_wait"})
    assert waiting["error"]["class"] == "timeout"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_a_down_target_opens_its_breaker_without_burning_attempts_or_slowing_others(
        api, schedulers, receiver, redis_client, key_prefix, clock, db) -> None:
    down_port = free_port()  # nothing listens: connection refused
    down_url = f"http://127.0.0.1:{down_port}/hook"
    # Enough attempts that the probes (real deliveries, which count) cannot use them up.
    down = [await submit(api, **http_job(down_url, name=f"down-{i}",
                                         retry={"maxAttempts": 8, "backoffSeconds": 1}))
            for i in range(10)]
    healthy = [await submit(api, **http_job(receiver.url, name=f"up-{i}")) for i in range(5)]
    node = await schedulers()
    down_label = telemetry.target_label(f"http://127.0.0.1:{down_port}")
    deferred_before = metric("herdwick_http_deliveries_total", outcome="circuit_open")
    async with http_worker(redis_client, key_prefix, concurrency=2):
        await run_due(node, clock)
        for job in healthy:  # the healthy target flows while the other fails
            await settled(api, node, job["jobId"], {"succeeded"})
        for job in down:
            await settled(api, node, job["jobId"], {"retry_wait"})
        async with db.connection() as conn:
            burned, deferred_first, deferred = await conn.fetchrow(
                "SELECT count(*) FILTER (WHERE a.attempt = 1 AND a.outcome = 'failed'), "
                "count(*) FILTER (WHERE a.attempt = 1 AND a.outcome = 'deferred'), "
                "count(*) FILTER (WHERE a.outcome = 'deferred') "
                "FROM execution_attempts a JOIN executions e USING (execution_id) "
                "WHERE e.job_id = ANY($1::uuid[])", [j["jobId"] for j in down])
        # 3 failures open it; at most the worker's 2 slots were already on their way. Every
        # other job's first attempt was deferred instead (and any attempt since, failed
        # ones' retries included, deferred too, each time a cool-down ran out).
        assert 3 <= burned <= 5
        assert deferred_first == 10 - burned
        some = await execution_of(api, down[-1]["jobId"])
        if some["attempts"][-1]["outcome"] == "deferred":
            assert some["error"]["class"] == "circuit_open"
            assert f"circuit open for http://127.0.0.1:{down_port}" in some["error"]["message"]

        # Deferred over and over while it stays down: only the probes use attempts.
        for _ in range(4):
            await asyncio.sleep(0.4)  # the breaker's real cool-down (0.3 s, 1 s at most)
            await run_due(node, clock, 4)
        await node.settle_events()
        async with db.connection() as conn:
            errors = await conn.fetch(
                "SELECT a.error FROM execution_attempts a JOIN executions e USING "
                "(execution_id) WHERE e.job_id = ANY($1::uuid[]) AND a.outcome = 'failed'",
                [j["jobId"] for j in down])
        probes = [e for e in errors if json.loads(e["error"]).get("probe")]
        assert probes and len(errors) == burned + len(probes)
        # The metrics say so: the target's breaker open (2), its deferrals counted.
        assert metric("herdwick_http_breaker_state", target=down_label) == 2
        assert metric("herdwick_http_breakers", state="open") >= 1
        assert metric("herdwick_http_deliveries_total", outcome="circuit_open") \
            - deferred_before >= deferred
        # The receiver comes back: the probe closes the breaker and everything is delivered.
        async with serving(Receiver(), down_port) as back:
            for _ in range(20):
                await asyncio.sleep(0.3)
                await run_due(node, clock, 4)
                await node.settle_events()
                if len(back.got) >= 10:
                    break
            finals = [await settled(api, node, j["jobId"], {"succeeded"}) for j in down]
        assert metric("herdwick_http_breaker_state", target=down_label) == 0
    assert all(f["state"] == "succeeded" for f in finals)
    deferred_attempts = sum(a["outcome"] == "deferred" for f in finals for a in f["attempts"])
    assert deferred_attempts >= 10 - burned


def metric(name: str, **labels) -> float:
    """A sample of this process's metrics, as a scrape would read it (0 when absent)."""
    for family in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0


class Rebinding(AbstractResolver):
    """A DNS server that answers each name as `answers` says, in turn (the last repeats)."""

    def __init__(self, answers: dict[str, list[str]]) -> None:
        self.answers = answers
        self.asked: list[str] = []

    async def resolve(self, host: str, port: int = 0, family=socket.AF_INET):
        self.asked.append(host)
        queue = self.answers[host]
        address = queue.pop(0) if len(queue) > 1 else queue[0]
        return [{"hostname": host, "host": address, "port": port, "family": socket.AF_INET,
                 "proto": 0, "flags": socket.AI_NUMERICHOST}]

    async def close(self) -> None:
        pass


async def test_delivery_refuses_a_name_that_resolves_to_a_private_address(
        api, schedulers, receiver, redis_client, key_prefix, clock) -> None:
    # The gateway cannot resolve this name (accepted: checked again at delivery); at
    # delivery it resolves to loopback, which this worker does not allow.
    url = f"http://hook.rebind.invalid:{receiver.port}/hook"
    job = await submit(api, **http_job(url))
    node = await schedulers()
    resolver = Rebinding({"hook.rebind.invalid": ["127.0.0.1"]})
    async with http_worker(redis_client, key_prefix, allow=(), resolver=resolver):
        await run_due(node, clock)
        dead = await settled(api, node, job["jobId"], {"dead"})
    assert receiver.got == []
    assert dead["error"]["class"] == "target_refused"
    assert "127.0.0.1" in dead["error"]["message"]


async def test_delivery_reaches_a_local_name_when_the_allow_list_covers_it(
        api, schedulers, receiver, redis_client, key_prefix, clock) -> None:
    url = f"http://hook.rebind.invalid:{receiver.port}/hook"
    job = await submit(api, **http_job(url))
    node = await schedulers()
    resolver = Rebinding({"hook.rebind.invalid": ["127.0.0.1"]})
    async with http_worker(redis_client, key_prefix, resolver=resolver):
        await run_due(node, clock)
        await settled(api, node, job["jobId"], {"succeeded"})
    assert len(receiver.got) == 1


async def test_delivery_refuses_a_literal_loopback_address_without_the_allow_list(
        api, schedulers, receiver, redis_client, key_prefix, clock) -> None:
    job = await submit(api, **http_job(receiver.url))  # the gateway allows it; the worker not
    node = await schedulers()
    async with http_worker(redis_client, key_prefix, allow=()):
        await run_due(node, clock)
        dead = await settled(api, node, job["jobId"], {"dead"})
    assert receiver.got == []
    assert dead["error"]["class"] == "target_refused"


async def test_a_killed_http_worker_s_delivery_is_retried_with_the_same_idempotency_key(
        api, schedulers, receiver, redis_client, key_prefix, clock, services) -> None:
    import os
    import signal
    import sys
    from pathlib import Path

    from herdwick.storage import keys

    receiver.hang = asyncio.Event()  # the first delivery is in flight when the process dies
    job = await submit(api, **http_job(receiver.url))
    node = await schedulers()
    herdwick_cmd = Path(sys.executable).parent / "herdwick"
    env = {**os.environ, "HERDWICK_REDIS_URL": services.redis_url,
           "HERDWICK_KEY_PREFIX": key_prefix, "HERDWICK_HTTP_ALLOW": "127.0.0.0/8"}
    proc = await asyncio.create_subprocess_exec(str(herdwick_cmd), "http-worker", env=env,
                                                stderr=asyncio.subprocess.DEVNULL)
    try:
        await run_due(node, clock)
        first = (await receiver.wait_for(1, within_s=20))[0]
        await settled(api, node, job["jobId"], {"running"})
    finally:
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
    receiver.hang.set()
    receiver.hang = None

    # Its lease lapses (moved on, as time does) and the reaper counts the attempt as failed.
    eid = first.headers["Herdwick-Execution-Id"]
    await redis_client.hset(keys.hot_state(key_prefix, "http", eid), "lease_until", 1)
    await redis_client.zadd(keys.leases_zset(key_prefix, "http"), {eid: 1})
    assert await node.reaper.run_once() == 1
    await settled(api, node, job["jobId"], {"retry_wait"})
    async with http_worker(redis_client, key_prefix):
        await run_due(node, clock, 3)
        second = (await receiver.wait_for(2))[1]
        done = await settled(api, node, job["jobId"], {"succeeded"})
    assert second.headers["Idempotency-Key"] == first.headers["Idempotency-Key"]
    assert second.headers["Herdwick-Attempt"] == "2"
    assert [a["outcome"] for a in done["attempts"]] == ["expired", "succeeded"]


async def test_a_slow_target_s_surplus_is_deferred_so_it_cannot_hold_every_slot(
        api, schedulers, redis_client, key_prefix, clock) -> None:
    class Slow(Receiver):
        async def handle(self, request: web.Request) -> web.StreamResponse:
            await asyncio.sleep(0.3)
            return await super().handle(request)

    async with serving(Slow()) as slow:
        first = await submit(api, **http_job(slow.url, name="first"))
        node = await schedulers()
        # One request at a time to it, 8 slots: once it is known to take 0.3 s a request,
        # more than 3 waiting for it would wait over a second.
        async with http_worker(redis_client, key_prefix, concurrency=8, target_concurrency=1):
            await run_due(node, clock)
            await settled(api, node, first["jobId"], {"succeeded"})
            jobs = [await submit(api, **http_job(slow.url, name=f"slow-{i}")) for i in range(8)]
            await run_due(node, clock)
            seen: list[dict] = []
            for _ in range(40):
                await node.settle_events()
                seen = [await execution_of(api, j["jobId"]) for j in jobs]
                if any(a["outcome"] == "deferred" for e in seen for a in e["attempts"]):
                    break
                await asyncio.sleep(0.1)
    deferred = [e for e in seen if any(a["outcome"] == "deferred" for a in e["attempts"])]
    assert deferred, seen
    assert all(e["error"]["class"] == "target_busy" for e in deferred
               if e["state"] == "retry_wait")


async def test_without_the_tenant_s_secret_in_redis_deliveries_wait_for_the_sync(
        api, schedulers, receiver, redis_client, key_prefix, clock) -> None:
    from herdwick.actors.base import sync
    from herdwick.actors.maintenance import SyncSigning
    from herdwick.storage import keys

    await redis_client.delete(keys.signing_hash(key_prefix))  # Redis lost it, say
    job = await submit(api, **http_job(receiver.url))
    node = await schedulers()
    await redis_client.delete(keys.signing_hash(key_prefix))  # and the start's sync too
    async with http_worker(redis_client, key_prefix):
        await run_due(node, clock)
        waiting = await settled(api, node, job["jobId"], {"retry_wait"})
        assert waiting["error"]["class"] == "secret_missing"
        assert waiting["attempts"][0]["outcome"] == "deferred"
        assert receiver.got == []  # nothing goes out unsigned
        await node.maintenance.send(SyncSigning())
        await sync(node.maintenance)
        await run_due(node, clock, 10)  # past the deferral
        done = await settled(api, node, job["jobId"], {"succeeded"})
    assert done["attempt"] == 2
    assert len(receiver.got) == 1


async def test_an_entry_without_a_url_is_deferred_to_come_back_with_one(
        redis_client, key_prefix) -> None:
    import uuid

    import msgspec

    from herdwick.storage import keys
    from herdwick.storage.hot import HotTier, ReadyExecution

    hot = HotTier(redis_client, key_prefix)
    await hot.load_functions()
    await hot.ensure_group("http")
    # As a scheduler of library 12 published it: no `target` field.
    execution = ReadyExecution(execution_id=str(uuid.uuid4()), attempt=1,
                               job_id=str(uuid.uuid4()), tenant_id=str(uuid.uuid4()),
                               scheduled_for="2026-12-04T00:00:00Z", payload="{}",
                               timeout_seconds=30, max_attempts=1)
    assert await hot.publish({"http": [execution]}) == 1
    events = keys.events_stream(key_prefix, "http")
    async with http_worker(redis_client, key_prefix):
        failed = None
        for _ in range(100):
            for _, fields in await redis_client.xrange(events):
                got = msgspec.json.decode(fields[b"e"])
                failed = next((e for e in (got if isinstance(got, list) else [got])
                               if e["type"] == "failed"), failed)
            if failed:
                break
            await asyncio.sleep(0.05)
    assert failed is not None
    assert (failed["outcome"], failed["deferred"]) == ("retry", "1")  # not dead at attempt 1
    assert json.loads(failed["error"])["class"] == "target_missing"
