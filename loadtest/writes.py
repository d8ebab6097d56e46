"""What a run wrote: Postgres rows by table and how (HOT or not), WAL, Redis commands
and bytes, per execution (issue 14's write profile).

Two snapshots, the first after the herd's move (its UPDATE of every due row is the
tool's, not the pipeline's), the second after the scheduler and worker processes have
exited: Postgres 15 keeps a backend's table counters pending for up to 10 s when it goes
idle, and flushes them at exit, so only then are every process's writes in the view.
Rows are those of the run's own database. WAL and Redis are server-wide: on a shared
server other databases' writes show in them, and `others_rows` says how many rows other
databases wrote in the window, so a reader can tell a clean run from a noisy one.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import redis.asyncio as aioredis

from herdwick.loadtest.measure import server_infos
from herdwick.storage.db import Database

# The tables an execution's life writes; partitions are summed under their parent.
TABLES = ("executions", "execution_attempts", "jobs", "due_index")
# How long to wait for the tool's own counters to reach the view: the herd's inserts
# (their idle connections flush within 10 s) and the move (flushed at once, if asked).
INSERT_FLUSH_WAIT_S = 12.0
MOVE_FLUSH_WAIT_S = 2.0
TOP_COMMANDS = 12

# The tool's own statements (storage/ has no statistics queries, and none should exist
# for a load test). A partition is executions_YYYYMMDD, executions_default and alike.
_TABLES_SQL = """
SELECT CASE WHEN relname ~ '^execution_attempts(_|$)' THEN 'execution_attempts'
            WHEN relname ~ '^executions(_|$)' THEN 'executions' ELSE relname END AS name,
       sum(n_tup_ins)::bigint AS ins, sum(n_tup_upd)::bigint AS upd,
       sum(n_tup_hot_upd)::bigint AS hot, sum(n_tup_del)::bigint AS del,
       sum(pg_total_relation_size(relid))::bigint AS bytes
FROM pg_stat_user_tables
WHERE relname IN ('jobs', 'due_index') OR relname ~ '^executions(_|$)'
   OR relname ~ '^execution_attempts(_|$)'
GROUP BY 1"""
# Indexes of one leaf of each table (every partition has the same ones), and how many
# are partial: a row version enters a partial index only when it meets the predicate.
_INDEXES_SQL = """
SELECT CASE WHEN c.relname ~ '^execution_attempts(_|$)' THEN 'execution_attempts'
            WHEN c.relname ~ '^executions(_|$)' THEN 'executions' ELSE c.relname END AS name,
       count(*)::int AS total, count(*) FILTER (WHERE i.indpred IS NOT NULL)::int AS partial
FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid
WHERE c.relname IN ('jobs', 'due_index', 'executions_default', 'execution_attempts_default')
GROUP BY 1"""
_WAL_SQL = """
SELECT pg_current_wal_lsn() AS lsn, wal_records, wal_fpi, wal_bytes::bigint FROM pg_stat_wal"""
_OTHERS_SQL = """
SELECT datname, (tup_inserted + tup_updated + tup_deleted)::bigint AS rows
FROM pg_stat_database WHERE datname <> current_database()"""
_JOBS_INSERTED_SQL = """
SELECT coalesce(sum(n_tup_ins), 0) FROM pg_stat_user_tables WHERE relname = 'jobs'"""


class TableCounts(msgspec.Struct, frozen=True, kw_only=True):
    inserted: int = 0
    updated: int = 0
    hot_updated: int = 0
    deleted: int = 0
    bytes: int = 0  # heap, indexes and TOAST

    def minus(self, before: TableCounts) -> TableCounts:
        return TableCounts(inserted=self.inserted - before.inserted,
                           updated=self.updated - before.updated,
                           hot_updated=self.hot_updated - before.hot_updated,
                           deleted=self.deleted - before.deleted,
                           bytes=self.bytes - before.bytes)


class Snapshot(msgspec.Struct, frozen=True, kw_only=True):
    tables: dict[str, TableCounts]
    wal_lsn: int  # pg_current_wal_lsn(), as asyncpg decodes it
    wal_records: int
    wal_fpi: int
    wal_bytes_stat: int
    others_rows: dict[str, int]  # by database
    redis_calls: dict[str, int]  # command -> calls, the functions' inner commands included
    redis_in_bytes: int
    redis_out_bytes: int


class TableWrites(msgspec.Struct, frozen=True, kw_only=True):
    """One table's rows per execution; index entries are an estimate (below)."""

    inserted: float
    updated: float
    hot_updated: float
    deleted: float
    indexes: int
    partial_indexes: int
    # (inserts + non-HOT updates) x indexes: at most what was written, partial indexes
    # counted as if every row version met their predicates.
    index_entries_max: float
    bytes_added: float  # growth of heap + indexes, per execution


class WriteProfile(msgspec.Struct, frozen=True, kw_only=True):
    executions: int
    tables: dict[str, TableWrites]
    rows_written: float  # inserted + updated + deleted, every table above, per execution
    hot_share: float  # of the updates above
    wal_bytes: float  # per execution, server-wide (pg_current_wal_lsn difference)
    wal_records: float
    wal_fpi: float  # full-page images: the first change of a page after a checkpoint
    others_rows: int  # rows other databases wrote in the window (0: a clean run)
    redis_commands: float  # per execution, the functions' inner commands included
    redis_top: dict[str, float]  # the most frequent commands, calls per execution
    redis_in_bytes: float  # per execution, what clients sent the server
    redis_out_bytes: float  # what it sent back


async def snapshot(db: Database, client: aioredis.Redis) -> Snapshot:
    async with db.connection() as conn:
        rows = await conn.fetch(_TABLES_SQL)
        wal = await conn.fetchrow(_WAL_SQL)
        others = {r["datname"]: r["rows"] for r in await conn.fetch(_OTHERS_SQL)}
    calls: dict[str, int] = {}
    for stats in await server_infos(client, "commandstats"):  # a cluster's primaries, summed
        for name, v in stats.items():
            calls[name.removeprefix("cmdstat_")] = calls.get(name.removeprefix("cmdstat_"), 0) \
                + int(v["calls"])
    nets = await server_infos(client, "stats")
    return Snapshot(
        tables={r["name"]: TableCounts(inserted=r["ins"], updated=r["upd"],
                                       hot_updated=r["hot"], deleted=r["del"],
                                       bytes=r["bytes"]) for r in rows},
        wal_lsn=wal["lsn"], wal_records=wal["wal_records"], wal_fpi=wal["wal_fpi"],
        wal_bytes_stat=wal["wal_bytes"], others_rows=others,
        redis_calls=calls,
        redis_in_bytes=sum(int(net["total_net_input_bytes"]) for net in nets),
        redis_out_bytes=sum(int(net["total_net_output_bytes"]) for net in nets))


async def inserted(db: Database, jobs: int, wait_s: float = INSERT_FLUSH_WAIT_S) -> None:
    """Until the herd's inserts are in the view: an idle backend keeps its counters
    pending for up to 10 s, and they must not land inside the window. Called before it."""
    deadline = time.perf_counter() + wait_s
    while time.perf_counter() < deadline:
        async with db.connection() as conn:
            if await conn.fetchval(_JOBS_INSERTED_SQL) >= jobs:
                return
        await asyncio.sleep(0.2)


async def after_move(db: Database, client: aioredis.Redis, before_move: Snapshot,
                     moved: int) -> Snapshot:
    """The first snapshot: once the move's updates of due_index are in the view (the move
    asks for its counters to be flushed at once: jobs.move_herd)."""
    deadline = time.perf_counter() + MOVE_FLUSH_WAIT_S
    while True:
        snap = await snapshot(db, client)
        done = (_counts(snap, "due_index").updated
                - _counts(before_move, "due_index").updated) >= moved
        if done or time.perf_counter() > deadline:
            return snap
        await asyncio.sleep(0.05)


def _counts(snap: Snapshot, table: str) -> TableCounts:
    return snap.tables.get(table, TableCounts())


async def profile(db: Database, before: Snapshot, after: Snapshot, executions: int,
                  own_redis_calls: int) -> WriteProfile:
    """Per execution from the two snapshots; `own_redis_calls`, the tool's own Redis
    commands in the window, are left out of the command count (not out of the bytes)."""
    n = max(executions, 1)
    async with db.connection() as conn:
        indexes = {r["name"]: (r["total"], r["partial"]) for r in await conn.fetch(_INDEXES_SQL)}
    tables: dict[str, TableWrites] = {}
    for name in TABLES:
        d = _counts(after, name).minus(_counts(before, name))
        total, partial = indexes.get(name, (0, 0))
        tables[name] = TableWrites(
            inserted=_per(d.inserted, n), updated=_per(d.updated, n),
            hot_updated=_per(d.hot_updated, n), deleted=_per(d.deleted, n), indexes=total,
            partial_indexes=partial,
            index_entries_max=_per((d.inserted + d.updated - d.hot_updated) * total, n),
            bytes_added=_per(d.bytes, n))
    updated = sum(t.updated for t in tables.values())
    calls = {name: c - before.redis_calls.get(name, 0) for name, c in after.redis_calls.items()}
    calls = {name: c for name, c in calls.items() if c > 0}
    top = sorted(calls.items(), key=lambda kv: -kv[1])[:TOP_COMMANDS]
    return WriteProfile(
        executions=executions, tables=tables,
        rows_written=round(sum(t.inserted + t.updated + t.deleted for t in tables.values()), 3),
        hot_share=round(sum(t.hot_updated for t in tables.values()) / updated, 3)
        if updated else 0.0,
        wal_bytes=_per(after.wal_lsn - before.wal_lsn, n),
        wal_records=_per(after.wal_records - before.wal_records, n),
        wal_fpi=_per(after.wal_fpi - before.wal_fpi, n),
        # databases made or dropped in the window count from 0 or not at all
        others_rows=sum(max(0, rows - before.others_rows.get(name, 0))
                        for name, rows in after.others_rows.items()),
        redis_commands=_per(sum(calls.values()) - own_redis_calls, n),
        redis_top={name: _per(c, n) for name, c in top},
        redis_in_bytes=_per(after.redis_in_bytes - before.redis_in_bytes, n),
        redis_out_bytes=_per(after.redis_out_bytes - before.redis_out_bytes, n))


def _per(value: float, n: int) -> float:
    return round(value / n, 3)


def render_lines(p: WriteProfile) -> list[str]:
    lines = [f"  writes per execution (Postgres: this database; WAL and Redis server-wide, "
             f"other databases wrote {p.others_rows} rows meanwhile):",
             f"    rows {p.rows_written:g} (inserted + updated + deleted), "
             f"{p.hot_share:.0%} of updates HOT; WAL {p.wal_bytes:,.0f} bytes, "
             f"{p.wal_records:g} records, {p.wal_fpi:g} full-page images"]
    for name, t in p.tables.items():
        lines.append(f"    {name}: ins {t.inserted:g}  upd {t.updated:g} (HOT {t.hot_updated:g})"
                     f"  del {t.deleted:g}; {t.indexes} indexes ({t.partial_indexes} partial), "
                     f"index entries <= {t.index_entries_max:g}; +{t.bytes_added:,.0f} bytes")
    top = "  ".join(f"{name} {c:g}" for name, c in p.redis_top.items())
    lines += [f"    Redis: {p.redis_commands:g} commands (inner ones included), "
              f"{p.redis_in_bytes:,.0f} bytes in, {p.redis_out_bytes:,.0f} bytes out",
              f"      most called: {top}"]
    return lines
