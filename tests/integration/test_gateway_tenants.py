"""Tenant administration and API key handling."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest

from herdwick.clock import to_us
from herdwick.model import TenantSpec
from herdwick.signing import SignatureError, SigningKeys, signature_header, verify_signature
from herdwick.storage import signing
from herdwick.storage.db import Database
from herdwick.storage.tenants import create_tenant
from tests.conftest import T0
from tests.integration.conftest import Api, make_job
from tests.integration.gateway_client import ADMIN_TOKEN, start_client

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
BODY = b'{"to":"a@example.com"}'
T0_S = int(T0.timestamp())


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
                        ({"name": "x", "plan": "gold"}, "plan"),
                        ({"name": "x", "durability": "quorum"}, "durability"),
                        ({"name": "x", "durability": None}, "durability")]:
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


async def test_durability_is_async_unless_asked_and_patchable(api: Api, db) -> None:
    plain = await api.create_tenant("plain")
    made = await api.create_tenant("bank", durability="sync")
    path = f"/v1/tenants/{made['tenantId']}"
    async with db.connection() as conn:
        assert dict(await conn.fetch("SELECT name, durability FROM tenants "
                                     "WHERE name IN ('plain', 'bank')")) == {
            "plain": "async", "bank": "sync"}
    got = await api.client.patch(path, json={"weight": 2}, headers=ADMIN)
    assert (await got.json())["durability"] == "sync"  # left as it was
    got = await api.client.patch(path, json={"durability": "async"}, headers=ADMIN)
    assert got.status == 200 and (await got.json())["durability"] == "async"
    for bad in ("quorum", None, 1):
        refused = await api.client.patch(f"/v1/tenants/{plain['tenantId']}",
                                         json={"durability": bad}, headers=ADMIN)
        assert refused.status == 422, bad
        assert (await refused.json())["errors"][0]["field"] == "durability"


async def test_rotate_secret_keeps_the_old_one_signing_for_a_day_by_default(api: Api) -> None:
    made = await api.create_tenant("r")
    resp = await api.client.post(f"/v1/tenants/{made['tenantId']}:rotate-secret",
                                 headers=ADMIN)
    assert resp.status == 200
    got = await resp.json()
    assert got["signingSecret"] != made["signingSecret"]
    assert got["signingSecret"].startswith("whsec_")
    assert got["previousSecretExpiresAt"] == "2026-12-03T12:00:00Z"  # T0 + 86400 s


async def test_a_new_tenant_can_submit_at_once(api: Api) -> None:
    made = await api.create_tenant("fresh")
    resp = await api.submit(make_job(), key=made["apiKey"])
    assert resp.status == 201


# --- signing secrets: rotation, overlap, and the http workers' copy in Redis ------------


def _rotate(api: Api, tenant_id: str, body: object = None, headers: dict | None = None,
            **kw):
    path = f"/v1/tenants/{tenant_id}:rotate-secret"
    if body is not None:
        kw["json"] = body
    return api.client.post(path, headers=ADMIN if headers is None else headers, **kw)


async def _secrets_in_postgres(db, tenant_id: str) -> tuple:
    async with db.connection() as conn:
        row = await conn.fetchrow(
            "SELECT signing_secret, previous_signing_secret, previous_secret_until "
            "FROM tenants WHERE tenant_id = $1", uuid.UUID(tenant_id))
    return tuple(row)


async def test_a_new_tenants_secret_is_in_redis_at_once(api: Api, redis_client,
                                                        key_prefix) -> None:
    made = await api.create_tenant("fresh")
    keys = await signing.load(redis_client, key_prefix, [made["tenantId"]])
    assert keys == {made["tenantId"]: SigningKeys(current=made["signingSecret"])}


async def test_during_the_overlap_deliveries_verify_with_the_old_secret_and_the_new(
        api: Api, redis_client, key_prefix, clock) -> None:
    made = await api.create_tenant("r")
    tenant = made["tenantId"]
    resp = await _rotate(api, tenant, {"overlapSeconds": 3600})
    assert resp.status == 200, await resp.text()
    rotated = await resp.json()
    assert rotated["previousSecretExpiresAt"] == "2026-12-02T13:00:00Z"

    # What an http worker reads right after the rotate, and signs a delivery with.
    [(_, keys)] = (await signing.load(redis_client, key_prefix, [tenant])).items()
    assert keys == SigningKeys(current=rotated["signingSecret"], previous=made["signingSecret"],
                               previous_until_ms=to_us(T0 + timedelta(hours=1)) // 1000)
    now_s = int(clock.now().timestamp())
    header = signature_header(keys.active(now_s * 1000), BODY, now_s)
    for receiver_knows in (made["signingSecret"], rotated["signingSecret"]):
        verify_signature(receiver_knows, header, BODY, now=now_s)

    # An hour on, the old secret no longer signs.
    later_s = now_s + 3600
    header = signature_header(keys.active(later_s * 1000), BODY, later_s)
    verify_signature(rotated["signingSecret"], header, BODY, now=later_s)
    with pytest.raises(SignatureError):
        verify_signature(made["signingSecret"], header, BODY, now=later_s)


async def test_an_overlap_of_zero_retires_the_old_secret_at_once(api: Api, redis_client,
                                                                 key_prefix, db) -> None:
    made = await api.create_tenant("r")
    resp = await _rotate(api, made["tenantId"], {"overlapSeconds": 0})
    rotated = await resp.json()
    assert rotated["previousSecretExpiresAt"] is None
    assert await _secrets_in_postgres(db, made["tenantId"]) == (rotated["signingSecret"],
                                                                None, None)
    keys = (await signing.load(redis_client, key_prefix, [made["tenantId"]]))[made["tenantId"]]
    assert keys.active(to_us(T0) // 1000) == [rotated["signingSecret"]]
    header = signature_header(keys.active(to_us(T0) // 1000), BODY, T0_S)
    with pytest.raises(SignatureError, match="no v1 signature matches"):
        verify_signature(made["signingSecret"], header, BODY, now=T0_S)


async def test_an_empty_body_or_object_takes_the_default_overlap(api: Api) -> None:
    made = await api.create_tenant("r")
    for kw in ({"data": b""}, {"data": b"", "headers": {**ADMIN, "Content-Type":
                                                       "application/json"}}, {"json": {}}):
        headers = kw.pop("headers", ADMIN)
        resp = await api.client.post(f"/v1/tenants/{made['tenantId']}:rotate-secret",
                                     headers=headers, **kw)
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["previousSecretExpiresAt"] == "2026-12-03T12:00:00Z"


async def test_rotating_twice_in_an_overlap_keeps_only_the_secret_just_replaced(
        api: Api, redis_client, key_prefix, clock) -> None:
    made = await api.create_tenant("r")
    first = await (await _rotate(api, made["tenantId"], {"overlapSeconds": 3600})).json()
    clock.advance(60)
    second = await (await _rotate(api, made["tenantId"], {"overlapSeconds": 600})).json()
    assert second["previousSecretExpiresAt"] == "2026-12-02T12:11:00Z"
    keys = (await signing.load(redis_client, key_prefix, [made["tenantId"]]))[made["tenantId"]]
    assert keys.active(to_us(clock.now()) // 1000) == [second["signingSecret"],
                                                       first["signingSecret"]]
    assert made["signingSecret"] not in keys.active(to_us(clock.now()) // 1000)


@pytest.mark.parametrize(("body", "field"), [
    ({"overlapSeconds": -1}, "overlapSeconds"),
    ({"overlapSeconds": 604801}, "overlapSeconds"),
    ({"overlapSeconds": 1.5}, "overlapSeconds"),
    ({"overlapSeconds": "3600"}, "overlapSeconds"),
    ({"overlapSeconds": None}, "overlapSeconds"),
    ({"overlap": 60}, "overlap"),
    ([], "body"),
])
async def test_a_bad_overlap_is_422_naming_the_field_and_changes_nothing(
        api: Api, db, redis_client, key_prefix, body, field) -> None:
    made = await api.create_tenant("r")
    before = await _secrets_in_postgres(db, made["tenantId"])
    resp = await _rotate(api, made["tenantId"], body)
    assert resp.status == 422
    assert resp.headers["Content-Type"].startswith("application/problem+json")
    assert [e["field"] for e in (await resp.json())["errors"]] == [field]
    assert await _secrets_in_postgres(db, made["tenantId"]) == before
    assert await signing.load(redis_client, key_prefix, [made["tenantId"]]) == {
        made["tenantId"]: SigningKeys(current=made["signingSecret"])}


async def test_the_largest_overlap_is_a_week(api: Api) -> None:
    made = await api.create_tenant("r")
    resp = await _rotate(api, made["tenantId"], {"overlapSeconds": 604800.0})
    assert (await resp.json())["previousSecretExpiresAt"] == "2026-12-09T12:00:00Z"


async def test_rotating_an_unknown_tenant_is_404(api: Api) -> None:
    assert (await _rotate(api, str(uuid.uuid4()))).status == 404
    assert (await _rotate(api, "not-a-uuid")).status == 404


async def test_a_tenant_may_rotate_its_own_secret_and_no_one_elses(api: Api, db) -> None:
    other = await api.create_tenant("other")
    own = await _rotate(api, api.tenant_id, {"overlapSeconds": 60}, headers=api.auth())
    assert own.status == 200, await own.text()
    assert (await _secrets_in_postgres(db, api.tenant_id))[0] == (await own.json())[
        "signingSecret"]
    before = await _secrets_in_postgres(db, other["tenantId"])
    theirs = await _rotate(api, other["tenantId"], headers=api.auth())
    assert theirs.status == 404  # as with every other tenant's id: it is not yours
    assert await _secrets_in_postgres(db, other["tenantId"]) == before
    assert (await _rotate(api, api.tenant_id, headers={})).status == 401
    bad = await _rotate(api, api.tenant_id, headers={"Authorization": "Bearer hwk_nope"})
    assert bad.status == 401 and "admin token" in (await bad.json())["detail"]


async def test_with_the_admin_api_off_a_tenant_still_rotates_its_own(
        db_url, services, key_prefix, clock) -> None:
    client = await start_client(db_url, services.redis_url, key_prefix, clock, admin_token=None)
    try:
        db = await Database.connect(db_url, min_size=1, max_size=1)
        try:
            made = await create_tenant(db, TenantSpec(name="solo"), clock.now())
        finally:
            await db.close()
        auth = {"Authorization": f"Bearer {made.api_key}"}
        resp = await client.post(f"/v1/tenants/{made.tenant_id}:rotate-secret", headers=auth)
        assert resp.status == 200
        admin = await client.post(f"/v1/tenants/{made.tenant_id}:rotate-secret", headers=ADMIN)
        assert admin.status == 401
    finally:
        await client.close()


async def test_redis_being_down_does_not_undo_a_create_or_a_rotate(db_url, key_prefix, clock,
                                                                   db, caplog) -> None:
    client = await start_client(db_url, "redis://127.0.0.1:1/0", key_prefix, clock)
    try:
        made = await client.post("/v1/tenants", json={"name": "t"}, headers=ADMIN)
        assert made.status == 201
        tenant = (await made.json())["tenantId"]
        resp = await client.post(f"/v1/tenants/{tenant}:rotate-secret", headers=ADMIN)
        assert resp.status == 200
        rotated = await resp.json()
    finally:
        await client.close()
    assert (await _secrets_in_postgres(db, tenant))[0] == rotated["signingSecret"]
    assert caplog.text.count("event=signing_publish_failed") == 2
