"""Liveness and readiness."""

from __future__ import annotations

import msgspec
from aiohttp import web

from herdwick.errors import StorageUnavailable
from herdwick.gateway.context import Ctx


class Health(msgspec.Struct, kw_only=True):
    status: str
    checks: dict[str, str] = {}


_encoder = msgspec.json.Encoder()


async def healthz(request: web.Request) -> web.Response:
    """The process is up and its event loop answers."""
    return web.Response(body=_encoder.encode(Health(status="ok")), content_type="application/json")


async def readyz(request: web.Request) -> web.Response:
    """Postgres and Redis answer: route traffic here."""
    ctx = Ctx.of(request)
    checks = {"postgres": "ok", "redis": "ok"}
    try:
        await ctx.db.ping()
    except StorageUnavailable as exc:
        checks["postgres"] = str(exc)
    if ctx.redis is not None:
        try:
            await ctx.redis.ping()
        except (OSError, ConnectionError, TimeoutError) as exc:
            checks["redis"] = f"unavailable: {exc}"
        except Exception as exc:  # redis-py raises its own family; any failure means not ready
            checks["redis"] = f"unavailable: {type(exc).__name__}: {exc}"
    ok = all(v == "ok" for v in checks.values())
    body = Health(status="ok" if ok else "unavailable", checks=checks)
    return web.Response(status=200 if ok else 503, body=_encoder.encode(body),
                        content_type="application/json")
