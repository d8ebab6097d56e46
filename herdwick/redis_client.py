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
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException, RedisError

from herdwick.redis_url import BadRedisUrl, cluster_seeds, is_cluster_url

__all__ = ["REDIS_ERRORS", "BadRedisUrl", "Client", "cluster_seeds", "connect", "is_cluster",
           "is_cluster_url", "node_client_for"]

# A cluster client raises RedisClusterException (not a RedisError) when it cannot map
# a slot to a node or reach any node: to every caller that is "Redis is not there".
REDIS_ERRORS: tuple[type[Exception], ...] = (RedisError, RedisClusterException)

Client = aioredis.Redis | RedisCluster


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
