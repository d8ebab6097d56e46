"""A redis-server of one scenario's own, for the faults that restart, fill or cut Redis.

The suite's shared server cannot be restarted or filled without hurting every
other test. This one listens on a free loopback port with no persistence
(`--save '' --appendonly no`), so a restart comes back empty: a crash with
nothing on disk, as the design's "Redis may lose everything" means it.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import tempfile
import time

import redis.asyncio as aioredis

from herdwick.loadtest.driver import dies_with_us, free_port

READY_TIMEOUT_S = 5.0
POLL_S = 0.02


class RedisServer:
    """Start with `await RedisServer.start()`; `restart()` kills it (SIGKILL) and starts a
    fresh one on the same port; `stop()` at the end."""

    def __init__(self, port: int, data_dir: str) -> None:
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self._dir = data_dir
        self._proc: subprocess.Popen | None = None

    @classmethod
    async def start(cls) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not on PATH")
        server = cls(free_port(), tempfile.mkdtemp(prefix="hw-faults-redis-"))
        await server._launch()
        return server

    async def _launch(self) -> None:
        # Popen, not asyncio's: the server must outlive no event loop, and stop() is sync.
        self._proc = subprocess.Popen(  # noqa: ASYNC220
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self._dir, "--maxmemory-policy", "noeviction"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=dies_with_us())
        client = aioredis.from_url(self.url, socket_connect_timeout=1)
        deadline = time.monotonic() + READY_TIMEOUT_S
        try:
            while True:
                with contextlib.suppress(OSError, aioredis.RedisError):
                    if await client.ping():
                        return
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {self.port} did not start")
                await asyncio.sleep(POLL_S)
        finally:
            await client.aclose()

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    async def restart(self) -> None:
        """A crash and a restart: everything in memory is gone, functions included."""
        self._kill()
        await self._launch()

    def stop(self) -> None:
        self._kill()
        shutil.rmtree(self._dir, ignore_errors=True)
