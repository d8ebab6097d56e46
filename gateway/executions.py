"""Execution history: per job, one execution with its attempts, dead letters; replay and trigger."""

from __future__ import annotations

import uuid

from aiohttp import web

from gateway.auth import tenant_of
from gateway.context import Ctx
from gateway.jobs import _job_id, _json, _limit
from gateway.problems import bad_field
from herdwick.ids import shard_of
from herdwick.model import ExecutionPage, Triggered
from storage import history as store
from storage import jobs as job_store


def _execution_id(request: web.Request) -> uuid.UUID:
    try:
        return uuid.UUID(request.match_info["executionId"])
    except ValueError:
        raise bad_field("executionId", "not an execution id", status=404) from None


def _cursor(request: web.Request, decode):
    text = request.query.get("cursor")
    if not text:
        return None
    try:
        return decode(text)
    except ValueError:
        raise bad_field("cursor", "not a cursor returned by this API") from None


async def job_executions(request: web.Request) -> web.Response:
    ctx = Ctx.of(request)
    owner = await tenant_of(request, ctx.db, ctx.keys)
    job = await job_store.get_job(ctx.db, owner.tenant_id, _job_id(request))
    items, cursor = await store.job_executions(
        ctx.db, owner.tenant_id, job.job_id, _cursor(request, store.decode_cursor),
        _limit(request))
    return _json(200, ExecutionPage(items=items, next_cursor=cursor))


async def get_execution(request: web.Request) -> web.Response:
    ctx = Ctx.of(request)
    owner = await tenant_of(request, ctx.db, ctx.keys)
    return _json(200, await store.get_execution(ctx.db, owner.tenant_id, _execution_id(request)))


async def dead_letters(request: web.Request) -> web.Response:
    ctx = Ctx.of(request)
    owner = await tenant_of(request, ctx.db, ctx.keys)
    items, cursor = await store.dead_letters(
        ctx.db, owner.tenant_id, _cursor(request, job_store.decode_cursor), _limit(request))
    return _json(200, ExecutionPage(items=items, next_cursor=cursor))


async def retry_execution(request: web.Request) -> web.Response:
    ctx = Ctx.of(request)
    owner = await tenant_of(request, ctx.db, ctx.keys)
    now = ctx.clock.now()
    job_id = await store.replay(ctx.db, owner.tenant_id, _execution_id(request), now)
    await ctx.notify_due([(shard_of(job_id), job_id, now)])
    return web.Response(status=202)


async def trigger_job(request: web.Request) -> web.Response:
    ctx = Ctx.of(request)
    owner = await tenant_of(request, ctx.db, ctx.keys)
    job = await job_store.get_job(ctx.db, owner.tenant_id, _job_id(request))
    now = ctx.clock.now()
    execution_id = await store.trigger(ctx.db, owner.tenant_id, job.job_id, job.state, now)
    await ctx.notify_due([(shard_of(job.job_id), job.job_id, now)])
    return _json(202, Triggered(execution_id=execution_id))
