"""Who is calling: tenants by API key (cached briefly), operators by the admin token."""

from __future__ import annotations

import time

from aiohttp import web

from herdwick.credentials import hash_api_key, same_secret
from herdwick.gateway.problems import HttpProblem
from herdwick.storage.db import Database
from herdwick.storage.tenants import KeyOwner, owner_of_key

CACHE_TTL_S = 5.0  # a revoked key or a changed quota is seen within this long
CACHE_MAX = 10_000


class KeyCache:
    """Recently verified keys, by hash, so the hot path skips a lookup per request.

    Owned by the app; handlers on the one event loop read and write it. Only
    keys that resolved are cached, so garbage keys cannot grow it.
    """

    def __init__(self, ttl_s: float = CACHE_TTL_S) -> None:
        self._ttl_s = ttl_s
        self._entries: dict[bytes, tuple[float, KeyOwner]] = {}

    def get(self, digest: bytes) -> KeyOwner | None:
        hit = self._entries.get(digest)
        if hit is None or hit[0] < time.monotonic():
            return None
        return hit[1]

    def put(self, digest: bytes, owner: KeyOwner) -> None:
        if len(self._entries) >= CACHE_MAX:
            self._entries.clear()
        self._entries[digest] = (time.monotonic() + self._ttl_s, owner)


def _unauthorized(detail: str) -> HttpProblem:
    return HttpProblem(401, "unauthorized", "Unauthorized", detail,
                       headers={"WWW-Authenticate": 'Bearer realm="herdwick"'})


def bearer(request: web.Request) -> str:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise _unauthorized("send Authorization: Bearer <api key>")
    return token.strip()


async def key_owner(key: str, db: Database, cache: KeyCache) -> KeyOwner | None:
    """The tenant whose API key this is, through the cache; None if it is no tenant's."""
    digest = hash_api_key(key)
    owner = cache.get(digest)
    if owner is None:
        owner = await owner_of_key(db, key)
        if owner is not None:
            cache.put(digest, owner)
    return owner


async def tenant_of(request: web.Request, db: Database, cache: KeyCache) -> KeyOwner:
    owner = await key_owner(bearer(request), db, cache)
    if owner is None:
        raise _unauthorized("the API key is not valid")
    return owner


async def admin_or_tenant(request: web.Request, admin_token: str | None, db: Database,
                          cache: KeyCache) -> KeyOwner | None:
    """None for the admin token; else the tenant whose API key it is (401 if none is).

    With the admin API off, only tenant keys are tried: the route stays open to them.
    """
    token = bearer(request)
    if is_admin_token(token, admin_token):
        return None
    owner = await key_owner(token, db, cache)
    if owner is None:
        raise _unauthorized("the token is neither a tenant's API key nor the admin token")
    return owner


def is_admin_token(token: str, admin_token: str | None) -> bool:
    """In constant time; never true with the admin API off."""
    return admin_token is not None and same_secret(token, admin_token)


def require_admin(request: web.Request, admin_token: str | None) -> None:
    if admin_token is None:
        raise HttpProblem(403, "admin-disabled", "Admin API disabled",
                          "the admin API is off: set HERDWICK_ADMIN_TOKEN to enable it")
    if not same_secret(bearer(request), admin_token):
        raise _unauthorized("the admin token is not valid")
