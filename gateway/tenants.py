"""Tenant handlers: create, update (admin) and rotate the signing secret (admin or the tenant)."""

from __future__ import annotations

import asyncio
import uuid

import msgspec
from aiohttp import web

from herdwick import logs
from herdwick.errors import NotFound, StorageUnavailable
from herdwick.gateway.auth import admin_or_tenant, require_admin
from herdwick.gateway.body import read_json_body
from herdwick.gateway.context import Ctx
from herdwick.gateway.decoding import decode
from herdwick.gateway.params import json_response, path_uuid
from herdwick.gateway.problems import bad_field
from herdwick.model import SecretRotation, TenantPatch, TenantSpec, valid_name
from herdwick.redis_client import REDIS_ERRORS
from herdwick.signing import SigningKeys
from herdwick.storage import signing
from herdwick.storage import tenants as store

log = logs.get("herdwick.gateway")

BODY_CAP = 16 * 1024
# The write-through of a tenant's signing keys to Redis waits this long at most: it is
# best effort (the schedulers copy every tenant's keys within seconds anyway), and the
# answer must not hang on a Redis that does not answer.
SIGNING_PUBLISH_TIMEOUT_S = 2.0
_spec_decoder = msgspec.json.Decoder(TenantSpec)
_patch_decoder = msgspec.json.Decoder(TenantPatch)
_rotation_decoder = msgspec.json.Decoder(SecretRotation)


def _tenant_id(request: web.Request) -> uuid.UUID:
    return path_uuid(request, "tenantId", "tenant")


async def _publish_keys(ctx: Ctx, tenant_id: uuid.UUID, keys: SigningKeys) -> None:
    """Best effort, after the commit: Postgres has the secret, and the schedulers' sync
    (actors/maintenance.py) copies it to Redis within SIGNING_SYNC_S if this fails."""
    if ctx.redis is None:
        return
    try:
        async with asyncio.timeout(SIGNING_PUBLISH_TIMEOUT_S):
            await signing.publish(ctx.redis, ctx.settings.key_prefix, {str(tenant_id): keys})
    except (StorageUnavailable, *REDIS_ERRORS, OSError, TimeoutError) as exc:
        log.warning("signing_publish_failed", tenant_id=str(tenant_id), error=str(exc))


async def create_tenant(request: web.Request) -> web.Response:
    ctx = Ctx.of(request)
    require_admin(request, ctx.settings.admin_token)
    spec = decode(_spec_decoder, await read_json_body(request, BODY_CAP))
    if not valid_name(spec.name):
        raise bad_field("name", "must not contain control characters")
    created = await store.create_tenant(ctx.db, spec, ctx.clock.now())
    await _publish_keys(ctx, created.tenant_id, SigningKeys(current=created.signing_secret))
    return json_response(201, created)


async def patch_tenant(request: web.Request) -> web.Response:
    ctx = Ctx.of(request)
    require_admin(request, ctx.settings.admin_token)
    patch = decode(_patch_decoder, await read_json_body(request, BODY_CAP))
    return json_response(200, await store.patch_tenant(ctx.db, _tenant_id(request), patch))


async def rotate_secret(request: web.Request) -> web.Response:
    """Replaces the tenant's signing secret. The admin token may rotate any tenant's; a
    tenant's API key only its own (another tenant's id is 404). The body is optional:
    none, or {}, keeps the old secret signing beside the new one for the default
    overlapSeconds (86400); 0 stops it at once. Rotating again inside an overlap keeps
    only the secret current just before: the older one stops signing at once."""
    ctx = Ctx.of(request)
    owner = await admin_or_tenant(request, ctx.settings.admin_token, ctx.db, ctx.keys)
    tenant_id = _tenant_id(request)
    if owner is not None and owner.tenant_id != tenant_id:
        raise NotFound(f"tenant {tenant_id} does not exist")
    # No body at all is the defaults, whatever Content-Type came with it (clients send
    # application/octet-stream, or none, for a bodiless POST).
    raw = await read_json_body(request, BODY_CAP) if request.body_exists else b""
    rotation = decode(_rotation_decoder, raw) if raw else SecretRotation()
    rotated = await store.rotate_signing_secret(ctx.db, tenant_id, rotation.overlap_seconds,
                                                ctx.clock.now())
    log.info("signing_secret_rotated", tenant_id=str(tenant_id),
             overlap_s=rotation.overlap_seconds, by="admin" if owner is None else "tenant")
    await _publish_keys(ctx, tenant_id, rotated.keys)
    return json_response(200, rotated.shown)
