"""`herdwick dev` as a newcomer runs it: a real process, its banner read from stdout.

Most tests point dev at the suite's Postgres and Redis (a fresh database and key
prefix each) to start in about a second; those about the embedded servers use
them (Redis always; Postgres where a second dev could take it over).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shlex
import signal
import socket
import stat
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import msgspec
import psutil
import pytest

from herdwick.dev import CREDENTIALS_FILE, LOCK_FILE
from herdwick.ids import SHARD_COUNT
from tests.proxy import Proxy
from tests.services import with_database

BANNER_TIMEOUT_S = 60.0  # a first embedded initdb included
STOP_BOUND_S = 10.0  # SIGINT/SIGTERM to exit, whatever state the services are in
REFUSE_BOUND_S = 10.0  # a second dev on the same directory gives up within this
WAIT_S = 15.0  # anything else dev should do promptly
HARD_STOP_S = 15.0  # teardown: SIGTERM, then SIGKILL after this
MAX_LOGGED_EXCEPTIONS = 5  # a restart loop with backoff logs a few; a tight loop, thousands
GIVEN_TOKEN = "given-admin-token-0123456789"

# "  API key:      hwk_...   (reused from ...)": a name, a value, and a note in brackets.
_FIELD = re.compile(r"^  (?P<name>[A-Za-z ]+?):\s+(?P<value>\S+)(?:\s+\((?P<note>.*)\))?$")
_CHAINED = ("During handling of the above exception, another exception occurred:",
            "The above exception was the direct cause of the following exception:")


@dataclass
class Banner:
    lines: list[str]
    values: dict[str, str] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, lines: list[str]) -> Banner:
        banner = cls(lines)
        for line in lines:
            if match := _FIELD.match(line):
                banner.values[match["name"]] = match["value"]
                banner.notes[match["name"]] = match["note"] or ""
        return banner

    @property
    def worker_command(self) -> str:
        (line,) = [x.strip() for x in self.lines if " herdwick worker " in x]
        return line


class Dev:
    """One `herdwick dev` process. stderr is read all along, so a full pipe never blocks it."""

    def __init__(self, proc: asyncio.subprocess.Process, data_dir: Path, port: int) -> None:
        self.proc = proc
        self.data_dir = data_dir
        self.url = f"http://127.0.0.1:{port}"
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self._new_stderr = asyncio.Condition()  # notified by _read_stderr at each line
        self._stderr_done = asyncio.create_task(self._read_stderr())

    async def _read_stderr(self) -> None:
        async for raw in self.proc.stderr:
            async with self._new_stderr:
                self.stderr.append(raw.decode(errors="replace").rstrip("\n"))
                self._new_stderr.notify_all()

    async def banner(self) -> Banner:
        async with asyncio.timeout(BANNER_TIMEOUT_S):
            while True:
                raw = await self.proc.stdout.readline()
                if not raw:
                    code = await self.exit_code(WAIT_S)
                    raise AssertionError(f"dev exited ({code}) before its banner:\n"
                                         + "\n".join(self.stderr[-40:]))
                line = raw.decode().rstrip("\n")
                self.stdout.append(line)
                if line.lstrip().startswith("-H 'Content-Type"):  # the banner's last line
                    return Banner.parse(self.stdout)

    async def exit_code(self, within_s: float) -> int:
        code = await asyncio.wait_for(self.proc.wait(), within_s)
        await self._stderr_done
        return code

    async def stop(self, sig: int = signal.SIGTERM, within_s: float = STOP_BOUND_S) -> int:
        self.proc.send_signal(sig)
        try:
            return await self.exit_code(within_s)
        except TimeoutError:
            since = len(self.stderr)
            self.proc.send_signal(signal.SIGUSR2)  # where its tasks wait (herdwick/cli.py)
            await asyncio.sleep(2.0)
            dump = "\n".join(self.stderr[since:]) or "(no task dump: its event loop is blocked)"
            tail = "\n".join(self.stderr[max(0, since - 30):since])
            raise AssertionError(f"dev did not stop within {within_s} s; its log:\n{tail}\n"
                                 f"its tasks:\n{dump}") from None

    async def wait_for_stderr(self, pattern: str, count: int = 1) -> None:
        async with asyncio.timeout(WAIT_S), self._new_stderr:
            await self._new_stderr.wait_for(
                lambda: sum(pattern in line for line in self.stderr) >= count)

    def logged_exceptions(self, since: int = 0) -> int:
        """Exceptions logged with their traceback; a chained one counts once."""
        lines = self.stderr[since:]
        starts = [i for i, line in enumerate(lines) if line.startswith("Traceback")]
        return sum(1 for i in starts
                   if not any(lines[j] in _CHAINED for j in range(max(0, i - 2), i)))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _stop_leftover_postmaster(data_dir: Path) -> None:
    """Embedded Postgres outlives a SIGKILLed dev (pg_ctl detaches it): end it after a failure."""
    pidfile = data_dir / "postgres" / "postmaster.pid"
    with contextlib.suppress(FileNotFoundError, ValueError, IndexError, psutil.Error):
        proc = psutil.Process(int(pidfile.read_text().split()[0]))
        if str(data_dir) in " ".join(proc.cmdline()):
            proc.kill()


@pytest.fixture
async def start_dev(tmp_path: Path) -> AsyncIterator:
    """start_dev(data_dir=..., **env) -> a started Dev; embedded servers unless URLs are given."""
    started: list[Dev] = []

    async def start(data_dir: Path | None = None, **env: str) -> Dev:
        data_dir = data_dir or tmp_path / "dev"
        port = free_port()
        clean = {k: v for k, v in os.environ.items() if not k.startswith("HERDWICK_")}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "herdwick.cli", "dev",
            env={**clean, "HERDWICK_DEV_DIR": str(data_dir), "HERDWICK_API_PORT": str(port),
                 **env},
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
        dev = Dev(proc, data_dir, port)
        started.append(dev)
        return dev

    try:
        yield start
    finally:
        for dev in started:
            if dev.proc.returncode is None:
                dev.proc.send_signal(signal.SIGTERM)
                try:
                    await dev.exit_code(HARD_STOP_S)
                except TimeoutError:
                    dev.proc.kill()
                    await dev.proc.wait()
                    _stop_leftover_postmaster(dev.data_dir)


@pytest.fixture
def external(db_url: str, services, key_prefix: str, redis_client) -> dict[str, str]:
    """The suite's Postgres (a fresh database) and Redis (a fresh key prefix, removed after)."""
    return {"HERDWICK_DATABASE_URL": db_url, "HERDWICK_REDIS_URL": services.redis_url,
            "HERDWICK_KEY_PREFIX": key_prefix}


async def _status(url: str, path: str, *, token: str | None = None,
                  json: dict | None = None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as http:
        method = http.post if json is not None else http.get
        async with method(url + path, json=json, headers=headers) as resp:
            return resp.status, await resp.json(content_type=None)


def _job(**overrides) -> dict:
    return {"name": "hello", "target": {"type": "queue", "ref": "emails"},
            "schedule": {"delaySeconds": 60}, "payload": {"hi": 1}, **overrides}


def _valkey_pid(data_dir: Path) -> int:
    return int((data_dir / "valkey" / "valkey.pid").read_text().split()[0])


# -- one dev per data directory -------------------------------------------------------


async def test_a_second_dev_on_the_same_data_dir_refuses_and_leaves_the_first_alone(
        start_dev) -> None:
    first = await start_dev()  # embedded Postgres and Redis, as `./run dev` runs
    await first.banner()
    redis_pid = _valkey_pid(first.data_dir)
    postmaster = (first.data_dir / "postgres" / "postmaster.pid").read_text()

    second = await start_dev(first.data_dir)
    code = await second.exit_code(REFUSE_BOUND_S)

    assert code != 0
    said = [line for line in second.stderr if line.strip()]
    assert len(said) == 1, said
    assert f"pid {first.proc.pid}" in said[0] and str(first.data_dir) in said[0]
    assert (first.data_dir / LOCK_FILE).read_text().strip() == str(first.proc.pid)
    # Nothing of the first's was touched: the same Redis and Postgres, still serving it.
    assert _valkey_pid(first.data_dir) == redis_pid and psutil.pid_exists(redis_pid)
    assert (first.data_dir / "postgres" / "postmaster.pid").read_text() == postmaster
    status, body = await _status(first.url, "/readyz")
    assert (status, body["checks"]) == (200, {"postgres": "ok", "redis": "ok"})
    assert await first.stop() == 0


async def test_dev_on_a_busy_port_says_so_in_one_line_and_starts_nothing(
        start_dev, external, tmp_path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        dev = await start_dev(**external, HERDWICK_API_PORT=str(port))
        code = await dev.exit_code(WAIT_S)

    assert code == 1
    said = [line for line in dev.stderr if line.strip()]
    assert said == [f"herdwick: 127.0.0.1:{port} is in use by another process; stop it or "
                    "set HERDWICK_API_PORT"]
    assert not (tmp_path / "dev" / CREDENTIALS_FILE).exists()  # no key issued for nothing


# -- credentials kept across restarts -------------------------------------------------


async def test_a_restart_reuses_the_api_key_and_admin_token(start_dev, external) -> None:
    first = await start_dev(**external)
    issued = await first.banner()
    assert await first.stop() == 0

    again = await start_dev(**external)
    kept = await again.banner()

    assert kept.values["API key"] == issued.values["API key"]
    assert kept.values["admin token"] == issued.values["admin token"]
    assert kept.values["dev tenant"] == issued.values["dev tenant"]
    assert issued.notes["API key"].startswith("new") and kept.notes["API key"].startswith("reused")
    assert kept.notes["admin token"].startswith("reused")
    status, _ = await _status(again.url, "/v1/jobs", token=kept.values["API key"], json=_job())
    assert status == 201
    status, _ = await _status(again.url, "/v1/tenants", token=kept.values["admin token"],
                              json={"name": "acme"})
    assert status == 201
    saved = again.data_dir / CREDENTIALS_FILE
    assert stat.S_IMODE(saved.stat().st_mode) == 0o600
    assert msgspec.json.decode(saved.read_bytes())["api_key"] == kept.values["API key"]


async def test_a_given_admin_token_wins_and_the_kept_one_comes_back_after(
        start_dev, external) -> None:
    first = await start_dev(**external)
    kept = (await first.banner()).values["admin token"]
    assert await first.stop() == 0

    given = await start_dev(**external, HERDWICK_ADMIN_TOKEN=GIVEN_TOKEN)
    banner = await given.banner()
    assert banner.values["admin token"] == GIVEN_TOKEN
    assert banner.notes["admin token"] == "from HERDWICK_ADMIN_TOKEN"
    assert await given.stop() == 0

    after = await start_dev(**external)
    assert (await after.banner()).values["admin token"] == kept


async def test_a_saved_key_the_database_does_not_know_is_replaced_and_the_banner_says_so(
        start_dev, external, services, databases) -> None:
    first = await start_dev(**external)
    issued = await first.banner()
    assert await first.stop() == 0

    fresh = await databases.take()  # the saved key was issued in another database
    try:
        moved = {**external, "HERDWICK_DATABASE_URL": with_database(services.admin_dsn, fresh)}
        again = await start_dev(**moved)
        banner = await again.banner()

        assert banner.values["API key"] != issued.values["API key"]
        assert banner.notes["API key"].startswith(
            "new: the saved key does not work against this database")
        assert banner.values["admin token"] == issued.values["admin token"]
        status, _ = await _status(again.url, "/v1/jobs", token=banner.values["API key"],
                                  json=_job())
        assert status == 201
        assert await again.stop() == 0
    finally:
        databases.give_back(fresh)


# -- the banner tells a worker where to connect -----------------------------------------


async def test_the_banner_prints_the_redis_url_and_a_worker_command_that_works(
        start_dev, external, tmp_path) -> None:
    dev = await start_dev(**external)
    banner = await dev.banner()
    assert banner.values["redis"] == external["HERDWICK_REDIS_URL"]

    *assignments, program, command, target = shlex.split(banner.worker_command)
    env = dict(a.split("=", 1) for a in assignments)
    assert env == {"HERDWICK_REDIS_URL": external["HERDWICK_REDIS_URL"],
                   "HERDWICK_KEY_PREFIX": external["HERDWICK_KEY_PREFIX"]}
    assert (program, command, target) == ("herdwick", "worker", "app:worker")

    # Run it as printed, on the app.py the banner describes, and a job gets done.
    (tmp_path / "app.py").write_text(textwrap.dedent("""
        import herdwick

        worker = herdwick.Worker(pool="emails")

        @worker.handler
        async def send(ctx):
            return {"sent": ctx.payload["hi"]}
    """))
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HERDWICK_")}
    worker = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "herdwick.cli", command, target, env={**clean, **env},
        cwd=tmp_path, stdin=asyncio.subprocess.DEVNULL)
    try:
        key = banner.values["API key"]
        status, job = await _status(dev.url, "/v1/jobs", token=key,
                                    json=_job(schedule={"delaySeconds": 0}))
        assert status == 201
        async with asyncio.timeout(WAIT_S):
            while True:
                _, page = await _status(dev.url, f"/v1/jobs/{job['jobId']}/executions",
                                        token=key)
                if [e["state"] for e in page["items"]] == ["succeeded"]:
                    break
                await asyncio.sleep(0.1)
    finally:
        worker.send_signal(signal.SIGTERM)
        await asyncio.wait_for(worker.wait(), WAIT_S)


async def test_dev_delivers_an_http_job_signed_with_the_tenant_s_secret(
        start_dev, external) -> None:
    import json

    from aiohttp import web

    import herdwick

    got: list[tuple[dict, bytes]] = []
    arrived = asyncio.Event()

    async def hook(request: web.Request) -> web.Response:
        got.append((dict(request.headers), await request.read()))
        arrived.set()
        return web.Response(text="thanks")

    app = web.Application()
    app.router.add_post("/hook", hook)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        dev = await start_dev(**external, HERDWICK_HTTP_ALLOW="127.0.0.0/8")
        banner = await dev.banner()
        token = banner.values["admin token"]
        tenant = banner.values["dev tenant"]
        status, rotated = await _status(dev.url, f"/v1/tenants/{tenant}:rotate-secret",
                                        token=token, json={"overlapSeconds": 0})
        assert status == 200, rotated
        status, job = await _status(
            dev.url, "/v1/jobs", token=banner.values["API key"],
            json=_job(target={"type": "http", "ref": f"http://127.0.0.1:{port}/hook"},
                      schedule={"delaySeconds": 0}))
        assert status == 201, job
        await asyncio.wait_for(arrived.wait(), WAIT_S)
    finally:
        await runner.cleanup()
    headers, body = got[0]
    assert json.loads(body) == {"hi": 1}
    herdwick.verify_signature(rotated["signingSecret"], headers["Herdwick-Signature"], body)


# -- stopping ------------------------------------------------------------------------------


async def test_sigterm_stops_dev_promptly_with_exit_code_0(start_dev, external) -> None:
    dev = await start_dev(**external)
    await dev.banner()
    # SIGUSR2 only logs where its tasks wait (docs/operations.md); it keeps running.
    dev.proc.send_signal(signal.SIGUSR2)
    await dev.wait_for_stderr("event=tasks_dumped")
    await dev.wait_for_stderr("--- ")
    assert dev.proc.returncode is None
    began = time.monotonic()
    assert await dev.stop(signal.SIGTERM) == 0
    assert time.monotonic() - began < STOP_BOUND_S
    assert any("event=stopping signal=SIGTERM" in line for line in dev.stderr)
    assert dev.logged_exceptions() == 0


async def test_with_its_redis_killed_dev_logs_a_line_a_retry_and_sigint_stops_it(
        start_dev, external) -> None:
    embedded_redis = {k: v for k, v in external.items() if k != "HERDWICK_REDIS_URL"}
    dev = await start_dev(**embedded_redis)
    await dev.banner()
    before = len(dev.stderr)

    os.kill(_valkey_pid(dev.data_dir), signal.SIGKILL)
    # The notify listener has lost it and retries, backed off, one line a retry.
    await dev.wait_for_stderr("event=notify_unavailable", count=2)
    assert (await _status(dev.url, "/readyz"))[0] == 503
    began = time.monotonic()
    assert await dev.stop(signal.SIGINT) == 0

    assert time.monotonic() - began < STOP_BOUND_S
    assert dev.logged_exceptions(since=before) <= MAX_LOGGED_EXCEPTIONS, \
        "\n".join(dev.stderr[before:][:200])


@pytest.mark.slow
async def test_with_postgres_and_redis_both_gone_sigint_still_stops_dev(
        start_dev, external, tmp_path) -> None:
    # What a second dev used to leave the first: its Postgres stopped, its Redis killed.
    proxy = Proxy(external["HERDWICK_DATABASE_URL"])
    await proxy.start()
    through_proxy = {"HERDWICK_DATABASE_URL": proxy.dsn(),
                     "HERDWICK_KEY_PREFIX": external["HERDWICK_KEY_PREFIX"]}
    dev = await start_dev(**through_proxy)
    await dev.banner()

    await proxy.cut()
    os.kill(_valkey_pid(dev.data_dir), signal.SIGKILL)
    # Shard actors fail at their next load (a line each, no traceback) and wait out
    # restart backoffs: once half of them have, a stop that waited for each in turn
    # would take minutes.
    await dev.wait_for_stderr("event=actor_unavailable actor=shard-", count=SHARD_COUNT // 2)
    assert (await _status(dev.url, "/readyz"))[0] == 503
    began = time.monotonic()
    assert await dev.stop(signal.SIGINT) == 0
    assert time.monotonic() - began < STOP_BOUND_S


async def test_the_printed_metrics_url_shows_the_lag_of_a_job_that_ran(start_dev,
                                                                       external) -> None:
    dev = await start_dev(**external)
    banner = await dev.banner()
    url, admin = banner.values["metrics"], banner.values["admin token"]
    assert "admin token" in banner.notes["metrics"]
    status, _ = await _status(dev.url, "/v1/jobs", token=banner.values["API key"],
                              json=_job(schedule={"delaySeconds": 1}))
    assert status == 201
    async with aiohttp.ClientSession() as http:
        async with http.get(url) as resp:
            assert resp.status == 401
        for _ in range(100):  # real time: the job falls due a second from now
            async with http.get(url, headers={"Authorization": f"Bearer {admin}"}) as resp:
                text = await resp.text()
            if "herdwick_dispatch_lag_seconds_count" in text:
                break
            await asyncio.sleep(0.1)
    tenant = banner.values["dev tenant"]
    assert (f'herdwick_dispatch_lag_seconds_count{{pool="emails",stage="published",'
            f'tenant="{tenant}"}} 1.0') in text
