"""The fault harness's http target: an aiohttp server in the test's own process.

Each delivery waits 50-200 ms (as the queue workers' handlers do, so deliveries are in
flight when a fault hits), has its Herdwick-Signature checked with the tenant's secret
and is counted by its Idempotency-Key. A bad signature is answered 400, which dead-letters
the job, so the history check fails on it as well as `bad_signatures`.
"""

from __future__ import annotations

import asyncio
import collections
import random

from aiohttp import web

from herdwick import SignatureError, verify_signature
from herdwick.loadtest.driver import free_port

DELAY_MS = (50, 200)
PATH = "/hook"


class Receiver:
    def __init__(self) -> None:
        self.secret = ""  # the tenant's signing secret, set once the tenant exists
        self.deliveries: collections.Counter[str] = collections.Counter()
        self.bad_signatures = 0
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}{PATH}"
        self._runner: web.AppRunner | None = None
        self._random = random.Random()  # delays only: the fault's choices stay the seed's

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post(PATH, self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        try:
            verify_signature(self.secret, request.headers.get("Herdwick-Signature"), body)
        except SignatureError:
            self.bad_signatures += 1
            return web.Response(status=400, text="bad signature")
        # Counted on arrival: a delivery whose sender dies mid-wait may still do the work.
        self.deliveries[request.headers.get("Idempotency-Key", "")] += 1
        await asyncio.sleep(self._random.uniform(*DELAY_MS) / 1000)
        return web.Response(text="ok")

    def repeated(self) -> int:
        """Deliveries beyond the first of an occurrence (each may have done the work)."""
        return sum(n - 1 for n in self.deliveries.values())
