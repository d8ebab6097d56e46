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
from datetime import datetime

import pytest

from herdwick.storage.sql import q

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


def _by_key_only(indexes: set[str]) -> bool:
    return bool(indexes) and all(i.endswith("_pkey") for i in indexes)


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
