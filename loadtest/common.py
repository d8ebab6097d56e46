"""What every load test needs: loopback-only targets and scratch database names."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ipaddress
import urllib.parse

from herdwick.config import ConfigError


def require_loopback(url: str, what: str) -> None:
    """Load goes to this machine only: a loopback host, or a local socket path."""
    parts = urllib.parse.urlsplit(url)
    for host in [parts.hostname, *urllib.parse.parse_qs(parts.query).get("host", [])]:
        if host is None or host.startswith("/") or host == "localhost":
            continue
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise ConfigError(f"{what}: {host!r} is not a loopback address; the load test "
                              "only targets this machine")


def with_database(dsn: str, name: str) -> str:
    parts = urllib.parse.urlsplit(dsn)
    return urllib.parse.urlunsplit(parts._replace(path="/" + name))


class Child:
    """A herdwick child process. Its merged output drains into a short tail, so a full pipe
    never blocks it and a failure can say why; it counts as started at its `marker` line.

    Subclasses name the command, the marker, the timeouts and the error to raise.
    """

    command = "herdwick"
    marker = ""
    start_timeout_s = 30.0
    stop_timeout_s = 20.0
    error: type[Exception] = RuntimeError

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self.is_started = False
        self._settled = asyncio.Event()  # set once it has started or its output ended
        self.drain = asyncio.create_task(self._drain())

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def _drain(self) -> None:
        assert self.proc.stdout is not None
        async for line in self.proc.stdout:
            text = line.decode(errors="replace").rstrip()
            self.tail.append(text)
            if self.marker in text:
                self.is_started = True
                self._settled.set()
        self._settled.set()

    def check_alive(self) -> None:
        if self.proc.returncode is not None:
            raise self.error(f"{self.command} pid {self.pid} exited ({self.proc.returncode}):\n"
                             + "\n".join(self.tail))

    async def started(self) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._settled.wait(), self.start_timeout_s)
        if not self.is_started:
            raise self.error(f"{self.command} did not start (exit {self.proc.returncode}):\n"
                             + "\n".join(self.tail))

    async def stop(self) -> None:
        """SIGTERM (a clean stop), SIGKILL past the deadline."""
        try:
            if self.proc.returncode is None:
                self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), self.stop_timeout_s)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
            await asyncio.wait_for(self.drain, self.stop_timeout_s)
        except BaseException:
            # Cancelled while stopping (a second Ctrl-C): never leave the child behind.
            if self.proc.returncode is None:
                self.proc.kill()
            self.drain.cancel()
            raise
