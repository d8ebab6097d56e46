"""The fault scenarios' table in the terminal summary, so every CI run's output shows it
(CI does not pass -s). Each row also goes to a file under pytest's base temp directory as
it is measured (tests/faults/conftest.py). Under xdist the scenarios run in a worker,
whose base temp is a folder of the run's: it writes the file there, and the summary (in
the controller, which loads only the root conftest) reads it back."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults import harness

NAME = "fault-table.md"
TITLE = "faults (issue 13): one row per scenario"


def _rows(config: pytest.Config) -> tuple[list[str], Path | None]:
    """The rows this process measured, else those its xdist workers wrote."""
    if harness.ROWS:
        return list(harness.ROWS), harness.TABLE_FILE
    factory = getattr(config, "_tmp_path_factory", None)
    path = factory.getbasetemp() / NAME if factory is not None else None
    if path is None or not path.exists():
        return [], None
    return [line for line in path.read_text().splitlines()
            if line.startswith("| ") and line not in (harness.HEADER, harness.RULE)], path


def summarise(terminalreporter, config: pytest.Config) -> None:
    rows, path = _rows(config)
    if not rows:
        return
    terminalreporter.section(TITLE)
    for line in (harness.HEADER, harness.RULE, *rows):
        terminalreporter.write_line(line)
    if path is not None:
        terminalreporter.write_line(f"(also in {path})")
