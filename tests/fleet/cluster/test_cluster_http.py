"""HTTP callbacks on a Redis Cluster: the http pool's streams, breakers and the tenants'
secrets share the `{http}` slot."""

from tests.integration.test_http_worker import (  # noqa: F401 - tests and fixtures, by name
    api,
    clock,
    receiver,
    test_a_500_then_a_200_succeeds_on_attempt_2_with_the_same_idempotency_key,
    test_a_delivery_carries_the_contract_headers_and_a_signature_that_verifies,
    test_a_down_target_opens_its_breaker_without_burning_attempts_or_slowing_others,
)
