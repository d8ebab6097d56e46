"""The read replicas' settings, and the arithmetic that says what a replica has."""

from __future__ import annotations

import pytest

from herdwick.config import ConfigError, from_env
from herdwick.storage.replicas import fresh_at, name_of


def test_several_read_urls_are_split_on_commas_before_a_scheme() -> None:
    settings = from_env({"HERDWICK_READ_DATABASE_URL":
                         "postgresql://hw:secret@replica-a:5432/herdwick?sslmode=require, "
                         "postgres://replica-b/herdwick"})
    assert settings.read_database_urls == (
        "postgresql://hw:secret@replica-a:5432/herdwick?sslmode=require",
        "postgres://replica-b/herdwick")
    assert from_env({}).read_database_urls == ()


@pytest.mark.parametrize(("value", "says"), [
    ("postgresql://hw:secret@a:5432,b:5432/herdwick", "'postgresql://hw@a:5432,b:5432/herdwick'"
                                                      " does not name one host"),
    ("postgresql://a/herdwick?host=b", "does not name one host"),
    ("mysql://a/herdwick", "is not a postgresql:// URL"),
])
def test_a_read_url_names_one_postgres_server(value: str, says: str) -> None:
    with pytest.raises(ConfigError, match="HERDWICK_READ_DATABASE_URL") as refused:
        from_env({"HERDWICK_READ_DATABASE_URL": value})
    assert says in str(refused.value)
    assert "secret" not in str(refused.value)


@pytest.mark.parametrize("value", ["0", "-1", "61", "soon"])
def test_the_lag_bound_is_above_zero_and_at_most_a_minute(value: str) -> None:
    with pytest.raises(ConfigError, match="HERDWICK_READ_MAX_LAG_S"):
        from_env({"HERDWICK_READ_MAX_LAG_S": value})
    assert from_env({"HERDWICK_READ_MAX_LAG_S": "0.5"}).read_max_lag_s == 0.5


def test_a_replica_has_every_commit_made_before_the_last_sample_it_has_replayed() -> None:
    history = [(10.0, 100), (10.2, 150), (10.4, 150), (10.6, 400)]
    assert fresh_at(history, 99) is None  # behind everything the history holds
    assert fresh_at(history, 100) == 10.0
    assert fresh_at(history, 399) == 10.4  # the primary stood still from 10.2 to 10.4
    assert fresh_at(history, 400) == 10.6
    assert fresh_at([], 400) is None


def test_a_replica_is_named_without_its_credentials() -> None:
    assert name_of("postgresql://hw:secret@replica-a:6432/herdwick") == \
        "replica-a:6432/herdwick"
    assert name_of("postgresql://replica-b") == "replica-b:5432/"
