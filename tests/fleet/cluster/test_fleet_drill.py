"""The fleet drill (issue 16): herdwick as a deployment past one machine runs it.

A Postgres primary with a streaming standby (tests/fleet/postgres_pair.py; the
processes connect through the multi-host DSN a failover needs), a local
3-primary Redis Cluster with a replica each, four `herdwick scheduler`
processes, two `herdwick worker` processes for each of three pools, and the
fault suite's herd plus steady load (tests/faults/harness.py). Mid-herd, two of
the schedulers are killed (their shards' leases lapse and the others take
them) and the Redis primary serving one pool's slot is killed (its replica takes
over). Afterwards the fault suite's invariants are checked over the whole
history in Postgres: nothing lost, no occurrence executed twice, no stale
complete accepted, every execution settled, cron continuations intact.
"""

from __future__ import annotations

import pytest

from tests.faults.harness import LEASE_S, Stack
from tests.fleet.postgres_pair import PostgresPair
from tests.fleet.redis_cluster import LocalCluster

pytestmark = pytest.mark.slow

SCHEDULERS = 4
POOLS = ("faults", "faults-b", "faults-c")
SHARD_LEASE_S = 10.0  # actors/coordinator.py: a dead node's shards move after this


async def test_kill_two_of_four_schedulers_and_a_redis_primary_during_a_herd(
        pair: PostgresPair, own_cluster: LocalCluster, key_prefix: str) -> None:
    seen: dict[str, object] = {}

    async def kill_schedulers_and_a_primary(stack: Stack) -> None:
        for child in stack.rng.sample(stack.schedulers, 2):
            stack.kill(child)
        pool = stack.rng.choice(POOLS)
        serving = await own_cluster.primary_of(f"{key_prefix}:{{{pool}}}:ready")
        seen["pool"] = pool
        seen["redis failover s"] = round(await own_cluster.kill(serving), 1)

    async with Stack.up(pair.failover_dsn, own_cluster.url, key_prefix, api=True,
                        schedulers=SCHEDULERS, pools=POOLS) as stack:
        stack.steady_via_api = True
        result = await stack.run(
            "fleet: 2 of 4 schedulers and a Redis primary killed", (0.2, 1.0),
            kill_schedulers_and_a_primary,
            notes=lambda: {**seen, "api answers": dict(stack.steady_statuses)},
            drain_timeout_s=SHARD_LEASE_S + 3 * LEASE_S + 30,
            # A killed scheduler's committed, unpublished executions are republished as
            # their next attempt by the sweeper, as in the scheduler-kill scenario.
            allow_gaps=True)
        live = [s for s in stack.schedulers if s.pid not in stack.down]
        assert len(live) == SCHEDULERS - 2
    result.assert_sound()
    # Submits never failed for it: Postgres was there throughout (the cluster is only
    # notified of near-due jobs, best effort).
    assert set(stack.steady_statuses) == {201}, stack.steady_statuses
