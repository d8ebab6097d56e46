"""Every Redis key and channel name herdwick uses, in one place.

A pool's keys share the hash tag `{pool}`, so on Redis Cluster they live in
one slot and a function call may touch all of them.
"""

from __future__ import annotations


def pool_base(prefix: str, pool: str) -> str:
    """The one key the worker-protocol functions take: `P:{pool}`."""
    return f"{prefix}:{{{pool}}}"


def ready_stream(prefix: str, pool: str) -> str:
    return pool_base(prefix, pool) + ":ready"


def events_stream(prefix: str, pool: str) -> str:
    return pool_base(prefix, pool) + ":events"


def hot_state(prefix: str, pool: str, execution_id: str) -> str:
    return pool_base(prefix, pool) + ":x:" + execution_id


def leases_zset(prefix: str, pool: str) -> str:
    """Sorted set of leased execution ids, scored by lease_until (ms): hw_expire's work list."""
    return pool_base(prefix, pool) + ":leases"


def tenant_bucket(prefix: str, tenant_id: str) -> str:
    """A tenant's dispatch-rate token bucket (hw_take), in a slot of its own: one bucket
    a tenant, shared by every pool its jobs use and by every scheduler."""
    return f"{prefix}:{{t.{tenant_id}}}:bucket"


def tenant_wrote(prefix: str, tenant_id: str) -> str:
    """The tenant's last write through any gateway: a key set after each commit with a
    fixed time to live, so its remaining TTL says how long ago that was (storage/write_marks.py);
    in the tenant's slot, beside its bucket."""
    return f"{prefix}:{{t.{tenant_id}}}:wrote"


def notify_channel(prefix: str) -> str:
    """Pub/sub channel: the gateway announces near-due submissions to the shard owners."""
    return f"{prefix}:notify"


WORKERS_GROUP = "workers"


def pools_set(prefix: str) -> str:
    """Every pool that has had work published: what the event actor and reaper watch."""
    return f"{prefix}:pools"


def epoch_key(prefix: str) -> str:
    """Set once by a scheduler; its absence means Redis lost its data (restart, flush)."""
    return f"{prefix}:epoch"


def signing_hash(prefix: str) -> str:
    """Hash of tenant id -> its signing secrets (herdwick.signing.SigningKeys as JSON), what
    the http workers sign deliveries with; in the http pool's slot, beside its streams."""
    return f"{prefix}:{{http}}:signing"
