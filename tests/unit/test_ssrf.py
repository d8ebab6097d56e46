"""The SSRF guard: every spelling of a refused address is refused, and an allow list lets it by."""

from __future__ import annotations

import ipaddress
import re
import socket

import pytest
from aiohttp.abc import AbstractResolver

from herdwick import ssrf

LOOPBACK_ONLY = (ipaddress.ip_network("127.0.0.0/8"),)

# (host as a URL spells it, the address it spells)
SPELLINGS = [
    ("127.0.0.1", "127.0.0.1"),
    ("2130706433", "127.0.0.1"),  # one decimal number
    ("0x7f000001", "127.0.0.1"),  # one hex number
    ("0X7F000001", "127.0.0.1"),
    ("017700000001", "127.0.0.1"),  # one octal number
    ("0177.0.0.1", "127.0.0.1"),  # octal parts
    ("0x7f.0.0.1", "127.0.0.1"),  # hex parts
    ("0x7f.0x0.0x0.0x1", "127.0.0.1"),
    ("127.1", "127.0.0.1"),  # short: the last part fills the rest
    ("127.0.1", "127.0.0.1"),
    ("0x7f.1", "127.0.0.1"),  # short and mixed
    ("0177.0x0.1", "127.0.0.1"),
    ("00000000177.0.0.1", "127.0.0.1"),
    ("127.0.0.01", "127.0.0.1"),
    ("127.0.0.1.", "127.0.0.1"),  # the root's empty label
    ("１２７.０.０.１", "127.0.0.1"),  # full-width, as IDNA maps it
    ("127%2E0%2E0%2E1", "127.0.0.1"),  # percent-encoded dots, as a browser decodes them
    ("0", "0.0.0.0"),
    ("0.0.0.0", "0.0.0.0"),
    ("0xffffffff", "255.255.255.255"),
    ("1.16777215", "1.255.255.255"),
    ("10.1.2.3", "10.1.2.3"),
    ("[::1]", "::1"),
    ("::1", "::1"),
    ("[::]", "::"),
    ("[::ffff:127.0.0.1]", "::ffff:7f00:1"),
    ("[::ffff:7f00:1]", "::ffff:7f00:1"),
    ("[FE80::1%25eth0]", "fe80::1%eth0"),
    ("fe80::1%eth0", "fe80::1%eth0"),
    ("[2606:4700::1111]", "2606:4700::1111"),
]

# Hosts that are names, however much they look like numbers.
NAMES = ["example.com", "1e100.net", "0x.example", "0xdead.com", "deadbeef.example",
         "1.2.3.4.example", "0x7f.1.example", "localhost", "metadata.google.internal",
         "08.0.0.1", "1.2.3.256", "4294967296", "0x100000000", "1.16777216", "1..1",
         "+127.0.0.1", "0x7f.-0.0.1", "1_0.0.0.1", "9" * 5000, ""]

# (host, what the refusal says it is); each is allowed when the allow list holds it
REFUSED = [
    ("127.0.0.1", "127.0.0.1 is a loopback address"),
    ("2130706433", "127.0.0.1 is a loopback address"),
    ("0x7f.1", "127.0.0.1 is a loopback address"),
    ("0177.0.0.1", "127.0.0.1 is a loopback address"),
    ("0.0.0.0", "0.0.0.0 is the unspecified address"),
    ("0.1.2.3", "a 'this network' address"),
    ("10.1.2.3", "10.1.2.3 is a private address"),
    ("172.16.0.1", "a private address"),
    ("192.168.1.1", "a private address"),
    ("100.64.0.1", "100.64.0.1 is a shared (carrier-grade NAT) address"),
    ("169.254.1.1", "a link-local address"),
    ("169.254.169.254", "169.254.169.254 is a cloud metadata address"),
    ("169.254.170.2", "a cloud metadata address"),
    ("100.100.100.200", "a cloud metadata address"),
    ("168.63.129.16", "a cloud metadata address"),  # Azure's: public, refused all the same
    ("192.0.0.192", "a cloud metadata address"),
    ("192.0.2.1", "a documentation address"),
    ("198.18.0.1", "a benchmarking address"),
    ("224.0.0.1", "224.0.0.1 is a multicast address"),
    ("239.255.255.250", "a multicast address"),
    ("240.0.0.1", "a reserved address"),
    ("255.255.255.255", "the broadcast address"),
    ("[::1]", "::1 is a loopback address"),
    ("[::]", ":: is the unspecified address"),
    ("[fe80::1%25eth0]", "fe80::1%eth0 is a link-local address"),
    ("[fc00::1]", "a private (unique local) address"),
    ("[fd00:ec2::254]", "fd00:ec2::254 is a cloud metadata address"),
    ("[ff02::1]", "a multicast address"),
    ("[2001:db8::1]", "a documentation address"),
    ("[64:ff9b:1::1]", "a local-use NAT64 address"),
    ("[::ffff:127.0.0.1]", "::ffff:7f00:1 carries 127.0.0.1, a loopback address"),
    ("[::ffff:169.254.169.254]", "carries 169.254.169.254, a cloud metadata address"),
    ("[::127.0.0.1]", "::7f00:1 carries 127.0.0.1, a loopback address"),  # IPv4-compatible
    ("[64:ff9b::10.0.0.1]", "64:ff9b::a00:1 carries 10.0.0.1, a private address"),  # NAT64
    ("[2002:7f00:1::1]", "2002:7f00:1::1 carries 127.0.0.1, a loopback address"),  # 6to4
    ("[2002:a9fe:a9fe::]", "carries 169.254.169.254, a cloud metadata address"),
    ("[::ffff:0:7f00:1]", "a reserved address"),  # IPv4-translated
]

PUBLIC = ["8.8.8.8", "1.1.1.1", "93.184.215.14", "[2606:4700::1111]",
          "[::ffff:8.8.8.8]", "[64:ff9b::8.8.8.8]", "[2002:808:808::1]"]


@pytest.mark.parametrize(("host", "address"), SPELLINGS, ids=[s[0] for s in SPELLINGS])
def test_every_spelling_is_read_as_the_address_it_spells(host, address) -> None:
    assert ssrf.parse_host(host) == ipaddress.ip_address(address)


@pytest.mark.parametrize("host", NAMES, ids=[n[:20] for n in NAMES])
def test_a_name_is_not_read_as_a_number(host) -> None:
    assert ssrf.parse_host(host) is None


@pytest.mark.parametrize(("host", "why"), REFUSED, ids=[r[0] for r in REFUSED])
def test_a_refused_address_is_refused_in_every_form_unless_allowed(host, why) -> None:
    address = ssrf.parse_host(host)
    assert address is not None
    refused = ssrf.refusal(address, ())
    assert refused is not None and why in refused
    with pytest.raises(ssrf.TargetRefused, match="refused") as caught:
        ssrf.check_url(f"http://{host}:8080/hook", ())
    assert why in caught.value.reason
    assert caught.value.address == address

    carried = ipaddress.ip_address(why.split("carries ")[1].split(",")[0]) \
        if "carries" in why else address
    allow = (ipaddress.ip_network(carried),)
    assert ssrf.refusal(address, allow) is None
    ssrf.check_url(f"http://{host}:8080/hook", allow)


@pytest.mark.parametrize("host", PUBLIC)
def test_a_public_address_is_allowed(host) -> None:
    address = ssrf.parse_host(host)
    assert address is not None and ssrf.refusal(address, ()) is None
    ssrf.check_url(f"https://{host}/hook", ())


@pytest.mark.parametrize("url", [
    "http://localhost/", "http://LOCALHOST./", "http://api.localhost:8080/",
    "http://localhost.localdomain/"])
def test_localhost_is_loopback_whatever_dns_says(url) -> None:
    with pytest.raises(ssrf.TargetRefused, match="loopback"):
        ssrf.check_url(url, ())
    ssrf.check_url(url, LOOPBACK_ONLY)


@pytest.mark.parametrize(("url", "why"), [
    ("ftp://example.com/", "http:// or https://"),
    ("file:///etc/passwd", "http:// or https://"),
    ("http:///x", "needs a host"),
    ("http://08.0.0.1/", "ends in a number"),  # a browser refuses it; so do we
    ("http://1.2.3.256/", "ends in a number"),
    ("http://example.0x10/", "ends in a number"),
])
def test_urls_that_are_no_target(url, why) -> None:
    with pytest.raises(ssrf.TargetRefused, match=why):
        ssrf.check_url(url, LOOPBACK_ONLY)


def test_a_url_is_read_as_aiohttp_reads_it() -> None:
    # urllib keeps full-width digits in the host; yarl, which aiohttp connects with,
    # folds them to 127.0.0.1 and would skip the resolver for it.
    with pytest.raises(ssrf.TargetRefused, match=re.escape("127.0.0.1 is a loopback address")):
        ssrf.check_url("http://１２７.0.0.1/", ())
    ssrf.check_url("https://1e100.net/", ())


def answers(*addresses: str):
    calls: list[str] = []

    async def resolve(host: str, port: int) -> list[str]:
        calls.append(host)
        return list(addresses)

    resolve.calls = calls  # type: ignore[attr-defined]
    return resolve


async def test_a_name_resolving_to_metadata_is_refused() -> None:
    resolve = answers("169.254.169.254")
    with pytest.raises(ssrf.TargetRefused) as caught:
        await ssrf.check_host("metadata.google.internal", 80, (), resolve=resolve)
    assert caught.value.reason == ("metadata.google.internal resolves to 169.254.169.254, "
                                   "a cloud metadata address")
    allow = (ipaddress.ip_network("169.254.169.254/32"),)
    assert await ssrf.check_host("metadata.google.internal", 80, allow,
                                 resolve=resolve) == ["169.254.169.254"]


async def test_one_refused_address_refuses_the_name() -> None:
    resolve = answers("93.184.215.14", "2606:4700::1111", "::ffff:10.0.0.1")
    with pytest.raises(ssrf.TargetRefused,
                       match=re.escape("which carries 10.0.0.1, a private address")):
        await ssrf.check_host("mixed.example", 443, (), resolve=resolve)


async def test_a_name_resolving_to_nothing_is_refused() -> None:
    with pytest.raises(ssrf.TargetRefused, match="resolves to no address"):
        await ssrf.check_host("empty.example", 443, (), resolve=answers())


async def test_a_literal_is_checked_without_a_lookup() -> None:
    resolve = answers("8.8.8.8")
    with pytest.raises(ssrf.TargetRefused, match="loopback"):
        await ssrf.check_host("0x7f.1", 80, (), resolve=resolve)
    assert await ssrf.check_host("[2606:4700::1111]", 80, (), resolve=resolve) == [
        "2606:4700::1111"]
    assert resolve.calls == []  # type: ignore[attr-defined]


async def test_a_name_that_does_not_resolve_raises_what_the_resolver_raised() -> None:
    async def nxdomain(host: str, port: int) -> list[str]:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    with pytest.raises(socket.gaierror):
        await ssrf.check_host("nowhere.invalid", 80, (), resolve=nxdomain)


class Rebinding(AbstractResolver):
    """A DNS server that answers a public address once, then loopback."""

    def __init__(self) -> None:
        self.answers = ["93.184.215.14", "127.0.0.1"]

    async def resolve(self, host: str, port: int = 0, family=socket.AF_INET):
        address = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        return [{"hostname": host, "host": address, "port": port, "family": socket.AF_INET,
                 "proto": 0, "flags": socket.AI_NUMERICHOST}]

    async def close(self) -> None:
        pass


async def test_a_rebinding_name_is_refused_the_second_time() -> None:
    resolver = ssrf.GuardedResolver((), base=Rebinding())
    [first] = await resolver.resolve("rebind.example", 443)
    assert first["host"] == "93.184.215.14"
    with pytest.raises(ssrf.TargetRefused,
                       match=re.escape("rebind.example resolves to 127.0.0.1, a loopback address")):
        await resolver.resolve("rebind.example", 443)
    await resolver.close()
