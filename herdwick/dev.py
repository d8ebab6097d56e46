"""`herdwick dev`: the whole system in one process, on embedded services when no URLs are set."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import sys
from pathlib import Path

import msgspec

from herdwick.clock import SystemClock
from herdwick.config import Settings

DEV_DIR_ENV = "HERDWICK_DEV_DIR"
DEFAULT_DEV_DIR = ".herdwick"
DEV_TENANT = "dev"


def dev_dir() -> Path:
    """Where embedded services keep their data: $HERDWICK_DEV_DIR, else ./.herdwick."""
    return Path(os.environ.get(DEV_DIR_ENV, DEFAULT_DEV_DIR)).absolute()


async def _embedded(settings: Settings, stack: contextlib.ExitStack) -> Settings:
    if settings.database_url and settings.redis_url:
        return settings
    from herdwick import embedded

    base = dev_dir()
    changes: dict[str, str] = {}
    if not settings.database_url:
        pg = stack.enter_context(await asyncio.to_thread(embedded.start_postgres, base))
        changes["database_url"] = pg.dsn
    if not settings.redis_url:
        # Started on the loop's thread: die-with-parent is tied to the starting thread.
        redis = stack.enter_context(embedded.start_redis(base))
        changes["redis_url"] = redis.url
    return msgspec.structs.replace(settings, **changes)


def _banner(settings: Settings, tenant_id: object, api_key: str) -> str:
    url = f"http://{settings.api_host}:{settings.api_port}"
    example = ('{"name": "hello", "target": {"type": "queue", "ref": "emails"}, '
               '"schedule": {"delaySeconds": 5}, "payload": {"hi": 1}}')
    return "\n".join([
        "herdwick dev is running",
        f"  API:          {url}   (OpenAPI: {url}/openapi.json)",
        f"  admin token:  {settings.admin_token}",
        f"  dev tenant:   {tenant_id}",
        f"  API key:      {api_key}",
        f"  postgres:     {settings.database_url}",
        f"  redis:        {settings.redis_url}",
        "  scheduler:    running: due jobs go to their pools' ready streams",
        "  http worker:  not yet implemented: http targets are queued, not yet delivered",
        "",
        f"  curl -s {url}/v1/jobs -H 'Authorization: Bearer {api_key}' \\",
        f"       -H 'Content-Type: application/json' -d '{example}'",
        "",
    ])


async def run_dev(settings: Settings, stop: asyncio.Event) -> int:
    from herdwick.actors.scheduler import Scheduler
    from herdwick.gateway.app import create_app, serve
    from herdwick.storage import migrate
    from herdwick.storage.db import Database
    from herdwick.storage.tenants import issue_key_for

    with contextlib.ExitStack() as stack:
        settings = await _embedded(settings, stack)
        if settings.admin_token is None:
            settings = msgspec.structs.replace(settings, admin_token=secrets.token_urlsafe(24))
        await migrate.apply(settings.database_url)
        db = await Database.connect(settings.database_url)
        try:
            tenant_id, api_key = await issue_key_for(db, DEV_TENANT, SystemClock().now())
            scheduler = await Scheduler(settings).start()
            try:
                app = create_app(settings, db=db)
                print(_banner(settings, tenant_id, api_key), file=sys.stdout, flush=True)
                await serve(app, settings.api_host, settings.api_port, stop)
            finally:
                await scheduler.stop()
        finally:
            await db.close()
    return 0
