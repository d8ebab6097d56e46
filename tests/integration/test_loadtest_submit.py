"""`herdwick loadtest submit`: its report adds up, whatever the speed.

No figure here is asserted against a speed: only that every request is
accounted for, every job it reported is in the database, and the ratios
follow from the rates.
"""

from __future__ import annotations

import asyncio
import io
import sys
import uuid

import asyncpg
import msgspec
import pytest

from herdwick.cli import main
from herdwick.config import ConfigError
from herdwick.loadtest.submit import (
    PHASES,
    CpuProbe,
    HttpTarget,
    PhaseResult,
    Plan,
    Progress,
    Report,
    http_phases,
    latency_of,
    ratios,
    raw_phases,
    require_loopback,
)

TINY = Plan(clients=4, batch_clients=2, batch_size=50, duration_s=0.9, warmup_s=0.2)


def assert_phase_adds_up(phase: PhaseResult) -> None:
    assert phase.errors == {}, phase.name
    assert phase.requests == phase.ok == phase.latency.samples > 0
    assert phase.jobs_per_s == pytest.approx(phase.ok * phase.jobs_per_request / phase.measured_s)
    assert phase.jobs_created >= phase.ok * phase.jobs_per_request  # warm-up and tail too
    lat = phase.latency
    assert 0 < lat.p50_ms <= lat.p95_ms <= lat.p99_ms <= lat.max_ms


async def test_every_job_the_phases_report_is_in_the_database(api, db) -> None:
    out = io.StringIO()
    progress = Progress(out)
    target = HttpTarget(str(api.client.make_url("")).rstrip("/"), api.key)

    phases = await http_phases(TINY, target, CpuProbe(), progress)
    phases += await raw_phases(TINY, db, uuid.UUID(api.tenant_id), CpuProbe(), progress)

    assert sorted(p.name for p in phases) == sorted(PHASES)
    for phase in phases:
        assert_phase_adds_up(phase)
        assert phase.cpu.api_s is None and phase.cpu.loadgen_s > 0
    async with db.connection() as conn:
        jobs = await conn.fetchval("SELECT count(*) FROM jobs")
        due = await conn.fetchval("SELECT count(*) FROM due_index")
    assert jobs == due == sum(p.jobs_created for p in phases)
    found = {r.shape: r for r in ratios(phases)}
    assert set(found) == {"single", "batch"}
    for shape, r in found.items():
        by_name = {p.name: p for p in phases}
        assert r.http_over_raw == pytest.approx(
            by_name[f"http-{shape}"].jobs_per_s / by_name[f"raw-{shape}"].jobs_per_s)
    lines = out.getvalue().splitlines()
    assert {line.split()[0] for line in lines} == set(PHASES)  # a progress line a second


async def _hw_loadtest_databases(admin_dsn: str) -> set[str]:
    conn = await asyncpg.connect(admin_dsn)
    try:
        rows = await conn.fetch("SELECT datname FROM pg_database "
                                "WHERE datname LIKE 'hw_loadtest_%'")
    finally:
        await conn.close()
    return {r["datname"] for r in rows}


@pytest.mark.slow
async def test_the_command_runs_two_api_processes_and_cleans_up(services) -> None:
    before = await _hw_loadtest_databases(services.admin_dsn)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "herdwick.cli", "loadtest", "submit", "--clients", "3",
        "--batch-clients", "1", "--batch-size", "20", "--duration", "0.5", "--warmup", "0.2",
        "--api-processes", "2", "--database-url", services.admin_dsn,
        "--redis-url", services.redis_url, "--json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == 0, stderr.decode()

    report = msgspec.json.decode(stdout, type=Report)
    assert report.api_processes == 2
    assert [p.name for p in report.phases] == list(PHASES)
    for phase in report.phases:
        assert_phase_adds_up(phase)
        assert (phase.cpu.api_s is not None) == phase.name.startswith("http-")
    assert all(p.cpu.api_s > 0 for p in report.phases if p.cpu.api_s is not None)
    assert report.database.consistent
    assert report.database.jobs_found == sum(p.jobs_created for p in report.phases)
    assert [r.shape for r in report.ratios] == ["single", "batch"]
    assert "api: 2 process(es)" in stderr.decode()
    assert await _hw_loadtest_databases(services.admin_dsn) == before  # dropped


def test_loadtest_without_an_action_says_which_are_there(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["loadtest"])
    assert exit_.value.code == 2
    assert "ACTION" in capsys.readouterr().err


@pytest.mark.parametrize("url", ["http://10.0.0.5:8080", "postgresql://db.example.com/x",
                                 "postgresql://u@/x?host=192.168.1.9"])
def test_only_this_machine_is_a_target(url: str) -> None:
    with pytest.raises(ConfigError, match="loopback"):
        require_loopback(url, "--url")


def test_loopback_and_local_sockets_are_targets() -> None:
    for url in ("http://127.0.0.1:8080", "http://localhost:1", "http://[::1]:80",
                "postgresql://postgres@127.0.0.1:5432/postgres",
                "postgresql://u@/x?host=/var/run/postgresql"):
        require_loopback(url, "--url")


def test_latency_percentiles_are_nearest_rank() -> None:
    lat = latency_of([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert (lat.samples, lat.p50_ms, lat.p95_ms, lat.p99_ms, lat.max_ms) == pytest.approx(
        (100, 50, 95, 99, 100))
    assert latency_of([]).samples == 0
