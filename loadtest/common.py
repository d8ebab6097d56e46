"""What every load test needs: loopback-only targets and scratch database names."""

from __future__ import annotations

import ipaddress
import urllib.parse

from herdwick.config import ConfigError


def require_loopback(url: str, what: str) -> None:
    """Load goes to this machine only: a loopback host, or a local socket path."""
    parts = urllib.parse.urlsplit(url)
    for host in [parts.hostname, *urllib.parse.parse_qs(parts.query).get("host", [])]:
        if host is None or host.startswith("/") or host == "localhost":
            continue
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise ConfigError(f"{what}: {host!r} is not a loopback address; the load test "
                              "only targets this machine")


def with_database(dsn: str, name: str) -> str:
    parts = urllib.parse.urlsplit(dsn)
    return urllib.parse.urlunsplit(parts._replace(path="/" + name))
