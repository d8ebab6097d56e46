"""The gateway's app factory and server."""

from __future__ import annotations

import asyncio
import errno
import time
from collections.abc import AsyncIterator

import redis.asyncio as aioredis
from aiohttp import web

from herdwick import logs, redis_client, ssrf, telemetry
from herdwick.clock import Clock, SystemClock
from herdwick.config import Settings
from herdwick.errors import HerdwickError
from herdwick.gateway.auth import require_admin
from herdwick.gateway.context import CTX, Ctx
from herdwick.gateway.jobs import BATCH_BODY_CAP
from herdwick.gateway.notify import canceller, notifier
from herdwick.gateway.openapi import DOCUMENT, document, openapi
from herdwick.gateway.problems import problem_middleware
from herdwick.gateway.reads import read_replicas
from herdwick.gateway.routes import register
from herdwick.gateway.target_dns import TargetDns
from herdwick.gateway.ui import create_ui
from herdwick.gateway.ui_session import UI_PATH
from herdwick.storage import migrate
from herdwick.storage.db import Database
from herdwick.storage.hot import HotTier
from herdwick.storage.protocol import Protocol

log = logs.get("herdwick.gateway")

DB_POOL_MAX = 20
# aiohttp's keepalive timeout is also the only clock on a request's line and headers: it
# starts when a connection opens (and again after each answer) and closes the connection
# if no whole request head has arrived by then, however slowly bytes trickle in. Its
# default is an hour; 75 s stays longer than the idle timeouts of the usual proxies in front
# (nginx and AWS ALB: 60 s), so none of them reuses a connection just as it closes here.
# The body has its own deadline (gateway/body.py BODY_READ_TIMEOUT_S).
KEEPALIVE_TIMEOUT_S = 75.0
# After an answer given before its body was read whole (413, 408, 401), aiohttp reads and
# drops what the client still sends for this long, so that the client sees the answer
# rather than a reset, then closes. Its default, 10 s, is ten seconds more of a slow client.
LINGERING_TIME_S = 2.0


def create_app(settings: Settings, *, clock: Clock | None = None, db: Database | None = None,
               redis: aioredis.Redis | None = None,
               resolve: ssrf.Resolve | None = None) -> web.Application:
    """The tenants' HTTP API. Pass db/redis to share ones the caller owns (tests, dev);
    resolve answers the submit-time lookups of http targets' names (default getaddrinfo)."""
    app = web.Application(middlewares=[timing_middleware, problem_middleware],
                          client_max_size=BATCH_BODY_CAP)

    async def resources(app: web.Application) -> AsyncIterator[None]:
        database = db or await Database.connect(
            settings.database_url, max_size=settings.db_pool_max or DB_POOL_MAX)
        client = redis
        if client is None and settings.redis_url:
            client = redis_client.connect(settings.redis_url)
        the_clock = clock or SystemClock()
        target_dns = TargetDns(settings.http_allow_networks, the_clock, resolve=resolve)
        try:
            async with database.connection() as conn:
                await migrate.check(conn)
            ctx = Ctx(settings=settings, clock=the_clock, db=database, redis=client,
                      http_allow=settings.http_allow_networks, target_dns=target_dns)
            if client is not None:
                ctx.notify_due = notifier(HotTier(client, settings.key_prefix), the_clock)
                ctx.cancel_running = canceller(Protocol(client, settings.key_prefix))
            app[CTX] = ctx
            yield
        finally:
            await target_dns.close()
            if db is None:
                await database.close()
            if redis is None and client is not None:
                await client.aclose()

    app.cleanup_ctx.append(resources)
    app.cleanup_ctx.append(read_replicas(settings))  # after resources: it needs their Ctx
    register(app)
    app[DOCUMENT] = document()
    app.router.add_get("/openapi.json", openapi)
    app.router.add_get("/metrics", metrics)
    # The dashboard: HTML pages, not part of ROUTES or the OpenAPI document.
    app.add_subapp(UI_PATH, create_ui())
    return app


async def metrics(request: web.Request) -> web.StreamResponse:
    """Prometheus metrics of this process, to the admin token: they name every tenant.
    (Every process, this one too, also serves them unauthenticated on --metrics-port.)"""
    require_admin(request, request.app[CTX].settings.admin_token)
    return await telemetry.metrics(request)


_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


@web.middleware
async def timing_middleware(request: web.Request, handler) -> web.StreamResponse:
    """herdwick_api_request_seconds by route template (bounded: never the raw path)."""
    start = time.perf_counter()
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as exc:
        status = exc.status
        raise
    finally:
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"
        method = request.method if request.method in _METHODS else "other"
        telemetry.API_REQUESTS.labels(route, method, str(status)).observe(
            time.perf_counter() - start)


def app_runner(app: web.Application) -> web.AppRunner:
    """The runner every gateway serves through (serve() here, `herdwick dev`), with the
    slow-client timeout."""
    return web.AppRunner(app, access_log=None, keepalive_timeout=KEEPALIVE_TIMEOUT_S,
                         lingering_time=LINGERING_TIME_S)


class PortInUse(HerdwickError):
    """The gateway's address is taken (by another herdwick, say)."""


async def serve(app: web.Application, host: str, port: int,
                stop: asyncio.Event | None = None, *, reuse_port: bool = False) -> None:
    """Run the app until `stop` is set (or forever), then shut down cleanly.

    reuse_port shares the port with other processes that ask for it too
    (SO_REUSEPORT: the kernel spreads connections over them); without it a
    busy port is PortInUse, so two servers never answer one port unawares.
    A client that sends its request head slower than KEEPALIVE_TIMEOUT_S is cut off.
    """
    runner = app_runner(app)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_port=reuse_port or None)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        if exc.errno == errno.EADDRINUSE:
            raise PortInUse(f"{host}:{port} is in use by another process; stop it or set "
                            "HERDWICK_API_PORT") from None
        raise
    log.info("api_listening", host=host, port=port)
    try:
        await (stop.wait() if stop is not None else asyncio.Event().wait())
    finally:
        await runner.cleanup()
