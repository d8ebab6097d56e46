"""Tenant administration and API key handling."""

from __future__ import annotations

from tests.integration.conftest import Api, make_job
from tests.integration.gateway_client import ADMIN_TOKEN, start_client

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


async def test_keys_are_random_and_stored_only_hashed(api: Api, db) -> None:
    a = await api.create_tenant("a")
    b = await api.create_tenant("b")
    assert a["apiKey"] != b["apiKey"] and len(a["apiKey"]) >= 40
    assert a["signingSecret"] != b["signingSecret"]
    async with db.connection() as conn:
        hashes = [bytes(r["key_hash"]) for r in await conn.fetch("SELECT key_hash FROM api_keys")]
        dump = await conn.fetchval("SELECT string_agg(t::text, '') FROM api_keys t")
    assert all(len(h) == 32 for h in hashes)
    assert a["apiKey"] not in dump and a["apiKey"].encode() not in b"".join(hashes)


async def test_admin_routes_need_the_admin_token(api: Api) -> None:
    assert (await api.client.post("/v1/tenants", json={"name": "x"})).status == 401
    tenant_key = {"Authorization": f"Bearer {api.key}"}
    assert (await api.client.post("/v1/tenants", json={"name": "x"},
                                  headers=tenant_key)).status == 401


async def test_admin_api_is_off_without_a_token(db_url, services, key_prefix, clock) -> None:
    client = await start_client(db_url, services.redis_url, key_prefix, clock, admin_token=None)
    try:
        resp = await client.post("/v1/tenants", json={"name": "x"}, headers=ADMIN)
        assert resp.status == 403
    finally:
        await client.close()


async def test_create_validates_fields(api: Api) -> None:
    for body, field in [({}, "name"), ({"name": "x", "weight": 0}, "weight"),
                        ({"name": "x", "dispatchRate": -1}, "dispatchRate"),
                        ({"name": "x", "maxActiveJobs": 0}, "maxActiveJobs"),
                        ({"name": "x", "plan": "gold"}, "plan")]:
        resp = await api.client.post("/v1/tenants", json=body, headers=ADMIN)
        assert resp.status == 422, body
        assert (await resp.json())["errors"][0]["field"] == field


async def test_patch_changes_only_named_fields_and_lifts_limits(api: Api) -> None:
    made = await api.create_tenant("p", weight=3, maxActiveJobs=10)
    path = f"/v1/tenants/{made['tenantId']}"
    got = await (await api.client.patch(path, json={"dispatchRate": 50},
                                        headers=ADMIN)).json()
    assert (got["weight"], got["dispatchRate"], got["maxActiveJobs"]) == (3, 50, 10)
    got = await (await api.client.patch(path, json={"maxActiveJobs": None},
                                        headers=ADMIN)).json()
    assert got["maxActiveJobs"] is None and got["weight"] == 3
    missing = await api.client.patch("/v1/tenants/0190c1d2-0000-7000-8000-000000000000",
                                     json={"weight": 2}, headers=ADMIN)
    assert missing.status == 404


async def test_rotate_secret(api: Api) -> None:
    made = await api.create_tenant("r")
    resp = await api.client.post(f"/v1/tenants/{made['tenantId']}:rotate-secret",
                                 headers=ADMIN)
    assert resp.status == 200
    assert (await resp.json())["signingSecret"] != made["signingSecret"]


async def test_a_new_tenant_can_submit_at_once(api: Api) -> None:
    made = await api.create_tenant("fresh")
    resp = await api.submit(make_job(), key=made["apiKey"])
    assert resp.status == 201
