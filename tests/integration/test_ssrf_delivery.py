"""Delivery through the guard: a real aiohttp client against a real server on 127.0.0.1.

The client is set up as delivery sets it up: TCPConnector(resolver=GuardedResolver)
for names, and the url_guard middleware for literal addresses and redirects.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web
from aiohttp.abc import AbstractResolver
from aiohttp.test_utils import TestServer

from herdwick import ssrf

LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"),)
HOOK = "hooks.example"  # a name only the injected resolver knows


class Hosts(AbstractResolver):
    """A DNS server of one name, that answers 127.0.0.1; it counts its questions."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    async def resolve(self, host: str, port: int = 0, family=socket.AF_INET):
        self.asked.append(host)
        if host != HOOK:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [{"hostname": host, "host": "127.0.0.1", "port": port,
                 "family": socket.AF_INET, "proto": 0, "flags": socket.AI_NUMERICHOST}]

    async def close(self) -> None:
        pass


@pytest.fixture
async def hook() -> AsyncIterator[tuple[TestServer, list[bytes]]]:
    """A local webhook receiver; /moved redirects to ::1 (a literal the resolver never sees)."""
    received: list[bytes] = []

    async def deliver(request: web.Request) -> web.Response:
        received.append(await request.read())
        return web.Response(status=204)

    async def moved(request: web.Request) -> web.Response:
        raise web.HTTPTemporaryRedirect(f"http://[::1]:{request.url.port}/hook")

    app = web.Application()
    app.router.add_post("/hook", deliver)
    app.router.add_post("/moved", moved)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield server, received
    finally:
        await server.close()


@asynccontextmanager
async def delivery(allow, base: AbstractResolver | None = None,
                   guard: bool = True) -> AsyncIterator[aiohttp.ClientSession]:
    resolver = ssrf.GuardedResolver(allow, base=base)
    connector = aiohttp.TCPConnector(resolver=resolver)
    middlewares = (ssrf.url_guard(allow),) if guard else ()
    try:
        async with aiohttp.ClientSession(connector=connector, middlewares=middlewares) as s:
            yield s
    finally:
        await resolver.close()


async def test_a_name_resolving_to_loopback_is_refused_and_nothing_is_sent(hook) -> None:
    server, received = hook
    hosts = Hosts()
    async with delivery((), base=hosts) as session:
        with pytest.raises(ssrf.TargetRefused) as caught:
            await session.post(f"http://{HOOK}:{server.port}/hook", json={"n": 1})
    assert "hooks.example resolves to 127.0.0.1, a loopback address" in str(caught.value)
    assert "refused" in str(caught.value)
    assert hosts.asked == [HOOK]
    assert received == []


async def test_the_allow_list_lets_the_same_name_through(hook) -> None:
    server, received = hook
    async with delivery(LOOPBACK, base=Hosts()) as session:
        async with session.post(f"http://{HOOK}:{server.port}/hook", data=b"{}") as resp:
            assert resp.status == 204
    assert received == [b"{}"]


async def test_aiohttp_skips_the_resolver_for_a_literal_so_url_guard_checks_it(hook) -> None:
    server, received = hook
    hosts = Hosts()
    async with delivery((), base=hosts, guard=False) as session:
        async with session.post(f"http://127.0.0.1:{server.port}/hook", data=b"a") as resp:
            assert resp.status == 204  # what url_guard is for
    assert hosts.asked == [] and received == [b"a"]
    async with delivery((), base=hosts) as session:
        with pytest.raises(ssrf.TargetRefused, match=re.escape("127.0.0.1 is a loopback address")):
            await session.post(f"http://127.0.0.1:{server.port}/hook", data=b"b")
    assert received == [b"a"]


@pytest.mark.parametrize("host", ["0x7f.0.0.1", "0x7f.1", "2130706433", "127.1"])
async def test_numeric_spellings_never_reach_the_server(hook, host) -> None:
    server, received = hook
    # Without url_guard, aiohttp (3.14.5) refuses the decimal forms itself
    # (InvalidUrlClientError) and hands hex ones to the resolver, whose getaddrinfo
    # reads them as 127.0.0.1: GuardedResolver refuses that.
    async with delivery((), guard=False) as session:
        with pytest.raises((ssrf.TargetRefused, aiohttp.InvalidUrlClientError)):
            await session.post(f"http://{host}:{server.port}/hook", data=b"x")
    async with delivery((), guard=True) as session:
        with pytest.raises(ssrf.TargetRefused, match=re.escape("127.0.0.1 is a loopback address")):
            await session.post(f"http://{host}:{server.port}/hook", data=b"x")
    assert received == []


async def test_a_redirect_to_a_refused_literal_is_refused(hook) -> None:
    server, received = hook
    allow = (ipaddress.ip_network("127.0.0.1/32"),)  # the receiver, not ::1
    async with delivery(allow, base=Hosts()) as session:
        with pytest.raises(ssrf.TargetRefused, match="::1 is a loopback address"):
            await session.post(f"http://{HOOK}:{server.port}/moved", data=b"x")
    assert received == []
