"""HERDWICK_REDIS_URL read without a Redis client: one server, or a cluster's seeds.

`redis+cluster://[user:password@]host:port[,host:port...][/]` (TLS:
`rediss+cluster://`) names a Redis Cluster by one or more seed nodes; anything
else is one server's URL, as redis-py reads it. Kept apart from redis_client so
that the settings can check the URL without importing redis (`herdwick --help`
imports no client library).
"""

from __future__ import annotations

import urllib.parse
from typing import Any

from herdwick.redaction import redacted

CLUSTER_SCHEMES = {"redis+cluster": False, "rediss+cluster": True}  # scheme -> TLS
DEFAULT_PORT = 6379


class BadRedisUrl(ValueError):
    """HERDWICK_REDIS_URL cannot be read; the message says what is wrong with it."""


def is_cluster_url(url: str) -> bool:
    return urllib.parse.urlsplit(url).scheme in CLUSTER_SCHEMES


def cluster_seeds(url: str) -> tuple[list[tuple[str, int]], dict[str, Any]]:
    """The seed nodes of a `redis+cluster://` URL and the client options it carries."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in CLUSTER_SCHEMES:
        raise BadRedisUrl(f"not a cluster URL (redis+cluster://host:port,...): {url!r}")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    seeds = []
    for spec in filter(None, hosts.split(",")):
        if spec.startswith("["):  # [IPv6]:port
            host, _, rest = spec[1:].partition("]")
            port = rest[1:] if rest.startswith(":") else str(DEFAULT_PORT)
        else:
            host, colon, port = spec.partition(":")
            port = port if colon else str(DEFAULT_PORT)
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise BadRedisUrl(f"a seed is host:port, not {spec!r}, in {redacted(url)}")
        seeds.append((host, int(port)))
    if not seeds:
        raise BadRedisUrl(f"no seed node in {redacted(url)}")
    if parts.path not in ("", "/"):
        raise BadRedisUrl(f"a cluster has no database number: {redacted(url)}")
    options: dict[str, Any] = {"ssl": CLUSTER_SCHEMES[parts.scheme]}
    if userinfo:
        user, colon, password = userinfo.partition(":")
        if colon:
            options["password"] = urllib.parse.unquote(password)
        if user:
            options["username"] = urllib.parse.unquote(user)
    return seeds, options
