"""Retention: days older than HERDWICK_RETENTION_DAYS are archived, then dropped whole.

Real Postgres, a real directory and a real S3-compatible server (moto's, in a thread);
time is the ManualClock's, T0 = 2026-12-02 12:00 UTC, so with 30 days the first day
kept is 2026-11-02.
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import json
import uuid
from collections.abc import Iterator
from datetime import UTC, date, datetime, time, timedelta
from pathlib import Path

import asyncpg
import msgspec
import pytest
from aiobotocore.session import get_session
from moto.server import ThreadedMotoServer

from herdwick.actors.base import Supervisor, sync
from herdwick.actors.maintenance import Maintenance, Retain
from herdwick.clock import ManualClock
from herdwick.storage import maintenance as partitions
from herdwick.storage import retention
from herdwick.storage.archive import Manifest, open_target
from herdwick.storage.db import Database
from tests.conftest import T0

FIRST_DAY = date(2026, 10, 23)  # 40 days of history: 2026-10-23 .. 2026-12-01
DAYS = 40
KEPT_FROM = date(2026, 11, 2)
DROPPED = [FIRST_DAY + timedelta(days=i) for i in range(10)]
# Each day's executions: at its first and last instants and at noon, so a day boundary
# that is off by a microsecond or a time zone shows.
TIMES = (time(0, 0), time(12, 0), time(23, 59, 59, 999_999))


class Killed(BaseException):
    """A process killed between two steps: nothing after it runs (not caught as an error)."""


def policy(url: str, days: int = 30, endpoint: str | None = None) -> retention.RetentionPolicy:
    return retention.RetentionPolicy(days=days, archive_url=url, s3_endpoint=endpoint)


async def seed(db: Database, first: date = FIRST_DAY, days: int = DAYS, *,
               partition: bool = True, state: str = "succeeded") -> list[uuid.UUID]:
    """Executions on each of `days` days from `first`, each with attempts 1..3 (the nth
    of a day has n): failed, failed, then `state`'s outcome."""
    if partition:
        await partitions.ensure_partitions(db, first, days)
    ids, times = [], []
    for i in range(days):
        for at in TIMES:
            ids.append(uuid.uuid4())
            times.append(datetime.combine(first + timedelta(days=i), at, UTC))
    async with db.connection() as conn:
        await conn.execute(
            "INSERT INTO executions (execution_id, job_id, tenant_id, scheduled_for, attempt, "
            "state, queued_at, finished_at, result) "
            "SELECT x.id, x.id, x.id, x.at, 1, $3, x.at, x.at, '{\"ok\": true}' "
            "FROM unnest($1::uuid[], $2::timestamptz[]) AS x(id, at)", ids, times, state)
        await conn.execute(
            "INSERT INTO execution_attempts (execution_id, attempt, scheduled_for, worker_id, "
            "started_at, finished_at, outcome, error) "
            "SELECT e.execution_id, n, e.scheduled_for, 'worker-' || n, e.scheduled_for, "
            "e.scheduled_for, CASE WHEN n < 3 THEN 'failed' ELSE 'succeeded' END, "
            "CASE WHEN n < 3 THEN '{\"type\": \"Boom\"}'::jsonb END "
            "FROM executions e, generate_series(1, 3) n "
            "WHERE e.execution_id = ANY($1::uuid[]) "
            "  AND n <= 1 + (extract(hour FROM e.scheduled_for)::int + 1) / 12", ids)
    return ids


async def history(db: Database, day: date) -> list[dict]:
    """A day's executions and attempts as the archive must carry them."""
    lo = datetime.combine(day, time(0), UTC)
    async with db.connection() as conn:
        rows = await conn.fetch(
            "SELECT (to_jsonb(e) || jsonb_build_object('attempts', coalesce((SELECT "
            "jsonb_agg(to_jsonb(a) - 'execution_id' - 'scheduled_for' ORDER BY a.attempt) "
            "FROM execution_attempts a WHERE a.execution_id = e.execution_id AND "
            "a.scheduled_for = e.scheduled_for), '[]')))::text AS line FROM executions e "
            "WHERE scheduled_for >= $1 AND scheduled_for < $2 "
            "ORDER BY scheduled_for, execution_id", lo, lo + timedelta(days=1))
    return [json.loads(r["line"]) for r in rows]


async def read_back(url: str, day: date, endpoint: str | None = None) -> list[dict]:
    target = open_target(url, s3_endpoint=endpoint)
    try:
        return [json.loads(line) async for line in retention.read_day(target, day)]
    finally:
        await target.close()


async def attached_days(db: Database) -> list[date]:
    async with db.connection() as conn:
        rows = await conn.fetch(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = $1::regclass AND c.relname ~ '_[0-9]{8}$'", "executions")
        attempts = await conn.fetchval(
            "SELECT count(*) FROM pg_inherits WHERE inhparent = 'execution_attempts'::regclass")
    days = sorted(datetime.strptime(r["relname"][-8:], "%Y%m%d").date() for r in rows)
    assert attempts == len(days) + 1  # the attempts' partitions follow, and the default one
    return days


async def records(db: Database) -> list[dict]:
    async with db.connection() as conn:
        rows = await conn.fetch("SELECT * FROM retention_archives ORDER BY day, name")
    return [dict(r) for r in rows]


# --- targets ------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def aws_env(monkeypatch) -> None:
    """Credentials by botocore's usual chain: here, its environment variables."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")


async def new_bucket(endpoint: str) -> str:
    name = f"hw-archive-{uuid.uuid4().hex[:12]}"
    async with get_session().create_client("s3", endpoint_url=endpoint) as client:
        await client.create_bucket(Bucket=name)
    return name


@pytest.fixture(params=["directory", "s3"])
async def target(request, tmp_path: Path, s3_server: str, aws_env) -> tuple[str, str | None]:
    """(HERDWICK_ARCHIVE_URL, S3 endpoint) of each kind of target."""
    if request.param == "directory":
        return str(tmp_path / "archive"), None
    return f"s3://{await new_bucket(s3_server)}/herdwick/prod", s3_server


async def object_bytes(url: str, endpoint: str | None, key: str) -> bytes:
    target = open_target(url, s3_endpoint=endpoint)
    try:
        return await target.get(key)
    finally:
        await target.close()


# --- the story ----------------------------------------------------------------------------


async def test_forty_days_keep_thirty_and_archive_ten_that_read_back(db, target) -> None:
    url, endpoint = target
    await seed(db)
    expected = {day: await history(db, day) for day in DROPPED}
    kept_before = {day: await history(db, day) for day in (KEPT_FROM, date(2026, 12, 1))}

    report = await retention.run_pass(db, policy(url, endpoint=endpoint), T0)

    assert report.leased and report.first_day_kept == KEPT_FROM
    assert [(o.day, o.result) for o in report.outcomes] == [(d, "dropped") for d in DROPPED]
    assert [o.executions for o in report.outcomes] == [3] * 10
    assert [o.attempts for o in report.outcomes] == [6] * 10  # 1 + 2 + 3 a day
    days = await attached_days(db)
    assert [d for d in days if d < date(2026, 12, 2)] == [
        KEPT_FROM + timedelta(days=i) for i in range(30)]
    for day in DROPPED:
        archived = await read_back(url, day, endpoint)
        assert archived == expected[day]  # every row, every column, every attempt
        assert [len(e["attempts"]) for e in archived] == [1, 2, 3]
        assert archived[2]["attempts"][0] == {
            "attempt": 1, "worker_id": "worker-1", "outcome": "failed",
            "error": {"type": "Boom"}, "started_at": archived[2]["scheduled_for"],
            "finished_at": archived[2]["scheduled_for"], "lease_until": None}
    for day, rows in kept_before.items():
        assert await history(db, day) == rows

    recorded = await records(db)
    assert [(r["name"], r["rows"], r["attempts"]) for r in recorded] == [
        (f"executions_{d:%Y%m%d}", 3, 6) for d in DROPPED]
    assert all(r["archived_at"] == r["dropped_at"] == T0 and r["error"] is None
               for r in recorded)
    first = recorded[0]
    data = await object_bytes(url, endpoint, first["name"] + ".jsonl.gz")
    manifest = msgspec.json.decode(
        await object_bytes(url, endpoint, first["name"] + ".manifest.json"), type=Manifest)
    assert hashlib.sha256(data).hexdigest() == first["sha256"] == manifest.sha256
    assert (manifest.executions, manifest.attempts, manifest.bytes) == (3, 6, len(data))
    assert first["url"].endswith("executions_20261023.jsonl.gz")
    assert len(gzip.decompress(data).splitlines()) == 3

    again = await retention.run_pass(db, policy(url, endpoint=endpoint), T0)
    assert again.leased and again.outcomes == []


async def test_dry_run_shows_what_would_leave_and_changes_nothing(db, tmp_path) -> None:
    await seed(db)
    await seed(db, date(2026, 9, 1), 1, partition=False)  # caught by the default partition
    before = await attached_days(db)

    planned = await retention.plan(db, T0, 30)

    assert [(d.partition, d.day, d.executions, d.name) for d in planned] == [
        ("executions_default", date(2026, 9, 1), 3, "executions_20260901"),
        *((f"executions_{d:%Y%m%d}", d, 3, f"executions_{d:%Y%m%d}") for d in DROPPED)]
    assert await attached_days(db) == before
    assert await records(db) == []
    assert not (tmp_path / "archive").exists()


async def test_default_rows_get_a_day_of_their_own_and_a_later_batch_the_next_name(
        db, tmp_path) -> None:
    """Rows the default partition caught for an old day (a past runAt) leave as that day;
    rows of a day that arrive after it was dropped leave as its second archive."""
    url = str(tmp_path / "archive")
    first = await seed(db, date(2026, 9, 1), 1, partition=False)
    report = await retention.run_pass(db, policy(url), T0)
    assert [(o.name, o.result) for o in report.outcomes] == [("executions_20260901", "dropped")]

    later = await seed(db, date(2026, 9, 1), 1, partition=False)
    report = await retention.run_pass(db, policy(url), T0)
    assert [(o.name, o.result) for o in report.outcomes] == [
        ("executions_20260901_2", "dropped")]
    archived = await read_back(url, date(2026, 9, 1))
    assert [uuid.UUID(e["execution_id"]) for e in archived] == [*first, *later]
    async with db.connection() as conn:
        assert await conn.fetchval("SELECT count(*) FROM executions_default") == 0
        assert await conn.fetchval("SELECT count(*) FROM execution_attempts_default") == 0


async def test_a_day_with_unfinished_work_is_kept_and_the_rest_go_on(db, tmp_path) -> None:
    url = str(tmp_path / "archive")
    await seed(db)
    stuck = DROPPED[4]
    async with db.connection() as conn:
        await conn.execute("UPDATE executions SET state = 'retry_wait' WHERE scheduled_for = $1",
                           datetime.combine(stuck, time(12), UTC))

    report = await retention.run_pass(db, policy(url), T0)

    results = {o.day: o.result for o in report.outcomes}
    assert results == {d: ("kept" if d == stuck else "dropped") for d in DROPPED}
    assert "1 unfinished" in next(o.reason for o in report.outcomes if o.day == stuck)
    assert stuck in await attached_days(db)
    assert len(await history(db, stuck)) == 3
    recorded = {r["day"]: r for r in await records(db)}
    assert recorded[stuck]["dropped_at"] is None and "unfinished" in recorded[stuck]["error"]

    async with db.connection() as conn:  # it finishes; the next pass takes the day
        await conn.execute("UPDATE executions SET state = 'succeeded' WHERE state = 'retry_wait'")
    report = await retention.run_pass(db, policy(url), T0)
    assert [(o.day, o.result) for o in report.outcomes] == [(stuck, "dropped")]
    assert len(await read_back(url, stuck)) == 3


async def test_a_crash_after_the_archive_is_recorded_loses_nothing_and_drops_once(
        db, target) -> None:
    url, endpoint = target
    await seed(db, FIRST_DAY, 2)
    expected = await history(db, FIRST_DAY)

    async def crash(step: str, day: retention.Day) -> None:
        if step == "archived":
            raise Killed()

    with pytest.raises(Killed):
        await retention.run_pass(db, policy(url, endpoint=endpoint), T0, on_step=crash)
    # Detached and archived, not dropped: out of the application's reach, all there.
    assert FIRST_DAY not in await attached_days(db)
    (row,) = await records(db)
    assert row["archived_at"] == T0 and row["dropped_at"] is None
    first_bytes = await object_bytes(url, endpoint, "executions_20261023.jsonl.gz")
    first_manifest = await object_bytes(url, endpoint, "executions_20261023.manifest.json")

    later = T0 + timedelta(hours=1)
    report = await retention.run_pass(db, policy(url, endpoint=endpoint), later)

    assert [(o.day, o.result) for o in report.outcomes] == [
        (FIRST_DAY, "dropped"), (FIRST_DAY + timedelta(days=1), "dropped")]
    assert await object_bytes(url, endpoint, "executions_20261023.jsonl.gz") == first_bytes
    assert await object_bytes(url, endpoint,
                              "executions_20261023.manifest.json") == first_manifest
    assert await read_back(url, FIRST_DAY, endpoint) == expected
    recorded = await records(db)
    assert [(r["name"], r["dropped_at"]) for r in recorded] == [
        ("executions_20261023", later), ("executions_20261024", later)]
    async with db.connection() as conn:
        assert await conn.fetchval("SELECT to_regclass('executions_20261023')") is None


async def test_a_drop_that_fails_is_recorded_and_the_rerun_finishes_it(db, db_url,
                                                                        tmp_path) -> None:
    """Someone reads the detached table just as the drop comes: the drop gives up after
    its lock timeout, the other days go on, and the next pass drops it."""
    url = str(tmp_path / "archive")
    await seed(db, FIRST_DAY, 3)
    reader = await asyncpg.connect(db_url)
    reading = reader.transaction()

    async def hold_a_lock(step: str, day: retention.Day) -> None:
        if step == "archived" and day.day == FIRST_DAY:
            await reading.start()
            await reader.execute("LOCK TABLE executions_20261023 IN ACCESS SHARE MODE")

    try:
        report = await retention.run_pass(db, policy(url), T0, on_step=hold_a_lock,
                                          lock_timeout_ms=100)
        assert [o.result for o in report.outcomes] == ["failed", "dropped", "dropped"]
        assert "LockNotAvailable" in report.outcomes[0].reason
        bytes_then = (tmp_path / "archive" / "executions_20261023.jsonl.gz").read_bytes()
        (row, *_) = await records(db)
        assert row["archived_at"] == T0 and row["dropped_at"] is None
        assert "lock timeout" in row["error"]
    finally:
        await reading.rollback()
        await reader.close()

    report = await retention.run_pass(db, policy(url), T0)
    assert [(o.day, o.result) for o in report.outcomes] == [(FIRST_DAY, "dropped")]
    assert (tmp_path / "archive" / "executions_20261023.jsonl.gz").read_bytes() == bytes_then
    assert len(await read_back(url, FIRST_DAY)) == 3
    (row, *_) = await records(db)
    assert row["dropped_at"] == T0 and row["error"] is None


async def test_a_busy_table_makes_the_detach_wait_briefly_and_try_again(db, db_url, tmp_path,
                                                                        monkeypatch) -> None:
    """The detach's lock would queue every write to executions behind it: it gives up
    after a short lock timeout, and tries again in the same pass once the table is free."""
    monkeypatch.setattr(retention, "DETACH_RETRY_S", (0.2, 0.3))
    url = str(tmp_path / "archive")
    await seed(db, FIRST_DAY, 2)
    reader = await asyncpg.connect(db_url)
    reading = reader.transaction()
    await reading.start()
    await reader.execute("LOCK TABLE executions IN ACCESS SHARE MODE")  # a long read

    async def finish_reading() -> None:
        await asyncio.sleep(0.5)
        await reading.rollback()

    try:
        release = asyncio.create_task(finish_reading())
        report = await retention.run_pass(db, policy(url), T0, lock_timeout_ms=50)
        await release
    finally:
        await reader.close()
    assert [(o.day, o.result) for o in report.outcomes] == [(FIRST_DAY, "dropped"),
                                                            (FIRST_DAY + timedelta(days=1),
                                                             "dropped")]
    assert len(await read_back(url, FIRST_DAY)) == len(TIMES)


async def test_an_unwritable_target_drops_nothing_and_says_why(db, redis_client, key_prefix,
                                                               tmp_path, clock) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the archive directory should be")
    url = str(blocker / "archive")
    await seed(db, FIRST_DAY, 3)
    before = {day: await history(db, day) for day in DROPPED[:3]}
    maintenance = Maintenance(db=db, clock=clock, redis=redis_client, key_prefix=key_prefix,
                              retention=policy(url))
    async with Supervisor("test") as supervisor:
        await supervisor.start("maintenance", lambda: maintenance)
        await maintenance.send(Retain())
        await sync(maintenance)
        report = maintenance.last_retention
        assert [o.result for o in report.outcomes] == ["failed"] * 3
        assert all("Not a directory" in o.reason for o in report.outcomes)
        # The rest of maintenance goes on: days later, partitions are still made ahead.
        clock.advance(86_400 * 20)
        await maintenance.run_once()
    assert {day: await history(db, day) for day in DROPPED[:3]} == before
    assert set(DROPPED[:3]) <= set(await attached_days(db))
    assert date(2026, 12, 29) in await attached_days(db)  # (T0 + 20 days) - 1 + 8
    assert [(r["detached_at"], r["dropped_at"], r["failed_at"]) for r in await records(db)] == [
        (None, None, T0)] * 3
    assert all("Not a directory" in r["error"] for r in await records(db))


async def test_an_s3_bucket_that_is_not_there_drops_nothing(db, s3_server, aws_env) -> None:
    await seed(db, FIRST_DAY, 1)
    report = await retention.run_pass(db, policy("s3://no-such-bucket/x", endpoint=s3_server),
                                      T0)
    assert [o.result for o in report.outcomes] == ["failed"]
    reason = report.outcomes[0].reason
    assert "write check" in reason and "NoSuchBucket" in reason
    assert FIRST_DAY in await attached_days(db)


async def test_two_maintenance_actors_at_once_only_one_archives(db_url, redis_client,
                                                                key_prefix, tmp_path) -> None:
    """Two scheduler nodes, each with its own pool, get Retain at the same moment: one
    takes the lease and archives; the other finds it held and does nothing."""
    url = str(tmp_path / "archive")
    nodes = [await Database.connect(db_url, max_size=2) for _ in range(2)]
    await seed(nodes[0], FIRST_DAY, 3)
    inside, go_on = asyncio.Event(), asyncio.Event()
    holder: list[Maintenance] = []
    actors = [Maintenance(db=db, clock=ManualClock(T0), redis=redis_client,
                          key_prefix=key_prefix, retention=policy(url)) for db in nodes]

    def gate(actor: Maintenance):
        async def step(name: str, day: retention.Day) -> None:
            if name == "detached" and not inside.is_set():
                holder.append(actor)
                inside.set()
                await go_on.wait()
        return step

    for actor in actors:
        actor.retention_step = gate(actor)
    try:
        async with Supervisor("test") as supervisor:
            for i, actor in enumerate(actors):
                await supervisor.start(f"maintenance-{i}", lambda a=actor: a)
            await asyncio.gather(*(actor.send(Retain()) for actor in actors))
            await asyncio.wait_for(inside.wait(), 30)
            (winner,) = holder
            (loser,) = [a for a in actors if a is not winner]
            await sync(loser)  # its pass ended while the winner holds the lease
            assert loser.last_retention.leased is False
            assert loser.last_retention.outcomes == []
            go_on.set()
            await sync(winner)
            assert [o.result for o in winner.last_retention.outcomes] == ["dropped"] * 3
        recorded = await records(nodes[0])
        assert [(r["name"], r["dropped_at"] is not None) for r in recorded] == [
            (f"executions_{d:%Y%m%d}", True) for d in DROPPED[:3]]
    finally:
        for db in nodes:
            await db.close()


async def test_the_command_dry_runs_runs_a_pass_and_reads_back(db, db_url, tmp_path) -> None:
    """`herdwick retention` as an operator runs it: the real clock, a real process."""
    from tests.integration.test_cli import herdwick

    first = datetime.now(UTC).date() - timedelta(days=45)
    ids = await seed(db, first, 2)
    env = {"HERDWICK_DATABASE_URL": db_url, "HERDWICK_ARCHIVE_URL": str(tmp_path / "archive")}

    code, out, err = await herdwick("retention", "--dry-run", env=env)
    assert code == 0, err
    shown = [line.split() for line in out.splitlines()[2:]]
    assert [row[:3] for row in shown] == [
        [f"executions_{first:%Y%m%d}", first.isoformat(), "3"],
        [f"executions_{first + timedelta(days=1):%Y%m%d}",
         (first + timedelta(days=1)).isoformat(), "3"]]
    assert all(" ".join(row[3:]).startswith("archive as executions_") for row in shown)
    assert await records(db) == [] and not (tmp_path / "archive").exists()

    code, out, err = await herdwick("retention", env=env)
    assert code == 0, err
    assert [line.split()[3] for line in out.splitlines()[2:]] == ["dropped;", "dropped;"]
    code, out, err = await herdwick("retention", "--read", first.isoformat(), env=env)
    assert code == 0, err
    assert [json.loads(line)["execution_id"] for line in out.splitlines()] == [
        str(i) for i in ids[:3]]

    code, out, err = await herdwick("retention", "--dry-run", env=env)
    assert (code, out.splitlines()[-1]) == (0, "nothing is older than that")
    code, _, err = await herdwick("retention", "--retention-days", "0", env=env)
    assert code == 2 and "HERDWICK_RETENTION_DAYS must be 1 to 36500" in err
    code, _, err = await herdwick("retention", "--read", "yesterday", env=env)
    assert code == 2 and "not a day" in err
