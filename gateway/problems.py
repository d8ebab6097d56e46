"""problem+json: the one place error bodies are built, and the middleware that maps errors."""

from __future__ import annotations

import re

import msgspec
from aiohttp import web

from herdwick import logs
from herdwick.errors import (
    Conflict,
    IdempotencyKeyReused,
    InvalidInput,
    NotFound,
    QuotaExceeded,
    Rejected,
    StorageUnavailable,
    VersionMismatch,
)
from herdwick.model import FieldError, Problem

log = logs.get("herdwick.gateway")

PROBLEM_BASE = "https://herdwick.dev/problems/"
STORAGE_RETRY_AFTER_S = 5
_encoder = msgspec.json.Encoder()


class HttpProblem(Exception):
    """Raised by handlers for an error response; rendered by the middleware."""

    def __init__(self, status: int, slug: str, title: str, detail: str,
                 errors: list[FieldError] | None = None, headers: dict[str, str] | None = None,
                 close: bool = False):
        super().__init__(detail)
        self.problem = Problem(type=PROBLEM_BASE + slug, title=title, status=status,
                               detail=detail, errors=errors or [])
        self.headers = headers or {}
        self.close = close  # close the connection after the answer (a body not read to its end)

    def response(self, rendered: web.Response) -> web.Response:
        if self.close:
            rendered.force_close()
        return rendered


def bad_field(field: str, message: str, status: int = 422) -> HttpProblem:
    return invalid([FieldError(field=field, message=message)], status)


def invalid(errors: list[FieldError], status: int = 422) -> HttpProblem:
    if status == 413:
        return HttpProblem(413, "payload-too-large", "Payload too large",
                           errors[0].message, errors)
    detail = "; ".join(f"{e.field}: {e.message}" for e in errors[:5])
    if len(errors) > 5:
        detail += f"; and {len(errors) - 5} more"
    return HttpProblem(status, "invalid-request", "Invalid request", detail, errors)


_AT = re.compile(r" - at `\$\.?(.*)`$")
_UNKNOWN = re.compile(r"^Object contains unknown field `(.+)`")
_MISSING = re.compile(r"^Object missing required field `(.+)`")


def from_validation_error(exc: msgspec.ValidationError, prefix: str = "") -> FieldError:
    """Turn msgspec's "Expected ... - at `$.a.b`" into FieldError(field="a.b")."""
    text = str(exc)
    match = _AT.search(text)
    path = match.group(1) if match else ""
    message = _AT.sub("", text)
    named = _UNKNOWN.match(message) or _MISSING.match(message)
    if named:
        path = f"{path}.{named.group(1)}" if path else named.group(1)
    # msgspec names a map's value "[...]" (labels[...]): the field is the map.
    path = ".".join(p for p in (prefix, path.replace("[...]", "")) if p) or "body"
    return FieldError(field=path.replace(".[", "["), message=message)


def render(problem: Problem, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=problem.status, body=_encoder.encode(problem),
                        content_type="application/problem+json", headers=headers)


def from_domain(exc: Exception) -> HttpProblem | None:
    """The problem a domain error answers with; None for any other exception."""
    match exc:
        case InvalidInput():
            return invalid(exc.errors, exc.status)
        case NotFound():
            return HttpProblem(404, "not-found", "Not found", str(exc))
        case Conflict():
            return HttpProblem(409, "conflict", "Conflict", str(exc))
        case VersionMismatch():
            return HttpProblem(412, "precondition-failed", "Precondition failed", str(exc),
                               headers={"ETag": f'"{exc.current_version}"'})
        case IdempotencyKeyReused():
            return HttpProblem(422, "idempotency-key-reused", "Idempotency key reused", str(exc),
                               [FieldError(field="Idempotency-Key", message=str(exc))])
        case QuotaExceeded():
            return HttpProblem(429, "quota-exceeded", "Quota exceeded", str(exc),
                               headers={"Retry-After": str(exc.retry_after_s)})
        case Rejected():
            # What a request carried got past our checks and Postgres refused it: the
            # request's fault, not the server's, but a check is missing: log it.
            return HttpProblem(422, "rejected", "Invalid request",
                               "the database refused a value of this request; nothing was "
                               "written")
        case StorageUnavailable():
            return HttpProblem(503, "storage-unavailable", "Storage unavailable",
                               "storage is unavailable; nothing was written, retry later",
                               headers={"Retry-After": str(STORAGE_RETRY_AFTER_S)})
    return None


_HTTP_SLUGS = {404: "not-found", 405: "method-not-allowed", 413: "payload-too-large",
               415: "unsupported-media-type", 400: "bad-request"}


@web.middleware
async def problem_middleware(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except HttpProblem as exc:
        return exc.response(render(exc.problem, exc.headers))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        slug = _HTTP_SLUGS.get(exc.status, "http-error")
        headers = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "retry-after")}
        return render(Problem(type=PROBLEM_BASE + slug, title=exc.reason, status=exc.status,
                              detail=exc.text or exc.reason), headers)
    except Exception as exc:
        mapped = from_domain(exc)
        if mapped is not None:
            if isinstance(exc, Rejected):
                log.warning("request_rejected", path=request.path, error=str(exc))
            if mapped.problem.status >= 500:
                log.warning("request_failed", status=mapped.problem.status, path=request.path,
                            error=exc)
            return render(mapped.problem, mapped.headers)
        log.exception("request_crashed", path=request.path)
        return render(Problem(type=PROBLEM_BASE + "internal", title="Internal error", status=500,
                              detail="an unexpected error; it has been logged"))
