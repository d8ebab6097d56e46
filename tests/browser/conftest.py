"""A real headless Chromium driving /ui over a gateway on a real socket.

The browser is Debian's `chromium` package, driven by Playwright (the dev extra),
not a browser build of Playwright's own: on a machine that lacks it the session
installs it with apt-get, and skips, saying why, where it cannot. The gateway,
scheduler and workers run as in tests/integration: the test's own database and
Redis prefix, time moved through the ManualClock.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import pytest

from herdwick.actors.scheduler import Scheduler
from herdwick.clock import ManualClock
from herdwick.config import Settings
from herdwick.storage.protocol import Protocol
from tests.integration.conftest import Api, tenant_api

try:
    from playwright.async_api import async_playwright
except ImportError:  # the dev extra is not installed
    async_playwright = None

CHROMIUM = Path("/usr/bin/chromium")
INSTALL_LOCK = Path(tempfile.gettempdir()) / "herdwick-chromium-install.lock"
INSTALL_TIMEOUT_S = 480
PAGE_TIMEOUT_MS = 10_000


def _install_chromium() -> str | None:
    """Debian's chromium, installed if missing; None, or why it cannot be had here.

    One install at a time: each pytest process (an xdist worker, a second run) that
    needs it takes INSTALL_LOCK and looks again once it holds it, and apt-get waits for
    dpkg's own lock rather than failing at once (a CI run skipped every browser test
    when two installs met)."""
    if CHROMIUM.exists():
        return None
    apt = shutil.which("apt-get")
    if apt is None:
        return f"{CHROMIUM} is missing and there is no apt-get to install Debian's chromium"
    with open(INSTALL_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if CHROMIUM.exists():
            return None
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        wait = ["-o", f"DPkg::Lock::Timeout={INSTALL_TIMEOUT_S // 2}"]
        for argv in ([apt, *wait, "install", "-y", "-q", "chromium"],
                     [apt, *wait, "update", "-q"],
                     [apt, *wait, "install", "-y", "-q", "chromium"]):
            done = subprocess.run(argv, env=env, capture_output=True, text=True,
                                  timeout=INSTALL_TIMEOUT_S)
            if "install" in argv and done.returncode == 0 and CHROMIUM.exists():
                return None
    return f"apt-get could not install chromium: {done.stderr[-2000:]}"


@pytest.fixture(scope="session")
def chromium_path() -> Path:
    if async_playwright is None:
        pytest.skip("playwright is missing: it comes with the dev extra")
    why = _install_chromium()
    if why is not None:
        pytest.skip(why)
    return CHROMIUM


@pytest.fixture(scope="session")
async def browser(chromium_path: Path) -> AsyncIterator[object]:
    async with async_playwright() as pw:
        launched = await pw.chromium.launch(executable_path=str(chromium_path), headless=True)
        try:
            yield launched
        finally:
            await launched.close()


@dataclass
class Tab:
    """One browser context (its own cookies) and its page, recording every request."""

    context: object
    page: object
    base: str
    requested: list[str] = field(default_factory=list)

    async def goto(self, path: str):
        return await self.page.goto(self.base + path)

    async def log_in(self, token: str) -> None:
        await self.goto("/ui/login")
        await self.page.fill("#token", token)
        await self.page.click("#login")
        await self.page.wait_for_url(re.compile(r".*/ui/$"))

    async def text(self, selector: str) -> str:
        return (await self.page.locator(selector).inner_text()).strip()


@dataclass
class Stack:
    api: Api
    node: Scheduler
    protocol: Protocol
    clock: ManualClock
    base: str
    browser: object
    redis: object
    key_prefix: str
    tabs: list[Tab] = field(default_factory=list)

    async def tab(self) -> Tab:
        context = await self.browser.new_context()
        context.set_default_timeout(PAGE_TIMEOUT_MS)
        page = await context.new_page()
        tab = Tab(context=context, page=page, base=self.base)
        page.on("request", lambda request: tab.requested.append(request.url))
        self.tabs.append(tab)
        return tab


@pytest.fixture
def clock() -> ManualClock:
    # Attempt times come from the Redis server's clock: the fake one starts at real time.
    return ManualClock(datetime.now(UTC).replace(microsecond=0))


@pytest.fixture
async def stack(db, db_url, services, redis_client, key_prefix, clock,
                browser) -> AsyncIterator[Stack]:
    async with tenant_api(db_url, services.redis_url, key_prefix, clock) as api:
        node = Scheduler(Settings(key_prefix=key_prefix), clock=clock, db=db,
                         redis=redis_client, node_id="node-ui", tick=False)
        await node.start()
        base = str(api.client.make_url("")).rstrip("/")
        built = Stack(api=api, node=node, protocol=Protocol(redis_client, key_prefix),
                      clock=clock, base=base, browser=browser, redis=redis_client,
                      key_prefix=key_prefix)
        try:
            yield built
        finally:
            for tab in built.tabs:
                await tab.context.close()
            await node.stop()
