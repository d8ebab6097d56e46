"""The newcomer's first look: `herdwick dev` prints the dashboard's URL; logging in there
with the printed key shows the dev tenant's jobs and their lag.

A real `herdwick dev` process (on the suite's Postgres and Redis), so its own
clock runs: the one wait below polls the API, bounded, for the scheduler to queue
a job that is due at once.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys

import aiohttp
import pytest

from tests.browser.conftest import PAGE_TIMEOUT_MS
from tests.integration.test_dev import Dev, free_port

pytestmark = pytest.mark.timeout(600)  # the first browser test may install chromium
QUEUED_WITHIN_S = 30.0


@pytest.fixture
async def dev(tmp_path, db_url, services, key_prefix, redis_client):
    port = free_port()
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HERDWICK_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "herdwick.cli", "dev",
        env={**clean, "HERDWICK_DEV_DIR": str(tmp_path / "dev"), "HERDWICK_API_PORT": str(port),
             "HERDWICK_DATABASE_URL": db_url, "HERDWICK_REDIS_URL": services.redis_url,
             "HERDWICK_KEY_PREFIX": key_prefix},
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    started = Dev(proc, tmp_path / "dev", port)
    try:
        yield started
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            await started.exit_code(30)


async def test_the_printed_dashboard_shows_the_dev_tenant_s_jobs_and_lag(dev, browser) -> None:
    banner = await dev.banner()
    url, key = banner.values["dashboard"], banner.values["API key"]
    assert url == f"{dev.url}/ui/"
    assert "API key" in banner.notes["dashboard"]

    headers = {"Authorization": f"Bearer {key}"}
    job = {"name": "hello-dashboard", "target": {"type": "queue", "ref": "emails"},
           "schedule": {"delaySeconds": 0}}
    async with aiohttp.ClientSession(headers=headers) as http:
        async with http.post(f"{dev.url}/v1/jobs", json=job) as resp:
            assert resp.status == 201, await resp.text()
            job_id = (await resp.json())["jobId"]
        async with asyncio.timeout(QUEUED_WITHIN_S):
            while True:  # dev's own scheduler, on its own clock
                async with http.get(f"{dev.url}/v1/jobs/{job_id}/executions") as resp:
                    if (await resp.json())["items"]:
                        break
                await asyncio.sleep(0.1)

    context = await browser.new_context()
    context.set_default_timeout(PAGE_TIMEOUT_MS)
    try:
        page = await context.new_page()
        await page.goto(url)
        await page.fill("#token", key)
        await page.click("#login")
        await page.wait_for_url(re.compile(r".*/ui/$"))
        row = page.locator("tr[data-tenant]")
        assert await row.count() == 1
        assert await row.locator('[data-figure="executions"]').inner_text() == "1"
        assert re.fullmatch(r"-?\d+(\.\d+)? m?s",
                            await row.locator('[data-figure="queue_lag_p50"]').inner_text())
        await page.click("text=Jobs")
        assert await page.locator(f'tr[data-job="{job_id}"]').count() == 1
        assert "hello-dashboard" in await page.locator(f'tr[data-job="{job_id}"]').inner_text()
    finally:
        await context.close()
