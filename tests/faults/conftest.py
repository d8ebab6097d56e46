"""Each fault scenario's row goes to a file under pytest's base temp directory as it is
measured (the summary is tests/faults/table.py's); under xdist, a worker's base temp is a
folder of the run's, so it writes to the run's own."""

from __future__ import annotations

import os

import pytest

from tests.faults import harness, table


@pytest.fixture(scope="session", autouse=True)
def fault_table(tmp_path_factory: pytest.TempPathFactory) -> None:
    base = tmp_path_factory.getbasetemp()
    harness.TABLE_FILE = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) \
        / table.NAME
