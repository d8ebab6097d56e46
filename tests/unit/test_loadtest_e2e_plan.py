"""`loadtest e2e --history-days`: checked like every flag, and kept by the schedulers'
retention when it reaches past the default."""

from __future__ import annotations

import argparse

import pytest

from herdwick.config import DEFAULT_RETENTION_DAYS, ConfigError, from_env
from herdwick.loadtest import e2e


def _plan(*flags: str) -> e2e.Plan:
    parser = argparse.ArgumentParser()
    e2e.add_arguments(parser)
    return e2e.plan_from(parser.parse_args(list(flags)))


def test_history_within_the_default_retention_needs_no_setting() -> None:
    assert e2e.scheduler_settings(_plan("--history-days", str(DEFAULT_RETENTION_DAYS))) == {}
    assert e2e.scheduler_settings(_plan()) == {}


def test_a_longer_history_is_kept_by_the_schedulers_retention() -> None:
    settings = e2e.scheduler_settings(_plan("--history-days", "90"))
    assert settings == {"HERDWICK_RETENTION_DAYS": "90"}
    assert from_env({"HERDWICK_DATABASE_URL": "postgresql://h/d", **settings}).retention_days == 90


def test_a_negative_history_is_refused() -> None:
    with pytest.raises(ConfigError, match="history_days"):
        _plan("--history-days", "-1")
