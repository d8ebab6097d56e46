"""The fault scenarios' table: each row to a file under pytest's base temp directory as it
is measured, and all of them in the terminal summary, so every CI run's output shows it
(CI does not pass -s)."""

from __future__ import annotations

import pytest

from tests.faults import harness


@pytest.fixture(scope="session", autouse=True)
def fault_table(tmp_path_factory: pytest.TempPathFactory) -> None:
    harness.TABLE_FILE = tmp_path_factory.getbasetemp() / "fault-table.md"


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if not harness.ROWS:
        return
    terminalreporter.section("faults (issue 13): one row per scenario")
    for line in (harness.HEADER, harness.RULE, *harness.ROWS):
        terminalreporter.write_line(line)
    if harness.TABLE_FILE is not None:
        terminalreporter.write_line(f"(also in {harness.TABLE_FILE})")
