"""Log lines: the text form any handler shows, and one JSON object a line."""

from __future__ import annotations

import io
import json
import logging
import uuid

import pytest

from herdwick import logs


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_text_lines_quote_what_would_split_them(restore_logging) -> None:
    out = io.StringIO()
    logs.configure("info", "text", out)
    logs.get("herdwick.test").info("report_failed", execution_id="e1", error="boom: a=b",
                                   tries=2)
    line = out.getvalue().strip()
    assert line.endswith('INFO herdwick.test event=report_failed execution_id=e1 '
                         'error="boom: a=b" tries=2')


def test_json_lines_carry_the_fields_ids_and_traceback(restore_logging) -> None:
    out = io.StringIO()
    logs.configure("debug", "json", out)
    job_id = uuid.uuid4()
    log = logs.get("herdwick.test")
    try:
        raise RuntimeError("bad row")
    except RuntimeError:
        log.exception("row_rejected", job_id=job_id, tenant_id="t1", count=3)
    logging.getLogger("aiohttp.access").warning("plain %s", "text")
    first, second = (json.loads(line) for line in out.getvalue().splitlines())
    assert first["event"] == "row_rejected"
    assert (first["job_id"], first["tenant_id"], first["count"]) == (str(job_id), "t1", 3)
    assert first["level"] == "error" and "RuntimeError: bad row" in first["exc"]
    assert second == {"ts": second["ts"], "level": "warning", "logger": "aiohttp.access",
                      "message": "plain text"}


def test_the_level_filters_and_unknown_settings_are_refused(restore_logging) -> None:
    out = io.StringIO()
    logs.configure("warning", "text", out)
    logs.get("herdwick.test").info("quiet")
    assert out.getvalue() == ""
    with pytest.raises(ValueError, match="HERDWICK_LOG_LEVEL"):
        logs.configure("loud", "text", out)
    with pytest.raises(ValueError, match="HERDWICK_LOG_FORMAT"):
        logs.configure("info", "xml", out)


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_asyncpg_refilling_its_pool_while_postgres_is_away_is_one_line(restore_logging,
                                                                       fmt) -> None:
    """asyncpg logs a traceback at each retry of its pool's floor; ours is one event line
    with the error (a failover would bury every other line in tracebacks)."""
    out = io.StringIO()
    logs.configure("info", fmt, out)
    try:
        raise ConnectionRefusedError(111, "Connect call failed")
    except ConnectionRefusedError:
        logging.getLogger("asyncpg.pool").warning(
            "Failed to restore the pool connection floor; retrying", exc_info=True)
    [line] = out.getvalue().splitlines()
    if fmt == "text":
        assert "WARNING asyncpg.pool event=postgres_pool_refill_failed error=" in line
        assert "Connect call failed" in line
    else:
        got = json.loads(line)
        assert got["event"] == "postgres_pool_refill_failed" and "exc" not in got
        assert "ConnectionRefusedError" in got["error"]
