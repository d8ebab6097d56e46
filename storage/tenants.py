"""Tenants and their API keys."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from datetime import datetime, timedelta

import asyncpg
import msgspec

from herdwick.clock import to_us
from herdwick.credentials import hash_api_key, new_api_key, new_signing_secret, same_secret
from herdwick.errors import NotFound, StorageUnavailable
from herdwick.ids import uuid7
from herdwick.model import SigningSecret, Tenant, TenantCreated, TenantPatch, TenantSpec
from herdwick.signing import SigningKeys
from herdwick.storage.db import Database
from herdwick.storage.sql import q


class KeyOwner(msgspec.Struct, frozen=True):
    """What authentication needs to know about the tenant behind a key."""

    tenant_id: uuid.UUID
    max_active_jobs: int | None
    durability: str = "async"  # "sync": its submits commit with remote_apply


async def create_tenant(db: Database, spec: TenantSpec, now: datetime) -> TenantCreated:
    tenant_id = uuid7(now)
    api_key = new_api_key()
    secret = new_signing_secret()
    async with db.connection() as conn:
        await conn.execute(
            q("create_tenant"), tenant_id, spec.name, spec.weight, spec.dispatch_rate,
            spec.max_active_jobs, secret, hash_api_key(api_key), now, spec.burst, spec.dry_run,
            spec.durability)
    return TenantCreated(tenant_id=tenant_id, api_key=api_key, signing_secret=secret)


async def owner_of_key(db: Database, api_key: str) -> KeyOwner | None:
    digest = hash_api_key(api_key)
    async with db.connection() as conn:
        row = await conn.fetchrow(q("tenant_by_key"), digest)
    if row is None or not same_secret(row["key_hash"], digest):
        return None
    return KeyOwner(tenant_id=row["tenant_id"], max_active_jobs=row["max_active_jobs"],
                    durability=row["durability"])


def _tenant(row: asyncpg.Record) -> Tenant:
    return Tenant(tenant_id=row["tenant_id"], name=row["name"], weight=row["weight"],
                  dispatch_rate=row["dispatch_rate"], burst=row["burst"],
                  max_active_jobs=row["max_active_jobs"], dry_run=row["dry_run"],
                  durability=row["durability"], created_at=row["created_at"],
                  updated_at=row["updated_at"])


async def get_tenant(db: Database, tenant_id: uuid.UUID) -> Tenant:
    async with db.connection() as conn:
        row = await conn.fetchrow(q("get_tenant"), tenant_id)
    if row is None:
        raise NotFound(f"tenant {tenant_id} does not exist")
    return _tenant(row)


# Setting a quota recounts under a lock that every submit and completion queues behind
# while it is asked for. The statement asks for 200 ms at a time (quota_changes_lock); the
# PATCH tries again until QUOTA_SET_WITHIN_S, so a long transaction in the lock's way
# holds the others back 200 ms at a time, not for as long as it lasts.
QUOTA_SET_WITHIN_S = 10.0


async def patch_tenant(db: Database, tenant_id: uuid.UUID, patch: TenantPatch, *,
                       within_s: float = QUOTA_SET_WITHIN_S) -> Tenant:
    def field(value: object) -> tuple[bool, object]:
        return (False, None) if value is msgspec.UNSET else (True, value)

    args = (*field(patch.weight), *field(patch.dispatch_rate), *field(patch.max_active_jobs),
            *field(patch.burst), *field(patch.dry_run), *field(patch.durability))
    deadline = time.monotonic() + within_s
    while True:
        try:
            return await _patch_once(db, tenant_id, args, patch.max_active_jobs)
        except asyncpg.LockNotAvailableError:
            if time.monotonic() >= deadline:
                raise StorageUnavailable(
                    f"setting the quota found transactions in the way for {within_s:g} s; "
                    "nothing was changed") from None
            await asyncio.sleep(random.uniform(0.2, 0.5))


async def _patch_once(db: Database, tenant_id: uuid.UUID, args: tuple,
                      max_active_jobs: int | msgspec.UnsetType | None) -> Tenant:
    async with db.transaction() as conn:
        row = await conn.fetchrow(q("patch_tenant"), tenant_id, *args)
        if row is None:
            raise NotFound(f"tenant {tenant_id} does not exist")
        if max_active_jobs is None:
            # The submits' quota lock first: quota_forget and a submit's quota_live both
            # delete the tenant's changes and its count row, in opposite orders.
            await conn.execute(q("tenant_quota_lock"), tenant_id)
            await conn.execute(q("quota_forget"), tenant_id)
        elif max_active_jobs is not msgspec.UNSET:
            # An exact live-job count, which the statements that write and end jobs keep
            # from then on (storage/migrations/0011).
            await conn.execute(q("quota_changes_lock"))
            await conn.execute(q("quota_recount"), tenant_id)
    return _tenant(row)


class TenantLimits(msgspec.Struct, frozen=True, kw_only=True):
    """What a fair queue needs of a tenant: its share, its dispatch-rate quota, and whether
    its dispatches commit with remote_apply (sync: sent in dispatches of their own, so the
    others never wait for a standby on its account)."""

    weight: int = 1
    rate: float | None = None  # dispatches a second; None: no quota
    burst: float | None = None  # tokens its bucket holds; None: one second of the rate
    sync: bool = False

    @property
    def bucket_size(self) -> float:
        return self.burst or max(1.0, self.rate or 1.0)


async def limits_since(db: Database,
                       since: datetime | None) -> tuple[dict[str, TenantLimits], datetime | None]:
    """Tenants whose settings changed after `since` (all when None), by tenant id text,
    and the latest change seen (the next call's `since`)."""
    async with db.connection() as conn:
        rows = await conn.fetch(q("tenant_limits_since"), since)
    changed = {str(r["tenant_id"]): TenantLimits(weight=r["weight"], rate=r["dispatch_rate"],
                                                 burst=r["burst"],
                                                 sync=r["durability"] == "sync")
               for r in rows}
    return changed, rows[-1]["updated_at"] if rows else since


class Rotation(msgspec.Struct, frozen=True, kw_only=True):
    """A committed rotation: what its caller is shown, and what the http workers sign with."""

    shown: SigningSecret
    keys: SigningKeys


def _signing_keys(row: asyncpg.Record) -> SigningKeys:
    until = row["previous_secret_until"]
    return SigningKeys(current=row["signing_secret"], previous=row["previous_signing_secret"],
                       previous_until_ms=None if until is None else to_us(until) // 1000)


async def rotate_signing_secret(db: Database, tenant_id: uuid.UUID, overlap_s: int,
                                now: datetime) -> Rotation:
    """A new signing secret; the one it replaces signs too for `overlap_s` more seconds.

    Rotating again inside an overlap keeps only the secret that was current just
    before: the older one stops signing at once.
    """
    until = now + timedelta(seconds=overlap_s) if overlap_s > 0 else None
    async with db.connection() as conn:
        row = await conn.fetchrow(q("rotate_signing_secret"), tenant_id, new_signing_secret(),
                                  until)
    if row is None:
        raise NotFound(f"tenant {tenant_id} does not exist")
    shown = SigningSecret(signing_secret=row["signing_secret"],
                          previous_secret_expires_at=row["previous_secret_until"])
    return Rotation(shown=shown, keys=_signing_keys(row))


async def signing_secrets(db: Database, now: datetime) -> dict[str, SigningKeys]:
    """Every tenant's signing secrets at `now`, by tenant id text (one query)."""
    async with db.connection() as conn:
        rows = await conn.fetch(q("tenant_signing_secrets"), now)
    return {str(row["tenant_id"]): _signing_keys(row) for row in rows}


async def issue_key_for(db: Database, name: str, now: datetime) -> tuple[uuid.UUID, str]:
    """A new API key for the tenant called `name`, creating the tenant if there is none.

    Keys are stored hashed, so an old key cannot be shown again: `herdwick dev`
    issues a fresh one each start.
    """
    async with db.connection() as conn:
        tenant_id = await conn.fetchval(q("tenant_by_name"), name)
    if tenant_id is None:
        created = await create_tenant(db, TenantSpec(name=name), now)
        return created.tenant_id, created.api_key
    api_key = new_api_key()
    async with db.connection() as conn:
        await conn.execute(q("insert_api_key"), hash_api_key(api_key), tenant_id, now)
    return tenant_id, api_key
