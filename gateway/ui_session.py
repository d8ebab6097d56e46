"""Who is looking at /ui: the token its cookie holds, and the CSRF token its forms carry.

The cookie holds the token the viewer logged in with (the admin token or a
tenant's API key), HttpOnly, SameSite=Strict and scoped to /ui, so no script
reads it and no other site's page sends it. It is checked on every request with
gateway/auth.py's own checks (the key cache, the constant-time admin compare),
so a revoked key logs its viewer out within the cache's TTL.

A form's CSRF token is an HMAC of the session's token: any gateway process can
check it without shared state, and a page that shows it does not show the token.
The login form, before any session, carries a random one that must match a
cookie of its own (double submit), so no other site can log a browser in.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import uuid

import msgspec
from aiohttp import web

from herdwick.credentials import same_secret
from herdwick.gateway.auth import is_admin_token, key_owner
from herdwick.gateway.context import Ctx

UI_PATH = "/ui"
SESSION_COOKIE = "herdwick_ui"
LOGIN_COOKIE = "herdwick_ui_login"
CSRF_FIELD = "csrf"
MAX_TOKEN_LEN = 512  # longer than any API key or sensible admin token
_CSRF_CONTEXT = b"herdwick ui csrf v1"


class Viewer(msgspec.Struct, frozen=True, kw_only=True):
    tenant_id: uuid.UUID | None  # None: the admin, who sees every tenant
    csrf: str

    @property
    def is_admin(self) -> bool:
        return self.tenant_id is None

    def may_see(self, tenant_id: uuid.UUID) -> bool:
        return self.tenant_id is None or self.tenant_id == tenant_id


def csrf_of(token: str) -> str:
    return hmac.new(token.encode(), _CSRF_CONTEXT, hashlib.sha256).hexdigest()


async def viewer_of_token(ctx: Ctx, token: str) -> Viewer | None:
    """The viewer this token makes, or None if it is neither the admin token nor a key."""
    if not token or len(token) > MAX_TOKEN_LEN:
        return None
    if is_admin_token(token, ctx.settings.admin_token):
        return Viewer(tenant_id=None, csrf=csrf_of(token))
    owner = await key_owner(token, ctx.db, ctx.keys)
    return None if owner is None else Viewer(tenant_id=owner.tenant_id, csrf=csrf_of(token))


async def viewer(request: web.Request, ctx: Ctx) -> Viewer | None:
    return await viewer_of_token(ctx, request.cookies.get(SESSION_COOKIE, ""))


def csrf_matches(expected: str, given: object) -> bool:
    return isinstance(given, str) and bool(given) and same_secret(given, expected)


def _cookie(response: web.StreamResponse, request: web.Request, name: str, value: str) -> None:
    response.set_cookie(name, value, path=UI_PATH, httponly=True, samesite="Strict",
                        secure=request.secure)


def start(response: web.StreamResponse, request: web.Request, token: str) -> None:
    _cookie(response, request, SESSION_COOKIE, token)
    response.del_cookie(LOGIN_COOKIE, path=UI_PATH)


def end(response: web.StreamResponse) -> None:
    response.del_cookie(SESSION_COOKIE, path=UI_PATH)


def login_csrf(request: web.Request) -> tuple[str, bool]:
    """The login form's token: the one its cookie already holds, else a new one (True)."""
    token = request.cookies.get(LOGIN_COOKIE)
    if token and len(token) <= MAX_TOKEN_LEN:
        return token, False
    return secrets.token_urlsafe(24), True


def remember_login_csrf(response: web.StreamResponse, request: web.Request, token: str) -> None:
    _cookie(response, request, LOGIN_COOKIE, token)
