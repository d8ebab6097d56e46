"""Path and query parameters, and JSON responses: shared by every handler module."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import TypeVar

import msgspec
from aiohttp import web

from herdwick.gateway.problems import bad_field
from herdwick.model import LIST_LIMIT_DEFAULT, LIST_LIMIT_MAX

T = TypeVar("T")
_encoder = msgspec.json.Encoder()


def json_response(status: int, value: object,
                  headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=_encoder.encode(value),
                        content_type="application/json", headers=headers)


def etag(job) -> dict[str, str]:
    """A job's ETag: its version, quoted (what If-Match sends back)."""
    return {"ETag": f'"{job.version}"'}


def path_uuid(request: web.Request, name: str, what: str) -> uuid.UUID:
    """A path id; one that is not even a UUID cannot exist, so it is a 404 too."""
    try:
        return uuid.UUID(request.match_info[name])
    except ValueError:
        raise bad_field(name, f"not a {what} id", status=404) from None


def limit(request: web.Request) -> int:
    text = request.query.get("limit")
    if text is None:
        return LIST_LIMIT_DEFAULT
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= LIST_LIMIT_MAX:
        raise bad_field("limit", f"an integer from 1 to {LIST_LIMIT_MAX}")
    return value


def cursor(request: web.Request, decode: Callable[[str], T]) -> T | None:
    text = request.query.get("cursor")
    if not text:
        return None
    try:
        return decode(text)
    except ValueError:
        raise bad_field("cursor", "not a cursor returned by this API") from None
