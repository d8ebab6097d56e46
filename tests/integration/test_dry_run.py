"""Dry runs: each occurrence is recorded as a dry_run execution and nothing is published.

The rollout story of issue 15: a job (or a whole tenant) runs dry beside the
old system, its recorded fire times are compared, then a PATCH of dryRun:false
flips it and the next occurrence really runs. Time moves through the fake clock.
"""

from __future__ import annotations

from datetime import timedelta

from herdwick.storage import dashboard
from tests.conftest import T0
from tests.integration.conftest import Api
from tests.integration.gateway_client import ADMIN_TOKEN
from tests.integration.stack import advance, ready, submit


def _z(when) -> str:
    return when.isoformat().replace("+00:00", "Z")


async def _executions(api: Api, job_id: str) -> list[dict]:
    resp = await api.client.get(f"/v1/jobs/{job_id}/executions", headers=api.auth())
    assert resp.status == 200, await resp.text()
    return list(reversed((await resp.json())["items"]))  # oldest first


async def _job(api: Api, job_id: str) -> dict:
    return await (await api.client.get(f"/v1/jobs/{job_id}", headers=api.auth())).json()


async def test_a_dry_cron_job_records_its_fire_times_then_flips(
        api: Api, schedulers, redis_client, key_prefix, clock) -> None:
    job = await submit(api, schedule={"cron": "* * * * *", "overlap": "forbid"}, dryRun=True)
    assert (await _job(api, job["jobId"]))["dryRun"] is True
    node = await schedulers()
    for _ in range(2):
        await advance(clock, 60, node)
        await node.settle()

    # Two occurrences, at their minutes, recorded when they would have been published;
    # forbid did not hold the second back: a dry run has nothing running.
    runs = await _executions(api, job["jobId"])
    assert [(r["state"], r["scheduledFor"]) for r in runs] == [
        ("dry_run", _z(T0 + timedelta(minutes=1))), ("dry_run", _z(T0 + timedelta(minutes=2)))]
    assert all(r["finishedAt"] >= r["scheduledFor"] for r in runs)
    assert await ready(redis_client, key_prefix) == []
    assert node.published == 0
    got = await _job(api, job["jobId"])
    assert (got["state"], got["nextRunAt"]) == ("active", _z(T0 + timedelta(minutes=3)))

    # Flipped: the next occurrence runs for real.
    resp = await api.client.patch(f"/v1/jobs/{job['jobId']}", json={"dryRun": False},
                                  headers={**api.auth(), "If-Match": f'"{got["version"]}"'})
    assert resp.status == 200, await resp.text()
    await advance(clock, 60, node)
    await node.settle()
    [entry] = await ready(redis_client, key_prefix)
    assert entry["scheduled_for"] == _z(T0 + timedelta(minutes=3))
    assert (await _executions(api, job["jobId"]))[-1]["state"] == "queued"


async def test_a_dry_one_off_completes_after_its_recorded_occurrence(
        api: Api, schedulers, redis_client, key_prefix, clock, db) -> None:
    job = await submit(api, schedule={"delaySeconds": 30}, dryRun=True)
    node = await schedulers()
    await advance(clock, 30, node)
    await node.settle()
    [run] = await _executions(api, job["jobId"])
    assert (run["state"], run["scheduledFor"]) == ("dry_run", job["nextRunAt"])
    got = await _job(api, job["jobId"])
    assert (got["state"], got["nextRunAt"]) == ("completed", None)
    assert await ready(redis_client, key_prefix) == []
    # The dashboard counts what ran or waits to: a dry run did neither.
    assert await dashboard.recent(db, T0, T0 + timedelta(minutes=5), None) == {}


async def test_a_dry_tenant_runs_every_job_of_its_dry(
        api: Api, schedulers, redis_client, key_prefix, clock) -> None:
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    resp = await api.client.patch(f"/v1/tenants/{api.tenant_id}", json={"dryRun": True},
                                  headers=admin)
    assert resp.status == 200 and (await resp.json())["dryRun"] is True
    job = await submit(api, schedule={"cron": "* * * * *"})
    assert (await _job(api, job["jobId"]))["dryRun"] is False  # the job's own flag
    node = await schedulers()
    await advance(clock, 60, node)
    await node.settle()
    assert [r["state"] for r in await _executions(api, job["jobId"])] == ["dry_run"]
    assert await ready(redis_client, key_prefix) == []

    await api.client.patch(f"/v1/tenants/{api.tenant_id}", json={"dryRun": False},
                           headers=admin)
    await advance(clock, 60, node)
    await node.settle()
    assert len(await ready(redis_client, key_prefix)) == 1
    bad = await api.client.patch(f"/v1/tenants/{api.tenant_id}", json={"dryRun": "yes"},
                                 headers=admin)
    assert bad.status == 422
    assert (await bad.json())["errors"][0]["field"] == "dryRun"
