"""The http workers' copy of the signing secrets in Redis: written, read, and brought back.

The http workers never read Postgres, so a Redis that lost its data (a restart, a
FLUSHALL) must get every tenant's secrets back without anyone rotating anything:
the schedulers' Maintenance actor copies them every SIGNING_SYNC_S.
"""

from __future__ import annotations

import uuid

import redis.asyncio as aioredis

from herdwick.actors.base import sync
from herdwick.actors.maintenance import Maintenance, SyncSigning
from herdwick.clock import to_us
from herdwick.model import TenantSpec
from herdwick.signing import SigningKeys
from herdwick.storage import keys, signing
from herdwick.storage.signing import Synced
from herdwick.storage.tenants import create_tenant, rotate_signing_secret

A, B = "whsec_a", "whsec_b"


async def _tenants(db, clock, n: int) -> list[str]:
    return [str((await create_tenant(db, TenantSpec(name=f"t{i}"), clock.now())).tenant_id)
            for i in range(n)]


async def test_publish_and_load_round_trip_and_skip_what_is_missing_or_garbage(
        redis_client, key_prefix) -> None:
    one, two, missing, garbage = (str(uuid.uuid4()) for _ in range(4))
    given = {one: SigningKeys(current=A),
             two: SigningKeys(current=B, previous=A, previous_until_ms=1_800_000_000_000)}
    await signing.publish(redis_client, key_prefix, given)
    await signing.publish(redis_client, key_prefix, {})  # nothing to do: no round trip
    await redis_client.hset(keys.signing_hash(key_prefix), garbage, b"not json")
    assert keys.signing_hash(key_prefix) == f"{key_prefix}:{{http}}:signing"
    assert await signing.load(redis_client, key_prefix, [one, two, missing, garbage]) == given
    assert await signing.load(redis_client, key_prefix, []) == {}
    raw = await redis_client.hget(keys.signing_hash(key_prefix), one)
    assert raw == b'{"current":"whsec_a","previous":null,"previous_until_ms":null}'


async def test_sync_all_refills_an_emptied_redis(db, redis_client, key_prefix, clock) -> None:
    tenants = await _tenants(db, clock, 3)
    rotated = await rotate_signing_secret(db, uuid.UUID(tenants[0]), 3600, clock.now())
    assert await signing.sync_all(db, redis_client, key_prefix, clock.now()) == Synced(3, 0)
    before = await signing.load(redis_client, key_prefix, tenants)
    assert before[tenants[0]] == rotated.keys
    assert before[tenants[0]].previous_until_ms == to_us(clock.now()) // 1000 + 3_600_000

    await redis_client.delete(keys.signing_hash(key_prefix))  # the FLUSHALL, for this test
    assert await signing.load(redis_client, key_prefix, tenants) == {}
    assert await signing.sync_all(db, redis_client, key_prefix, clock.now()) == Synced(3, 0)
    assert await signing.load(redis_client, key_prefix, tenants) == before


async def test_sync_all_writes_only_what_differs_and_drops_vanished_tenants(
        db, redis_client, key_prefix, clock) -> None:
    [tenant] = await _tenants(db, clock, 1)
    await signing.sync_all(db, redis_client, key_prefix, clock.now())
    assert await signing.sync_all(db, redis_client, key_prefix, clock.now()) == Synced(0, 0)

    gone = str(uuid.uuid4())
    await signing.publish(redis_client, key_prefix, {gone: SigningKeys(current=A),
                                                     tenant: SigningKeys(current=B)})
    await redis_client.hset(keys.signing_hash(key_prefix), b"\xff\xfe", b"junk")
    assert await signing.sync_all(db, redis_client, key_prefix, clock.now()) == Synced(1, 2)
    fields = await redis_client.hkeys(keys.signing_hash(key_prefix))
    assert fields == [tenant.encode()]
    [(_, got)] = (await signing.load(redis_client, key_prefix, [tenant])).items()
    assert got.current != B  # Postgres' secret again, not the stray one


async def test_a_previous_secret_whose_overlap_ended_is_not_copied(
        db, redis_client, key_prefix, clock) -> None:
    [tenant] = await _tenants(db, clock, 1)
    rotated = await rotate_signing_secret(db, uuid.UUID(tenant), 60, clock.now())
    await signing.sync_all(db, redis_client, key_prefix, clock.now())
    clock.advance(61)
    assert await signing.sync_all(db, redis_client, key_prefix, clock.now()) == Synced(1, 0)
    assert await signing.load(redis_client, key_prefix, [tenant]) == {
        tenant: SigningKeys(current=rotated.keys.current)}


async def test_the_scheduler_copies_the_secrets_at_start_and_on_each_sync(
        db, redis_client, key_prefix, clock, schedulers) -> None:
    tenants = await _tenants(db, clock, 2)
    node = await schedulers()
    copied = await signing.load(redis_client, key_prefix, tenants)
    assert set(copied) == set(tenants)  # on start, before any tick

    # Redis loses its data; the next SyncSigning (every SIGNING_SYNC_S) puts it back.
    await redis_client.delete(*[k async for k in redis_client.scan_iter(f"{key_prefix}:*")])
    assert await signing.load(redis_client, key_prefix, tenants) == {}
    await node.maintenance.send(SyncSigning())
    await sync(node.maintenance)
    assert await signing.load(redis_client, key_prefix, tenants) == copied


async def test_a_redis_that_stays_away_is_one_warning_not_a_crash(db, key_prefix, clock,
                                                                  caplog) -> None:
    away = aioredis.from_url("redis://127.0.0.1:1/0")
    try:
        actor = Maintenance(db=db, clock=clock, redis=away, key_prefix=key_prefix)
        for _ in range(3):
            assert await actor.sync_signing() is None
    finally:
        await away.aclose()
    assert caplog.text.count("event=signing_sync_failed") == 1
