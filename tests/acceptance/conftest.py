"""Acceptance tests use the integration tier's stack fixtures."""

from tests.integration.conftest import api, schedulers  # noqa: F401 - fixtures, by name
