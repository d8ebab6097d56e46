"""API keys and the admin token: stored hashed (or not at all), compared in constant time."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from herdwick import credentials
from herdwick.gateway import auth, ui_session
from tests.integration.conftest import Api, tenant_api
from tests.integration.gateway_client import ADMIN_TOKEN

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture
async def api(db_url, services, key_prefix, clock):
    async with tenant_api(db_url, services.redis_url, key_prefix, clock) as holder:
        yield holder


async def every_text_in_postgres(db) -> list[tuple[str, bytes]]:
    """(table.column, value as bytes) for every text, json and bytea value of every table."""
    found = []
    async with db.connection() as conn:
        columns = await conn.fetch(
            "SELECT table_schema, table_name, column_name, data_type "
            "FROM information_schema.columns c JOIN pg_tables t "
            "ON t.schemaname = c.table_schema AND t.tablename = c.table_name "
            "WHERE table_schema NOT IN ('pg_catalog', 'information_schema') AND data_type IN "
            "('text', 'character varying', 'character', 'json', 'jsonb', 'bytea', 'ARRAY')")
        for col in columns:
            name = f'"{col["table_schema"]}"."{col["table_name"]}"'
            column = f'"{col["column_name"]}"'
            cast = column if col["data_type"] == "bytea" else f"convert_to({column}::text, 'UTF8')"
            query = f"SELECT {cast} AS v FROM {name} WHERE {column} IS NOT NULL"
            for row in await conn.fetch(query):
                found.append((f"{col['table_name']}.{col['column_name']}", bytes(row["v"])))
    return found


async def every_value_in_redis(redis_client, key_prefix: str) -> list[tuple[bytes, bytes]]:
    found = []
    async for key in redis_client.scan_iter(match=f"{key_prefix}*", count=1000):
        kind = (await redis_client.type(key)).decode()
        if kind == "string":
            parts = [await redis_client.get(key)]
        elif kind == "hash":
            parts = [b for kv in (await redis_client.hgetall(key)).items() for b in kv]
        elif kind == "list":
            parts = await redis_client.lrange(key, 0, -1)
        elif kind == "set":
            parts = list(await redis_client.smembers(key))
        elif kind == "zset":
            parts = await redis_client.zrange(key, 0, -1)
        elif kind == "stream":
            parts = [b for _, fields in await redis_client.xrange(key)
                     for kv in fields.items() for b in kv]
        else:
            raise AssertionError(f"a Redis key of a type this test cannot read: {kind}")
        found.append((key, key + b"\0" + b"\0".join(p or b"" for p in parts)))
    return found


async def test_api_keys_and_the_admin_token_are_nowhere_in_postgres_or_redis(
        api: Api, db, redis_client, key_prefix) -> None:
    created = await api.create_tenant("second")
    await api.client.post(f"/v1/tenants/{created['tenantId']}:rotate-secret", headers=ADMIN)
    await api.submit({"name": "n", "target": {"type": "queue", "ref": "q"},
                      "schedule": {"delaySeconds": 0}}, key=created["apiKey"])
    secrets = {"first tenant's key": api.key.encode(), "second's key": created["apiKey"].encode(),
               "admin token": ADMIN_TOKEN.encode()}
    stored = await every_text_in_postgres(db)
    assert any(where == "api_keys.key_hash" for where, _ in stored)  # the scan sees them
    for what, secret in secrets.items():
        token = secret.removeprefix(b"hwk_")
        for where, value in stored:
            assert token not in value, f"{what} in Postgres, {where}"
        for key, value in await every_value_in_redis(redis_client, key_prefix):
            assert token not in value, f"{what} in Redis, {key!r}"


async def test_the_api_keys_table_holds_sha256_of_each_key(api: Api, db) -> None:
    async with db.connection() as conn:
        rows = await conn.fetch("SELECT key_hash FROM api_keys WHERE tenant_id = $1::uuid",
                                api.tenant_id)
    assert [bytes(r["key_hash"]) for r in rows] == [hashlib.sha256(api.key.encode()).digest()]
    assert credentials.hash_api_key(api.key) == bytes(rows[0]["key_hash"])


def test_secrets_are_compared_with_hmac_compare_digest() -> None:
    # The admin token (gateway/auth.py) and the UI's CSRF tokens (gateway/ui_session.py)
    # go through the one comparison; a key is found by its hash, never compared as text.
    assert auth.same_secret is credentials.same_secret
    assert ui_session.same_secret is credentials.same_secret
    assert "compare_digest" in credentials.same_secret.__code__.co_names
    assert credentials.hmac is hmac


async def test_a_wrong_admin_token_of_the_same_length_is_refused_in_constant_time(
        api: Api, monkeypatch) -> None:
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(credentials.hmac, "compare_digest", spy)
    wrong = ADMIN_TOKEN[:-1] + ("x" if ADMIN_TOKEN[-1] != "x" else "y")
    assert len(wrong) == len(ADMIN_TOKEN)
    for route in ("/v1/tenants", "/metrics"):
        method = "POST" if route == "/v1/tenants" else "GET"
        resp = await api.client.request(method, route, json={"name": "x"},
                                        headers={"Authorization": f"Bearer {wrong}"})
        assert resp.status == 401, await resp.text()
        assert (wrong.encode(), ADMIN_TOKEN.encode()) in compared
    ok = await api.client.post("/v1/tenants", json={"name": "x"}, headers=ADMIN)
    assert ok.status == 201


async def test_a_wrong_api_key_of_the_same_length_is_refused(api: Api) -> None:
    last = api.key[-1]
    wrong = api.key[:-1] + ("A" if last != "A" else "B")
    assert len(wrong) == len(api.key)
    for path in ("/v1/jobs", "/v1/dead-letters"):
        resp = await api.client.get(path, headers=api.auth(wrong))
        assert resp.status == 401
        assert resp.headers["WWW-Authenticate"] == 'Bearer realm="herdwick"'
    assert (await api.client.get("/v1/jobs", headers=api.auth())).status == 200
    # Nor is the admin token a tenant's key, nor a key the admin token.
    assert (await api.client.get("/v1/jobs", headers=ADMIN)).status == 401
    assert (await api.client.post("/v1/tenants", json={"name": "x"},
                                  headers=api.auth())).status == 401
