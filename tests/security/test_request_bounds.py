"""Request bodies are bounded before they are read, and slow clients are cut off.

Against the gateway as `herdwick api` serves it (gateway/app.py serve(), on a real
port), over raw sockets, so that what the client sends, and when, is the test's: a
Content-Length past the cap is refused before any body byte is sent, a chunked body
is cut off at the cap, and a request head or body trickled a byte at a time meets
the timeouts (shortened here, so the test takes seconds, not minutes).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import pytest

from herdwick.config import Settings
from herdwick.gateway import app as gateway_app
from herdwick.gateway import body
from herdwick.gateway.jobs import BATCH_BODY_CAP, SINGLE_BODY_CAP
from herdwick.gateway.ui import FORM_MAX_BYTES
from tests.integration.conftest import make_job, tenant_api
from tests.integration.gateway_client import ADMIN_TOKEN

SHORT_S = 1.0  # the timeouts while these tests run
CONNECTION_CLOSED_WITHIN_S = 5.0


@pytest.fixture
async def server(db_url, services, key_prefix, clock, unused_tcp_port, monkeypatch):
    """(port, a tenant's API key): serve() on a port of its own, over the test's database."""
    monkeypatch.setattr(gateway_app, "KEEPALIVE_TIMEOUT_S", SHORT_S)
    monkeypatch.setattr(body, "BODY_READ_TIMEOUT_S", SHORT_S)
    async with tenant_api(db_url, services.redis_url, key_prefix, clock) as api:
        settings = Settings(database_url=db_url, redis_url=services.redis_url,
                            key_prefix=key_prefix, admin_token=ADMIN_TOKEN)
        stop = asyncio.Event()
        task = asyncio.create_task(gateway_app.serve(
            gateway_app.create_app(settings, clock=clock), "127.0.0.1", unused_tcp_port, stop))
        for _ in range(200):  # until it accepts
            with contextlib.suppress(OSError):
                async with connect(unused_tcp_port):
                    break
            await asyncio.sleep(0.02)
        try:
            yield unused_tcp_port, api.key
        finally:
            stop.set()
            await task


@contextlib.asynccontextmanager
async def connect(port: int):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


def head(path: str, key: str, *lines: str, method: str = "POST") -> bytes:
    return "\r\n".join([f"{method} {path} HTTP/1.1", "Host: herdwick", f"Authorization: Bearer "
                        f"{key}", "Content-Type: application/json", *lines, "", ""]).encode()


async def answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    status_line = await reader.readline()
    status = int(status_line.split()[1])
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    content = await reader.readexactly(int(headers.get("content-length", 0)))
    return status, headers, content


async def closed(reader: asyncio.StreamReader) -> bool:
    """Whether the server closes the connection (EOF) within CONNECTION_CLOSED_WITHIN_S."""
    try:
        async with asyncio.timeout(CONNECTION_CLOSED_WITHIN_S):
            while await reader.read(65536):
                pass
            return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


async def job_count(db) -> int:
    async with db.connection() as conn:
        return await conn.fetchval("SELECT count(*) FROM jobs")


async def test_a_content_length_past_the_cap_is_refused_before_the_body_is_sent(
        server, db) -> None:
    port, key = server
    for path, cap in (("/v1/jobs", SINGLE_BODY_CAP), ("/v1/jobs:batch", BATCH_BODY_CAP),
                      ("/v1/tenants", 16 * 1024)):
        auth = key if path != "/v1/tenants" else ADMIN_TOKEN
        async with connect(port) as (reader, writer):
            writer.write(head(path, auth, f"Content-Length: {cap + 1}"))
            await writer.drain()  # and not one byte of the body
            async with asyncio.timeout(5):
                status, headers, content = await answer(reader)
        assert status == 413, content
        assert headers["content-type"].startswith("application/problem+json")
        assert json.loads(content)["type"].endswith("/payload-too-large")
    assert await job_count(db) == 0


async def test_a_chunked_body_past_the_cap_is_cut_off_at_the_cap(server, db) -> None:
    port, key = server
    chunk = b"[" + b" " * (64 * 1024 - 1)
    sent = 0
    got = None
    async with connect(port) as (reader, writer):
        writer.write(head("/v1/jobs", key, "Transfer-Encoding: chunked"))
        async with asyncio.timeout(30):
            while got is None and sent < 20 * SINGLE_BODY_CAP:
                with contextlib.suppress(ConnectionError):
                    writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    await writer.drain()
                sent += len(chunk)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.001 if sent <= SINGLE_BODY_CAP else 0.05):
                        got = await answer(reader)
    assert got is not None, f"no answer after {sent} bytes"
    status, _, content = got
    assert status == 413, content
    # Cut off at the cap: within a few chunks of it, not at the end of what was offered.
    assert sent < 2 * SINGLE_BODY_CAP, sent
    assert await job_count(db) == 0


async def test_a_request_head_trickled_byte_by_byte_is_cut_off(server) -> None:
    port, key = server
    trickled = head("/v1/jobs", key, "X-Padding: " + "p" * 200)
    cut_off = False
    started = time.monotonic()
    async with connect(port) as (reader, writer):
        for byte in trickled:  # a byte every 50 ms: the head would take over 10 s
            try:
                writer.write(bytes([byte]))
                await writer.drain()
                async with asyncio.timeout(0.05):
                    if await reader.read(1) == b"":
                        cut_off = True
                        break
            except TimeoutError:
                continue
            except ConnectionError:
                cut_off = True
                break
    took_s = time.monotonic() - started
    assert cut_off, "the server waited out a head trickled over 10 s"
    assert took_s < SHORT_S + CONNECTION_CLOSED_WITHIN_S


async def test_a_body_trickled_byte_by_byte_is_408_and_closes(server, db) -> None:
    port, key = server
    payload = json.dumps(make_job()).encode()
    got = None
    started = time.monotonic()
    async with connect(port) as (reader, writer):
        writer.write(head("/v1/jobs", key, f"Content-Length: {len(payload)}"))
        for byte in payload[:-1]:  # never the last byte: the body cannot complete in time
            writer.write(bytes([byte]))
            await writer.drain()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.05):
                    got = await answer(reader)
                    break
        assert got is not None, "the server waited out a body trickled byte by byte"
        status, headers, content = got
        assert status == 408, content
        assert headers["content-type"].startswith("application/problem+json")
        assert json.loads(content)["type"].endswith("/request-timeout")
        assert time.monotonic() - started < SHORT_S + 2
        assert await closed(reader)  # after the lingering time (LINGERING_TIME_S)
    assert await job_count(db) == 0


async def test_a_dashboard_form_past_its_cap_is_refused(server) -> None:
    port, _ = server
    form = b"token=" + b"x" * (FORM_MAX_BYTES * 4)
    for framing, sent in ((f"Content-Length: {len(form)}", form),
                          ("Transfer-Encoding: chunked",
                           b"%x\r\n%s\r\n0\r\n\r\n" % (len(form), form))):
        async with connect(port) as (reader, writer):
            writer.write("\r\n".join(["POST /ui/login HTTP/1.1", "Host: herdwick",
                                      "Content-Type: application/x-www-form-urlencoded",
                                      framing, "", ""]).encode() + sent)
            await writer.drain()
            async with asyncio.timeout(5):
                status, _, content = await answer(reader)
        assert status == 413, (framing, content[:300])


def test_the_production_server_sets_the_slow_client_timeouts() -> None:
    # The shipped values: an hour (aiohttp's default) would hold a trickling client's
    # connection an hour; the body deadline did not exist before issue 13.
    assert 10 <= gateway_app.KEEPALIVE_TIMEOUT_S <= 120
    assert 5 <= body.BODY_READ_TIMEOUT_S <= 60
    assert gateway_app.LINGERING_TIME_S <= 5
    runner = gateway_app.app_runner(gateway_app.web.Application())
    assert runner._kwargs["keepalive_timeout"] == gateway_app.KEEPALIVE_TIMEOUT_S
    assert runner._kwargs["lingering_time"] == gateway_app.LINGERING_TIME_S
