"""Migrations: from empty to the expected schema, idempotent, safe concurrently."""

from __future__ import annotations

import asyncio
import uuid

import asyncpg
import pytest

from herdwick.errors import SchemaOutOfDate
from herdwick.storage import migrate
from herdwick.storage.sql import q
from tests.services import Services, with_database

EXPECTED_TABLES = {
    "tenants", "api_keys", "jobs", "idempotency_keys", "due_index", "executions",
    "execution_attempts", "shard_leases", "scheduler_nodes", "schema_migrations",
    "retention_archives", "job_revisions", "quota_counts", "quota_changes",
}


@pytest.fixture
async def empty_db(services: Services):
    name = f"hw_empty_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(services.admin_dsn)
    await admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield with_database(services.admin_dsn, name)
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


async def test_empty_database_is_refused_until_migrated(empty_db: str) -> None:
    conn = await asyncpg.connect(empty_db)
    try:
        with pytest.raises(SchemaOutOfDate, match="herdwick migrate"):
            await migrate.check(conn)
    finally:
        await conn.close()


async def test_concurrent_runs_apply_each_migration_once(empty_db: str) -> None:
    results = await asyncio.gather(*(migrate.apply(empty_db) for _ in range(4)))
    applied = [m.version for run in results for m in run]
    assert sorted(applied) == [m.version for m in migrate.available()]
    assert await migrate.apply(empty_db) == []

    conn = await asyncpg.connect(empty_db)
    try:
        assert await migrate.check(conn) == migrate.latest_version()
        tables = {r["relname"] for r in await conn.fetch(
            "SELECT relname FROM pg_class WHERE relkind IN ('r', 'p') AND relnamespace = "
            "'public'::regnamespace AND NOT relispartition")}
        assert tables == EXPECTED_TABLES
        assert await conn.fetchval("SELECT count(*) FROM shard_leases") == 256
        due_pk = await conn.fetchval(
            "SELECT pg_get_constraintdef(oid) FROM pg_constraint "
            "WHERE conrelid = 'due_index'::regclass AND contype = 'p'")
        assert due_pk == "PRIMARY KEY (shard_id, due_minute, next_run_at, job_id)"
        assert await conn.fetchval(
            "SELECT partstrat FROM pg_partitioned_table WHERE partrelid = 'executions'::regclass"
        ) == b"r"
        assert await conn.fetchval(
            "SELECT partstrat FROM pg_partitioned_table "
            "WHERE partrelid = 'execution_attempts'::regclass") == b"r"
        attempts_pk = await conn.fetchval(
            "SELECT pg_get_constraintdef(oid) FROM pg_constraint "
            "WHERE conrelid = 'execution_attempts'::regclass AND contype = 'p'")
        assert attempts_pk == "PRIMARY KEY (execution_id, scheduled_for, attempt)"
        assert await _partitions(conn, "execution_attempts") == await _partitions(
            conn, "executions")
    finally:
        await conn.close()


async def _partitions(conn: asyncpg.Connection, parent: str) -> list[tuple[str, str]]:
    """(day suffix, bound) of each partition of `parent`, the default one included."""
    rows = await conn.fetch(
        "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) AS bound FROM pg_inherits i "
        "JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = $1::regclass "
        "ORDER BY c.relname", parent)
    return [(r["relname"].removeprefix(parent), r["bound"]) for r in rows]


async def test_existing_attempts_move_into_daily_partitions(empty_db: str) -> None:
    """0006 partitions execution_attempts by day like executions: every row of an earlier
    release is kept, in the partition of its day (or the default one, as its execution)."""
    earlier = [m for m in migrate.available() if m.version < 6]
    conn = await asyncpg.connect(empty_db)
    try:
        await conn.execute("SET TIME ZONE 'UTC'")
        await conn.execute(q("migrations_table"))
        for migration in earlier:
            await conn.execute(migration.path.read_text())
            await conn.execute(q("migrations_record"), migration.version, migration.name)
        today, old = uuid.uuid4(), uuid.uuid4()
        await conn.execute(
            "INSERT INTO executions (execution_id, job_id, tenant_id, scheduled_for, state) "
            "VALUES ($1, $3, $3, date_trunc('hour', now()), 'succeeded'), "
            "($2, $3, $3, '2020-01-01T10:00:00Z', 'dead')", today, old, uuid.uuid4())
        await conn.execute(
            "INSERT INTO execution_attempts (execution_id, attempt, scheduled_for, worker_id, "
            "outcome, error) SELECT e.execution_id, n, e.scheduled_for, 'w' || n, "
            "CASE WHEN n = 3 THEN 'succeeded' ELSE 'failed' END, '{\"type\": \"E\"}' "
            "FROM executions e, generate_series(1, 3) n WHERE n = 1 OR e.execution_id = $1",
            today)
        before = await conn.fetch("SELECT * FROM execution_attempts ORDER BY 1, 2")
        await migrate.apply(empty_db)
        after = await conn.fetch(
            "SELECT execution_id, attempt, scheduled_for, worker_id, started_at, finished_at, "
            "outcome, error, tableoid::regclass::text AS partition FROM execution_attempts "
            "ORDER BY 1, 2")
        days = await conn.fetch("SELECT execution_id, tableoid::regclass::text AS partition "
                                "FROM executions")
    finally:
        await conn.close()
    assert [tuple(r) for r in before] == [tuple(r)[:-1] for r in after]
    where = {r["execution_id"]: r["partition"].replace("executions", "execution_attempts")
             for r in days}
    assert [r["partition"] for r in after] == [where[r["execution_id"]] for r in after]
    assert where[old] == "execution_attempts_default"
    assert where[today] != "execution_attempts_default"


async def test_partitions_are_created_ahead_and_rescue_default_rows(db) -> None:
    async with db.connection() as conn:
        far = "2031-05-04 10:00:00+00"
        await conn.execute(
            "INSERT INTO executions (execution_id, job_id, tenant_id, scheduled_for, state) "
            "VALUES ($1, $2, $3, $4::text::timestamptz, 'queued')",
            uuid.uuid4(), uuid.uuid4(), uuid.uuid4(), far)
        assert await conn.fetchval("SELECT count(*) FROM executions_default") == 1
        created = await conn.fetchval(
            "SELECT herdwick_ensure_execution_partitions('2031-05-03', 3)")
        assert created == 3
        assert await conn.fetchval("SELECT count(*) FROM executions_default") == 0
        assert await conn.fetchval("SELECT count(*) FROM executions_20310504") == 1
        assert await conn.fetchval(
            "SELECT herdwick_ensure_execution_partitions('2031-05-03', 3)") == 0
        # The attempts of each day get their partition beside its executions'.
        assert await conn.fetchval("SELECT count(*) FROM pg_inherits WHERE inhrelid IN "
                                   "('execution_attempts_20310503'::regclass, "
                                   "'execution_attempts_20310505'::regclass)") == 2


async def tenant_and_job(conn: asyncpg.Connection,
                         next_run_at: str) -> tuple[uuid.UUID, uuid.UUID]:
    """A tenant and its active queue job due at `next_run_at`, written as an earlier
    release's schema takes them."""
    tenant, job = uuid.uuid4(), uuid.uuid4()
    await conn.execute("INSERT INTO tenants (tenant_id, name, signing_secret) "
                       "VALUES ($1, 't', 's')", tenant)
    await conn.execute(
        "INSERT INTO jobs (job_id, tenant_id, name, target_type, target_ref, pool, payload, "
        "schedule, max_attempts, backoff_s, timeout_s, state, next_run_at, created_at, "
        "updated_at) VALUES ($1, $2, 'j', 'queue', 'q', 'q', 'null', '{}', 1, 1, 1, "
        "'active', $3::text::timestamptz, now(), now())", job, tenant, next_run_at)
    return tenant, job


async def test_infinite_due_times_of_earlier_releases_become_due_at_once(empty_db: str) -> None:
    """runAt 0001-01-01 was stored as -infinity; after 0002 it runs as a past runAt does."""
    first = migrate.available()[0]
    conn = await asyncpg.connect(empty_db)
    try:
        await conn.execute("SET TIME ZONE 'UTC'")
        await conn.execute(first.path.read_text())
        await conn.execute(q("migrations_table"))
        await conn.execute(q("migrations_record"), first.version, first.name)
        _, job = await tenant_and_job(conn, "-infinity")
        await conn.execute("INSERT INTO due_index (shard_id, due_minute, next_run_at, job_id) "
                           "VALUES (3, '-infinity', '-infinity', $1)", job)
        await migrate.apply(empty_db)
        due = await conn.fetchrow("SELECT due_minute::text, next_run_at::text FROM due_index")
        next_run = await conn.fetchval("SELECT next_run_at::text FROM jobs")
    finally:
        await conn.close()
    assert tuple(due) == ("1970-01-01 00:00:00+00", "1970-01-01 00:00:00+00")
    assert next_run == "1970-01-01 00:00:00+00"


async def test_pending_occurrences_take_their_tenant_for_the_herd_count(empty_db: str) -> None:
    """0010: the herd warning counts due_index rows by tenant; the rows an earlier release
    wrote get their job's tenant, a retry's row (an execution's) none."""
    earlier, last = up_to("herd_count_on_due_index")
    conn = await asyncpg.connect(empty_db)
    try:
        await apply_by_hand(conn, earlier)
        tenant, job = await tenant_and_job(conn, "2031-05-03 12:00")
        await conn.execute("INSERT INTO due_index (shard_id, due_minute, next_run_at, job_id) "
                           "VALUES (3, '2031-05-03 12:00', '2031-05-03 12:00', $1)", job)
        await conn.execute(
            "INSERT INTO due_index (shard_id, due_minute, next_run_at, job_id, execution_id, "
            "scheduled_for, attempt) VALUES (3, '2031-05-03 11:01', '2031-05-03 11:01:30', $1, "
            "$2, '2031-05-03 11:00', 2)", job, uuid.uuid4())
        await apply_by_hand(conn, [last])
        rows = await conn.fetch("SELECT execution_id IS NULL AS occurrence, tenant_id "
                                "FROM due_index ORDER BY next_run_at")
        indexes = {r["indexname"] for r in await conn.fetch(
            "SELECT indexname FROM pg_indexes WHERE tablename IN ('jobs', 'due_index')")}
    finally:
        await conn.close()
    assert [tuple(r) for r in rows] == [(False, None), (True, tenant)]
    # The index the api processes of the release before count on stays while they roll
    # (0012 drops it).
    assert {"due_index_tenant_due", "jobs_tenant_due"} <= indexes


def up_to(name: str) -> tuple[list, migrate.Migration]:
    """The migrations before the one called `name`, and that one."""
    every = migrate.available()
    at = next(i for i, m in enumerate(every) if m.name == name)
    return every[:at], every[at]


async def apply_by_hand(conn: asyncpg.Connection, migrations: list) -> None:
    await conn.execute(q("migrations_table"))
    for m in migrations:
        await conn.execute(m.path.read_text())
        await conn.execute(q("migrations_record"), m.version, m.name)


async def test_quota_tenants_get_their_live_jobs_counted(empty_db: str) -> None:
    """0011: a tenant with max_active_jobs gets its active and paused jobs counted; a
    tenant without one gets no count."""
    earlier, _ = up_to("quota_counts")
    conn = await asyncpg.connect(empty_db)
    try:
        await apply_by_hand(conn, earlier)
        limited, job = await tenant_and_job(conn, "2031-05-03 12:00")
        await tenant_and_job(conn, "2031-05-03 12:00")  # a tenant without a quota
        await conn.execute("UPDATE tenants SET max_active_jobs = 5 WHERE tenant_id = $1", limited)
        for state in ("paused", "completed", "canceled"):
            await conn.execute(
                "INSERT INTO jobs (job_id, tenant_id, name, target_type, target_ref, pool, "
                "payload, schedule, max_attempts, backoff_s, timeout_s, state, created_at, "
                "updated_at) SELECT $1, tenant_id, name, target_type, target_ref, pool, payload, "
                "schedule, max_attempts, backoff_s, timeout_s, $3, now(), now() FROM jobs "
                "WHERE job_id = $2", uuid.uuid4(), job, state)
        await migrate.apply(empty_db)
        counts = [tuple(r) for r in await conn.fetch("SELECT tenant_id, live FROM quota_counts")]
    finally:
        await conn.close()
    assert counts == [(limited, 2)]  # the active and the paused one


async def test_jobs_next_run_at_leaves_every_index(empty_db: str) -> None:
    """0012: a cron job's next_run_at moves with each dispatch; no index may hold it, or
    the move cannot be a HOT update."""
    await migrate.apply(empty_db)
    conn = await asyncpg.connect(empty_db)
    try:
        indexed = await conn.fetch(
            "SELECT i.indexrelid::regclass::text AS name FROM pg_index i "
            "WHERE i.indrelid = 'jobs'::regclass AND (pg_get_indexdef(i.indexrelid) "
            "LIKE '%next_run_at%' OR coalesce(pg_get_expr(i.indpred, i.indrelid), '') "
            "LIKE '%next_run_at%')")
        options = await conn.fetchval("SELECT reloptions FROM pg_class WHERE relname = 'jobs'")
    finally:
        await conn.close()
    assert indexed == []
    assert "fillfactor=90" in options
