"""Tenant isolation on a Redis Cluster: each tenant's token bucket has a slot of its own,
the pool's stream bound is in the pool's."""

from tests.integration.test_fair_queue import (  # noqa: F401 - tests, by name
    test_a_bounded_stream_stays_at_its_bound_while_postgres_holds_the_rest,
    test_two_schedulers_share_one_tenant_s_rate_quota,
    test_weights_1_2_4_get_1_2_4_of_a_pool_s_dispatch,
)
