"""docs/fleet/compose.yaml, checked against the code it deploys.

No container engine runs on this machine, so the file is not started here; what
can be checked without one is: it parses; every herdwick service runs a real
command with flags the CLI takes; the environment it gives them passes the
settings' own validation (the multi-host DSN, the replica, the cluster URL); it
names only variables herdwick reads; the cluster it creates joins every Redis
service; and the image is a plain install.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from herdwick import cli, config, redis_client

ROOT = Path(__file__).resolve().parents[2]
FLEET = ROOT / "docs" / "fleet"
# What the package reads, however it reads it: every "HERDWICK_..." it spells.
KNOWN_VARIABLES = {m for path in (ROOT / "herdwick").rglob("*.py")
                   for m in re.findall(r'"(HERDWICK_[A-Z_]+)"', path.read_text())}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((FLEET / "compose.yaml").read_text())


def _herdwick_services(compose: dict) -> dict[str, dict]:
    return {name: s for name, s in compose["services"].items() if s.get("image") == "herdwick"}


def test_every_herdwick_service_runs_a_real_command(compose: dict) -> None:
    services = _herdwick_services(compose)
    assert set(services) == {"migrate", "api", "scheduler", "http-worker"}
    parser = cli._parser()
    for name, service in services.items():
        program, *argv = service["command"]
        assert program == "herdwick", name
        parser.parse_args(argv)  # exits (SystemExit) on a command or flag it lacks


def test_their_environment_passes_the_settings_own_checks(compose: dict) -> None:
    for name, service in _herdwick_services(compose).items():
        env = {k: str(v) for k, v in service["environment"].items()}
        assert set(env) <= KNOWN_VARIABLES, (name, set(env) - KNOWN_VARIABLES)
        settings = config.from_env(env)
        settings.require_services()
        assert redis_client.is_cluster_url(settings.redis_url)
        assert "target_session_attrs=read-write" in settings.database_url
        assert settings.read_database_urls, name
    api = compose["services"]["api"]["environment"]
    assert len(api["HERDWICK_ADMIN_TOKEN"]) >= 16


def test_the_cluster_joins_every_redis_node_with_a_replica_each(compose: dict) -> None:
    nodes = sorted(n for n in compose["services"] if re.fullmatch(r"redis-\d+", n))
    create = compose["services"]["redis-cluster"]["entrypoint"]
    assert re.findall(r"(redis-\d+):6379", create.split("--cluster create")[1]) == nodes
    assert "--cluster-replicas 1" in create and len(nodes) == 6
    for node in nodes:
        command = compose["services"][node]["command"]
        for setting in ("--cluster-enabled yes", "--appendonly yes",
                        "--maxmemory-policy noeviction"):
            assert setting in command, (node, setting)


def test_the_image_is_a_plain_install() -> None:
    dockerfile = (FLEET / "Dockerfile").read_text()
    assert "pip install --no-cache-dir /src " in dockerfile  # no [extras]
