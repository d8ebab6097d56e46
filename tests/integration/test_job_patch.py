"""PATCH /v1/jobs/{jobId}: merge patches under If-Match, schedule moves, revisions."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from herdwick.credentials import hash_api_key
from tests.integration.conftest import Api, make_job
from tests.integration.stack import advance, ready

MERGE = "application/merge-patch+json"


async def _submit(api: Api, **overrides) -> dict:
    resp = await api.submit(make_job(**overrides))
    assert resp.status == 201, await resp.text()
    return await (await api.client.get(f"/v1/jobs/{(await resp.json())['jobId']}",
                                       headers=api.auth())).json()


async def _patch(api: Api, job_id: str, body, version: int | str | None,
                 content_type: str = MERGE):
    headers = {**api.auth(), "Content-Type": content_type}
    if version is not None:
        headers["If-Match"] = version if isinstance(version, str) else f'"{version}"'
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return await api.client.patch(f"/v1/jobs/{job_id}", data=data, headers=headers)


async def _get(api: Api, job_id: str):
    return await api.client.get(f"/v1/jobs/{job_id}", headers=api.auth())


async def _revisions(api: Api, job_id: str, query: str = "") -> dict:
    resp = await api.client.get(f"/v1/jobs/{job_id}/revisions{query}", headers=api.auth())
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def test_a_patch_merges_bumps_the_version_and_leaves_a_revision(api: Api) -> None:
    job = await _submit(api, payload={"to": "a@example.com", "cc": "b@example.com"},
                        labels={"team": "payments", "tier": "1"})
    got = await _get(api, job["jobId"])
    assert got.headers["ETag"] == '"1"'

    resp = await _patch(api, job["jobId"], {
        "name": "renamed", "payload": {"cc": None, "bcc": "c@example.com"},
        "labels": {"tier": None, "env": "prod"}, "retry": {"maxAttempts": 2},
        "timeoutSeconds": None}, 1)
    assert resp.status == 200, await resp.text()
    assert resp.headers["ETag"] == '"2"'
    changed = await resp.json()
    assert changed["name"] == "renamed"
    assert changed["payload"] == {"to": "a@example.com", "bcc": "c@example.com"}
    assert changed["labels"] == {"team": "payments", "env": "prod"}
    assert changed["retry"] == {"maxAttempts": 2, "backoffSeconds": 10}
    assert changed["version"] == 2 and changed["nextRunAt"] == job["nextRunAt"]
    assert (await (await _get(api, job["jobId"])).json()) == changed

    [revision] = (await _revisions(api, job["jobId"]))["items"]
    assert revision["version"] == 2
    assert revision["revisedBy"] == "key:" + hash_api_key(api.key).hex()[:12]
    assert set(revision["changes"]) == {"name", "payload", "labels", "retry"}
    assert revision["changes"]["name"] == {"before": "nightly-report", "after": "renamed"}
    assert revision["changes"]["labels"]["before"] == {"team": "payments", "tier": "1"}


async def test_plain_json_is_a_patch_too_and_a_no_op_changes_nothing(api: Api) -> None:
    job = await _submit(api)
    resp = await _patch(api, job["jobId"], {"name": job["name"]}, 1, "application/json")
    assert resp.status == 200 and (await resp.json())["version"] == 1
    assert (await _revisions(api, job["jobId"]))["items"] == []
    resp = await _patch(api, job["jobId"], {"name": "x"}, 1, "text/plain")
    assert resp.status == 415


async def _unchanged(api: Api, job: dict) -> None:
    after = await (await _get(api, job["jobId"])).json()
    assert after == job
    assert (await _revisions(api, job["jobId"]))["items"] == []


@pytest.mark.parametrize(("version", "status"), [
    (None, 428), ("*", 428), ("", 428), (2, 412), ('W/"1"', 412), ("1", 412), ('"2", "3"', 412)])
async def test_without_the_current_version_nothing_changes(api: Api, version, status) -> None:
    job = await _submit(api)
    resp = await _patch(api, job["jobId"], {"name": "renamed"}, version)
    assert resp.status == status, await resp.text()
    assert resp.headers["Content-Type"].startswith("application/problem+json")
    if status == 412:
        assert resp.headers["ETag"] == '"1"'
    await _unchanged(api, job)
    ok = await _patch(api, job["jobId"], {"name": "renamed"}, '"3", "1"')  # any one matches
    assert ok.status == 200


@pytest.mark.parametrize(("body", "field"), [
    ({"state": "paused"}, "state"),
    ({"jobId": "01a236a0-3a00-71c1-8ffc-20d75b4bd3ee"}, "jobId"),
    ({"version": 7}, "version"),
    ({"name": None}, "name"),
    ({"schedule": None}, "schedule"),
    ({"schedule": {"cron": "0 0 30 2 *"}}, "schedule.cron"),
    ({"schedule": {"runAt": "2027-01-01T00:00:00Z"}}, "schedule"),  # two kinds at once
    ({"schedule": {"tz": "Mars/Olympus"}}, "schedule.tz"),
    ({"target": {"ref": "not a pool"}}, "target.ref"),
    ({"retry": {"maxAttempts": 0}}, "retry.maxAttempts"),
    ({"timeoutSeconds": 5.5}, "timeoutSeconds"),
    ({"labels": {"a:b": "c"}}, "labels"),
    ({"payload": {"s": "nul\u0000"}}, "payload"),
    ([1, 2], "body"),
])
async def test_an_invalid_patch_is_422_naming_the_field(api: Api, body, field) -> None:
    job = await _submit(api, schedule={"cron": "0 9 * * *"})
    resp = await _patch(api, job["jobId"], body, 1)
    assert resp.status == 422, await resp.text()
    assert field in [e["field"] for e in (await resp.json())["errors"]]
    await _unchanged(api, job)


async def test_malformed_json_is_400(api: Api) -> None:
    job = await _submit(api)
    resp = await _patch(api, job["jobId"], b'{"name": ', 1)
    assert resp.status == 400
    await _unchanged(api, job)


@pytest.mark.parametrize("depth", [960, 990, 5000])
async def test_a_deeply_nested_payload_patch_is_never_a_crash(api: Api, depth) -> None:
    """Near the recursion limit the merge, and comparing before and after, recurse as
    deep as the decoder did, with the server's frames on top: 400 then, never a 500."""
    job = await _submit(api, payload={"a": {"b": 1}})
    deep = b'{"payload": ' + b'{"a": ' * depth + b"1" + b"}" * depth + b"}"
    resp = await _patch(api, job["jobId"], deep, 1)
    assert resp.status in (200, 400), await resp.text()
    if resp.status == 400:
        await _unchanged(api, job)


async def test_a_canceled_or_completed_job_is_409(api: Api, db) -> None:
    job = await _submit(api)
    await api.client.delete(f"/v1/jobs/{job['jobId']}", headers=api.auth())
    version = (await (await _get(api, job["jobId"])).json())["version"]
    assert (await _patch(api, job["jobId"], {"name": "x"}, version)).status == 409
    other = await _submit(api)
    async with db.connection() as conn:
        await conn.execute("UPDATE jobs SET state = 'completed' WHERE job_id = $1",
                           other["jobId"])
    assert (await _patch(api, other["jobId"], {"name": "x"}, 1)).status == 409
    missing = "01a236a0-3a00-71c1-8ffc-20d75b4bd3ee"
    assert (await _patch(api, missing, {"name": "x"}, 1)).status == 404


async def test_concurrent_patches_of_one_version_one_wins(api: Api) -> None:
    job = await _submit(api)
    answers = await asyncio.gather(*(_patch(api, job["jobId"], {"name": f"n{i}"}, 1)
                                     for i in range(6)))
    statuses = sorted(r.status for r in answers)
    assert statuses == [200] + [412] * 5
    [winner] = [await r.json() for r in answers if r.status == 200]
    assert (await (await _get(api, job["jobId"])).json())["name"] == winner["name"]
    assert len((await _revisions(api, job["jobId"]))["items"]) == 1


async def _due(db, job_id: str) -> list:
    async with db.connection() as conn:
        return [r["next_run_at"] for r in await conn.fetch(
            "SELECT next_run_at FROM due_index WHERE job_id = $1 AND execution_id IS NULL",
            job_id)]


def _utc(text: str) -> str:
    return text.replace("Z", "+00:00")


async def test_a_schedule_change_moves_next_run_and_the_due_row(api: Api, db) -> None:
    job = await _submit(api, schedule={"cron": "0 9 * * *", "tz": "Europe/London"})
    assert job["nextRunAt"] == "2026-12-03T09:00:00Z"
    resp = await _patch(api, job["jobId"], {"schedule": {"cron": "30 13 * * *"}}, 1)
    moved = await resp.json()
    assert moved["nextRunAt"] == "2026-12-02T13:30:00Z"  # T0 is 12:00 UTC
    assert moved["schedule"]["tz"] == "Europe/London"  # merged: the zone stays
    assert [d.isoformat() for d in await _due(db, job["jobId"])] == [_utc(moved["nextRunAt"])]

    # From cron to a one-off: the cron-only fields are nulled, as a merge patch does.
    resp = await _patch(api, job["jobId"], {"schedule": {
        "cron": None, "tz": None, "overlap": None, "misfire": None, "delaySeconds": 60}}, 2)
    assert resp.status == 200, await resp.text()
    once = await resp.json()
    assert once["schedule"] == {"delaySeconds": 60, "jitterSeconds": 0}
    assert once["nextRunAt"] == "2026-12-02T12:01:00Z"
    assert [d.isoformat() for d in await _due(db, job["jobId"])] == [_utc(once["nextRunAt"])]


async def test_a_paused_job_s_schedule_moves_without_a_due_row(api: Api, db) -> None:
    job = await _submit(api, schedule={"cron": "0 9 * * *"})
    await api.client.post(f"/v1/jobs/{job['jobId']}:pause", headers=api.auth())
    resp = await _patch(api, job["jobId"], {"schedule": {"cron": "0 15 * * *"}}, 2)
    assert (await resp.json())["nextRunAt"] == "2026-12-02T15:00:00Z"
    assert await _due(db, job["jobId"]) == []
    resumed = await api.client.post(f"/v1/jobs/{job['jobId']}:resume", headers=api.auth())
    assert resumed.headers["ETag"] == '"4"'
    assert [d.isoformat() for d in await _due(db, job["jobId"])] == ["2026-12-02T15:00:00+00:00"]


async def test_next_run_and_the_due_row_always_agree_under_concurrent_patches(
        api: Api, db) -> None:
    """Writers patch the schedule as fast as they can, each from the version it last saw;
    a reader compares jobs.next_run_at with the due row in one snapshot all along."""
    job = await _submit(api, schedule={"cron": "0 9 * * *"})
    done = asyncio.Event()
    rng = random.Random(15)
    applied = 0

    async def writer() -> None:
        nonlocal applied
        for _ in range(15):
            current = await (await _get(api, job["jobId"])).json()
            cron = f"{rng.randrange(60)} {rng.randrange(24)} * * *"
            resp = await _patch(api, job["jobId"], {"schedule": {"cron": cron}},
                                current["version"])
            assert resp.status in (200, 412), await resp.text()
            applied += resp.status == 200

    async def reader() -> int:
        checks = 0
        while not done.is_set():
            async with db.connection() as conn:
                row = await conn.fetchrow(
                    "SELECT j.next_run_at AS job, array_agg(d.next_run_at) AS due FROM jobs j "
                    "LEFT JOIN due_index d ON d.job_id = j.job_id AND d.execution_id IS NULL "
                    "WHERE j.job_id = $1 GROUP BY j.next_run_at", job["jobId"])
            assert row["due"] == [row["job"]], row
            checks += 1
            await asyncio.sleep(0)
        return checks

    checking = asyncio.create_task(reader())
    await asyncio.gather(*(writer() for _ in range(4)))
    done.set()
    assert await checking > 0
    assert applied >= 15
    revisions = (await _revisions(api, job["jobId"], "?limit=500"))["items"]
    assert len(revisions) == applied


async def test_revisions_are_newest_first_and_keyset_paginated(api: Api) -> None:
    job = await _submit(api)
    for version in range(1, 6):
        assert (await _patch(api, job["jobId"], {"name": f"v{version}"}, version)).status == 200
    seen, cursor = [], None
    while True:
        page = await _revisions(api, job["jobId"], "?limit=2" + (f"&cursor={cursor}"
                                                                 if cursor else ""))
        seen += [r["version"] for r in page["items"]]
        cursor = page["nextCursor"]
        if cursor is None:
            break
    assert seen == [6, 5, 4, 3, 2]
    for bad in ("r1.0", "r1.99999999999", "x", "r1.-3"):
        resp = await api.client.get(f"/v1/jobs/{job['jobId']}/revisions?cursor={bad}",
                                    headers=api.auth())
        assert resp.status == 422, bad
    other = (await api.create_tenant("other"))["apiKey"]
    resp = await api.client.get(f"/v1/jobs/{job['jobId']}/revisions", headers=api.auth(other))
    assert resp.status == 404


async def test_a_dispatched_execution_keeps_the_definition_it_was_published_with(
        api: Api, schedulers, redis_client, key_prefix, clock) -> None:
    job = await _submit(api, schedule={"cron": "* * * * *"}, payload={"v": 1})
    node = await schedulers()
    await advance(clock, 60, node)
    await node.settle()
    resp = await _patch(api, job["jobId"], {"payload": {"v": 2}}, 1)
    assert resp.status == 200
    await advance(clock, 60, node)
    await node.settle()
    entries = await ready(redis_client, key_prefix)
    assert [json.loads(e["payload"]) for e in entries] == [{"v": 1}, {"v": 2}]
