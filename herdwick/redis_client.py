"""A Redis client from HERDWICK_REDIS_URL: one server, or a Redis Cluster.

`redis://` and `rediss://` (and `unix://`) name one server, as redis-py reads
them. `redis+cluster://[user:password@]host:port[,host:port...][/]` (TLS:
`rediss+cluster://`) names a Redis Cluster by one or more seed nodes; the client
(redis-py's RedisCluster) learns the rest, follows MOVED and ASK, and refreshes
its map of the slots after a failover or a resharding. Every key of a pool
shares its hash tag (`P:{pool}:...`), so a pool lives in one slot and every
function call touches one node.

What differs for a caller is small and kept here: the errors a cluster client
raises outside RedisError (REDIS_ERRORS), and the node a blocking read of one
stream must hold a connection to (node_client_for).
"""

from __future__ import annotations

import inspect
import urllib.parse
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException, RedisError

CLUSTER_SCHEMES = {"redis+cluster": False, "rediss+cluster": True}  # scheme -> TLS
DEFAULT_PORT = 6379

# A cluster client raises RedisClusterException (not a RedisError) when it cannot map
# a slot to a node or reach any node: to every caller that is "Redis is not there".
REDIS_ERRORS: tuple[type[Exception], ...] = (RedisError, RedisClusterException)

Client = aioredis.Redis | RedisCluster


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
            raise BadRedisUrl(f"a seed is host:port, not {spec!r}, in {_redacted(url)}")
        seeds.append((host, int(port)))
    if not seeds:
        raise BadRedisUrl(f"no seed node in {_redacted(url)}")
    if parts.path not in ("", "/"):
        raise BadRedisUrl(f"a cluster has no database number: {_redacted(url)}")
    options: dict[str, Any] = {"ssl": CLUSTER_SCHEMES[parts.scheme]}
    if userinfo:
        user, colon, password = userinfo.partition(":")
        if colon:
            options["password"] = urllib.parse.unquote(password)
        if user:
            options["username"] = urllib.parse.unquote(user)
    return seeds, options


def _redacted(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    hosts = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit(parts._replace(netloc=hosts))


def connect(url: str, **options: Any) -> Client:
    """The client for `url`; `options` go to the client (socket_timeout, ...)."""
    if not is_cluster_url(url):
        return aioredis.from_url(url, **options)
    seeds, from_url = cluster_seeds(url)
    return RedisCluster(startup_nodes=[ClusterNode(host, port) for host, port in seeds],
                        **from_url, **options)


def is_cluster(client: Client) -> bool:
    return isinstance(client, RedisCluster)


def node_client_for(client: Client, key: str, **options: Any) -> aioredis.Redis:
    """A client of its own, on one connection, for a blocking read of `key`.

    On one server: a connection from the client's own pool. On a cluster: a
    connection to the node serving `key`'s slot now; after a failover or a
    resharding it answers MOVED or fails to connect, and the caller asks again.
    """
    if not is_cluster(client):
        return aioredis.Redis(connection_pool=client.connection_pool,
                              single_connection_client=True, **options)
    node = client.get_node_from_key(key)
    kwargs = {k: v for k, v in node.connection_kwargs.items()
              if k in _REDIS_PARAMETERS and k not in ("host", "port")}
    return aioredis.Redis(host=node.host, port=node.port, single_connection_client=True,
                          **{**kwargs, **options})


# What a one-server client takes of a cluster node's connection settings (credentials,
# TLS, timeouts), by the names its constructor has.
_REDIS_PARAMETERS = frozenset(inspect.signature(aioredis.Redis.__init__).parameters)
