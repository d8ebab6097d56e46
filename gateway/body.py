"""Reading request bodies under a cap and a deadline, before anything parses them."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from aiohttp import web

from herdwick.gateway.problems import HttpProblem

T = TypeVar("T")
_JSON_TYPES = ("application/json", "")
# The whole body must arrive within this long of the handler asking for it. aiohttp has no
# timeout of its own on a body (its keepalive timeout covers only the request line and
# headers: gateway/app.py), so without one a client trickling a byte a second holds a
# handler, and a database connection's worth of work behind it, for as long as it likes.
# 16 MiB, the largest cap, takes under 2 s at 100 Mbit/s.
BODY_READ_TIMEOUT_S = 30.0


def _too_slow() -> HttpProblem:
    # The connection closes after the answer: what is left of the body is not worth waiting
    # for, nor is a client that slow worth keeping.
    return HttpProblem(408, "request-timeout", "Request timeout",
                       f"the request body did not arrive within {BODY_READ_TIMEOUT_S:g} s",
                       close=True)


async def within_read_timeout(read: Awaitable[T]) -> T:
    """The body that `read` reads (a form's too), or 408 once BODY_READ_TIMEOUT_S passes."""
    try:
        async with asyncio.timeout(BODY_READ_TIMEOUT_S):
            return await read
    except TimeoutError:
        raise _too_slow() from None


def _too_large(cap: int) -> HttpProblem:
    return HttpProblem(413, "payload-too-large", "Payload too large",
                       f"the request body is over {cap} bytes")


async def read_json_body(request: web.Request, cap: int) -> bytes:
    """The raw body, refusing a non-JSON content type (415) or more than `cap` bytes (413)."""
    ctype = request.content_type if request.headers.get("Content-Type") else ""
    if ctype not in _JSON_TYPES and not ctype.endswith("+json"):
        raise HttpProblem(415, "unsupported-media-type", "Unsupported media type",
                          f"send application/json, not {ctype}")
    if request.content_length is not None and request.content_length > cap:
        raise _too_large(cap)
    return await within_read_timeout(_read_capped(request, cap))


async def _read_capped(request: web.Request, cap: int) -> bytes:
    # A chunked body (no Content-Length) is cut off at the first chunk past the cap.
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.content.iter_chunked(64 * 1024):
        size += len(chunk)
        if size > cap:
            raise _too_large(cap)
        chunks.append(chunk)
    return b"".join(chunks)
