"""A DSN that names several hosts, taken apart host by host (storage/db.py HostByHost)."""

from __future__ import annotations

from herdwick.storage.db import host_dsns


def test_each_host_gets_the_whole_rest_of_the_url() -> None:
    assert host_dsns("postgresql://hw:secret@db-a:5432,db-b:6432,[::1]:5433/herdwick"
                     "?target_session_attrs=read-write&sslmode=require") == [
        "postgresql://hw:secret@db-a:5432/herdwick?target_session_attrs=read-write&sslmode=require",
        "postgresql://hw:secret@db-b:6432/herdwick?target_session_attrs=read-write&sslmode=require",
        "postgresql://hw:secret@[::1]:5433/herdwick?target_session_attrs=read-write&sslmode=require",
    ]


def test_one_host_or_another_form_is_left_to_asyncpg() -> None:
    for dsn in ("postgresql://hw@db-a:5432/herdwick", "postgres://db-a/herdwick",
                "host=db-a,db-b dbname=herdwick"):
        assert host_dsns(dsn) == [dsn]
