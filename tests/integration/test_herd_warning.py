"""The spiky-schedule warning: a 201 says so when a tenant's jobs pile into one second.

The gateway here warns at five jobs (HERDWICK_HERD_WARN_JOBS=5), so a herd
costs a handful of rows. T0 is 2026-12-02 12:00:00 UTC.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest

from herdwick.config import ConfigError, from_env
from tests.conftest import T0
from tests.integration.conftest import Api, make_job, tenant_api
from tests.integration.stack import advance, ready

WARN_JOBS = 5
ONE_PM = T0 + timedelta(hours=1)


@pytest.fixture
async def api(db_url, services, key_prefix, clock) -> AsyncIterator[Api]:
    async with tenant_api(db_url, services.redis_url, key_prefix, clock,
                          herd_warn_jobs=WARN_JOBS) as holder:
        yield holder


def rfc3339(dt: datetime) -> str:
    return dt.astimezone(UTC).isoformat().replace("+00:00", "Z")


def one_offs(count: int, when: datetime, **schedule) -> list[dict]:
    return [make_job(name=f"j{i}", schedule={"runAt": rfc3339(when), **schedule})
            for i in range(count)]


async def batch(api: Api, jobs: list[dict], **headers) -> dict:
    resp = await api.client.post("/v1/jobs:batch", json={"jobs": jobs},
                                 headers={**api.auth(), **headers})
    assert resp.status == 201, await resp.text()
    return await resp.json()


async def single(api: Api, when: datetime) -> list[str]:
    resp = await api.submit(make_job(schedule={"runAt": rfc3339(when)}))
    assert resp.status == 201, await resp.text()
    return (await resp.json())["warnings"]


def warning(second: datetime, limit: int = WARN_JOBS) -> str:
    return (f"at least {limit} of this tenant's jobs are due in the second {rfc3339(second)}; "
            "spread them with schedule.jitterSeconds (e.g. 60)")


async def test_the_threshold_is_the_herd_warn_jobs_setting(api: Api, db_url, services,
                                                           key_prefix, clock) -> None:
    assert (await batch(api, one_offs(4, ONE_PM)))["warnings"] == []
    two_pm = ONE_PM + timedelta(hours=1)
    assert (await batch(api, one_offs(5, two_pm)))["warnings"] == [warning(two_pm)]
    async with tenant_api(db_url, services.redis_url, key_prefix, clock) as default:
        assert (await batch(default, one_offs(5, ONE_PM)))["warnings"] == []


async def test_a_request_adds_to_the_second_an_earlier_one_filled(api: Api) -> None:
    assert (await batch(api, one_offs(3, ONE_PM)))["warnings"] == []
    assert await single(api, ONE_PM) == []  # the fourth
    assert await single(api, ONE_PM + timedelta(seconds=0.5)) == [warning(ONE_PM)]  # the fifth
    assert await single(api, ONE_PM + timedelta(seconds=1)) == []


async def test_a_paused_job_leaves_the_count_until_it_is_resumed(api: Api) -> None:
    """The tenant's side counts the occurrences waiting in the due index: a pause takes
    its job's out, a resume puts it back (with its tenant, whom it counts for)."""
    two_pm = ONE_PM + timedelta(hours=1)
    herd = (await batch(api, one_offs(4, two_pm)))["items"]
    await api.client.post(f"/v1/jobs/{herd[0]['jobId']}:pause", headers=api.auth())
    assert await single(api, two_pm) == []  # three waiting and this one

    first = (await batch(api, one_offs(2, ONE_PM)))["items"]
    await api.client.post(f"/v1/jobs/{first[0]['jobId']}:pause", headers=api.auth())
    assert (await batch(api, one_offs(2, ONE_PM)))["warnings"] == []
    resumed = await api.client.post(f"/v1/jobs/{first[0]['jobId']}:resume", headers=api.auth())
    assert resumed.status == 200, await resumed.text()
    assert await single(api, ONE_PM) == [warning(ONE_PM)]  # four waiting and this one


async def test_a_job_moved_by_a_patch_counts_in_its_new_second(api: Api) -> None:
    await batch(api, one_offs(3, ONE_PM))
    moved = (await batch(api, one_offs(1, ONE_PM + timedelta(hours=2))))["items"][0]
    resp = await api.client.patch(
        f"/v1/jobs/{moved['jobId']}", data=json.dumps({"schedule": {"runAt": rfc3339(ONE_PM)}}),
        headers={**api.auth(), "Content-Type": "application/merge-patch+json",
                 "If-Match": '"1"'})
    assert resp.status == 200, await resp.text()
    assert await single(api, ONE_PM) == [warning(ONE_PM)]


async def test_a_cron_job_s_next_fire_counts_once_dispatched(api: Api, schedulers,
                                                              clock) -> None:
    """Dispatch writes a cron job's next occurrence into the due index with its tenant."""
    ten_past = T0 + timedelta(minutes=10)
    resp = await api.submit(make_job(schedule={"cron": "*/10 * * * *", "overlap": "allow"}))
    assert (await resp.json())["nextRunAt"] == rfc3339(ten_past)
    node = await schedulers()
    await advance(clock, 11 * 60, node)  # its 12:10 fire dispatched; 12:20 waits
    await node.settle()
    twenty_past = ten_past + timedelta(minutes=10)
    assert (await batch(api, one_offs(3, twenty_past)))["warnings"] == []
    assert await single(api, twenty_past) == [warning(twenty_past)]  # the cron fire, 3, this


async def test_a_batch_warns_for_a_second_other_than_its_busiest(api: Api) -> None:
    busy = ONE_PM + timedelta(minutes=30)
    await batch(api, one_offs(4, busy))
    # Three due at one o'clock (nothing else is then) and one joining the four at half past.
    body = await batch(api, one_offs(3, ONE_PM) + one_offs(1, busy))
    assert body["warnings"] == [warning(busy)]


@pytest.mark.parametrize("cron", ["0 13 * * *", "*/5 * * * *"],
                         ids=["first-fire", "twelfth-fire"])
async def test_a_cron_job_firing_in_a_busy_second_warns(api: Api, cron: str) -> None:
    await batch(api, one_offs(4, ONE_PM))
    resp = await api.submit(make_job(schedule={"cron": cron}))
    assert (await resp.json())["warnings"] == [warning(ONE_PM)]


async def test_cron_fires_are_checked_a_day_ahead_only(api: Api) -> None:
    tomorrow = ONE_PM + timedelta(days=1)  # 25 hours after the submit
    await batch(api, one_offs(4, tomorrow))
    resp = await api.submit(make_job(schedule={"cron": "0 13 * * *"}))
    assert (await resp.json())["warnings"] == []


async def test_a_replay_answers_the_warning_the_original_gave(api: Api) -> None:
    busy = ONE_PM + timedelta(minutes=30)
    await batch(api, one_offs(4, busy))
    jobs = one_offs(3, ONE_PM) + one_offs(1, busy)
    first = await api.client.post("/v1/jobs:batch", json={"jobs": jobs},
                                  headers={**api.auth(), "Idempotency-Key": "k1"})
    again = await api.client.post("/v1/jobs:batch", json={"jobs": jobs},
                                  headers={**api.auth(), "Idempotency-Key": "k1"})
    assert (first.status, again.status) == (201, 201)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert await again.read() == await first.read()
    assert (await again.json())["warnings"] == [warning(busy)]


@pytest.mark.parametrize("value", ["0", "-3", "many", "2.5"])
def test_an_invalid_herd_warn_jobs_is_refused(value: str) -> None:
    with pytest.raises(ConfigError, match="HERDWICK_HERD_WARN_JOBS"):
        from_env({"HERDWICK_HERD_WARN_JOBS": value})


@pytest.mark.parametrize(("args", "env", "named"), [
    (["api"], {"HERDWICK_HERD_WARN_JOBS": "0"}, "HERDWICK_HERD_WARN_JOBS must be at least 1"),
    (["api", "--herd-warn-jobs", "lots"], {}, "--herd-warn-jobs must be a whole number"),
], ids=["variable", "flag"])
async def test_the_api_refuses_to_start_with_an_invalid_herd_warn_jobs(args, env, named) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "herdwick.cli", *args, env={**os.environ, **env},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2
    assert named in err.decode()


async def test_jitter_spreads_a_herd_over_its_window(db_url, services, key_prefix, clock,
                                                     schedulers, redis_client, db) -> None:
    """docs/reference.md: each occurrence runs at nominal + a stable per-job offset in
    [0, jitter)."""
    async with tenant_api(db_url, services.redis_url, key_prefix, clock,
                          herd_warn_jobs=100) as api:
        nominal = T0 + timedelta(minutes=1)
        herd = await batch(api, one_offs(200, nominal + timedelta(days=1)))
        assert herd["warnings"] == [warning(nominal + timedelta(days=1), 100)]
        spread = await batch(api, one_offs(200, nominal, jitterSeconds=10))
    assert spread["warnings"] == []
    due = sorted(datetime.fromisoformat(item["nextRunAt"]) for item in spread["items"])
    assert nominal <= due[0] and due[-1] < nominal + timedelta(seconds=10)
    assert len({d.replace(microsecond=0) for d in due}) >= 8

    node = await schedulers()
    await advance(clock, 65, node)  # nominal + 5 s
    await node.settle()
    assert await scheduled_for(db) == [d for d in due if d <= clock.now()]
    await advance(clock, 6, node)  # nominal + 11 s: every offset has passed
    await node.settle()
    assert await scheduled_for(db) == due
    published = await ready(redis_client, key_prefix)
    assert sorted(datetime.fromisoformat(e["scheduled_for"]) for e in published) == due


async def scheduled_for(db) -> list[datetime]:
    async with db.connection() as conn:
        rows = await conn.fetch("SELECT scheduled_for FROM executions ORDER BY scheduled_for")
    return [r["scheduled_for"] for r in rows]
