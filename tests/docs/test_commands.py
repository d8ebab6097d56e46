"""Every shell command the README and docs/ show, run as a reader would run it.

Each document is one story, its ```sh blocks run in order, against real Postgres and
Redis: the environment a reader is told to set (HERDWICK_DATABASE_URL, _REDIS_URL,
_ADMIN_TOKEN, `API_KEY` for a tenant's key) points at this test's database and key
prefix, and a ```python block whose first line is `# name.py` is written to that file
first (the README's worker). What the runner changes, and why:

- a command that serves or consumes forever (`herdwick dev`, `api`, `scheduler`,
  `worker`, `./run dev`) starts in the background and must print its ready line within
  a deadline; it keeps running for the rest of the document (later `curl` lines talk to
  it), then SIGTERM must stop it with exit code 0. Each gateway gets a free port, and
  `127.0.0.1:8080` in later commands means the latest one started;
- `./run test` runs the suite, which runs this test: it is checked with
  `--collect-only` instead;
- `curl` gets `--fail-with-body`, so an error status fails the command.

Every other command must exit 0. Blocks in other fences (```text, ```python, ```json)
are not run; the install commands, shown as text, are run by tests/packaging.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import shlex
import signal
import socket
import sys
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import pytest

from herdwick.model import TenantSpec
from herdwick.storage.tenants import create_tenant

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
READY_S = 90.0  # ./run dev may install the venv on its first run
COMMAND_S = 150.0  # the load tests the docs show take tens of seconds
DOCUMENT_S = 900  # a document's commands together: past the suite's default of 120 s
STOP_S = 20.0
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
# How a long-running command says it is up.
_SERVES = {
    "./run dev": "herdwick dev is running",
    "herdwick dev": "herdwick dev is running",
    "herdwick api": "event=api_listening",
    "herdwick scheduler": "event=scheduler_started",
    "herdwick worker": "event=worker_started",
}
_GATEWAYS = ("./run dev", "herdwick dev", "herdwick api")


@dataclass
class Block:
    fence: str
    text: str
    line: int


def blocks(path: Path) -> list[Block]:
    text = path.read_text()
    return [Block(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1)
            for m in _FENCE.finditer(text)]


def commands(block: Block) -> list[str]:
    """One command a line (a line ending in a backslash goes on), its comment cut off."""
    found, current = [], ""
    for line in block.text.splitlines():
        current += line[:-1] + " " if line.endswith("\\") else line
        if line.endswith("\\"):
            continue
        command = _without_comment(current).strip()
        if command:
            found.append(command)
        current = ""
    return found


def _without_comment(line: str) -> str:
    """The line up to a `#` that starts a shell comment: unquoted, after a blank."""
    quote, escaped = "", False
    for i, char in enumerate(line):
        if escaped:
            escaped = False
        elif char == "\\" and quote != "'":
            escaped = True
        elif quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serves(command: str) -> str | None:
    return next((marker for prefix, marker in _SERVES.items() if command.startswith(prefix)),
                None)


@dataclass
class Reader:
    """One reader's shell: the environment, the working directory, what runs meanwhile."""

    env: dict[str, str]
    workdir: Path
    port: int = 8080
    background: list[tuple[str, asyncio.subprocess.Process, list[str]]] = field(
        default_factory=list)
    ran: list[str] = field(default_factory=list)

    def _prepare(self, command: str) -> tuple[str, Path, dict[str, str]]:
        env = dict(self.env)
        if command.startswith(_GATEWAYS):
            self.port = _free_port()
            env["HERDWICK_API_PORT"] = str(self.port)
        command = command.replace("127.0.0.1:8080", f"127.0.0.1:{self.port}")
        if command.startswith("./run test"):
            command += " --collect-only -q"
        if command.startswith("curl "):
            command = "curl --fail-with-body " + command[len("curl "):]
        return command, ROOT if command.startswith("./run") else self.workdir, env

    async def run(self, command: str, where: str) -> None:
        shell_command, cwd, env = self._prepare(command)
        self.ran.append(command)
        proc = await asyncio.create_subprocess_exec(
            "bash", "-c", "exec " + shell_command, cwd=cwd, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            start_new_session=True)
        marker = _serves(command)
        if marker is None:
            out = bytearray()

            async def drain() -> None:
                assert proc.stdout is not None
                while chunk := await proc.stdout.read(65536):
                    out.extend(chunk)

            reading = asyncio.create_task(drain())
            try:
                await asyncio.wait_for(proc.wait(), COMMAND_S)
            except TimeoutError:
                _kill(proc)
                await reading
                raise AssertionError(f"{where}: `{command}` ran over {COMMAND_S} s; its output:\n"
                                     f"{out.decode(errors='replace')[-4000:]}") from None
            await reading
            assert proc.returncode == 0, f"{where}: `{command}` exited {proc.returncode}:\n" \
                                         f"{out.decode(errors='replace')[-4000:]}"
            return
        lines: list[str] = []
        self.background.append((command, proc, lines))
        await _wait_for(proc, marker, lines, f"{where}: `{command}`")

    async def stop_all(self) -> None:
        failures = []
        for command, proc, lines in reversed(self.background):
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), STOP_S)
            except TimeoutError:
                _kill(proc)
                failures.append(f"`{command}` did not stop within {STOP_S} s of SIGTERM:\n"
                                + "".join(lines[-40:]))
                continue
            if proc.returncode != 0:
                tail = "".join(lines[-40:])
                failures.append(f"`{command}` exited {proc.returncode} on SIGTERM:\n{tail}")
        self.background.clear()
        assert not failures, "\n".join(failures)


async def _wait_for(proc: asyncio.subprocess.Process, marker: str, lines: list[str],
                    what: str) -> None:
    """Read its output until the ready line; keep draining after, so it never blocks."""
    assert proc.stdout is not None
    found = asyncio.get_running_loop().create_future()

    async def drain() -> None:
        async for raw in proc.stdout:
            lines.append(raw.decode(errors="replace"))
            if marker in lines[-1] and not found.done():
                found.set_result(True)
        if not found.done():
            found.set_result(False)

    asyncio.get_running_loop().create_task(drain())
    try:
        ready = await asyncio.wait_for(found, READY_S)
    except TimeoutError:
        ready = False
    if not ready:
        _kill(proc)
        raise AssertionError(f"{what} never said {marker!r}:\n{''.join(lines[-40:])}")


def _kill(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _write_files(document: Path, workdir: Path) -> None:
    for block in blocks(document):
        first = block.text.splitlines()[0] if block.text else ""
        named = re.fullmatch(r"#\s*([\w.-]+\.py)\s*", first)
        if block.fence == "python" and named:
            (workdir / named.group(1)).write_text(block.text)


def test_every_document_has_commands_to_run() -> None:
    """The runner found what it should: a sh block whose commands it would run."""
    readme = [c for b in blocks(ROOT / "README.md") if b.fence == "sh" for c in commands(b)]
    assert readme[:2] == ["./run dev", "./run test"]
    assert any(c.startswith("herdwick worker") for c in readme)
    assert {d.name for d in _with_commands()} >= {"README.md", "operations.md", "reference.md"}
    joined = commands(Block("sh", "a \\\n  b\n# note\n\nc  # why\n", 1))
    assert [" ".join(c.split()) for c in joined] == ["a b", "c"]
    assert _without_comment("""curl -d '{"a": "#1"}' # why""") == """curl -d '{"a": "#1"}' """


def _with_commands() -> list[Path]:
    return [d for d in DOCUMENTS if any(b.fence == "sh" for b in blocks(d))]


@pytest.mark.timeout(DOCUMENT_S)
@pytest.mark.parametrize("document", _with_commands(), ids=lambda d: d.name)
async def test_the_commands_of(document: Path, db, db_url, services, key_prefix,
                               tmp_path: Path) -> None:
    sh = [b for b in blocks(document) if b.fence == "sh"]
    tenant = await create_tenant(db, TenantSpec(name="docs reader"), datetime.now(UTC))
    workdir = tmp_path / "work"
    workdir.mkdir()
    _write_files(document, workdir)
    env = {**os.environ,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "HERDWICK_DATABASE_URL": db_url, "HERDWICK_REDIS_URL": services.redis_url,
           "HERDWICK_KEY_PREFIX": key_prefix, "HERDWICK_DEV_DIR": str(tmp_path / "dev"),
           "HERDWICK_ADMIN_TOKEN": secrets.token_urlsafe(24), "API_KEY": tenant.api_key}
    reader = Reader(env=env, workdir=workdir)
    try:
        for block in sh:
            for command in commands(block):
                await reader.run(command, f"{document.name}:{block.line}")
    finally:
        await reader.stop_all()
    assert reader.ran, shlex.join(reader.ran)
