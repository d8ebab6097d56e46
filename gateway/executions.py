"""Execution history: per job, one execution with its attempts, dead letters; replay and trigger."""

from __future__ import annotations

import uuid

from aiohttp import web

from herdwick.gateway import params
from herdwick.gateway.auth import tenant_of
from herdwick.gateway.context import Ctx
from herdwick.gateway.jobs import job_id_of, pool_of
from herdwick.gateway.params import json_response, path_uuid
from herdwick.ids import shard_of
from herdwick.model import ExecutionPage, Triggered
from herdwick.storage import history as store
from herdwick.storage import jobs as job_store
from herdwick.storage.db import Database


def _execution_id(request: web.Request) -> uuid.UUID:
    return path_uuid(request, "executionId", "execution")


async def job_executions(request: web.Request) -> web.Response:
    ctx = Ctx.of(request)
    owner = await tenant_of(request, ctx.db, ctx.keys)
    job_id = job_id_of(request)

    async def page(db: Database):  # both on one server: the job, then its executions
        job = await job_store.get_job(db, owner.tenant_id, job_id)  # a missing job: 404 first
        return await store.job_executions(
            db, owner.tenant_id, job.job_id, params.cursor(request, store.decode_cursor),
            params.limit(request))

    items, cursor = await ctx.read(owner.tenant_id, page)
    return json_response(200, ExecutionPage(items=items, next_cursor=cursor))


async def get_execution(request: web.Request) -> web.Response:
    ctx = Ctx.of(request)
    owner = await tenant_of(request, ctx.db, ctx.keys)
    execution_id = _execution_id(request)
    found = await ctx.read(owner.tenant_id,
                           lambda db: store.get_execution(db, owner.tenant_id, execution_id))
    return json_response(200, found)


async def dead_letters(request: web.Request) -> web.Response:
    ctx = Ctx.of(request)
    owner = await tenant_of(request, ctx.db, ctx.keys)
    after, limit = params.cursor(request, job_store.decode_cursor), params.limit(request)
    items, cursor = await ctx.read(owner.tenant_id, lambda db: store.dead_letters(
        db, owner.tenant_id, after, limit))
    return json_response(200, ExecutionPage(items=items, next_cursor=cursor))


# Replay and trigger, with the notify after the commit: the /v1 handlers below and the
# dashboard's buttons (gateway/ui.py) both call these.


async def retry(ctx: Ctx, tenant_id: uuid.UUID, execution_id: uuid.UUID) -> None:
    now = ctx.clock.now()
    job_id, pool = await store.replay(ctx.db, tenant_id, execution_id, now)
    await ctx.wrote(tenant_id)
    await ctx.notify_due([(shard_of(job_id), job_id, now, tenant_id, pool)])


async def trigger(ctx: Ctx, tenant_id: uuid.UUID, job_id: uuid.UUID) -> uuid.UUID:
    job = await job_store.get_job(ctx.db, tenant_id, job_id)
    execution_id, due = await store.trigger(ctx.db, tenant_id, job.job_id, job.state,
                                            ctx.clock.now())
    await ctx.wrote(tenant_id)
    await ctx.notify_due([(shard_of(job.job_id), job.job_id, due, tenant_id, pool_of(job))])
    return execution_id


async def retry_execution(request: web.Request) -> web.Response:
    ctx = Ctx.of(request)
    owner = await tenant_of(request, ctx.db, ctx.keys)
    await retry(ctx, owner.tenant_id, _execution_id(request))
    return web.Response(status=202)


async def trigger_job(request: web.Request) -> web.Response:
    """An execution outside the schedule, which does not move. A paused job may be
    triggered: it runs once and the job stays paused (a retry of that execution waits
    for the resume). A canceled or completed job is 409."""
    ctx = Ctx.of(request)
    owner = await tenant_of(request, ctx.db, ctx.keys)
    execution_id = await trigger(ctx, owner.tenant_id, job_id_of(request))
    return json_response(202, Triggered(execution_id=execution_id))
