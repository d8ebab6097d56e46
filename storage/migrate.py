"""Forward-only, numbered SQL migrations (storage/migrations/NNNN_name.sql).

`apply` holds an advisory lock while it works, so concurrent runs queue up
and the second finds nothing left to do; each file is applied and recorded in
one transaction, so a crash leaves it either wholly applied or not at all.
"""

from __future__ import annotations

import re
from pathlib import Path

import asyncpg
import msgspec

from herdwick import logs
from herdwick.errors import SchemaOutOfDate
from herdwick.storage.db import HostByHost, translated
from herdwick.storage.sql import q

log = logs.get("herdwick.migrate")

MIGRATIONS_DIR = Path(__file__).with_name("migrations")
_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


class Migration(msgspec.Struct, frozen=True):
    version: int
    name: str
    path: Path


def available() -> list[Migration]:
    found = []
    for path in sorted(MIGRATIONS_DIR.glob("*.sql")):
        match = _FILE.match(path.name)
        if not match:
            raise ValueError(f"migration file {path.name!r} is not named NNNN_name.sql")
        found.append(Migration(int(match.group(1)), match.group(2), path))
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise ValueError("two migration files share a version number")
    return found


def latest_version() -> int:
    return available()[-1].version


async def apply(dsn: str) -> list[Migration]:
    """Apply every pending migration; returns the ones this call applied."""
    with translated():
        conn = await HostByHost(dsn)(timeout=10)
    try:
        return await _apply_locked(conn)
    finally:
        await conn.close()


async def _apply_locked(conn: asyncpg.Connection) -> list[Migration]:
    await conn.execute(q("migrations_lock"))
    try:
        await conn.execute(q("migrations_table"))
        done = {row["version"] for row in await conn.fetch(q("migrations_applied"))}
        applied = []
        for migration in available():
            if migration.version in done:
                continue
            async with conn.transaction():
                await conn.execute(migration.path.read_text())
                await conn.execute(q("migrations_record"), migration.version, migration.name)
            log.info("migration_applied", version=migration.version, name=migration.name)
            applied.append(migration)
        return applied
    finally:
        await conn.execute(q("migrations_unlock"))


async def check(conn: asyncpg.Connection) -> int:
    """Raise SchemaOutOfDate unless every migration this herdwick knows is applied."""
    exists = await conn.fetchval(q("migrations_table_exists"))
    have = await conn.fetchval(q("schema_version")) if exists else None
    want = latest_version()
    if have is None:
        raise SchemaOutOfDate("the database has no herdwick schema: run `herdwick migrate`")
    if have < want:
        raise SchemaOutOfDate(
            f"the database schema is at version {have}, this herdwick needs {want}: "
            "run `herdwick migrate`")
    if have > want:
        log.warning("schema_newer", have=have, want=want)
    return have
