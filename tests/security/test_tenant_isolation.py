"""A tenant can neither read nor change another tenant's things: 404, never 403.

Tenant A has a job, a triggered execution and a dead letter; tenant B, with its own
key, asks for each through the API and through /ui, and tries every change. Every
answer is 404 (nothing tells B that A's ids exist), and A's rows are as they were.
"""

from __future__ import annotations

import pytest

from tests.integration.conftest import Api, make_job, tenant_api
from tests.integration.ui_client import csrf_in, logged_out, login


@pytest.fixture
async def api(db_url, services, key_prefix, clock):
    async with tenant_api(db_url, services.redis_url, key_prefix, clock) as holder:
        yield holder


async def a_with_things(api: Api, db, clock) -> dict[str, str]:
    job_id = (await (await api.submit(make_job())).json())["jobId"]
    clock.advance(1)
    run = await api.client.post(f"/v1/jobs/{job_id}:trigger", headers=api.auth())
    execution_id = (await run.json())["executionId"]
    clock.advance(1)
    dead_id = (await (await api.client.post(f"/v1/jobs/{job_id}:trigger",
                                            headers=api.auth())).json())["executionId"]
    async with db.connection() as conn:  # as if its attempts ran out
        await conn.execute("UPDATE executions SET state = 'dead', finished_at = now() "
                           "WHERE execution_id = $1::uuid", dead_id)
    return {"job": job_id, "execution": execution_id, "dead": dead_id, "tenant": api.tenant_id}


async def rows_of(db, tenant_id: str) -> list:
    async with db.connection() as conn:
        jobs = await conn.fetch("SELECT * FROM jobs WHERE tenant_id = $1::uuid ORDER BY 1",
                                tenant_id)
        runs = await conn.fetch("SELECT * FROM executions WHERE tenant_id = $1::uuid "
                                "ORDER BY 1", tenant_id)
        due = await conn.fetch("SELECT * FROM due_index ORDER BY 1")
    return [list(map(dict, jobs)), list(map(dict, runs)), list(map(dict, due))]


async def test_another_tenants_things_are_404_through_the_api(api: Api, db, clock) -> None:
    a = await a_with_things(api, db, clock)
    b = (await api.create_tenant("b"))["apiKey"]
    before = await rows_of(db, a["tenant"])
    requests = [
        ("GET", f"/v1/jobs/{a['job']}"), ("GET", f"/v1/jobs/{a['job']}/executions"),
        ("POST", f"/v1/jobs/{a['job']}:pause"), ("POST", f"/v1/jobs/{a['job']}:resume"),
        ("POST", f"/v1/jobs/{a['job']}:trigger"), ("DELETE", f"/v1/jobs/{a['job']}"),
        ("GET", f"/v1/executions/{a['execution']}"), ("GET", f"/v1/executions/{a['dead']}"),
        ("POST", f"/v1/executions/{a['dead']}:retry"),
        ("POST", f"/v1/tenants/{a['tenant']}:rotate-secret"),
    ]
    for method, path in requests:
        resp = await api.client.request(method, path, headers=api.auth(b))
        assert resp.status == 404, (method, path, await resp.text())
        assert resp.headers["Content-Type"].startswith("application/problem+json")
    for path in ("/v1/jobs", "/v1/dead-letters"):
        page = await (await api.client.get(path, headers=api.auth(b))).json()
        assert page["items"] == [], path
    assert await rows_of(db, a["tenant"]) == before
    # A still sees and may change all of it: the refusals were about B, not the ids.
    assert (await api.client.post(f"/v1/executions/{a['dead']}:retry",
                                  headers=api.auth())).status == 202
    dead = await (await api.client.get("/v1/dead-letters", headers=api.auth())).json()
    assert dead["items"] == []


async def test_another_tenants_pages_are_404_in_the_dashboard(api: Api, db, clock) -> None:
    a = await a_with_things(api, db, clock)
    b = await api.create_tenant("b")
    own = f"/ui/tenants/{b['tenantId']}"
    theirs = f"/ui/tenants/{a['tenant']}"
    before = await rows_of(db, a["tenant"])
    csrf = await login(api.client, b["apiKey"])
    pages = [f"{theirs}/jobs", f"{theirs}/jobs/{a['job']}", f"{theirs}/executions/{a['dead']}",
             f"{theirs}/dead-letters",
             # A's ids under B's own tenant path: looked up as B's, so not found either.
             f"{own}/jobs/{a['job']}", f"{own}/executions/{a['execution']}"]
    for path in pages:
        resp = await api.client.get(path)
        assert resp.status == 404, (path, (await resp.text())[:300])
        assert a["job"] not in (await resp.text()) or path.endswith(a["job"])
    for path in (f"{own}/jobs", f"{own}/dead-letters"):
        page = await api.client.get(path)
        assert page.status == 200 and a["job"] not in await page.text()
    buttons = [f"{theirs}/jobs/{a['job']}/{action}" for action in
               ("pause", "resume", "trigger", "cancel")]
    buttons += [f"{own}/jobs/{a['job']}/pause", f"{own}/jobs/{a['job']}/cancel",
                f"{theirs}/executions/{a['dead']}/retry", f"{own}/executions/{a['dead']}/retry"]
    for path in buttons:
        resp = await api.client.post(path, data={"csrf": csrf}, allow_redirects=False)
        assert resp.status == 404, (path, (await resp.text())[:300])
    assert await rows_of(db, a["tenant"]) == before

    # A, logged in, sees its own job: the 404s were B's.
    logged_out(api.client)
    await login(api.client, api.key)
    mine = await api.client.get(f"{theirs}/jobs/{a['job']}")
    assert mine.status == 200 and csrf_in(await mine.text())
