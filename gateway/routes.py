"""Every endpoint, once: this table both registers the handlers and writes /openapi.json."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Literal, NamedTuple

from aiohttp import web

from herdwick.gateway import executions, health, jobs, tenants
from herdwick.model import (
    BatchCreated,
    Execution,
    ExecutionPage,
    Job,
    JobBatch,
    JobCreated,
    JobPage,
    JobSpec,
    SigningSecret,
    Tenant,
    TenantCreated,
    TenantPatch,
    TenantSpec,
    Triggered,
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Query(NamedTuple):
    name: str
    description: str
    schema: dict


class Route(NamedTuple):
    method: str
    path: str  # OpenAPI form: /v1/jobs/{jobId}:pause
    handler: Handler
    summary: str
    auth: Literal["tenant", "admin", "none"]
    body: type | None = None
    ok: tuple[int, type | None] = (200, None)
    errors: tuple[int, ...] = ()
    query: tuple[Query, ...] = ()
    headers: tuple[Query, ...] = ()


_LIST_QUERY = (
    Query("cursor", "the nextCursor of the previous page", {"type": "string"}),
    Query("limit", "page size", {"type": "integer", "minimum": 1, "maximum": 500, "default": 50}),
)
_IDEMPOTENCY = (Query("Idempotency-Key", "replays the original response for 24 hours",
                      {"type": "string", "minLength": 1, "maxLength": 255}),)
_SUBMIT_ERRORS = (400, 401, 413, 415, 422, 429, 503)

ROUTES: tuple[Route, ...] = (
    Route("POST", "/v1/jobs:batch", jobs.submit_batch, "Submit up to 1,000 jobs atomically",
          "tenant", JobBatch, (201, BatchCreated), _SUBMIT_ERRORS, headers=_IDEMPOTENCY),
    Route("POST", "/v1/jobs", jobs.submit, "Submit a job", "tenant", JobSpec, (201, JobCreated),
          _SUBMIT_ERRORS, headers=_IDEMPOTENCY),
    Route("GET", "/v1/jobs", jobs.list_jobs, "List jobs, newest first", "tenant",
          ok=(200, JobPage), errors=(401, 422, 503),
          query=(Query("state", "only jobs in this state",
                       {"enum": ["active", "paused", "canceled", "completed"]}), *_LIST_QUERY)),
    Route("POST", "/v1/jobs/{jobId}:pause", jobs.pause_job,
          "Pause a job: no new attempt of it starts until it is resumed", "tenant",
          ok=(200, Job), errors=(401, 404, 409, 503)),
    Route("POST", "/v1/jobs/{jobId}:resume", jobs.resume_job,
          "Resume a paused job (next run per its misfire policy; held retries go on)", "tenant",
          ok=(200, Job), errors=(401, 404, 409, 503)),
    Route("GET", "/v1/jobs/{jobId}", jobs.get_job, "Read a job", "tenant", ok=(200, Job),
          errors=(401, 404, 503)),
    Route("DELETE", "/v1/jobs/{jobId}", jobs.cancel_job, "Cancel a job (idempotent)", "tenant",
          ok=(204, None), errors=(401, 404, 503)),
    Route("POST", "/v1/jobs/{jobId}:trigger", executions.trigger_job,
          "Run a job once now, outside its schedule (a paused job stays paused)", "tenant",
          ok=(202, Triggered), errors=(401, 404, 409, 503)),
    Route("GET", "/v1/jobs/{jobId}/executions", executions.job_executions,
          "A job's executions, newest first", "tenant", ok=(200, ExecutionPage),
          errors=(401, 404, 422, 503), query=_LIST_QUERY),
    Route("POST", "/v1/executions/{executionId}:retry", executions.retry_execution,
          "Replay a dead execution with its next attempt", "tenant", ok=(202, None),
          errors=(401, 404, 409, 503)),
    Route("GET", "/v1/executions/{executionId}", executions.get_execution,
          "An execution with every attempt", "tenant", ok=(200, Execution),
          errors=(401, 404, 503)),
    Route("GET", "/v1/dead-letters", executions.dead_letters,
          "Dead executions, newest first", "tenant", ok=(200, ExecutionPage),
          errors=(401, 422, 503), query=_LIST_QUERY),
    Route("POST", "/v1/tenants", tenants.create_tenant, "Create a tenant", "admin", TenantSpec,
          (201, TenantCreated), (400, 401, 403, 415, 422, 503)),
    Route("POST", "/v1/tenants/{tenantId}:rotate-secret", tenants.rotate_secret,
          "Rotate a tenant's signing secret", "admin", ok=(200, SigningSecret),
          errors=(401, 403, 404, 503)),
    Route("PATCH", "/v1/tenants/{tenantId}", tenants.patch_tenant, "Update a tenant's limits",
          "admin", TenantPatch, (200, Tenant), (400, 401, 403, 404, 415, 422, 503)),
    Route("GET", "/healthz", health.healthz, "Liveness", "none", ok=(200, health.Health)),
    Route("GET", "/readyz", health.readyz, "Readiness: Postgres and Redis answer", "none",
          ok=(200, health.Health), errors=(503,)),
)

_PARAM = re.compile(r"\{(\w+)\}")


def aiohttp_path(path: str) -> str:
    """A path parameter never spans '/' or ':', so `{jobId}:pause` routes cleanly."""
    return _PARAM.sub(lambda m: "{" + m.group(1) + r":[^{}/:]+}", path)


def register(app: web.Application) -> None:
    for route in ROUTES:
        app.router.add_route(route.method, aiohttp_path(route.path), route.handler)
