"""The `herdwick` command as a user runs it: a real process, real Postgres."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from herdwick.storage import signing
from tests.services import with_database

TIMEOUT_S = 30


async def herdwick(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "herdwick.cli", *args, env={**os.environ, **(env or {})},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), TIMEOUT_S)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_help_imports_no_loadtest_gateway_or_driver() -> None:
    probe = ("import sys\n"
             "from herdwick.cli import main\n"
             "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
             "heavy = ('asyncpg', 'aiohttp', 'redis', 'psutil', 'herdwick.loadtest',\n"
             "         'herdwick.gateway', 'herdwick.storage', 'herdwick.actors')\n"
             "print(sorted(m for m in sys.modules if m.startswith(heavy)))\n")
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", probe,
                                                stdout=asyncio.subprocess.PIPE)
    out, _ = await asyncio.wait_for(proc.communicate(), TIMEOUT_S)
    assert out.decode().strip().splitlines()[-1] == "[]"


# Each command shows the settings it reads, and no others.
FLAGS = {
    ("migrate",): {"--database-url"},
    ("tenant", "create"): {"--database-url"},
    ("tenant", "update"): {"--database-url"},
    ("tenant", "rotate-secret"): {"--database-url", "--redis-url", "--key-prefix"},
    ("scheduler",): {"--database-url", "--redis-url", "--key-prefix", "--db-pool-max",
                     "--dispatch-order",
                     "--ready-max", "--retention-days", "--archive-url", "--archive-s3-endpoint"},
    ("retention",): {"--database-url", "--retention-days", "--archive-url",
                     "--archive-s3-endpoint"},
    ("worker",): {"--redis-url", "--key-prefix"},
    ("api",): {"--database-url", "--redis-url", "--key-prefix", "--db-pool-max",
               "--admin-token", "--http-allow",
               "--api-host", "--api-port", "--herd-warn-jobs", "--read-database-url",
               "--read-max-lag-s"},
}
SETTINGS = {"--database-url", "--redis-url", "--key-prefix", "--admin-token", "--http-allow",
            "--api-host", "--api-port", "--dispatch-order", "--ready-max", "--herd-warn-jobs",
            "--retention-days", "--archive-url", "--archive-s3-endpoint", "--read-database-url",
            "--read-max-lag-s", "--db-pool-max"}


@pytest.mark.parametrize("command", list(FLAGS), ids=" ".join)
def test_each_command_lists_only_its_settings_and_every_option_has_help(command) -> None:
    from herdwick.cli import _parser

    parser = _parser()
    for name in command:
        parser = next(a for a in parser._actions if a.dest in ("command", "tenant_command")
                      ).choices[name]
    flags = {s for a in parser._actions for s in a.option_strings}
    assert flags & SETTINGS == FLAGS[command]
    assert {"--log-level", "--log-format"} <= flags
    undocumented = [a.option_strings or a.dest for a in parser._actions if not a.help]
    assert undocumented == []


def test_every_loadtest_option_has_help() -> None:
    from herdwick.cli import _parser

    parser = _parser(loadtest_flags=True)
    loadtest = next(a for a in parser._actions if a.dest == "command").choices["loadtest"]
    actions = next(a for a in loadtest._actions if a.dest == "loadtest_command").choices
    assert set(actions) == {"submit", "herd", "e2e", "noisy-neighbour", "http", "soak"}
    for name, action in actions.items():
        undocumented = [a.option_strings for a in action._actions if not a.help]
        assert undocumented == [], name


async def test_tenant_create_prints_its_credentials_and_stores_the_weight(db_url, db) -> None:
    code, out, err = await herdwick("tenant", "create", "acme", "--weight", "2", "--rate", "50",
                                    "--database-url", db_url)
    assert code == 0, err
    lines = dict(line.split(":", 1) for line in out.strip().splitlines())
    tenant_id = uuid.UUID(lines["tenant id"].strip())
    assert lines["api key"].strip().startswith("hwk_")
    assert lines["signing secret"].strip().startswith("whsec_")
    async with db.connection() as conn:
        row = await conn.fetchrow("SELECT name, weight, dispatch_rate FROM tenants "
                                  "WHERE tenant_id = $1", tenant_id)
    assert (row["name"], row["weight"], row["dispatch_rate"]) == ("acme", 2, 50.0)


async def test_tenant_update_changes_the_share_and_lifts_limits(db_url, db) -> None:
    code, out, err = await herdwick("tenant", "create", "acme", "--rate", "50", "--burst", "5",
                                    "--database-url", db_url)
    assert code == 0, err
    tenant_id = dict(line.split(":", 1) for line in out.splitlines())["tenant id"].strip()
    code, out, err = await herdwick("tenant", "update", tenant_id, "--weight", "3", "--rate",
                                    "20", "--burst", "none", "--database-url", db_url)
    assert code == 0, err
    shown = json.loads(out)
    assert (shown["weight"], shown["dispatchRate"], shown["burst"]) == (3, 20.0, None)
    async with db.connection() as conn:
        row = await conn.fetchrow("SELECT weight, dispatch_rate, burst FROM tenants")
    assert tuple(row) == (3, 20.0, None)
    code, _, err = await herdwick("tenant", "update", str(uuid.uuid4()), "--weight", "2",
                                  "--database-url", db_url)
    assert code == 1 and "does not exist" in err
    code, _, err = await herdwick("tenant", "update", tenant_id, "--rate", "fast",
                                  "--database-url", db_url)
    assert code == 2 and "fast" in err


async def test_tenant_durability_is_async_unless_asked_and_can_change(db_url, db) -> None:
    code, out, err = await herdwick("tenant", "create", "bank", "--durability", "sync",
                                    "--database-url", db_url)
    assert code == 0, err
    tenant_id = dict(line.split(":", 1) for line in out.splitlines())["tenant id"].strip()
    code, out, err = await herdwick("tenant", "create", "shop", "--database-url", db_url)
    assert code == 0, err
    async with db.connection() as conn:
        assert dict(await conn.fetch("SELECT name, durability FROM tenants")) == {
            "bank": "sync", "shop": "async"}
    code, out, err = await herdwick("tenant", "update", tenant_id, "--durability", "async",
                                    "--database-url", db_url)
    assert code == 0, err
    assert json.loads(out)["durability"] == "async"
    code, _, err = await herdwick("tenant", "update", tenant_id, "--durability", "quorum",
                                  "--database-url", db_url)
    assert code == 2 and "quorum" in err


async def test_tenant_rotate_secret_prints_the_new_secret_and_hands_it_to_redis(
        db_url, db, services, key_prefix, redis_client) -> None:
    code, out, err = await herdwick("tenant", "create", "acme", "--database-url", db_url)
    assert code == 0, err
    created = {k: v.strip() for k, v in (line.split(":", 1) for line in out.splitlines())}
    tenant_id = created["tenant id"]
    redis = ("--redis-url", services.redis_url, "--key-prefix", key_prefix)
    code, out, err = await herdwick("tenant", "rotate-secret", tenant_id, "--overlap", "3600",
                                    "--database-url", db_url, *redis)
    assert code == 0, err
    shown = {k: v.strip() for k, v in (line.split(":", 1) for line in out.splitlines())}
    new = shown["signing secret"]
    assert new.startswith("whsec_") and new != created["signing secret"]
    expires = datetime.fromisoformat(shown["previous secret expires at"])
    assert timedelta(minutes=59) < expires - datetime.now(UTC) <= timedelta(hours=1)
    async with db.connection() as conn:
        row = await conn.fetchrow("SELECT signing_secret, previous_signing_secret, "
                                  "previous_secret_until FROM tenants")
    assert tuple(row) == (new, created["signing secret"], expires)
    keys = (await signing.load(redis_client, key_prefix, [tenant_id]))[tenant_id]
    assert keys.active(int(time.time() * 1000)) == [new, created["signing secret"]]

    code, out, err = await herdwick("tenant", "rotate-secret", tenant_id, "--overlap", "0",
                                    "--database-url", db_url, *redis)
    assert code == 0, err
    assert out.splitlines()[1].endswith("now (no overlap)")
    latest = out.splitlines()[0].split(":", 1)[1].strip()
    keys = (await signing.load(redis_client, key_prefix, [tenant_id]))[tenant_id]
    assert keys.active(int(time.time() * 1000)) == [latest]


async def test_tenant_rotate_secret_refuses_what_it_cannot_do(db_url, db) -> None:
    code, out, err = await herdwick("tenant", "create", "acme", "--database-url", db_url)
    tenant_id = dict(line.split(":", 1) for line in out.splitlines())["tenant id"].strip()
    async with db.connection() as conn:
        before = await conn.fetchval("SELECT signing_secret FROM tenants")
    for overlap in ("-1", "604801"):
        code, _, err = await herdwick("tenant", "rotate-secret", tenant_id, "--overlap", overlap,
                                      "--database-url", db_url)
        assert code == 2 and "--overlap must be 0 to 604800 seconds" in err
    code, _, err = await herdwick("tenant", "rotate-secret", "acme", "--database-url", db_url)
    assert code == 2 and "not a tenant id" in err
    code, _, err = await herdwick("tenant", "rotate-secret", str(uuid.uuid4()),
                                  "--database-url", db_url)
    assert code == 1 and "does not exist" in err
    async with db.connection() as conn:
        assert await conn.fetchval("SELECT signing_secret FROM tenants") == before
    # Without Redis configured it rotates all the same: the schedulers copy it over.
    code, out, err = await herdwick("tenant", "rotate-secret", tenant_id,
                                    "--database-url", db_url, env={"HERDWICK_REDIS_URL": ""})
    assert code == 0, err
    async with db.connection() as conn:
        assert await conn.fetchval("SELECT signing_secret FROM tenants") != before


async def test_tenant_create_refuses_a_bad_weight_by_name(db_url, db) -> None:
    code, _, err = await herdwick("tenant", "create", "acme", "--weight", "0",
                                  "--database-url", db_url)
    assert code == 2
    assert "weight" in err
    async with db.connection() as conn:
        assert await conn.fetchval("SELECT count(*) FROM tenants") == 0


async def test_production_commands_name_the_missing_variable() -> None:
    env = {"HERDWICK_DATABASE_URL": "", "HERDWICK_REDIS_URL": ""}
    code, _, err = await herdwick("migrate", env=env)
    assert (code, err.strip()) == (2, "herdwick: HERDWICK_DATABASE_URL is not set (a Postgres DSN)")
    code, _, err = await herdwick("scheduler", "--database-url", "postgresql://x@/y", env=env)
    assert (code, err.strip()) == (2, "herdwick: HERDWICK_REDIS_URL is not set (a Redis URL)")


async def test_migrate_logs_one_json_object_a_line(services) -> None:
    name = f"hw_cli_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(services.admin_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        code, out, err = await herdwick("migrate", "--log-format", "json", "--database-url",
                                        with_database(services.admin_dsn, name))
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()
    assert code == 0, err
    assert out.strip().splitlines()[0].startswith("applied 0001_")
    lines = [json.loads(line) for line in err.strip().splitlines()]
    applied = [line for line in lines if line.get("event") == "migration_applied"]
    assert applied and applied[0]["version"] == 1
    assert {"ts", "level", "logger"} <= set(applied[0])


async def test_a_log_setting_we_do_not_know_is_refused_by_name() -> None:
    code, _, err = await herdwick("cron", "@daily", env={"HERDWICK_LOG_FORMAT": "xml"})
    assert code == 2
    assert "HERDWICK_LOG_FORMAT" in err


async def test_api_on_a_busy_port_says_so_and_exits(db_url, services) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, _, err = await herdwick("api", "--database-url", db_url, "--redis-url",
                                      services.redis_url, "--api-port", str(port))
    assert code == 1
    assert f"127.0.0.1:{port} is in use" in err
    assert "Traceback" not in err
