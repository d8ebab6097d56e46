"""/ui in a real headless Chromium: an operator's hour, read and acted on from the pages.

Each story runs real dispatch (a scheduler over the test's database and Redis),
workers played through storage.protocol, and checks what the pages say against
what the API says about the same jobs and executions.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from datetime import datetime
from pathlib import Path

import msgspec
import pytest

from herdwick import schedule as sched
from herdwick.gateway.ui import percent_text, seconds_text
from herdwick.model import Schedule
from herdwick.storage import keys
from tests.browser.conftest import Stack, Tab
from tests.integration.conftest import Api, make_job
from tests.integration.gateway_client import ADMIN_TOKEN
from tests.integration.stack import advance, ready

# The first test may pay for apt-get installing chromium (tests/browser/conftest.py).
pytestmark = pytest.mark.timeout(600)

POOL = "emails"


# --- the story's steps -------------------------------------------------------------------


async def submitted(api: Api, key: str | None = None, **overrides) -> str:
    resp = await api.submit(make_job(**overrides), key=key)
    assert resp.status == 201, await resp.text()
    return (await resp.json())["jobId"]


async def get(api: Api, path: str, key: str | None = None) -> dict:
    resp = await api.client.get(path, headers=api.auth(key))
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def due_and_published(stack: Stack, seconds: float = 2) -> list[dict]:
    """Time passes, the scheduler publishes what fell due; the ready stream's entries."""
    await advance(stack.clock, seconds, stack.node)
    await stack.node.settle()
    return await ready(stack.redis, stack.key_prefix, POOL)


async def a_busy_minute(stack: Stack) -> dict[str, str]:
    """Four jobs fall due: two succeed, one dies on its only attempt, one waits queued.
    Returns each one's execution id by what became of it."""
    for name in ("report-a", "report-b", "report-c", "report-d"):
        await submitted(stack.api, name=name, schedule={"delaySeconds": 1},
                        retry={"maxAttempts": 1, "backoffSeconds": 1})
    entries = await due_and_published(stack)
    assert len(entries) == 4
    ids = [e["execution_id"] for e in entries]
    fates = dict(zip(("succeeded", "succeeded-too", "dead", "queued"), ids, strict=True))
    for eid in ids[:3]:
        assert await stack.protocol.lease(POOL, "worker-1", 30, eid, 1) is not None
    for eid in ids[:2]:
        assert await stack.protocol.complete(POOL, eid, 1, "worker-1", '{"ok": true}')
    error = json.dumps({"type": "Boom", "message": "no such mailbox"})
    assert await stack.protocol.fail(POOL, ids[2], 1, "worker-1", error, True) == "DEAD"
    await stack.node.settle_events()
    return fates


async def executions_by_api(api: Api, key: str | None = None) -> list[dict]:
    """Every execution of the tenant's jobs, read through the API."""
    found = []
    for job in (await get(api, "/v1/jobs?limit=500", key))["items"]:
        page = await get(api, f"/v1/jobs/{job['jobId']}/executions?limit=500", key)
        found += [await get(api, f"/v1/executions/{e['executionId']}", key)
                  for e in page["items"]]
    return found


def percentile(values: list[float], fraction: float) -> float | None:
    """Postgres's percentile_cont: linear between the two nearest ranks."""
    if not values:
        return None
    ordered = sorted(values)
    rank = fraction * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def parse_time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def seconds_between(later: str, earlier: str) -> float:
    return (parse_time(later) - parse_time(earlier)).total_seconds()


async def figure(tab: Tab, tenant_id: str, name: str) -> str:
    return await tab.text(f'tr[data-tenant="{tenant_id}"] [data-figure="{name}"]')


async def screenshot(tab: Tab, name: str) -> None:
    """With HERDWICK_UI_SCREENSHOTS=DIR, keep what the page looked like, to look at."""
    folder = os.environ.get("HERDWICK_UI_SCREENSHOTS")
    if folder:
        await tab.page.screenshot(path=str(Path(folder) / f"{name}.png"), full_page=True)


def same_origin_only(tab: Tab) -> None:
    assert tab.requested, "the page loaded nothing"
    assert [u for u in tab.requested if not u.startswith(tab.base + "/ui")] == []


# --- the stories -------------------------------------------------------------------------


async def test_log_in_with_the_key_see_the_hour_and_log_out(stack: Stack) -> None:
    await a_busy_minute(stack)
    tab = await stack.tab()

    # A wrong token is refused on the login page itself.
    await tab.goto("/ui/")
    assert tab.page.url.endswith("/ui/login")
    await tab.page.fill("#token", "hw_not_a_key")
    await tab.page.click("#login")
    assert "neither a tenant" in await tab.text("#login-error")

    await tab.log_in(stack.api.key)
    cookie = next(c for c in await tab.context.cookies() if c["name"] == "herdwick_ui")
    assert (cookie["httpOnly"], cookie["sameSite"], cookie["path"]) == (True, "Strict", "/ui")

    # The overview's figures are the API's, counted from the same executions.
    runs = await executions_by_api(stack.api)
    states = [r["state"] for r in runs]
    tenant = stack.api.tenant_id
    assert await figure(tab, tenant, "executions") == str(len(runs)) == "4"
    assert await figure(tab, tenant, "dead") == str(states.count("dead")) == "1"
    assert await figure(tab, tenant, "queued") == str(states.count("queued")) == "1"
    dead_letters = await get(stack.api, "/v1/dead-letters")
    assert len(dead_letters["items"]) == 1
    finished = states.count("succeeded") + states.count("dead")
    assert await figure(tab, tenant, "failure_rate") == percent_text(
        states.count("dead") / finished)
    queue_lags = [seconds_between(r["queuedAt"], r["scheduledFor"]) for r in runs]
    start_lags = [seconds_between(r["startedAt"], r["scheduledFor"]) for r in runs
                  if r["startedAt"]]
    for name, lags, fraction in (("queue_lag_p50", queue_lags, 0.5),
                                 ("queue_lag_p99", queue_lags, 0.99),
                                 ("start_lag_p50", start_lags, 0.5),
                                 ("start_lag_p99", start_lags, 0.99)):
        assert await figure(tab, tenant, name) == seconds_text(percentile(lags, fraction)), name
    assert await tab.page.locator("svg.spark").count() == 3
    await screenshot(tab, "overview")
    same_origin_only(tab)

    await tab.page.click("#logout")
    await tab.page.wait_for_url(re.compile(r".*/ui/login$"))
    assert [c for c in await tab.context.cookies() if c["name"] == "herdwick_ui"] == []
    await tab.goto("/ui/")
    assert tab.page.url.endswith("/ui/login")


async def test_the_job_page_shows_what_the_api_says_attempt_by_attempt(stack: Stack) -> None:
    fates = await a_busy_minute(stack)
    dead = await get(stack.api, f"/v1/executions/{fates['dead']}")
    name = (await get(stack.api, f"/v1/jobs/{dead['jobId']}"))["name"]
    tab = await stack.tab()
    await tab.log_in(stack.api.key)

    # The job list, filtered by name, then the dead job's page.
    await tab.goto(f"/ui/tenants/{stack.api.tenant_id}/jobs")
    assert await tab.page.locator("tr[data-job]").count() == 4
    await tab.page.fill("#filter-name", name.upper())  # any case
    await tab.page.click("#filter")
    rows = tab.page.locator("tr[data-job]")
    assert await rows.count() == 1
    assert await rows.first.get_attribute("data-job") == dead["jobId"]
    await rows.first.locator("a").click()

    api_runs = await get(stack.api, f"/v1/jobs/{dead['jobId']}/executions")
    sections = tab.page.locator("section[data-execution]")
    assert [await s.get_attribute("data-execution") for s in await sections.all()] == [
        e["executionId"] for e in api_runs["items"]]
    section = tab.page.locator(f'section[data-execution="{fates["dead"]}"]')
    assert await section.locator('[data-field="state"]').first.inner_text() == "dead"
    attempts = section.locator("tr[data-attempt]")
    assert await attempts.count() == len(dead["attempts"]) == 1
    assert await attempts.first.locator('[data-field="worker"]').inner_text() == "worker-1"
    assert await attempts.first.locator('[data-field="outcome"]').inner_text() == "failed"
    assert "no such mailbox" in await attempts.first.inner_text()
    assert "once, 1 s after submit" in await tab.text("#job-schedule")
    await screenshot(tab, "job")
    same_origin_only(tab)


async def test_a_cron_job_s_page_lists_its_next_fire_times(stack: Stack) -> None:
    schedule = {"cron": "*/15 * * * *", "tz": "Europe/London"}
    job_id = await submitted(stack.api, name="quarterly", schedule=schedule)
    tab = await stack.tab()
    await tab.log_in(stack.api.key)
    await tab.goto(f"/ui/tenants/{stack.api.tenant_id}/jobs/{job_id}")
    expected = sched.next_fire_times(msgspec.convert(schedule, Schedule), stack.clock.now(), 5,
                                     job_id=uuid.UUID(job_id))
    shown = await tab.page.locator("#next-fires li").all_inner_texts()
    assert shown == [sched.format_utc(t) for t in expected]
    job = await get(stack.api, f"/v1/jobs/{job_id}")
    assert await tab.text("#next-run") == sched.format_utc(parse_time(job["nextRunAt"]))
    assert shown[0] == await tab.text("#next-run")
    assert await tab.text("#no-executions") == "no execution yet"


async def test_pause_resume_and_run_now_do_what_the_api_does(stack: Stack) -> None:
    job_id = await submitted(stack.api, name="nightly", schedule={"cron": "0 3 * * *"})
    tab = await stack.tab()
    await tab.log_in(stack.api.key)
    await tab.goto(f"/ui/tenants/{stack.api.tenant_id}/jobs/{job_id}")

    await tab.page.click("#pause")
    assert await tab.text("#job-state") == "paused"
    assert (await get(stack.api, f"/v1/jobs/{job_id}"))["state"] == "paused"
    await tab.page.click("#resume")
    assert await tab.text("#job-state") == "active"
    assert (await get(stack.api, f"/v1/jobs/{job_id}"))["state"] == "active"

    # Run now: an execution outside the schedule, which the scheduler then publishes.
    await tab.page.click("#trigger")
    await tab.page.wait_for_url(re.compile(r".*/executions/[0-9a-f-]+\?did=trigger$"))
    triggered = tab.page.url.split("/executions/")[1].split("?")[0]
    listed = await get(stack.api, f"/v1/jobs/{job_id}/executions")
    assert [e["executionId"] for e in listed["items"]] == [triggered]
    entries = await due_and_published(stack, 1)
    assert [(e["execution_id"], e["attempt"]) for e in entries] == [(triggered, "1")]


async def test_cancel_cancels_the_job_and_tells_its_running_worker(stack: Stack) -> None:
    job_id = await submitted(stack.api, name="long-one", schedule={"delaySeconds": 1})
    [entry] = await due_and_published(stack)
    eid = entry["execution_id"]
    assert await stack.protocol.lease(POOL, "worker-9", 30, eid, 1) is not None
    await stack.node.settle_events()
    tab = await stack.tab()
    await tab.log_in(stack.api.key)
    await tab.goto(f"/ui/tenants/{stack.api.tenant_id}/jobs/{job_id}")
    assert await tab.text(f'section[data-execution="{eid}"] [data-field="state"]') == "running"

    await tab.page.click("#cancel")
    assert await tab.text("#job-state") == "canceled"
    assert (await get(stack.api, f"/v1/jobs/{job_id}"))["state"] == "canceled"
    # The worker holding it hears LEASE_LOST on its next call, as after DELETE /v1/jobs/{id}.
    assert await stack.protocol.heartbeat(POOL, eid, 1, "worker-9", 30) is None
    await stack.node.settle_events()
    assert (await get(stack.api, f"/v1/executions/{eid}"))["state"] == "canceled"
    assert await tab.page.locator("#pause").count() == 0


async def test_retry_of_a_dead_letter_queues_its_next_attempt(stack: Stack) -> None:
    fates = await a_busy_minute(stack)
    eid = fates["dead"]
    tab = await stack.tab()
    await tab.log_in(stack.api.key)
    await tab.goto(f"/ui/tenants/{stack.api.tenant_id}/dead-letters")
    assert [await r.get_attribute("data-execution")
            for r in await tab.page.locator("tr[data-execution]").all()] == [
        d["executionId"] for d in (await get(stack.api, "/v1/dead-letters"))["items"]] == [eid]

    await tab.page.click(f"#retry-{eid}")
    # Due at once: the replay told the shard's owner, which may have queued it already.
    assert await tab.text("#execution-state") in ("retry_wait", "queued")
    entries = await due_and_published(stack, 1)
    assert (entries[-1]["execution_id"], entries[-1]["attempt"]) == (eid, "2")
    replayed = await get(stack.api, f"/v1/executions/{eid}")
    assert (replayed["state"], replayed["attempt"]) == ("queued", 2)
    await tab.page.reload()
    assert await tab.text("#execution-state") == "queued"
    assert await tab.text("#execution-attempt") == "2"
    assert (await get(stack.api, "/v1/dead-letters"))["items"] == []


async def test_a_tenant_key_cannot_see_another_tenant(stack: Stack) -> None:
    other = await stack.api.create_tenant("globex")
    theirs = await submitted(stack.api, key=other["apiKey"], name="globex-payroll")
    mine = await submitted(stack.api, name="acme-digest")
    tab = await stack.tab()
    await tab.log_in(stack.api.key)
    assert await tab.page.locator(f'tr[data-tenant="{other["tenantId"]}"]').count() == 0
    assert await tab.page.locator(f'tr[data-tenant="{stack.api.tenant_id}"]').count() == 1

    await tab.goto(f"/ui/tenants/{stack.api.tenant_id}/jobs")
    listed = [await r.get_attribute("data-job")
              for r in await tab.page.locator("tr[data-job]").all()]
    assert listed == [mine]
    for path in (f"/ui/tenants/{other['tenantId']}/jobs/{theirs}",
                 f"/ui/tenants/{stack.api.tenant_id}/jobs/{theirs}",
                 f"/ui/tenants/{other['tenantId']}/jobs"):
        response = await tab.goto(path)
        assert response.status == 404, path
        assert "globex" not in await tab.page.content()

    # The admin, in a browser of its own, sees both.
    admin = await stack.tab()
    await admin.log_in(ADMIN_TOKEN)
    for tenant in (stack.api.tenant_id, other["tenantId"]):
        assert await admin.page.locator(f'tr[data-tenant="{tenant}"]').count() == 1
    response = await admin.goto(f"/ui/tenants/{other['tenantId']}/jobs/{theirs}")
    assert response.status == 200 and "globex-payroll" in await admin.page.content()


async def test_a_post_without_the_csrf_token_is_refused(stack: Stack) -> None:
    job_id = await submitted(stack.api, name="keep-running", schedule={"cron": "0 3 * * *"})
    tab = await stack.tab()
    await tab.log_in(stack.api.key)
    pause = f"{stack.base}/ui/tenants/{stack.api.tenant_id}/jobs/{job_id}/pause"

    # The browser's own session cookie, but no token: refused.
    bare = await tab.context.request.post(pause, form={"x": "1"})
    assert bare.status == 403
    # A form on a page from elsewhere, posting into the dashboard: refused too.
    await tab.page.set_content(f'<form method="post" action="{pause}">'
                               '<button id="go">win a prize</button></form>')
    async with tab.page.expect_navigation() as landed:
        await tab.page.click("#go")
    assert (await landed.value).status in (401, 403)
    assert (await get(stack.api, f"/v1/jobs/{job_id}"))["state"] == "active"
    # With the page's own form it works.
    await tab.goto(f"/ui/tenants/{stack.api.tenant_id}/jobs/{job_id}")
    await tab.page.click("#pause")
    assert (await get(stack.api, f"/v1/jobs/{job_id}"))["state"] == "paused"


async def test_an_execution_page_shows_its_possible_duplicates(stack: Stack) -> None:
    """The GC-pause story seen from the dashboard: worker A's lease lapsed, B finished,
    A's late complete was refused, and the execution says A may have acted too."""
    await submitted(stack.api, schedule={"delaySeconds": 1},
                    retry={"maxAttempts": 3, "backoffSeconds": 1})
    [entry] = await due_and_published(stack)
    eid = entry["execution_id"]
    assert await stack.protocol.lease(POOL, "worker-a", 30, eid, 1) is not None
    await stack.node.settle_events()
    hot = keys.hot_state(stack.key_prefix, POOL, eid)
    await stack.redis.hset(hot, "lease_until", 1)
    await stack.redis.zadd(keys.pool_base(stack.key_prefix, POOL)
                                + ":leases", {eid: 1})
    assert await stack.node.reaper.run_once() == 1
    await stack.node.settle_events()
    await due_and_published(stack, 3)
    assert await stack.protocol.lease(POOL, "worker-b", 30, eid, 2) is not None
    assert await stack.protocol.complete(POOL, eid, 2, "worker-b", '{"sent": true}')
    assert await stack.protocol.complete(POOL, eid, 1, "worker-a", '{"sent": true}') is False
    await stack.node.settle_events()

    got = await get(stack.api, f"/v1/executions/{eid}")
    tab = await stack.tab()
    await tab.log_in(stack.api.key)
    await tab.goto(f"/ui/tenants/{stack.api.tenant_id}/executions/{eid}")
    workers = await tab.page.locator('tr[data-attempt] [data-field="worker"]').all_inner_texts()
    assert workers == [a["workerId"] for a in got["attempts"]] == ["worker-a", "worker-b"]
    await screenshot(tab, "execution")
    duplicates = tab.page.locator("tr[data-duplicate]")
    assert await duplicates.count() == len(got.get("possibleDuplicates", []))
    if got.get("possibleDuplicates"):
        assert "worker-a" in await duplicates.first.inner_text()
