"""`herdwick loadtest submit`: its report adds up, whatever the speed.

No figure here is asserted against a speed: only that every request is
accounted for, every job it reported is in the database, and the ratios
follow from the rates. Against an API someone else runs (--url), every job
it submitted is canceled afterwards, and the report says so rather than
claiming a database it never looked at.
"""

from __future__ import annotations

import asyncio
import io
import re
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta

import asyncpg
import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from herdwick.cli import main
from herdwick.config import ConfigError, Settings
from herdwick.gateway.app import create_app
from herdwick.loadtest.driver import running
from herdwick.loadtest.submit import (
    DISTINCT_BODIES,
    PHASES,
    URL_DUE_AFTER_S,
    CpuProbe,
    HttpTarget,
    Options,
    PhaseResult,
    Plan,
    Progress,
    Report,
    http_phases,
    job_bodies,
    latency_of,
    ratios,
    raw_phases,
    render_text,
    require_loopback,
    run,
)
from tests.integration.conftest import Api
from tests.integration.gateway_client import ADMIN_TOKEN
from tests.services import with_database

TINY = Plan(clients=4, batch_clients=2, batch_size=50, duration_s=0.9, warmup_s=0.2)


def url_of(api: Api) -> str:
    return str(api.client.make_url("")).rstrip("/")


def assert_phase_adds_up(phase: PhaseResult) -> None:
    assert phase.errors == {}, phase.name
    assert phase.requests == phase.ok == phase.latency.samples > 0
    assert phase.jobs_per_s == pytest.approx(phase.ok * phase.jobs_per_request / phase.measured_s)
    assert phase.jobs_created >= phase.ok * phase.jobs_per_request  # warm-up and tail too
    lat = phase.latency
    assert 0 < lat.p50_ms <= lat.p95_ms <= lat.p99_ms <= lat.max_ms


async def test_every_job_the_phases_report_is_in_the_database(api, db) -> None:
    out = io.StringIO()
    progress = Progress(out, "submit", bar=True)  # forced: a StringIO is no terminal
    target = HttpTarget(url_of(api), api.key)
    bodies = job_bodies(DISTINCT_BODIES)

    async with running(progress.run()):
        phases = await http_phases(TINY, target, bodies, CpuProbe(), progress)
        phases += await raw_phases(TINY, db, uuid.UUID(api.tenant_id), bodies, CpuProbe(),
                                   progress)

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
    shown = out.getvalue()
    for phase in phases:  # the bar showed each phase, then counted its measured jobs
        assert f"submit {phase.name} measuring" in shown
        assert sum(s.count for s in phase.per_second) == phase.ok * phase.jobs_per_request


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


# --- against an API someone else runs (--url) -----------------------------------------------

URL_TINY = ("--clients", "2", "--batch-clients", "1", "--batch-size", "5",
            "--duration", "0.5", "--warmup", "0.2")


async def start_submit(services, api: Api, *flags: str) -> asyncio.subprocess.Process:
    """`herdwick loadtest submit --url` at a tenant of `api`, in a process of its own."""
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "herdwick.cli", "loadtest", "submit", "--url", url_of(api),
        "--api-key", api.key, "--database-url", services.admin_dsn,
        "--redis-url", services.redis_url, *flags,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)


async def jobs_by_state(db) -> dict[str, int]:
    async with db.connection() as conn:
        rows = await conn.fetch("SELECT state, count(*) AS n FROM jobs GROUP BY state")
    return {r["state"]: r["n"] for r in rows}


async def fetch_column(db, sql: str) -> list:
    async with db.connection() as conn:
        return [r[0] for r in await conn.fetch(sql)]


@pytest.mark.slow
async def test_what_it_submits_through_url_never_runs_and_is_canceled(api, db,
                                                                       services) -> None:
    proc = await start_submit(services, api, *URL_TINY, "--json",
                              "--phases", "http-single,http-batch,raw-single")
    stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == 0, stderr.decode()

    report = msgspec.json.decode(stdout, type=Report)
    http = [p for p in report.phases if p.name.startswith("http-")]
    cleanup = report.cleanup
    assert cleanup is not None
    assert cleanup.submitted == sum(p.jobs_created for p in http) > 0
    assert cleanup.canceled == cleanup.submitted
    assert (cleanup.failed, cleanup.already_gone, cleanup.unanswered_requests) == (0, 0, 0)

    # Through the API's own database: every job the tool made is canceled, none is due,
    # none ran, and none was due within URL_DUE_AFTER_S of its submit.
    assert await jobs_by_state(db) == {"canceled": cleanup.submitted}
    assert await fetch_column(db, "SELECT count(*) FROM due_index") == [0]
    assert await fetch_column(db, "SELECT count(*) FROM executions") == [0]
    [soonest] = await fetch_column(
        db, "SELECT min((schedule->>'delaySeconds')::float) FROM jobs")
    assert soonest >= URL_DUE_AFTER_S
    names = await fetch_column(db, "SELECT name FROM jobs")
    assert {n.rsplit("-", 1)[0] + "-*" for n in names} == {cleanup.job_names}

    # The report claims only what it measured: not the target's Postgres CPU; the
    # scratch database check covers the raw phase alone.
    assert all(p.cpu.api_s is None and p.cpu.postgres_s is None for p in http)
    [raw] = [p for p in report.phases if p.name == "raw-single"]
    assert raw.cpu.postgres_s is not None
    assert report.database is not None and report.database.consistent
    assert report.database.jobs_found == report.database.jobs_expected == raw.jobs_created
    assert "cleanup: submitted" in stderr.decode()  # outside the report too


def refusing_deletes(status: int, count: int):
    """A middleware: the first `count` DELETEs are answered `status`, not canceled."""
    left = count

    @web.middleware
    async def refuse(request: web.Request, handler):
        nonlocal left
        if request.method == "DELETE" and left > 0:
            left -= 1
            return web.Response(status=status)
        return await handler(request)

    return refuse


@asynccontextmanager
async def api_with(middleware, db_url: str, redis_url: str, key_prefix: str,
                   clock) -> AsyncIterator[Api]:
    """The `api` fixture's gateway and tenant, with one more middleware."""
    settings = Settings(database_url=db_url, redis_url=redis_url, key_prefix=key_prefix,
                        admin_token=ADMIN_TOKEN)
    app = create_app(settings, clock=clock)
    app.middlewares.append(middleware)
    client = TestClient(TestServer(app))
    await client.start_server()
    try:
        holder = Api(client=client, key="", tenant_id="")
        tenant = await holder.create_tenant()
        holder.key, holder.tenant_id = tenant["apiKey"], tenant["tenantId"]
        yield holder
    finally:
        await client.close()


@pytest.mark.slow
async def test_a_job_the_api_will_not_cancel_is_reported_and_fails_the_run(
        db_url, db, services, key_prefix, clock) -> None:
    async with api_with(refusing_deletes(403, 3), db_url, services.redis_url, key_prefix,
                        clock) as api:
        proc = await start_submit(services, api, *URL_TINY, "--phases", "http-single")
        stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == 1, stderr.decode()

    states = await jobs_by_state(db)
    total = sum(states.values())
    assert states == {"canceled": total - 3, "active": 3}
    text = stdout.decode()
    assert "the target's database was not inspected (--url)" in text
    assert f"submitted {total} jobs through --url; canceled {total - 3} (failed 3)" in text
    assert "NOT CANCELED: 3 jobs (403: 3)" in text
    for job_id in await fetch_column(db, "SELECT job_id FROM jobs WHERE state = 'active'"):
        assert str(job_id) in text
    assert "consistent" not in text  # no scratch check: no raw phase wrote there


@pytest.mark.slow
async def test_a_delete_that_fails_for_a_moment_is_tried_again(
        db_url, db, services, key_prefix, clock) -> None:
    async with api_with(refusing_deletes(503, 3), db_url, services.redis_url, key_prefix,
                        clock) as api:
        proc = await start_submit(services, api, *URL_TINY, "--phases", "http-single", "--json")
        stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == 0, stderr.decode()

    cleanup = msgspec.json.decode(stdout, type=Report).cleanup
    assert cleanup is not None and cleanup.canceled == cleanup.submitted > 0
    assert await jobs_by_state(db) == {"canceled": cleanup.submitted}


@pytest.mark.slow
async def test_a_run_stopped_by_a_signal_still_cancels_what_it_submitted(api, db,
                                                                         services) -> None:
    proc = await start_submit(services, api, "--clients", "2", "--warmup", "0.2",
                              "--duration", "60", "--phases", "http-single", "--progress")
    assert proc.stderr is not None
    seen = b""
    # Until the bar counts jobs: the load is flowing.
    while not re.search(rb"http-single [a-z-]+: [1-9]\d* jobs", seen):
        chunk = await asyncio.wait_for(proc.stderr.read(4096), 30)
        assert chunk, seen.decode()
        seen += chunk
    proc.send_signal(signal.SIGINT)
    stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == 130, stderr.decode()

    states = await jobs_by_state(db)
    submitted = states.get("canceled", 0)
    assert submitted > 0 and states == {"canceled": submitted}  # in flight at the signal too
    assert await fetch_column(db, "SELECT count(*) FROM due_index") == [0]
    assert (f"cleanup: submitted {submitted} jobs through --url; canceled {submitted} "
            "(failed 0)") in stderr.decode()
    assert stdout == b""  # no report for a run that did not finish


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


async def test_prefill_puts_the_tenant_s_jobs_there_before_the_first_phase(services) -> None:
    """`--prefill N`: the phases submit into a table that already holds N of the tenant's
    jobs; the database check counts them apart from the phases'."""
    plan = msgspec.structs.replace(TINY, phases=("raw-single",), prefill=2_500)
    options = Options(plan=plan, database_url=services.admin_dsn,
                      redis_url=services.redis_url)
    out = io.StringIO()
    report = await run(options, Progress(out, "submit", bar=False))
    [phase] = report.phases
    assert report.database is not None and report.database.consistent
    assert report.database.jobs_prefilled == 2_500
    assert report.database.jobs_found == 2_500 + phase.jobs_created
    assert "prefilling the scratch database with 2500 jobs" in out.getvalue()
    text = render_text(report)
    assert "2500 jobs in the scratch database before the first" in text
    assert f"the phases reported {phase.jobs_created} and 2500 were there before" in text


async def test_one_second_puts_every_job_in_the_same_second(services) -> None:
    """`--one-second`: a herd built by submits; the prefill joins the same second."""
    plan = msgspec.structs.replace(TINY, phases=("raw-single", "raw-batch"), prefill=1_000,
                                   one_second=True)
    out = io.StringIO()
    report = await run(Options(plan=plan, database_url=services.admin_dsn,
                               redis_url=services.redis_url, keep=True),
                       Progress(out, "submit", bar=False))
    assert report.database is not None and report.database.consistent
    assert "every job due in one second" in render_text(report)
    [name] = re.findall(r"kept database (\S+)", out.getvalue())
    admin = await asyncpg.connect(services.admin_dsn)
    try:
        conn = await asyncpg.connect(with_database(services.admin_dsn, name))
        try:
            seconds = await conn.fetch("SELECT date_trunc('second', next_run_at) AS s, "
                                       "count(*) AS n FROM jobs GROUP BY 1")
        finally:
            await conn.close()
        await admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
    finally:
        await admin.close()
    assert len(seconds) == 1 and seconds[0]["n"] == report.database.jobs_found
    assert seconds[0]["s"] == report.started_at.replace(microsecond=0) + timedelta(hours=1)
