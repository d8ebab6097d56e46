"""The commands of docs/operations.md's "Retention and archive", run against a day they
really archive.

tests/docs/test_commands.py runs the section's ```sh block with the rest of the page, on
a database with nothing old enough to leave; the read-back lines are shown as ```text, as
they need an archive to read. Here both run, in order, as a reader would: the dry run and
the pass on a database with executions of 2026-10-01 (older than the retention from any
day this runs on), then every read-back line on what that pass wrote.
"""

from __future__ import annotations

import os
import sys
import uuid
from datetime import UTC, date, datetime
from pathlib import Path

from herdwick.storage import maintenance as partitions
from tests.docs.test_commands import ROOT, Reader, blocks, commands

DAY = date(2026, 10, 1)  # the day the section's examples read


def section_blocks(title: str = "## Retention and archive") -> list:
    path = ROOT / "docs" / "operations.md"
    text = path.read_text()
    start = text.index(title)
    end = text.find("\n## ", start + len(title))
    first = text.count("\n", 0, start) + 1
    last = text.count("\n", 0, end if end != -1 else len(text)) + 1
    return [b for b in blocks(path) if first <= b.line <= last]


async def test_the_retention_section_runs_as_shown(db, db_url, tmp_path: Path) -> None:
    found = section_blocks()
    assert [b.fence for b in found] == ["sh", "text"]
    await partitions.ensure_partitions(db, DAY, 1)
    async with db.connection() as conn:
        await conn.execute(
            "INSERT INTO executions (execution_id, job_id, tenant_id, scheduled_for, state) "
            "SELECT gen_random_uuid(), $1, $1, $2::timestamptz + n * interval '1 hour', "
            "CASE WHEN n = 0 THEN 'dead' ELSE 'succeeded' END FROM generate_series(0, 2) n",
            uuid.uuid4(), datetime(2026, 10, 1, 9, tzinfo=UTC))
        await conn.execute(
            "INSERT INTO execution_attempts (execution_id, attempt, scheduled_for, outcome) "
            "SELECT execution_id, 1, scheduled_for, 'succeeded' FROM executions")
    workdir = tmp_path / "work"
    workdir.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HERDWICK_ARCHIVE")}
    env.update({"PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
                "HERDWICK_DATABASE_URL": db_url})
    reader = Reader(env=env, workdir=workdir)
    for block in found:
        for command in commands(block):
            await reader.run(command, f"operations.md:{block.line}")
    assert reader.ran[1] == "herdwick retention"
    assert (workdir / "archive" / "executions_20261001.jsonl.gz").exists()
    async with db.connection() as conn:
        assert await conn.fetchval("SELECT count(*) FROM executions") == 0
