"""Admin handlers: create, update and rotate the secret of tenants."""

from __future__ import annotations

import uuid

import msgspec
from aiohttp import web

from herdwick.gateway.auth import require_admin
from herdwick.gateway.body import read_json_body
from herdwick.gateway.context import Ctx
from herdwick.gateway.decoding import decode
from herdwick.gateway.params import json_response, path_uuid
from herdwick.gateway.problems import bad_field
from herdwick.model import SigningSecret, TenantPatch, TenantSpec, valid_name
from herdwick.storage import tenants as store

BODY_CAP = 16 * 1024
_spec_decoder = msgspec.json.Decoder(TenantSpec)
_patch_decoder = msgspec.json.Decoder(TenantPatch)


def _tenant_id(request: web.Request) -> uuid.UUID:
    return path_uuid(request, "tenantId", "tenant")


async def create_tenant(request: web.Request) -> web.Response:
    ctx = Ctx.of(request)
    require_admin(request, ctx.settings.admin_token)
    spec = decode(_spec_decoder, await read_json_body(request, BODY_CAP))
    if not valid_name(spec.name):
        raise bad_field("name", "must not contain control characters")
    return json_response(201, await store.create_tenant(ctx.db, spec, ctx.clock.now()))


async def patch_tenant(request: web.Request) -> web.Response:
    ctx = Ctx.of(request)
    require_admin(request, ctx.settings.admin_token)
    patch = decode(_patch_decoder, await read_json_body(request, BODY_CAP))
    return json_response(200, await store.patch_tenant(ctx.db, _tenant_id(request), patch))


async def rotate_secret(request: web.Request) -> web.Response:
    ctx = Ctx.of(request)
    require_admin(request, ctx.settings.admin_token)
    secret = await store.rotate_signing_secret(ctx.db, _tenant_id(request))
    return json_response(200, SigningSecret(signing_secret=secret))
