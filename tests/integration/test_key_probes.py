"""Statements that find executions by key probe each one's primary key, however the
planner rates the partial index of open executions.

A herd's executions share one scheduled_for, and a new day's partition has no statistics
until autovacuum analyses it. Told an execution's state is open, the planner may then
reach for executions_open (its key is scheduled_for alone, and it looks small) and read
every open execution of the second for each row of a batch: a herd's retries went from
thousands a second to a few hundred that way. These tests plan each statement as the
scheduler does (generically) over such a herd and look at which index finds the rows.
"""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timedelta

import pytest

from herdwick.actors.dispatcher import plan
from herdwick.ids import shard_of
from herdwick.storage import dispatch, executions, leases, sweep
from herdwick.storage.db import Database
from herdwick.storage.dispatch import DueKey
from herdwick.storage.sql import q
from tests.integration.conftest import Api

HERD = 2_000
BATCH = 50


def _array(values: list) -> str:
    """A Postgres array literal of plain values (uuids, times, numbers, words)."""
    cells = ["NULL" if v is None else str(v.isoformat() if isinstance(v, datetime) else v)
             for v in values]
    return "'{" + ",".join(cells) + "}'"


def _literal(value) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, list):
        return _array(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, datetime):
        return f"'{value.isoformat()}'"
    return f"'{value}'"


async def _herd(conn, state: str) -> tuple[datetime, list]:
    """HERD executions of one second in today's partition, all in `state` at attempt 1."""
    due = await conn.fetchval("SELECT date_trunc('second', now())")
    rows = await conn.fetch("""
        INSERT INTO executions (execution_id, job_id, tenant_id, scheduled_for, attempt, state,
                                queued_at)
        SELECT gen_random_uuid(), gen_random_uuid(), gen_random_uuid(), $1, 1, $2, $1
        FROM generate_series(1, $3)
        RETURNING execution_id, job_id, scheduled_for""", due, state, HERD)
    return due, rows[:BATCH]


async def _probes(conn, name: str, args: list) -> set[str]:
    """The indexes the generic plan of statement `name` scans executions by."""
    await conn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
    await conn.execute(q("plan_by_key"))  # as each of these statements' callers do
    await conn.execute(f"PREPARE probe AS {q(name)}")
    try:
        [plan] = json.loads(await conn.fetchval(
            f"EXPLAIN (FORMAT JSON) EXECUTE probe({', '.join(map(_literal, args))})"))
    finally:
        await conn.execute("DEALLOCATE probe")
    found: set[str] = set()

    def walk(node: dict) -> None:
        # an executions partition's index (a bitmap scan's names no relation)
        if node.get("Index Name", "").startswith("executions_"):
            found.add(node["Index Name"])
        for child in node.get("Plans", []):
            walk(child)

    walk(plan["Plan"])
    return found


def _by_key_only(indexes: set[str], key: str = "_pkey") -> bool:
    return bool(indexes) and all(i.endswith(key) for i in indexes)


def _ids(rows, key: str) -> list:
    return [r[key] for r in rows]


async def test_a_herds_retries_are_found_by_key(db) -> None:
    async with db.transaction() as conn:
        due, rows = await _herd(conn, "retry_wait")
        n = len(rows)
        indexes = await _probes(conn, "requeue_retries", [
            due, _ids(rows, "execution_id"), _ids(rows, "scheduled_for"), [2] * n, [0] * n,
            [due] * n, _ids(rows, "job_id")])
    assert _by_key_only(indexes), indexes


@pytest.mark.parametrize("name", ["bump_attempts", "fail_executions"])
async def test_the_sweepers_writes_find_a_herd_by_key(db, name: str) -> None:
    async with db.transaction() as conn:
        due, rows = await _herd(conn, "queued")
        n = len(rows)
        args = [_ids(rows, "execution_id"), _ids(rows, "scheduled_for"), [1] * n]
        args += [due] if name == "bump_attempts" else ['{"type": "X"}', due]
        indexes = await _probes(conn, name, args)
    assert _by_key_only(indexes), indexes


async def test_failed_retries_are_found_by_key(db) -> None:
    async with db.transaction() as conn:
        due, rows = await _herd(conn, "retry_wait")
        n = len(rows)
        indexes = await _probes(conn, "fail_claimed", [
            due, _ids(rows, "job_id"), _ids(rows, "execution_id"), _ids(rows, "scheduled_for"),
            [uuid.uuid4() for _ in rows], [uuid.uuid4() for _ in rows], ["1"] * n])
    assert _by_key_only(indexes), indexes


async def test_a_herds_events_are_found_by_key(db) -> None:
    async with db.transaction() as conn:
        due, rows = await _herd(conn, "queued")
        n = len(rows)
        ids, times = _ids(rows, "execution_id"), _ids(rows, "scheduled_for")
        none = [None] * n
        indexes = await _probes(conn, "apply_events", [
            ids, times, [1] * n, ["running"] * n, ["w"] * n, none, none, none, none, none,
            _ids(rows, "job_id"), none, none, none,
            ids, [1] * n, times, ["w"] * n, none, none, ["running"] * n, none,
            due, False, [0] * n, none])
    assert _by_key_only(indexes), indexes


async def test_replaced_occurrences_are_found_by_job(db) -> None:
    async with db.transaction() as conn:
        due, rows = await _herd(conn, "queued")
        later = [r["scheduled_for"] + timedelta(hours=1) for r in rows]
        indexes = await _probes(conn, "replace_previous", [_ids(rows, "job_id"), later, due])
    assert _by_key_only(indexes, "_job_id_scheduled_for_key"), indexes


@pytest.mark.parametrize("name", ["lock_stale_calls", "write_stale_calls"])
async def test_stale_calls_find_their_executions_by_key(db, name: str) -> None:
    async with db.transaction() as conn:
        _, rows = await _herd(conn, "running")
        args = [_ids(rows, "execution_id"), _ids(rows, "scheduled_for")]
        args += [["1"] * len(rows)] if name == "write_stale_calls" else []
        indexes = await _probes(conn, name, args)
    assert _by_key_only(indexes), indexes


# The callers: each runs its statement after plan_by_key, so over a herd Postgres neither
# reads a partition whole nor goes through an index of open executions. Judged by its own
# counters, on a pool of one connection (whose counters it can flush).

async def _scans(conn, partition: str) -> dict[str, int]:
    await conn.execute("SELECT pg_stat_force_next_flush()")
    await conn.execute("SELECT 1")  # a transaction's end: the flush
    await conn.execute("SELECT pg_stat_clear_snapshot()")
    rows = await conn.fetch(
        "SELECT indexrelname AS name, idx_scan FROM pg_stat_user_indexes WHERE relname = $1 "
        "UNION ALL SELECT 'seq', seq_scan FROM pg_stat_user_tables WHERE relname = $1",
        partition)
    return {r["name"].removeprefix(partition + "_"): r["idx_scan"] for r in rows}


async def _herd_of_jobs(conn, tenant_id: uuid.UUID, state: str) -> tuple[datetime, list, str]:
    """HERD jobs of the tenant with an execution each in one second, and its partition."""
    due = await conn.fetchval("SELECT date_trunc('second', now())")
    rows = await conn.fetch("""
        WITH j AS (
            INSERT INTO jobs (job_id, tenant_id, name, target_type, target_ref, pool, payload,
                              schedule, max_attempts, backoff_s, timeout_s, state,
                              next_run_at, created_at, updated_at)
            SELECT gen_random_uuid(), $1, 'h', 'queue', 'emails', 'emails', 'null',
                   '{"delaySeconds": 1}', 3, 1, 30, 'active', $2, $2, $2
            FROM generate_series(1, $4)
            RETURNING job_id)
        INSERT INTO executions (execution_id, job_id, tenant_id, scheduled_for, attempt, state,
                                queued_at)
        SELECT gen_random_uuid(), job_id, $1, $2, 1, $3, $2 FROM j
        RETURNING execution_id, job_id, tenant_id, scheduled_for, attempt, state""",
        tenant_id, due, state, HERD)
    return due, rows[:BATCH], f"executions_{due:%Y%m%d}"


def _judged(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


@pytest.fixture
async def one_conn(db_url: str):
    database = await Database.connect(db_url, min_size=1, max_size=1, generic_plans=True)
    try:
        yield database
    finally:
        await database.close()


def _unfinished(row) -> sweep.Unfinished:
    return sweep.Unfinished(execution_id=row["execution_id"], job_id=row["job_id"],
                            tenant_id=row["tenant_id"], scheduled_for=row["scheduled_for"],
                            attempt=row["attempt"], state=row["state"], pool="emails",
                            payload="null", timeout_s=30, max_attempts=3, backoff_s=1.0)


@pytest.mark.parametrize("call", ["bump", "fail", "stale"])
async def test_the_sweeper_and_the_stale_calls_probe_the_key(api: Api, one_conn, call) -> None:
    async with one_conn.transaction() as conn:
        due, rows, partition = await _herd_of_jobs(conn, uuid.UUID(api.tenant_id), "running")
    async with one_conn.connection() as conn:
        before = await _scans(conn, partition)
    if call == "bump":
        assert len(await sweep.bump(one_conn, [_unfinished(r) for r in rows], due)) == BATCH
    elif call == "fail":
        assert await sweep.fail(one_conn, [_unfinished(r) for r in rows], '"x"', due) == BATCH
    else:
        calls = [executions.StaleCall(execution_id=str(r["execution_id"]),
                                      scheduled_for=r["scheduled_for"], attempt=0,
                                      worker_id="w", call="complete", at_ms=0) for r in rows]
        assert len(await executions.record_stale_calls(one_conn, calls)) == BATCH
    async with one_conn.connection() as conn:
        used = _judged(before, await _scans(conn, partition))
    assert set(used) == {"pkey"}, used


async def test_a_dispatch_of_retries_probes_the_key(api: Api, one_conn) -> None:
    async with one_conn.transaction() as conn:
        due, rows, partition = await _herd_of_jobs(conn, uuid.UUID(api.tenant_id), "retry_wait")
        keys = [DueKey(shard_of(r["job_id"]), due, r["job_id"]) for r in rows]
        await conn.execute(
            "INSERT INTO due_index (shard_id, due_minute, next_run_at, job_id, execution_id, "
            "scheduled_for, attempt) SELECT s, date_trunc('minute', $2::timestamptz), $2, j, e, "
            "$2, 2 FROM unnest($1::smallint[], $3::uuid[], $4::uuid[]) AS u(s, j, e)",
            [k.shard_id for k in keys], due, [k.job_id for k in keys], _ids(rows, "execution_id"))
    held = await leases.claim(one_conn, "probe", 256, 3600, due)
    revisions = {lease.shard_id: lease.revision for lease in held}
    async with one_conn.connection() as conn:
        before = await _scans(conn, partition)
    out = await dispatch.dispatch(one_conn, "probe", revisions, keys, due,
                                  lambda claimed: plan(claimed, due))
    assert sorted(q.attempt for q in out.queued) == [2] * BATCH
    async with one_conn.connection() as conn:
        used = _judged(before, await _scans(conn, partition))
    assert set(used) == {"pkey"}, used


async def test_failed_occurrences_complete_their_jobs_by_key(api: Api, one_conn) -> None:
    """fail_claimed completes the one-offs whose rows failed through the jobs' key: its
    correlated subquery once scanned every active job of the database for each batch."""
    async with one_conn.transaction() as conn:
        due, rows, _ = await _herd_of_jobs(conn, uuid.UUID(api.tenant_id), "queued")
        await conn.execute("DELETE FROM executions WHERE scheduled_for = $1", due)
    async with one_conn.connection() as conn:
        before = await _scans(conn, "jobs")
    failed = [dispatch.Failed(_claimed_new(r, due), '"x"', uuid.uuid4()) for r in rows]
    async with one_conn.transaction() as conn:
        await conn.execute(q("plan_by_key"))
        assert await conn.fetchval(q("fail_claimed"), due, *dispatch._failed_args(failed)) == BATCH
    async with one_conn.connection() as conn:
        used = _judged(before, await _scans(conn, "jobs"))
        completed = await conn.fetchval(
            "SELECT count(*) FROM jobs WHERE state = 'completed' AND job_id = ANY($1::uuid[])",
            _ids(rows, "job_id"))
    assert completed == BATCH
    assert set(used) == {"pkey"}, used


def _claimed_new(row, due: datetime) -> dispatch.Claimed:
    """A claimed due row of the job's occurrence (no execution yet)."""
    return dispatch.Claimed(shard_id=shard_of(row["job_id"]), next_run_at=due, job_id=row["job_id"],
                            execution_id=None, scheduled_for=None, attempt=1,
                            tenant_id=row["tenant_id"], pool="emails", payload="null",
                            schedule='{"delaySeconds": 1}', timeout_s=30, state="active",
                            max_attempts=3, backoff_s=1.0, target="", dry_run=False, sync=False)
