"""Every endpoint, once: this table both registers the handlers and writes /openapi.json."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Literal, NamedTuple

from aiohttp import web

from herdwick.gateway import executions, health, jobs, patch, tenants
from herdwick.model import (
    JOB_STATES,
    LABEL_KEY_PATTERN,
    LIST_LIMIT_DEFAULT,
    LIST_LIMIT_MAX,
    MAX_IDEMPOTENCY_KEY_LEN,
    MAX_LABEL_FILTERS,
    MAX_LABEL_VALUE_LEN,
    MAX_NAME_LEN,
    NAME_PATTERN,
    BatchCreated,
    Execution,
    ExecutionPage,
    Job,
    JobBatch,
    JobCreated,
    JobPage,
    JobPatch,
    JobSpec,
    RevisionPage,
    SecretRotation,
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
    required: bool = False


class Link(NamedTuple):
    """An OpenAPI link: what an answer hands to the next operation (a client's next call,
    a stateful fuzzer's next step). parameters: the target's path parameter -> a runtime
    expression ($response.body#/jobId, $request.path.jobId)."""

    name: str
    handler: Handler  # the target operation: its operationId is the handler's name
    parameters: dict[str, str]


class Route(NamedTuple):
    method: str
    path: str  # OpenAPI form: /v1/jobs/{jobId}:pause
    handler: Handler
    summary: str
    # admin_or_tenant: the admin token, or the API key of the tenant the path names.
    auth: Literal["tenant", "admin", "admin_or_tenant", "none"]
    body: type | None = None
    ok: tuple[int, type | None] = (200, None)
    # Problem statuses of this route's own; gateway/openapi.py adds those that its auth,
    # body and path parameters imply (401, 403, 400/413/415/422, 404/405, 503).
    errors: tuple[int, ...] = ()
    query: tuple[Query, ...] = ()
    headers: tuple[Query, ...] = ()
    also: tuple[tuple[int, type], ...] = ()  # other answers that are not problems
    body_optional: bool = False  # an empty body is the body's defaults
    links: tuple[Link, ...] = ()  # on the ok answer
    body_types: tuple[str, ...] = ("application/json",)
    ok_headers: tuple[Query, ...] = ()  # headers every ok answer carries


# The cursors each list issues. storage/jobs.py encode_cursor, for jobs and dead letters:
# "j1." and a UUID's 16 bytes in unpadded base64url, the last of 22 characters carrying 2
# bits (so one of AQgw); every string of that pattern is a cursor the list takes.
# storage/history.py encode_cursor, for a job's executions: "e1." and 24 bytes in 32
# characters, scheduled_for in microseconds since 1970 (signed 64-bit big-endian; the
# leading "A" holds it from 1970 to the year 11103) and the execution's UUID. Every issued
# one matches; one that matches but was not issued can still be 422 (the time is past 9999,
# or it does not round-trip through the float arithmetic the encoding uses).
# A label filter: a key, a colon, a value (herdwick/model.py label_problem).
LABEL_FILTER_PATTERN = (f"^{LABEL_KEY_PATTERN}:[^\\x00-\\x1f\\x7f-\\x9f]"
                        f"{{0,{MAX_LABEL_VALUE_LEN}}}$")
ID_CURSOR_PATTERN = "^j1\\.[A-Za-z0-9_-]{21}[AQgw]$"
EXECUTION_CURSOR_PATTERN = "^e1\\.A[A-Za-z0-9_-]{31}$"


# Revisions page on the job's version: "r1." and the version before which the next page
# starts (storage/jobs.py encode_revision_cursor); one past 2^31 - 1 is 422.
REVISION_CURSOR_PATTERN = "^r1\\.[1-9][0-9]{0,9}$"
_ETAG = (Query("ETag", "the job's version, quoted: what If-Match sends back to change it",
               {"type": "string", "pattern": '^"[1-9][0-9]*"$'}, required=True),)
_IF_MATCH = (Query("If-Match", 'the ETag of the job as read (e.g. "3"); missing: 428, '
                               "another version: 412", {"type": "string"}, required=True),)


def _list_query(cursor_pattern: str) -> tuple[Query, ...]:
    return (
        Query("cursor", "the nextCursor of the previous page",
              {"type": "string", "pattern": cursor_pattern}),
        Query("limit", "page size",
              {"type": "integer", "minimum": 1, "maximum": LIST_LIMIT_MAX,
               "default": LIST_LIMIT_DEFAULT}),
    )


# The server strips a header value's surrounding spaces, and takes printable ASCII only
# (a byte beyond it does not survive the trip as the same character).
_IDEMPOTENCY = (Query("Idempotency-Key", "replays the original response for 24 hours",
                      {"type": "string", "minLength": 1, "maxLength": MAX_IDEMPOTENCY_KEY_LEN,
                       "pattern": "^[ -~]*[!-~][ -~]*$"}),)
_SUBMIT_ERRORS = (409, 429)  # 409: the Idempotency-Key is in use by a concurrent request


def _job_links(job_id: str, *handlers: Handler) -> tuple[Link, ...]:
    """Links from an answer naming a job (at the runtime expression job_id) to operations
    on it; the link's name is the handler's, camel-cased (getJob, pauseJob)."""
    def camel(name: str) -> str:
        head, *rest = name.split("_")
        return head + "".join(word.title() for word in rest)

    return tuple(Link(camel(h.__name__), h, {"jobId": job_id}) for h in handlers)


# What a job's id leads to, from any answer that names one. Cancel is among them: after it,
# pause, resume and trigger answer 409, as the document says they may.
_ON_A_JOB = (jobs.get_job, jobs.pause_job, jobs.resume_job, executions.trigger_job,
             executions.job_executions, patch.job_revisions, jobs.cancel_job)
_JOB_LINKS = _job_links("$response.body#/jobId", *_ON_A_JOB)
_TENANT_LINKS = (
    Link("patchTenant", tenants.patch_tenant, {"tenantId": "$response.body#/tenantId"}),
    Link("rotateSecret", tenants.rotate_secret, {"tenantId": "$response.body#/tenantId"}),
)

ROUTES: tuple[Route, ...] = (
    Route("POST", "/v1/jobs:batch", jobs.submit_batch, "Submit up to 1,000 jobs atomically",
          "tenant", JobBatch, (201, BatchCreated), _SUBMIT_ERRORS, headers=_IDEMPOTENCY,
          links=_job_links("$response.body#/items/0/jobId", *_ON_A_JOB)),
    Route("POST", "/v1/jobs", jobs.submit, "Submit a job", "tenant", JobSpec, (201, JobCreated),
          _SUBMIT_ERRORS, headers=_IDEMPOTENCY, links=_JOB_LINKS),
    Route("GET", "/v1/jobs", jobs.list_jobs, "List jobs, newest first", "tenant",
          ok=(200, JobPage), errors=(422,),
          query=(Query("state", "only jobs in this state", {"enum": list(JOB_STATES)}),
                 Query("name", "only jobs of exactly this name (case-sensitive)",
                       {"type": "string", "minLength": 1, "maxLength": MAX_NAME_LEN,
                        "pattern": NAME_PATTERN}),
                 Query("label", "key:value, repeatable: only jobs carrying every pair given "
                                "(a key given twice with two values is 422)",
                       {"type": "array", "maxItems": MAX_LABEL_FILTERS,
                        "items": {"type": "string", "pattern": LABEL_FILTER_PATTERN}}),
                 *_list_query(ID_CURSOR_PATTERN))),
    Route("POST", "/v1/jobs/{jobId}:pause", jobs.pause_job,
          "Pause a job: no new attempt of it starts until it is resumed", "tenant",
          ok=(200, Job), errors=(409,), links=_JOB_LINKS, ok_headers=_ETAG),
    Route("POST", "/v1/jobs/{jobId}:resume", jobs.resume_job,
          "Resume a paused job (next run per its misfire policy; held retries go on)", "tenant",
          ok=(200, Job), errors=(409,), links=_JOB_LINKS, ok_headers=_ETAG),
    Route("GET", "/v1/jobs/{jobId}", jobs.get_job, "Read a job", "tenant", ok=(200, Job),
          links=_JOB_LINKS, ok_headers=_ETAG),
    Route("PATCH", "/v1/jobs/{jobId}", patch.patch_job,
          "Change a job: a JSON merge patch under If-Match", "tenant", JobPatch, (200, Job),
          (409, 412, 428), headers=_IF_MATCH, links=_JOB_LINKS, ok_headers=_ETAG,
          body_types=("application/merge-patch+json", "application/json")),
    Route("GET", "/v1/jobs/{jobId}/revisions", patch.job_revisions,
          "A job's revisions (each PATCH), newest first", "tenant", ok=(200, RevisionPage),
          errors=(422,), query=_list_query(REVISION_CURSOR_PATTERN)),
    Route("DELETE", "/v1/jobs/{jobId}", jobs.cancel_job, "Cancel a job (idempotent)", "tenant",
          ok=(204, None)),
    Route("POST", "/v1/jobs/{jobId}:trigger", executions.trigger_job,
          "Run a job once now, outside its schedule (a paused job stays paused)", "tenant",
          ok=(202, Triggered), errors=(409,),
          links=(Link("getExecution", executions.get_execution,
                      {"executionId": "$response.body#/executionId"}),
                 Link("retryExecution", executions.retry_execution,
                      {"executionId": "$response.body#/executionId"}),
                 *_job_links("$request.path.jobId", executions.job_executions,
                             jobs.cancel_job))),
    Route("GET", "/v1/jobs/{jobId}/executions", executions.job_executions,
          "A job's executions, newest first", "tenant", ok=(200, ExecutionPage),
          errors=(422,), query=_list_query(EXECUTION_CURSOR_PATTERN),
          links=(Link("getExecution", executions.get_execution,
                      {"executionId": "$response.body#/items/0/executionId"}),)),
    Route("POST", "/v1/executions/{executionId}:retry", executions.retry_execution,
          "Replay a dead execution with its next attempt", "tenant", ok=(202, None),
          errors=(409,)),
    Route("GET", "/v1/executions/{executionId}", executions.get_execution,
          "An execution with every attempt", "tenant", ok=(200, Execution)),
    Route("GET", "/v1/dead-letters", executions.dead_letters,
          "Dead executions, newest first", "tenant", ok=(200, ExecutionPage),
          errors=(422,), query=_list_query(ID_CURSOR_PATTERN)),
    Route("POST", "/v1/tenants", tenants.create_tenant, "Create a tenant", "admin", TenantSpec,
          (201, TenantCreated), links=_TENANT_LINKS),
    Route("POST", "/v1/tenants/{tenantId}:rotate-secret", tenants.rotate_secret,
          "Rotate a tenant's signing secret, the old one signing too for an overlap",
          "admin_or_tenant", SecretRotation, (200, SigningSecret), body_optional=True,
          links=(Link("patchTenant", tenants.patch_tenant,
                      {"tenantId": "$request.path.tenantId"}),)),
    Route("PATCH", "/v1/tenants/{tenantId}", tenants.patch_tenant, "Update a tenant's limits",
          "admin", TenantPatch, (200, Tenant), links=_TENANT_LINKS),
    Route("GET", "/healthz", health.healthz, "Liveness", "none", ok=(200, health.Health)),
    Route("GET", "/readyz", health.readyz, "Readiness: Postgres and Redis answer", "none",
          ok=(200, health.Health), also=((503, health.Health),)),
)

_PARAM = re.compile(r"\{(\w+)\}")


def aiohttp_path(path: str) -> str:
    """A path parameter never spans '/' or ':', so `{jobId}:pause` routes cleanly."""
    return _PARAM.sub(lambda m: "{" + m.group(1) + r":[^{}/:]+}", path)


def register(app: web.Application) -> None:
    for route in ROUTES:
        app.router.add_route(route.method, aiohttp_path(route.path), route.handler)
