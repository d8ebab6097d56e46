"""Reading request bodies under a cap, before anything parses them."""

from __future__ import annotations

from aiohttp import web

from herdwick.gateway.problems import HttpProblem

_JSON_TYPES = ("application/json", "")


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
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.content.iter_chunked(64 * 1024):
        size += len(chunk)
        if size > cap:
            raise _too_large(cap)
        chunks.append(chunk)
    return b"".join(chunks)
