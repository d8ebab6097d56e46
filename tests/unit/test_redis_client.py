"""HERDWICK_REDIS_URL: one server as redis-py reads it, or a cluster by its seed nodes."""

from __future__ import annotations

import pytest
from redis.asyncio.cluster import RedisCluster

from herdwick import redis_client
from herdwick.config import ConfigError, Settings


def test_a_cluster_url_names_its_seeds_credentials_and_tls() -> None:
    seeds, options = redis_client.cluster_seeds(
        "rediss+cluster://app:p%40ss@10.0.0.1:7000,[::1]:7001,redis-2/")
    assert seeds == [("10.0.0.1", 7000), ("::1", 7001), ("redis-2", 6379)]
    assert options == {"ssl": True, "username": "app", "password": "p@ss"}
    assert redis_client.cluster_seeds("redis+cluster://h:1")[1] == {"ssl": False}


async def test_connect_gives_a_cluster_client_only_for_a_cluster_url() -> None:
    cluster = redis_client.connect("redis+cluster://127.0.0.1:7000,127.0.0.1:7001")
    single = redis_client.connect("redis://127.0.0.1:6379/0")
    try:
        assert isinstance(cluster, RedisCluster) and redis_client.is_cluster(cluster)
        assert not redis_client.is_cluster(single)
    finally:
        await single.aclose()
        await cluster.aclose()


@pytest.mark.parametrize(("url", "says"), [
    ("redis+cluster://", "no seed node"),
    ("redis+cluster://h:99999", "a seed is host:port"),
    ("redis+cluster://h:x", "a seed is host:port"),
    ("redis+cluster://h:7000/2", "no database number"),
])
def test_a_bad_cluster_url_is_a_config_error_naming_the_variable(url: str, says: str) -> None:
    with pytest.raises(ConfigError, match=f"HERDWICK_REDIS_URL: .*{says}"):
        Settings(redis_url=url)


def test_a_password_stays_out_of_the_error() -> None:
    with pytest.raises(ConfigError) as caught:
        Settings(redis_url="redis+cluster://u:secret@h:nope")
    assert "secret" not in str(caught.value)
