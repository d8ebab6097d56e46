"""Which addresses an http target may reach: one guard for submit and delivery.

A target is refused when its host is, or resolves to, an address that is not
globally routable (private, loopback, link-local, shared, reserved, ...), a
multicast address or a cloud metadata address, unless HERDWICK_HTTP_ALLOW
lists a network holding it. IPv6 forms that carry an IPv4 address (mapped,
compatible, NAT64, 6to4) are judged by the IPv4 address they carry, and every
spelling of IPv4 that inet_aton or a browser reads (`2130706433`, `0x7f.1`,
`0177.0.0.1`, `127.1`) is judged as the address it spells.

Delivery connects through `GuardedResolver`, which checks every address a name
resolves to and hands the connector only those: the connection goes to an
address that was checked, with no second lookup a DNS rebinding could answer
differently. aiohttp skips the resolver for literal addresses, so `check_url`
(or `url_guard`, on every request and redirect) checks those.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import unicodedata
import urllib.parse
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING

import yarl
from aiohttp.abc import AbstractResolver
from aiohttp.resolver import DefaultResolver

if TYPE_CHECKING:  # aiohttp 3.12 and later; the module imports without them
    from aiohttp import ClientHandlerType, ClientMiddlewareType, ClientRequest, ClientResponse
    from aiohttp.abc import ResolveResult

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
# (host, port) -> the addresses it resolves to, as text; OSError when it does not resolve.
Resolve = Callable[[str, int], Awaitable[list[str]]]

SCHEMES = ("http", "https")
LOCAL_NAMES = ("localhost", "localhost.localdomain")

_net = ipaddress.ip_network
# Named first, so a refusal says what the address is; the allow list still wins.
METADATA = frozenset(ipaddress.ip_address(a) for a in (
    "169.254.169.254",  # AWS, GCP, Azure, OpenStack, DigitalOcean, ... instance metadata
    "169.254.169.253",  # AWS DNS resolver
    "169.254.169.123",  # AWS time sync
    "169.254.170.2",  # AWS ECS task metadata and credentials
    "100.100.100.200",  # Alibaba Cloud
    "168.63.129.16",  # Azure wireserver: a public address, refused all the same
    "192.0.0.192",  # Oracle Cloud
    "fd00:ec2::254",  # AWS instance metadata over IPv6
    "fd00:ec2::23",  # AWS DNS over IPv6
    "fd20:ce::254",  # GCP instance metadata over IPv6
))
# What each special-purpose range is (IANA's registries), most specific first. Anything
# else Python's ipaddress counts as not global is refused too, as "not globally routable".
_KINDS: tuple[tuple[Network, str], ...] = (
    (_net("0.0.0.0/32"), "the unspecified address"),
    (_net("0.0.0.0/8"), "a 'this network' address"),
    (_net("127.0.0.0/8"), "a loopback address"),
    (_net("10.0.0.0/8"), "a private address"),
    (_net("172.16.0.0/12"), "a private address"),
    (_net("192.168.0.0/16"), "a private address"),
    (_net("100.64.0.0/10"), "a shared (carrier-grade NAT) address"),
    (_net("169.254.0.0/16"), "a link-local address"),
    (_net("192.0.0.0/24"), "an IETF protocol assignment"),
    (_net("192.0.2.0/24"), "a documentation address"),
    (_net("198.51.100.0/24"), "a documentation address"),
    (_net("203.0.113.0/24"), "a documentation address"),
    (_net("198.18.0.0/15"), "a benchmarking address"),
    (_net("192.88.99.0/24"), "a 6to4 relay anycast address"),
    (_net("224.0.0.0/4"), "a multicast address"),
    (_net("255.255.255.255/32"), "the broadcast address"),
    (_net("240.0.0.0/4"), "a reserved address"),
    (_net("::/128"), "the unspecified address"),
    (_net("::1/128"), "a loopback address"),
    (_net("fe80::/10"), "a link-local address"),
    (_net("fec0::/10"), "a site-local address"),
    (_net("fc00::/7"), "a private (unique local) address"),
    (_net("ff00::/8"), "a multicast address"),
    (_net("64:ff9b:1::/48"), "a local-use NAT64 address"),
    (_net("100::/64"), "a discard-only address"),
    (_net("2001::/32"), "a Teredo address"),
    (_net("2001:db8::/32"), "a documentation address"),
    (_net("3fff::/20"), "a documentation address"),
    (_net("2001::/23"), "an IETF protocol assignment"),
    (_net("::/8"), "a reserved address"),  # IPv4-translated ::ffff:0:a.b.c.d among them
)
_NAT64 = _net("64:ff9b::/96")
_LOOPBACK = ipaddress.IPv4Address("127.0.0.1")
_HEX = frozenset("0123456789abcdef")
_OCT = frozenset("01234567")
_DEC = frozenset("0123456789")


class TargetRefused(Exception):
    """An http target this herdwick must not reach; `reason` says why.

    `address` is the refused address when there is one: listing it (or a network
    holding it) in HERDWICK_HTTP_ALLOW would let the target through.
    """

    def __init__(self, reason: str, address: Address | None = None) -> None:
        super().__init__(f"http target refused: {reason}")
        self.reason = reason
        self.address = address


def parse_host(host: str) -> Address | None:
    """The address a URL's host spells, in any form inet_aton or a browser reads; None
    for a name. Takes the host with or without IPv6 brackets, zone ids as `%25` or `%`."""
    host = _folded(host)
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if ":" in host:
        try:
            return ipaddress.IPv6Address(host)
        except ValueError:
            return None
    return _ipv4(host)


def _folded(host: str) -> str:
    # What a browser does to a host before reading it: percent-decode it, then IDNA's
    # mapping, in which full-width digits and dots are digits and dots (yarl reads
    # http://１２７.0.0.1/ as 127.0.0.1 too).
    host = urllib.parse.unquote(host)
    return unicodedata.normalize("NFKC", host).replace("\u3002", ".").lower()


def _ipv4(host: str) -> ipaddress.IPv4Address | None:
    parts = _labels(host)
    if not 1 <= len(parts) <= 4:
        return None
    numbers = [_ipv4_number(p) for p in parts]
    if None in numbers:
        return None
    *head, last = numbers
    if any(n > 255 for n in head) or last >= 256 ** (5 - len(numbers)):
        return None
    value = last
    for i, n in enumerate(head):
        value += n << (8 * (3 - i))
    return ipaddress.IPv4Address(value)


def _labels(host: str) -> list[str]:
    parts = host.split(".")
    if len(parts) > 1 and parts[-1] == "":
        parts.pop()  # the root's empty label: "127.0.0.1." is 127.0.0.1 to a browser
    return parts


def _ipv4_number(part: str) -> int | None:
    # inet_aton's strtoul(base 0) and WHATWG's IPv4 number parser: 0x hex, a leading 0
    # octal, else decimal. The digits are checked here: int() would take "1_0" and " 1".
    if part[:2] == "0x":
        digits, base, allowed = part[2:], 16, _HEX
        if not digits:
            return 0  # WHATWG reads a bare "0x" as 0
    elif len(part) > 1 and part[0] == "0":
        digits, base, allowed = part[1:], 8, _OCT
    else:
        digits, base, allowed = part, 10, _DEC
    if not digits or not set(digits) <= allowed:
        return None
    if len(digits.lstrip("0")) > 12:
        return 1 << 32  # too big for any part, whatever the base; int() would balk at 5,000
    return int(digits, base)


def _ends_in_number(host: str) -> bool:
    # WHATWG's rule: a host whose last label is a number must be an IPv4 address, and a
    # browser refuses the URL otherwise. No real name ends in one (no TLD is numeric).
    last = _labels(_folded(host))[-1]
    return (last.isascii() and last.isdigit()) or _ipv4_number(last) is not None


def is_local_name(host: str) -> bool:
    """localhost and its subdomains, which RFC 6761 says are loopback whatever DNS says."""
    name = _folded(host).rstrip(".")
    return name in LOCAL_NAMES or name.endswith(".localhost")


def _carried_v4(address: Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 form carries: mapped, compatible, NAT64 or 6to4."""
    if isinstance(address, ipaddress.IPv4Address):
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    value = int(address)
    if address in _NAT64 or (value >> 32 == 0 and value > 1):  # :: and ::1 are their own
        return ipaddress.IPv4Address(value & 0xFFFFFFFF)
    return None


def _within(address: Address, allow: Iterable[Network]) -> bool:
    # ipaddress compares an IPv4 address with an IPv6 network by its integer alone.
    return any(address.version == net.version and address in net for net in allow)


def _kind(address: Address) -> str | None:
    """What makes an address unreachable for a target; None when it is public."""
    if address in METADATA:
        return "a cloud metadata address"
    for net, kind in _KINDS:
        if address.version == net.version and address in net:
            return kind
    if address.is_multicast:
        return "a multicast address"
    if not address.is_global:
        return "not a globally routable address"
    return None


def _judged(address: Address, allow: tuple[Network, ...]
            ) -> tuple[ipaddress.IPv4Address | None, str] | None:
    """(the IPv4 address it carries, what makes it unreachable), None when it may be
    reached."""
    carried = _carried_v4(address)
    if _within(address, allow) or (carried is not None and _within(carried, allow)):
        return None
    kind = _kind(address if carried is None else carried)
    return None if kind is None else (carried, kind)


def refusal(address: Address, allow: Iterable[Network]) -> str | None:
    """Why a target must not reach this address ("127.0.0.1 is a loopback address"), or
    None when it may: when a network of `allow` holds it (or the IPv4 address it
    carries), or when it is globally routable and not multicast."""
    judged = _judged(address, tuple(allow))
    return None if judged is None else _said(address, *judged)


def _said(address: Address, carried: ipaddress.IPv4Address | None, kind: str,
          name: str = "") -> str:
    if name:
        via = "" if carried is None else f", which carries {carried}"
        return f"{name} resolves to {address}{via}, {kind}"
    return f"{address} is {kind}" if carried is None else f"{address} carries {carried}, {kind}"


def _refuse_address(address: Address, allow: tuple[Network, ...], name: str = "") -> None:
    judged = _judged(address, allow)
    if judged is not None:
        raise TargetRefused(_said(address, *judged, name=name), address)


def check_literal(host: str, allow: Iterable[Network]) -> Address | None:
    """Refuse a host that spells a refused address, that looks like an address but is
    not one, or that is localhost (unless allowed). Returns the address it spells, None
    for a name: what a name resolves to is check_host's and GuardedResolver's to judge."""
    allow = tuple(allow)
    address = parse_host(host)
    if address is not None:
        _refuse_address(address, allow)
        return address
    if ":" in host:
        raise TargetRefused(f"{host} is not an IPv6 address")
    if _ends_in_number(host):
        raise TargetRefused(f"{host} ends in a number but is not an IPv4 address")
    if is_local_name(host) and refusal(_LOOPBACK, allow) is not None:
        raise TargetRefused(f"{host} is a loopback name: it always means {_LOOPBACK}",
                            _LOOPBACK)
    return None


def check_url(url: str, allow: Iterable[Network]) -> None:
    """Refuse a URL that is not http(s), has no host, or whose host is refused by
    check_literal, read both as urllib and as yarl (aiohttp's parser) read it."""
    try:
        parsed = yarl.URL(url)
        split = urllib.parse.urlsplit(url)
    except (ValueError, TypeError) as exc:
        raise TargetRefused(f"not a valid URL: {exc}") from None
    if parsed.scheme not in SCHEMES:
        raise TargetRefused("an http target must be an http:// or https:// URL")
    if not parsed.raw_host:
        raise TargetRefused("an http target needs a host")
    for host in {parsed.raw_host, split.hostname or ""} - {""}:
        check_literal(host, allow)


async def _getaddrinfo(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [info[4][0] for info in infos]


def check_addresses(host: str, addresses: Iterable[str], allow: Iterable[Network]) -> list[str]:
    """Refuse a name when any address it resolved to is refused, or when it resolved to
    none; returns them."""
    allow = tuple(allow)
    found = list(addresses)
    if not found:
        raise TargetRefused(f"{host} resolves to no address")
    for text in found:
        try:
            address = ipaddress.ip_address(text)
        except ValueError:
            raise TargetRefused(f"{host} resolves to {text!r}, not an address") from None
        _refuse_address(address, allow, host)
    return found


async def check_host(host: str, port: int, allow: Iterable[Network], *,
                     resolve: Resolve | None = None) -> list[str]:
    """The addresses a host is or resolves to, once every one of them has passed `refusal`:
    one refused address refuses the host (TargetRefused). A name that does not resolve
    raises what the resolver raised (OSError, TimeoutError)."""
    allow = tuple(allow)
    address = check_literal(host, allow)
    if address is not None:
        return [str(address)]
    return check_addresses(host, await (resolve or _getaddrinfo)(host, port), allow)


class GuardedResolver(AbstractResolver):
    """An aiohttp resolver that answers only with addresses `refusal` passes.

    TCPConnector connects to exactly the addresses its resolver returned, so the
    connection goes where the check looked: no second lookup for a rebinding DNS
    server to answer differently. A refused name raises TargetRefused, which
    aiohttp lets through session.post unwrapped (it wraps only OSError).
    aiohttp does not ask the resolver about a literal address: check those with
    check_url or url_guard.
    """

    def __init__(self, allow: Iterable[Network] = (),
                 base: AbstractResolver | None = None) -> None:
        self._allow = tuple(allow)
        self._owns_base = base is None
        self._base = DefaultResolver() if base is None else base

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        results = await self._base.resolve(host, port, family)
        check_addresses(host, [r["host"] for r in results], self._allow)
        return results

    async def close(self) -> None:
        if self._owns_base:
            await self._base.close()


def url_guard(allow: Iterable[Network]) -> ClientMiddlewareType:
    """An aiohttp client middleware (3.12+) that runs check_url on every request,
    redirects included: the literal addresses GuardedResolver never sees."""
    allow = tuple(allow)

    async def guard(request: ClientRequest, handler: ClientHandlerType) -> ClientResponse:
        check_url(str(request.url), allow)
        return await handler(request)

    return guard
