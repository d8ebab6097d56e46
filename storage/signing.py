"""The http workers' copy of every tenant's signing secrets: one Redis hash.

Postgres holds the truth (tenants.signing_secret and previous_*); the http workers
read only Redis. So the gateway writes a tenant's keys through after each create and
rotate commits, and every scheduler's Maintenance actor rewrites what differs every
few seconds (`sync_all`), which is also what refills a Redis that lost its data.

Key `keys.signing_hash(prefix)` (`P:{http}:signing`, in the http pool's slot); field:
the tenant id as text; value: `SigningKeys.encode()`, compact JSON
`{"current":"whsec_...","previous":"whsec_..."|null,"previous_until_ms":<ms>|null}`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime

import msgspec
import redis.asyncio as aioredis

from herdwick.errors import StorageUnavailable
from herdwick.redis_client import REDIS_ERRORS
from herdwick.signing import SigningKeys
from herdwick.storage import tenants
from herdwick.storage.db import Database
from herdwick.storage.keys import signing_hash


class Synced(msgspec.Struct, frozen=True):
    """What one sync_all changed: fields written, fields of vanished tenants dropped."""

    written: int
    dropped: int


def _bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


async def publish(client: aioredis.Redis, prefix: str,
                  keys: Mapping[str, SigningKeys]) -> None:
    """Set these tenants' keys (tenant id text -> keys), in one round trip."""
    if not keys:
        return
    mapping = {tenant_id: k.encode() for tenant_id, k in keys.items()}
    try:
        await client.hset(signing_hash(prefix), mapping=mapping)
    except (*REDIS_ERRORS, OSError) as exc:
        raise StorageUnavailable(f"redis: signing keys publish failed: {exc}") from exc


async def load(client: aioredis.Redis, prefix: str,
               tenant_ids: Iterable[str]) -> dict[str, SigningKeys]:
    """These tenants' keys, in one HMGET; a tenant missing or unreadable is left out."""
    ids = list(dict.fromkeys(tenant_ids))
    if not ids:
        return {}
    try:
        values = await client.hmget(signing_hash(prefix), ids)
    except (*REDIS_ERRORS, OSError) as exc:
        raise StorageUnavailable(f"redis: signing keys load failed: {exc}") from exc
    found = {}
    for tenant_id, value in zip(ids, values, strict=True):
        if value is None:
            continue
        try:
            found[tenant_id] = SigningKeys.decode(value)
        except msgspec.DecodeError:
            continue  # not ours, or from a release that wrote another form: sync_all mends it
    return found


async def sync_all(db: Database, client: aioredis.Redis, prefix: str,
                   now: datetime) -> Synced:
    """Make the hash say what Postgres says at `now`: write the tenants whose keys differ
    (or are missing), drop the fields of tenants that no longer exist.

    Redis is read before Postgres, and only what differs from that first read is
    written, so a gateway's write-through that lands meanwhile is not overwritten
    with the older secrets this pass read (unless the field was missing or wrong
    already: then the next pass, SIGNING_SYNC_S on, puts it right). A field is dropped
    only if it was there before the read and its tenant is not in Postgres, so a
    tenant created meanwhile keeps its field.
    """
    key = signing_hash(prefix)
    try:
        before = {_bytes(f): _bytes(v) for f, v in (await client.hgetall(key)).items()}
    except (*REDIS_ERRORS, OSError) as exc:
        raise StorageUnavailable(f"redis: signing keys read failed: {exc}") from exc
    truth = await tenants.signing_secrets(db, now)
    changed = {}
    for tenant_id, keys in truth.items():
        encoded = keys.encode()
        if before.get(tenant_id.encode()) != encoded:
            changed[tenant_id] = encoded
    gone = [f for f in before if f.decode(errors="replace") not in truth]
    if changed or gone:
        try:
            async with client.pipeline(transaction=True) as pipe:
                if changed:
                    pipe.hset(key, mapping=changed)
                if gone:
                    pipe.hdel(key, *gone)
                await pipe.execute()
        except (*REDIS_ERRORS, OSError) as exc:
            raise StorageUnavailable(f"redis: signing keys sync failed: {exc}") from exc
    return Synced(written=len(changed), dropped=len(gone))
