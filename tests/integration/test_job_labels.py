"""Labels: bounded string maps on jobs, and the list filter that finds jobs by them."""

from __future__ import annotations

import json
import uuid

import pytest

from herdwick.model import MAX_LABEL_VALUE_LEN, MAX_LABELS
from tests.integration.conftest import Api, make_job


async def _submit(api: Api, **overrides) -> str:
    resp = await api.submit(make_job(**overrides))
    assert resp.status == 201, await resp.text()
    return (await resp.json())["jobId"]


async def _listed(api: Api, query: str) -> list[str]:
    resp = await api.client.get(f"/v1/jobs?{query}", headers=api.auth())
    assert resp.status == 200, await resp.text()
    return [j["jobId"] for j in (await resp.json())["items"]]


async def test_labels_read_back_on_every_job_read(api: Api) -> None:
    job_id = await _submit(api, labels={"team": "payments", "env": "prod"})
    got = await (await api.client.get(f"/v1/jobs/{job_id}", headers=api.auth())).json()
    assert got["labels"] == {"team": "payments", "env": "prod"}
    [listed] = (await (await api.client.get("/v1/jobs", headers=api.auth())).json())["items"]
    assert listed["labels"] == {"team": "payments", "env": "prod"}
    bare = await _submit(api)
    got = await (await api.client.get(f"/v1/jobs/{bare}", headers=api.auth())).json()
    assert got["labels"] == {}


@pytest.mark.parametrize("labels", [
    {f"k{i}": "v" for i in range(MAX_LABELS + 1)},  # too many
    {"team:x": "payments"},  # a colon would make the filter ambiguous
    {"": "empty key"},
    {"-team": "not a letter or digit first"},
    {"k" * 64: "key too long"},
    {"team": "v" * (MAX_LABEL_VALUE_LEN + 1)},
    {"team": "pay\u0007ments"},
    {"team": 5},
])
async def test_bad_labels_are_422_naming_labels_and_write_nothing(api: Api, db, labels) -> None:
    resp = await api.submit(make_job(labels=labels))
    assert resp.status == 422, await resp.text()
    assert [e["field"] for e in (await resp.json())["errors"]] == ["labels"]
    async with db.connection() as conn:
        assert await conn.fetchval("SELECT count(*) FROM jobs") == 0


async def test_the_label_filter_is_and_and_the_name_filter_exact(api: Api, clock) -> None:
    both = await _submit(api, name="settle", labels={"team": "payments", "env": "prod"})
    clock.advance(0.001)  # ids are UUIDv7: in one millisecond their order is random
    team = await _submit(api, name="settle-eu", labels={"team": "payments"})
    await _submit(api, name="settle", labels={"team": "search", "env": "prod"})
    assert await _listed(api, "label=team:payments") == [team, both]
    assert await _listed(api, "label=team:payments&label=env:prod") == [both]
    assert await _listed(api, "label=team:payments&name=settle") == [both]
    assert await _listed(api, "name=settle-eu") == [team]
    assert await _listed(api, "name=Settle") == []  # exact, case-sensitive
    assert await _listed(api, "label=team:pay") == []  # values match whole
    # Another tenant's jobs with the same labels are not this tenant's.
    other = (await api.create_tenant("other"))["apiKey"]
    resp = await api.client.get("/v1/jobs?label=team:payments", headers=api.auth(other))
    assert (await resp.json())["items"] == []


async def test_a_label_filtered_list_pages_by_cursor(api: Api, clock) -> None:
    ids = []
    for _ in range(5):
        ids.append(await _submit(api, labels={"batch": "b1"}))
        await _submit(api, labels={"batch": "b2"})
        clock.advance(0.001)
    seen, cursor = [], None
    while True:
        query = "label=batch:b1&limit=2" + (f"&cursor={cursor}" if cursor else "")
        page = await (await api.client.get(f"/v1/jobs?{query}", headers=api.auth())).json()
        seen += [j["jobId"] for j in page["items"]]
        assert all(j["labels"] == {"batch": "b1"} for j in page["items"])
        cursor = page["nextCursor"]
        if cursor is None:
            break
    assert seen == list(reversed(ids))


@pytest.mark.parametrize("query", ["label=team", "label=:x", "label=team:a&label=team:b",
                                   "name=", "name=a%07b",
                                   "&".join(f"label=k{i}:v" for i in range(9))])
async def test_a_bad_filter_is_422_naming_it(api: Api, query: str) -> None:
    resp = await api.client.get(f"/v1/jobs?{query}", headers=api.auth())
    assert resp.status == 422, await resp.text()
    assert (await resp.json())["errors"][0]["field"] == query.split("=")[0]


async def test_the_label_filter_uses_the_per_tenant_gin_index(api: Api, db) -> None:
    """The plan at scale: 20,000 jobs of the tenant, 10 carrying the pair asked for."""
    tenant = uuid.UUID(api.tenant_id)
    async with db.connection() as conn:
        await conn.execute("""
            INSERT INTO jobs (job_id, tenant_id, name, target_type, target_ref, pool, payload,
                              schedule, max_attempts, backoff_s, timeout_s, state, created_at,
                              updated_at, labels)
            SELECT gen_random_uuid(), $1, 'j' || i, 'queue', 'emails', 'emails', 'null',
                   '{"delaySeconds": 1}', 1, 1, 1, 'active', now(), now(),
                   CASE WHEN i % 2000 = 0 THEN '{"team": "payments"}'::jsonb
                        ELSE jsonb_build_object('team', 'other', 'n', i::text) END
            FROM generate_series(1, 20000) i""", tenant)
        await conn.execute("ANALYZE jobs")
        wanted = json.dumps({str(tenant): {"team": "payments"}})
        plan = "\n".join(r[0] for r in await conn.fetch(
            "EXPLAIN SELECT job_id FROM jobs WHERE tenant_id = $1 "
            "AND jsonb_set('{}', ARRAY[tenant_id::text], labels) @> $2::jsonb "
            "ORDER BY job_id DESC LIMIT 51", tenant, wanted))
    assert "jobs_tenant_labels" in plan, plan
    assert len(await _listed(api, "label=team:payments&limit=500")) == 10
