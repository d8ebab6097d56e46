"""The submit-time lookups: concurrent, bounded in time and number, remembered for a while."""

from __future__ import annotations

import asyncio
import socket
from datetime import UTC, datetime

from herdwick.clock import ManualClock
from herdwick.gateway.target_dns import CACHE_TTL_S, TargetDns, target_name

T0 = datetime(2026, 12, 2, 12, 0, 0, tzinfo=UTC)


class Dns:
    """Answers from a table; a name in `held` waits until released."""

    def __init__(self, **table: str) -> None:
        self.table = {f"{k}.example": v for k, v in table.items()}
        self.asked: list[str] = []
        self.held: dict[str, asyncio.Event] = {}

    async def __call__(self, host: str, port: int) -> list[str]:
        self.asked.append(host)
        if host in self.held:
            await self.held[host].wait()
        if host not in self.table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [self.table[host]]


def test_target_name_is_the_name_aiohttp_resolves() -> None:
    assert target_name("https://Hooks.Example:8443/x") == "hooks.example"
    assert target_name("https://bücher.example/") == "xn--bcher-kva.example"
    assert target_name("http://127.0.0.1/") is None
    assert target_name("http://[::1]/") is None
    assert target_name("http://0x7f.1/") is None


async def test_each_name_is_looked_up_once_and_remembered_for_the_ttl() -> None:
    clock, dns = ManualClock(T0), Dns(a="10.0.0.1", b="8.8.8.8")
    lookups = TargetDns((), clock, resolve=dns)
    refused = await lookups.refusals(["a.example", "b.example", "a.example", "c.example"])
    assert list(refused) == ["a.example"]
    assert "10.0.0.1, a private address" in refused["a.example"].reason
    assert sorted(dns.asked) == ["a.example", "b.example", "c.example"]

    assert list(await lookups.refusals(["a.example", "b.example"])) == ["a.example"]
    assert len(dns.asked) == 3  # remembered, refused and accepted alike
    await lookups.refusals(["c.example"])
    assert len(dns.asked) == 4  # a name that did not resolve is asked again

    clock.advance(CACHE_TTL_S + 1)
    await lookups.refusals(["a.example"])
    assert len(dns.asked) == 5
    await lookups.close()


async def test_a_slow_name_is_accepted_and_its_answer_lands_later() -> None:
    clock, dns = ManualClock(T0), Dns(slow="10.0.0.1")
    dns.held["slow.example"] = asyncio.Event()
    lookups = TargetDns((), clock, resolve=dns, timeout_s=0.01)
    assert await lookups.refusals(["slow.example"]) == {}
    dns.held["slow.example"].set()
    # The next submit joins the lookup still in flight instead of starting another.
    refused = await lookups.refusals(["slow.example"])
    assert list(refused) == ["slow.example"] and dns.asked == ["slow.example"]
    await lookups.close()


async def test_lookups_in_flight_are_bounded() -> None:
    clock, dns = ManualClock(T0), Dns(held="8.8.8.8", other="10.0.0.1")
    dns.held["held.example"] = asyncio.Event()
    lookups = TargetDns((), clock, resolve=dns, timeout_s=0.01, max_lookups=1)
    assert await lookups.refusals(["held.example"]) == {}
    assert await lookups.refusals(["other.example"]) == {}  # left to delivery
    assert dns.asked == ["held.example"]
    await lookups.close()  # cancels the lookup still waiting


async def test_the_cache_is_bounded() -> None:
    clock, dns = ManualClock(T0), Dns(a="8.8.8.8", b="8.8.4.4", c="1.1.1.1")
    lookups = TargetDns((), clock, resolve=dns, max_names=2)
    for name in ("a.example", "b.example", "c.example", "c.example", "b.example"):
        await lookups.refusals([name])
    assert dns.asked == ["a.example", "b.example", "c.example"]
    await lookups.refusals(["a.example"])  # the oldest was dropped for c
    assert dns.asked[-1] == "a.example"
    await lookups.close()
