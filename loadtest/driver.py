"""The stack a load test drives: scratch databases and Redis prefixes, and herdwick children.

Everything here is made for one run and removed after it, however the run
ends: a scratch database is dropped, a prefix's keys deleted, a child
process stopped (SIGTERM, SIGKILL past a deadline; and, on Linux, SIGTERMed
by the kernel if this process dies without stopping it). Targets are
loopback addresses only: the load goes to this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import ctypes
import ipaddress
import os
import secrets
import signal
import socket
import sys
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable
from typing import Any

import asyncpg
import redis.asyncio as aioredis

from herdwick import redis_client
from herdwick.config import ConfigError
from herdwick.errors import HerdwickError
from herdwick.ids import SHARD_COUNT
from herdwick.storage import migrate
from herdwick.storage.db import Database

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 20.0
WORKER_STOP_TIMEOUT_S = 15.0
API_START_TIMEOUT_S = 30.0
API_STOP_TIMEOUT_S = 10.0
SETTLE_POLL_S = 0.2
DELETE_BATCH = 5_000
REDIS_TIMEOUT_S = 30.0
# The herd's consumers lease nothing, so a bound on the ready streams would measure
# the bound, not dispatch: unbounded unless a run asks for one ("auto": from the lease rate).
UNBOUNDED_READY = "100000000"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class RunFailed(HerdwickError):
    """The stack did not come up or died during the run; the message says which part."""


# --- targets and scratch state ---------------------------------------------------------


def add_scratch_flags(parser: argparse.ArgumentParser) -> None:
    """--database-url, --redis-url, --keep and --json, as every load test that runs in a
    scratch database and key prefix of its own takes them."""
    a = parser.add_argument
    a("--database-url", default=os.environ.get("HERDWICK_DATABASE_URL",
                                               "postgresql://postgres@127.0.0.1:5432/postgres"),
      help="Postgres server for the scratch database; default $HERDWICK_DATABASE_URL, else "
           "postgresql://postgres@127.0.0.1:5432/postgres")
    a("--redis-url", default=os.environ.get("HERDWICK_REDIS_URL", "redis://127.0.0.1:6379/0"),
      help="default $HERDWICK_REDIS_URL, else redis://127.0.0.1:6379/0")
    a("--keep", action="store_true",
      help="keep the scratch database (its name is printed) to inspect the history")
    a("--json", action="store_true", help="the report as JSON")


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


def scratch_name(kind: str) -> str:
    """A database name of this run's own, e.g. hw_herd_1a2b3c4d5e."""
    return f"hw_{kind}_{secrets.token_hex(5)}"


# Administrative statements on a throwaway database: storage/ creates no databases.
@contextlib.asynccontextmanager
async def scratch_database(server_dsn: str, name: str, keep: bool,
                           say: Callable[[str], None]) -> AsyncIterator[str]:
    """A fresh, migrated database `name` on the server; dropped afterwards unless `keep`."""
    admin = await asyncpg.connect(server_dsn, timeout=10)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        try:
            dsn = with_database(server_dsn, name)
            await migrate.apply(dsn)
            yield dsn
        finally:
            if keep:
                say(f"kept database {name}")
            else:
                await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


async def delete_keys(client: aioredis.Redis, prefix: str) -> int:
    """Every key under `prefix:`; the prefix is this run's own, so nothing else matches."""
    deleted = 0
    batch: list[bytes] = []
    async for key in client.scan_iter(match=f"{prefix}:*", count=DELETE_BATCH):
        batch.append(key)
        if len(batch) >= DELETE_BATCH:
            deleted += await client.unlink(*batch)
            batch = []
    if batch:
        deleted += await client.unlink(*batch)
    return deleted


@contextlib.asynccontextmanager
async def scratch_prefix(redis_url: str, kind: str) -> AsyncIterator[tuple[aioredis.Redis, str]]:
    """A client and a key prefix of this run's own (e.g. hwherd1a2b3c4d); its keys are
    deleted afterwards."""
    prefix = f"hw{kind}{secrets.token_hex(4)}"
    # A reply that never comes fails the run instead of hanging it (blocking reads wait
    # at most consumers.CONSUMER_BLOCK_MS).
    client = redis_client.connect(redis_url, socket_timeout=REDIS_TIMEOUT_S)
    try:
        yield client, prefix
    finally:
        await delete_keys(client, prefix)
        await client.aclose()


# --- child processes --------------------------------------------------------------------


def dies_with_us() -> Callable[[], None] | None:
    """A preexec_fn: Linux SIGTERMs the child if this process dies, even by SIGKILL."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)  # loaded before fork, not in the child
    return lambda: libc.prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGTERM))


def child_env(**settings: str) -> dict[str, str]:
    # Text logs: the start markers are text (`event=...`) whatever the caller's environment.
    return {**os.environ, "HERDWICK_LOG_FORMAT": "text", **settings}


async def spawn(args: list[str], env: dict[str, str],
                module: str = "herdwick.cli") -> asyncio.subprocess.Process:
    """`python -m MODULE ARGS`, its output merged into one pipe for a Child to drain."""
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", module, *args, env=env, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        preexec_fn=dies_with_us())


class Child:
    """A herdwick child process. Its merged output drains into a short tail, so a full pipe
    never blocks it and a failure can say why; it counts as started at its `marker` line.

    Subclasses name the command, the module it runs, the marker, the timeouts and the
    error to raise.
    """

    command = "herdwick"
    module = "herdwick.cli"
    marker = ""
    start_timeout_s = START_TIMEOUT_S
    stop_timeout_s = STOP_TIMEOUT_S
    error: type[Exception] = RunFailed

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
                await asyncio.wait_for(self.proc.wait(), self.stop_timeout_s)
            await asyncio.wait_for(self.drain, self.stop_timeout_s)
        except BaseException:
            # Cancelled while stopping (a second Ctrl-C): never leave the child behind.
            if self.proc.returncode is None:
                self.proc.kill()
            self.drain.cancel()
            raise


@contextlib.asynccontextmanager
async def children(kind: type[Child], count: int, args: list[str], env: dict[str, str],
                   metrics_port: int | None = None) -> AsyncIterator[list[Any]]:
    """`count` children started one after the other, each up before the next; all stopped
    together on the way out, whatever happened. With metrics_port, child i serves its
    Prometheus metrics on 127.0.0.1:metrics_port + i."""
    procs: list[Child] = []
    try:
        for i in range(count):
            served = [] if metrics_port is None else [
                "--metrics-port", str(metrics_port + i), "--metrics-host", "127.0.0.1"]
            procs.append(kind(await spawn([*args, *served], env, kind.module)))
            await procs[-1].started()
        yield procs
    finally:
        results = await asyncio.gather(*(p.stop() for p in procs), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result


class SchedulerProcess(Child):
    """One `herdwick scheduler` (a clean stop releases its leases)."""

    command = "herdwick scheduler"
    marker = "event=scheduler_started"


def scheduler_processes(count: int, dsn: str, redis_url: str, prefix: str,
                        ready_max: str = UNBOUNDED_READY, metrics_port: int | None = None,
                        **settings: str,
                        ) -> contextlib.AbstractAsyncContextManager[list[SchedulerProcess]]:
    """`count` schedulers on one database and prefix; `settings` are more HERDWICK_*
    variables (e.g. HERDWICK_DISPATCH_ORDER="fifo")."""
    env = child_env(HERDWICK_DATABASE_URL=dsn, HERDWICK_REDIS_URL=redis_url,
                    HERDWICK_KEY_PREFIX=prefix, HERDWICK_READY_MAX=ready_max, **settings)
    return children(SchedulerProcess, count, ["scheduler"], env, metrics_port)


class WorkerProcess(Child):
    """One `herdwick worker` running one of loadtest's worker apps."""

    command = "herdwick worker"
    marker = "event=worker_started"
    stop_timeout_s = WORKER_STOP_TIMEOUT_S


# What the worker apps (noop_worker, sleep_worker) read: they are configured by the
# environment their process is started with.
WORKER_REDIS_URL_ENV = "HW_LOADTEST_REDIS_URL"
WORKER_PREFIX_ENV = "HW_LOADTEST_PREFIX"
WORKER_POOL_ENV = "HW_LOADTEST_POOL"
WORKER_CONCURRENCY_ENV = "HW_LOADTEST_CONCURRENCY"
WORKER_HANDLER_MS_ENV = "HW_LOADTEST_HANDLER_MS"
WORKER_FAIL_FIRST_ENV = "HW_LOADTEST_FAIL_FIRST"


def worker_processes(count: int, app: str, redis_url: str, prefix: str, pool: str,
                     concurrency: int, handler_ms: float = 0.0, metrics_port: int | None = None,
                     fail_first: bool = False,
                     ) -> contextlib.AbstractAsyncContextManager[list[WorkerProcess]]:
    """`count` processes of `herdwick worker APP` (e.g. herdwick.loadtest.noop_worker:worker)
    on one pool; with `fail_first`, the no-op handler raises on each first attempt."""
    env = child_env(**{WORKER_REDIS_URL_ENV: redis_url, WORKER_PREFIX_ENV: prefix,
                       WORKER_POOL_ENV: pool, WORKER_CONCURRENCY_ENV: str(concurrency),
                       WORKER_HANDLER_MS_ENV: repr(handler_ms),
                       WORKER_FAIL_FIRST_ENV: "1" if fail_first else ""})
    return children(WorkerProcess, count, ["worker", app], env, metrics_port)


class HttpWorkerProcess(Child):
    """One `herdwick http-worker`."""

    command = "herdwick http-worker"
    marker = "event=worker_started"
    stop_timeout_s = WORKER_STOP_TIMEOUT_S


class ProfiledHttpWorkerProcess(HttpWorkerProcess):
    """`herdwick http-worker` under cProfile (loadtest/profiled.py)."""

    module = "herdwick.loadtest.profiled"


def http_worker_processes(count: int, redis_url: str, prefix: str, allow: str,
                          flags: list[str], profile_dir: str | None = None,
                          ) -> contextlib.AbstractAsyncContextManager[list[HttpWorkerProcess]]:
    """`count` processes of `herdwick http-worker FLAGS` on one prefix, allowed to reach
    `allow` (HERDWICK_HTTP_ALLOW: loopback, for the load test's receivers); with
    `profile_dir`, each under cProfile, its stats written there when it stops."""
    env = child_env(HERDWICK_REDIS_URL=redis_url, HERDWICK_KEY_PREFIX=prefix,
                    HERDWICK_HTTP_ALLOW=allow)
    args = ["http-worker", *flags]
    if profile_dir is None:
        return children(HttpWorkerProcess, count, args, env)
    return children(ProfiledHttpWorkerProcess, count, [profile_dir, "herdwick.cli", *args], env)


class ReceiverProcess(Child):
    """One `python -m herdwick.loadtest.receiver`: a local HTTP server answering 200."""

    command = "loadtest receiver"
    module = "herdwick.loadtest.receiver"
    marker = "event=receiver_listening"
    stop_timeout_s = API_STOP_TIMEOUT_S


def record_path(record_dir: str, port: int) -> str:
    """Where the receiver on `port` writes what it saw when it stops."""
    return os.path.join(record_dir, f"receiver-{port}.bin")


@contextlib.asynccontextmanager
async def receiver_processes(ports: list[int],
                             record_dir: str) -> AsyncIterator[list[ReceiverProcess]]:
    """A receiver on each port, each up before the next; on the way out each stops and
    writes its record (record_path) in `record_dir`."""
    async with contextlib.AsyncExitStack() as stack:
        procs: list[ReceiverProcess] = []
        for port in ports:
            procs += await stack.enter_async_context(children(
                ReceiverProcess, 1, ["--port", str(port), "--record",
                                     record_path(record_dir, port)], child_env()))
        yield procs


class ApiProcess(Child):
    """One `herdwick api`."""

    command = "herdwick api"
    marker = "event=api_listening"
    start_timeout_s = API_START_TIMEOUT_S
    stop_timeout_s = API_STOP_TIMEOUT_S
    error = ConfigError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.asynccontextmanager
async def api_processes(count: int, database_url: str,
                        redis_url: str) -> AsyncIterator[tuple[str, tuple[int, ...]]]:
    """`count` processes of `herdwick api` on one port (SO_REUSEPORT); yields URL and pids."""
    port = free_port()
    env = child_env(HERDWICK_DATABASE_URL=database_url, HERDWICK_REDIS_URL=redis_url,
                    HERDWICK_ADMIN_TOKEN=secrets.token_urlsafe(24),
                    HERDWICK_API_HOST="127.0.0.1", HERDWICK_API_PORT=str(port),
                    HERDWICK_KEY_PREFIX=f"hwlt{secrets.token_hex(4)}")
    async with children(ApiProcess, count, ["api", "--reuse-port"], env) as apis:
        yield f"http://127.0.0.1:{port}", tuple(a.pid for a in apis)


# --- waiting on the stack ----------------------------------------------------------------

# The tool's own statement on its scratch database: storage/ has no query that lists
# lease owners, and none should exist outside a load test.
_LEASE_OWNERS = ("SELECT owner, count(*) AS shards FROM shard_leases "
                 "WHERE owner IS NOT NULL AND lease_until > now() GROUP BY owner")


async def lease_owners(db: Database) -> dict[str, int]:
    async with db.connection() as conn:
        return {r["owner"]: r["shards"] for r in await conn.fetch(_LEASE_OWNERS)}


async def leases_settled(db: Database, procs: list[SchedulerProcess], deadline: float) -> None:
    """Wait until the processes hold all 256 shards in fair shares (a rebalance takes a few
    renewal rounds): a herd measured before that would measure one node, not K.
    `deadline` is on time.perf_counter()'s clock."""
    while True:
        owners = await lease_owners(db)
        counts = sorted(owners.values())
        if len(counts) == len(procs) and sum(counts) == SHARD_COUNT and counts[-1] - counts[0] <= 1:
            return
        for proc in procs:
            proc.check_alive()
        if time.perf_counter() > deadline:
            raise RunFailed(f"the shards did not settle over {len(procs)} schedulers: {owners}")
        await asyncio.sleep(SETTLE_POLL_S)


@contextlib.asynccontextmanager
async def running(coro: Coroutine[Any, Any, Any], name: str | None = None,
                  ) -> AsyncIterator[asyncio.Task]:
    """A helper task for the body's duration (samplers, tickers); cancelled after it."""
    task = asyncio.create_task(coro, name=name)
    try:
        yield task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def check_alive(procs: Iterable[Child], helpers: Iterable[asyncio.Task | None] = ()) -> None:
    """A dead child or a failed helper task (a sampler, a generator) fails the run now
    rather than as a timeout later."""
    for proc in procs:
        proc.check_alive()
    for task in helpers:
        if (task is not None and task.done() and not task.cancelled()
                and task.exception() is not None):
            raise RunFailed(f"{task.get_name()} failed") from task.exception()
