"""HERDWICK_RETENTION_DAYS and HERDWICK_ARCHIVE_URL validate themselves, and the horizon
is whole UTC days."""

from __future__ import annotations

from datetime import UTC, date, datetime
from pathlib import Path

import pytest

from herdwick.config import ConfigError, from_env
from herdwick.storage.archive import DirectoryTarget, S3Target, open_target
from herdwick.storage.retention import first_day_kept


def test_the_defaults_keep_thirty_days_in_a_local_directory() -> None:
    settings = from_env({})
    assert (settings.retention_days, settings.archive_url) == (30, "./archive")
    assert settings.archive_s3_endpoint is None


@pytest.mark.parametrize(("env", "message"), [
    ({"HERDWICK_RETENTION_DAYS": "0"}, "must be 1 to 36500"),
    ({"HERDWICK_RETENTION_DAYS": "a month"}, "whole number of days"),
    ({"HERDWICK_ARCHIVE_URL": "s3://"}, "names no bucket"),
    ({"HERDWICK_ARCHIVE_URL": "https://example.com/archive"}, "not a directory, file://"),
    ({"HERDWICK_ARCHIVE_URL": "file://otherhost/archive"}, "not a local file://"),
    ({"HERDWICK_ARCHIVE_S3_ENDPOINT": "minio:9000"}, "http:// or https://"),
])
def test_a_bad_setting_names_its_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        from_env(env)


def test_each_url_opens_its_kind_of_target() -> None:
    s3 = open_target("s3://bucket/herdwick/prod/", s3_endpoint="http://127.0.0.1:9000")
    assert isinstance(s3, S3Target)
    assert (s3.bucket, s3.prefix, s3.endpoint) == ("bucket", "herdwick/prod/",
                                                   "http://127.0.0.1:9000")
    assert open_target("s3://bucket").prefix == ""
    local = open_target("file:///var/lib/herdwick%20archive")
    assert isinstance(local, DirectoryTarget)
    assert local.root == Path("/var/lib/herdwick archive")
    assert open_target("./archive").root == Path("archive")


@pytest.mark.parametrize(("now", "kept"), [
    (datetime(2026, 12, 2, 12, 0, tzinfo=UTC), date(2026, 11, 2)),
    (datetime(2026, 12, 2, 0, 0, tzinfo=UTC), date(2026, 11, 2)),
    (datetime(2026, 12, 1, 23, 59, 59, 999_999, tzinfo=UTC), date(2026, 11, 1)),
])
def test_a_day_leaves_once_all_of_it_is_older_than_the_retention(now, kept) -> None:
    assert first_day_kept(now, 30) == kept
