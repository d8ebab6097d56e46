"""The tenant job API end to end over HTTP and a real database."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

from tests.conftest import T0
from tests.integration.conftest import Api, make_job


def rfc3339(dt: datetime) -> str:
    return dt.astimezone(UTC).isoformat().replace("+00:00", "Z")


async def test_submit_commits_the_job_and_its_due_row(api: Api, db) -> None:
    resp = await api.submit(make_job())
    assert resp.status == 201
    body = await resp.json()
    assert body["state"] == "active"
    assert body["nextRunAt"] == rfc3339(T0 + timedelta(seconds=30))
    assert body["warnings"] == []
    async with db.connection() as conn:
        job = await conn.fetchrow("SELECT * FROM jobs WHERE job_id = $1", body["jobId"])
        due = await conn.fetch("SELECT * FROM due_index WHERE job_id = $1", body["jobId"])
    assert job["state"] == "active" and job["pool"] == "emails"
    assert len(due) == 1
    assert due[0]["next_run_at"] == T0 + timedelta(seconds=30)
    assert due[0]["due_minute"] == T0.replace(second=0)


async def test_read_back_fills_every_default(api: Api) -> None:
    resp = await api.submit(make_job(schedule={"cron": "0 9 * * MON-FRI"}))
    job_id = (await resp.json())["jobId"]
    got = await (await api.client.get(f"/v1/jobs/{job_id}", headers=api.auth())).json()
    assert got["jobId"] == job_id
    assert got["schedule"] == {"cron": "0 9 * * MON-FRI", "tz": "UTC", "jitterSeconds": 0,
                               "overlap": "allow", "misfire": "skip"}
    assert got["retry"] == {"maxAttempts": 5, "backoffSeconds": 10}
    assert got["timeoutSeconds"] == 300
    assert got["payload"] == {"to": "a@example.com"}
    assert got["target"] == {"type": "queue", "ref": "emails"}
    assert got["version"] == 1 and got["state"] == "active"
    # T0 is Wednesday 2026-12-02 12:00 UTC: the next weekday 09:00 is Thursday's.
    assert got["nextRunAt"] == "2026-12-03T09:00:00Z"
    assert got["createdAt"] == rfc3339(T0)


async def test_run_at_in_the_past_runs_as_soon_as_possible(api: Api) -> None:
    past = rfc3339(T0 - timedelta(hours=3))
    resp = await api.submit(make_job(schedule={"runAt": past}))
    assert resp.status == 201
    assert (await resp.json())["nextRunAt"] == past


async def test_another_tenants_job_is_404(api: Api) -> None:
    job_id = (await (await api.submit(make_job())).json())["jobId"]
    other = (await api.create_tenant("other"))["apiKey"]
    for method, path in [("GET", f"/v1/jobs/{job_id}"), ("DELETE", f"/v1/jobs/{job_id}"),
                         ("POST", f"/v1/jobs/{job_id}:pause"),
                         ("POST", f"/v1/jobs/{job_id}:resume")]:
        resp = await api.client.request(method, path, headers=api.auth(other))
        assert resp.status == 404, (method, path)
    listed = await (await api.client.get("/v1/jobs", headers=api.auth(other))).json()
    assert listed["items"] == []
    still = await (await api.client.get(f"/v1/jobs/{job_id}", headers=api.auth())).json()
    assert still["state"] == "active"


async def test_no_key_or_a_bad_key_is_401(api: Api) -> None:
    assert (await api.client.post("/v1/jobs", json=make_job())).status == 401
    resp = await api.submit(make_job(), key="hwk_not-a-real-key")
    assert resp.status == 401
    assert resp.headers["Content-Type"].startswith("application/problem+json")
    assert resp.headers["WWW-Authenticate"].startswith("Bearer")


async def test_same_idempotency_key_and_body_replays_the_original(api: Api, db) -> None:
    body = make_job()
    first = await api.submit(body, **{"Idempotency-Key": "order-42"})
    again = await api.submit(body, **{"Idempotency-Key": "order-42"})
    assert first.status == again.status == 201
    assert await first.json() == await again.json()
    assert again.headers["Idempotent-Replayed"] == "true"
    async with db.connection() as conn:
        assert await conn.fetchval("SELECT count(*) FROM jobs") == 1


async def test_same_key_different_body_is_422_and_writes_nothing(api: Api, db) -> None:
    await api.submit(make_job(), **{"Idempotency-Key": "k1"})
    resp = await api.submit(make_job(name="other"), **{"Idempotency-Key": "k1"})
    assert resp.status == 422
    problem = await resp.json()
    assert problem["type"].endswith("/idempotency-key-reused")
    async with db.connection() as conn:
        assert await conn.fetchval("SELECT count(*) FROM jobs") == 1


async def test_concurrent_submits_with_one_key_create_one_job(api: Api, db) -> None:
    body = make_job()
    resps = await asyncio.gather(*(api.submit(body, **{"Idempotency-Key": "race"})
                                   for _ in range(8)))
    bodies = [await r.json() for r in resps]
    assert {r.status for r in resps} == {201}
    assert len({b["jobId"] for b in bodies}) == 1
    async with db.connection() as conn:
        assert await conn.fetchval("SELECT count(*) FROM jobs") == 1
        assert await conn.fetchval("SELECT count(*) FROM due_index") == 1


async def test_keys_are_per_tenant(api: Api) -> None:
    other = (await api.create_tenant("other"))["apiKey"]
    a = await api.submit(make_job(), **{"Idempotency-Key": "shared"})
    b = await api.submit(make_job(), key=other, **{"Idempotency-Key": "shared"})
    assert a.status == b.status == 201
    assert (await a.json())["jobId"] != (await b.json())["jobId"]


async def test_an_expired_key_can_be_used_again(api: Api, clock) -> None:
    first = await api.submit(make_job(), **{"Idempotency-Key": "daily"})
    clock.advance(25 * 3600)
    second = await api.submit(make_job(name="tomorrow"), **{"Idempotency-Key": "daily"})
    assert second.status == 201
    assert (await first.json())["jobId"] != (await second.json())["jobId"]


async def test_list_is_newest_first_and_keyset_paginated(api: Api, clock) -> None:
    ids = []
    for i in range(5):
        clock.advance(1)
        ids.append((await (await api.submit(make_job(name=f"j{i}"))).json())["jobId"])
    seen, cursor = [], None
    while True:
        query = {"limit": "2", **({"cursor": cursor} if cursor else {})}
        page = await (await api.client.get("/v1/jobs", params=query, headers=api.auth())).json()
        seen += [j["jobId"] for j in page["items"]]
        cursor = page["nextCursor"]
        if cursor is None:
            break
    assert seen == list(reversed(ids))


async def test_list_filters_by_state(api: Api) -> None:
    a = (await (await api.submit(make_job(name="a"))).json())["jobId"]
    b = (await (await api.submit(make_job(name="b"))).json())["jobId"]
    await api.client.post(f"/v1/jobs/{a}:pause", headers=api.auth())
    page = await (await api.client.get("/v1/jobs", params={"state": "paused"},
                                       headers=api.auth())).json()
    assert [j["jobId"] for j in page["items"]] == [a]
    page = await (await api.client.get("/v1/jobs", params={"state": "active"},
                                       headers=api.auth())).json()
    assert [j["jobId"] for j in page["items"]] == [b]


async def test_list_rejects_bad_limit_cursor_and_state(api: Api) -> None:
    for query, field in [({"limit": "0"}, "limit"), ({"limit": "501"}, "limit"),
                         ({"limit": "ten"}, "limit"), ({"cursor": "garbage"}, "cursor"),
                         ({"cursor": "j1.AAAAAAAAAAAAAAAAAAAAA!"}, "cursor"),
                         ({"state": "sleeping"}, "state")]:
        resp = await api.client.get("/v1/jobs", params=query, headers=api.auth())
        assert resp.status == 422, query
        assert (await resp.json())["errors"][0]["field"] == field


async def test_pause_resume_cancel_lifecycle(api: Api, db) -> None:
    job_id = (await (await api.submit(make_job())).json())["jobId"]
    paused = await api.client.post(f"/v1/jobs/{job_id}:pause", headers=api.auth())
    assert paused.status == 200
    assert (await paused.json())["state"] == "paused"
    async with db.connection() as conn:
        assert await conn.fetchval("SELECT count(*) FROM due_index WHERE job_id = $1",
                                   job_id) == 0
    again = await api.client.post(f"/v1/jobs/{job_id}:pause", headers=api.auth())
    assert again.status == 200 and (await again.json())["version"] == 2

    resumed = await (await api.client.post(f"/v1/jobs/{job_id}:resume",
                                           headers=api.auth())).json()
    assert resumed["state"] == "active" and resumed["version"] == 3
    async with db.connection() as conn:
        assert await conn.fetchval("SELECT count(*) FROM due_index WHERE job_id = $1",
                                   job_id) == 1

    assert (await api.client.delete(f"/v1/jobs/{job_id}", headers=api.auth())).status == 204
    assert (await api.client.delete(f"/v1/jobs/{job_id}", headers=api.auth())).status == 204
    got = await (await api.client.get(f"/v1/jobs/{job_id}", headers=api.auth())).json()
    assert got["state"] == "canceled" and got["nextRunAt"] is None
    async with db.connection() as conn:
        assert await conn.fetchval("SELECT count(*) FROM due_index WHERE job_id = $1",
                                   job_id) == 0
    for action in ("resume", "pause"):
        resp = await api.client.post(f"/v1/jobs/{job_id}:{action}", headers=api.auth())
        assert resp.status == 409, action


async def test_resume_after_missed_cron_runs_the_latest_missed_once(api: Api, clock) -> None:
    resp = await api.submit(make_job(schedule={"cron": "0 * * * *"}))
    job_id = (await resp.json())["jobId"]
    assert (await resp.json())["nextRunAt"] == "2026-12-02T13:00:00Z"
    await api.client.post(f"/v1/jobs/{job_id}:pause", headers=api.auth())
    clock.advance(5 * 3600 + 600)  # 17:10: 13:00 .. 17:00 were missed
    resumed = await (await api.client.post(f"/v1/jobs/{job_id}:resume",
                                           headers=api.auth())).json()
    assert resumed["nextRunAt"] == "2026-12-02T17:00:00Z"
    # The ones the misfire policy skips are recorded, not silently lost.
    history = await (await api.client.get(f"/v1/jobs/{job_id}/executions",
                                          headers=api.auth())).json()
    assert [(e["scheduledFor"], e["state"]) for e in history["items"]] == [
        (f"2026-12-02T{h}:00:00Z", "skipped") for h in (16, 15, 14, 13)]
    again = await api.client.post(f"/v1/jobs/{job_id}:pause", headers=api.auth())
    assert again.status == 200
    await api.client.post(f"/v1/jobs/{job_id}:resume", headers=api.auth())
    history = await (await api.client.get(f"/v1/jobs/{job_id}/executions",
                                          headers=api.auth())).json()
    assert len(history["items"]) == 4  # recorded once, however often it is resumed


async def test_resume_with_catch_up_runs_a_hundred_and_records_the_rest(api: Api,
                                                                        clock) -> None:
    resp = await api.submit(make_job(schedule={"cron": "* * * * *", "misfire": "catch_up"}))
    job_id = (await resp.json())["jobId"]
    await api.client.post(f"/v1/jobs/{job_id}:pause", headers=api.auth())
    clock.advance(150 * 60 + 30)  # 12:01 .. 14:30 fell due while paused: 150 of them
    resumed = await (await api.client.post(f"/v1/jobs/{job_id}:resume",
                                           headers=api.auth())).json()
    assert resumed["nextRunAt"] == "2026-12-02T12:51:00Z"  # the first of the last hundred
    history = await (await api.client.get(f"/v1/jobs/{job_id}/executions?limit=500",
                                          headers=api.auth())).json()
    skipped = [e["scheduledFor"] for e in history["items"]]
    assert {e["state"] for e in history["items"]} == {"skipped"}
    assert (len(skipped), skipped[0], skipped[-1]) == (50, "2026-12-02T12:50:00Z",
                                                       "2026-12-02T12:01:00Z")


async def test_unknown_and_malformed_job_ids_are_404(api: Api) -> None:
    for path in ("/v1/jobs/0190c1d2-0000-7000-8000-000000000000", "/v1/jobs/not-a-uuid"):
        resp = await api.client.get(path, headers=api.auth())
        assert resp.status == 404
        assert resp.headers["Content-Type"].startswith("application/problem+json")


async def test_batch_is_all_or_nothing_and_names_each_bad_index(api: Api, db) -> None:
    jobs = [make_job(name=f"n{i}") for i in range(20)]
    jobs[3]["schedule"] = {"cron": "61 * * * *"}
    jobs[17]["target"] = {"type": "queue", "ref": "Bad Name"}
    resp = await api.client.post("/v1/jobs:batch", json={"jobs": jobs}, headers=api.auth())
    assert resp.status == 422
    fields = {e["field"] for e in (await resp.json())["errors"]}
    assert fields == {"jobs[3].schedule.cron", "jobs[17].target.ref"}
    async with db.connection() as conn:
        assert await conn.fetchval("SELECT count(*) FROM jobs") == 0


async def test_batch_inserts_in_order(api: Api, db) -> None:
    jobs = [make_job(name=f"n{i}", schedule={"delaySeconds": i}) for i in range(1000)]
    resp = await api.client.post("/v1/jobs:batch", json={"jobs": jobs}, headers=api.auth())
    assert resp.status == 201
    items = (await resp.json())["items"]
    assert [i["nextRunAt"] for i in items] == [rfc3339(T0 + timedelta(seconds=s))
                                               for s in range(1000)]
    async with db.connection() as conn:
        assert await conn.fetchval("SELECT count(*) FROM jobs") == 1000
        assert await conn.fetchval("SELECT count(*) FROM due_index") == 1000


async def test_batch_limits(api: Api) -> None:
    for jobs in ([], [make_job()] * 1001):
        resp = await api.client.post("/v1/jobs:batch", json={"jobs": jobs}, headers=api.auth())
        assert resp.status == 422
        assert (await resp.json())["errors"][0]["field"] == "jobs"


async def test_a_herd_in_one_second_earns_a_jitter_warning(api: Api) -> None:
    at = rfc3339(T0 + timedelta(hours=1))
    jobs = [make_job(name=f"h{i}", schedule={"runAt": at}) for i in range(999)]
    resp = await api.client.post("/v1/jobs:batch", json={"jobs": jobs}, headers=api.auth())
    assert (await resp.json())["warnings"] == []
    resp = await api.submit(make_job(schedule={"runAt": at}))
    warnings = (await resp.json())["warnings"]
    assert len(warnings) == 1 and "jitterSeconds" in warnings[0]
    other = await api.submit(make_job(schedule={"runAt": rfc3339(T0 + timedelta(hours=2))}))
    assert (await other.json())["warnings"] == []


async def test_max_active_jobs_is_enforced_with_429(api: Api, db) -> None:
    key = (await api.create_tenant("small", maxActiveJobs=2))["apiKey"]
    results = await asyncio.gather(*(api.submit(make_job(), key=key) for _ in range(5)))
    statuses = sorted(r.status for r in results)
    assert statuses == [201, 201, 429, 429, 429]
    limited = next(r for r in results if r.status == 429)
    assert int(limited.headers["Retry-After"]) > 0
    async with db.connection() as conn:
        assert await conn.fetchval("SELECT count(*) FROM jobs") == 2


async def test_openapi_documents_every_route(api: Api) -> None:
    doc = await (await api.client.get("/openapi.json")).json()
    assert doc["openapi"].startswith("3.1")
    ops = {(m.upper(), p) for p, item in doc["paths"].items() for m in item}
    for method, path in [("POST", "/v1/jobs"), ("POST", "/v1/jobs:batch"), ("GET", "/v1/jobs"),
                         ("GET", "/v1/jobs/{jobId}"), ("DELETE", "/v1/jobs/{jobId}"),
                         ("POST", "/v1/jobs/{jobId}:pause"), ("POST", "/v1/jobs/{jobId}:resume"),
                         ("POST", "/v1/tenants"), ("PATCH", "/v1/tenants/{tenantId}"),
                         ("POST", "/v1/tenants/{tenantId}:rotate-secret"),
                         ("POST", "/v1/jobs/{jobId}:trigger"),
                         ("GET", "/v1/jobs/{jobId}/executions"),
                         ("GET", "/v1/executions/{executionId}"),
                         ("POST", "/v1/executions/{executionId}:retry"),
                         ("GET", "/v1/dead-letters"),
                         ("GET", "/healthz"), ("GET", "/readyz"), ("GET", "/openapi.json")]:
        assert (method, path) in ops
    assert set(doc["components"]["schemas"]) >= {"Execution", "ExecutionPage", "Attempt",
                                                 "Problem", "JobSpec", "Job"}
    spec = doc["components"]["schemas"]["JobSpec"]
    assert set(spec["required"]) == {"name", "target", "schedule"}
    assert spec["additionalProperties"] is False


async def test_health_and_readiness(api: Api) -> None:
    assert (await api.client.get("/healthz")).status == 200
    ready = await api.client.get("/readyz")
    assert ready.status == 200
    assert (await ready.json())["checks"] == {"postgres": "ok", "redis": "ok"}
