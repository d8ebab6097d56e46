"""Every declared dependency is used, and the code lints clean: what CI holds us to."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("herdwick", "storage", "actors", "gateway", "loadtest", "lua", "tests")
# Used, but not by an import statement.
USED_WITHOUT_IMPORT = {
    "tzdata": "zoneinfo reads its zone data where the system has none",
    "pytest-asyncio": "the suite's asyncio_mode (pyproject)",
    "pytest-timeout": "the suite's per-test timeout (pyproject)",
    "pytest-xdist": "the suite's two workers (pyproject addopts)",
    "pyyaml": "imported as yaml (tests/docs/test_fleet_compose.py)",
    "ruff": "test_the_code_lints_clean runs it",
    "server": "moto's extra for ThreadedMotoServer, the S3 server tests/integration/"
              "test_retention.py runs",
}


def _imported() -> set[str]:
    names: set[str] = set()
    for folder in SOURCES:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    names.add(node.module.split(".")[0])
    return names


def _declared() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = [*project["dependencies"],
             *(s for extra in project["optional-dependencies"].values() for s in extra)]
    found = []
    for spec in specs:
        name = re.match(r"[A-Za-z0-9_.-]+", spec).group(0)
        found.append(name)
        extras = re.match(r"[A-Za-z0-9_.-]+\[([^\]]+)\]", spec)
        found += extras.group(1).split(",") if extras else []
    return found


def test_every_declared_dependency_is_used() -> None:
    imported = _imported()
    unused = [name for name in _declared()
              if name not in USED_WITHOUT_IMPORT and name.replace("-", "_") not in imported]
    assert unused == []


def test_the_code_lints_clean() -> None:
    lint = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)],
                          capture_output=True, text=True, timeout=120)
    assert lint.returncode == 0, lint.stdout + lint.stderr
