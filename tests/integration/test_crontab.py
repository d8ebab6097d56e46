"""`herdwick crontab import` and `compare` end to end: the CLI against a real gateway,
a scheduler recording dry runs on the fake clock."""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta

import pytest

from herdwick import cli
from herdwick import schedule as sched
from tests.conftest import T0
from tests.integration.conftest import Api
from tests.integration.stack import advance, ready

CRONTAB = """\
MAILTO=ops@example.com
* * * * * /usr/bin/poll --quiet
*/2 * * * * /usr/bin/report%day=today
@reboot /usr/bin/start-agent
61 * * * * /usr/bin/bad-minute
"""


@pytest.fixture(autouse=True)
def _logging_put_back():
    """cli.main routes every logger to its own stderr handler (logs.configure): put back
    the handlers it replaced, so no later test logs to this test's closed capture."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


async def _cli(capsys, *argv: str) -> tuple[int, str]:
    code = await asyncio.to_thread(cli.main, list(argv))
    return code, capsys.readouterr().out


def _gateway(api: Api) -> list[str]:
    return ["--api-url", str(api.client.make_url("")).rstrip("/"), "--api-key", api.key]


async def test_import_twice_creates_once_and_reports_what_it_cannot_carry(
        api: Api, tmp_path, capsys) -> None:
    path = tmp_path / "billing.crontab"
    path.write_text(CRONTAB)
    code, out = await _cli(capsys, "crontab", "import", str(path), "--target", "emails",
                           "--dry-run", *_gateway(api))
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0].startswith("line 2: created ")
    assert lines[1].startswith("line 3: created ")
    assert lines[2].startswith("line 4: not carried over: @reboot")
    assert lines[3].startswith("line 5: not carried over: '61 * * * *'")
    assert lines[4] == "created 2, already there 0, not carried over 2"

    resp = await api.client.get("/v1/jobs?label=crontab:billing.crontab", headers=api.auth())
    jobs = {j["name"]: j for j in (await resp.json())["items"]}
    assert set(jobs) == {"/usr/bin/poll --quiet", "/usr/bin/report"}
    report = jobs["/usr/bin/report"]
    assert report["dryRun"] is True
    assert report["schedule"]["cron"] == "*/2 * * * *" and report["schedule"]["tz"] == "UTC"
    assert report["target"] == {"type": "queue", "ref": "emails"}
    assert report["payload"] == {"command": "/usr/bin/report", "stdin": "day=today",
                                 "env": {"MAILTO": "ops@example.com"},
                                 "crontab": {"source": "billing.crontab", "line": 3}}

    # Again, with a line moved down: nothing new.
    path.write_text("# moved\n" + CRONTAB)
    code, out = await _cli(capsys, "crontab", "import", str(path), "--target", "emails",
                           *_gateway(api))
    assert code == 0 and out.splitlines()[-1] == \
        "created 0, already there 2, not carried over 2"
    resp = await api.client.get("/v1/jobs", headers=api.auth())
    assert len((await resp.json())["items"]) == 2


async def test_import_without_a_key_or_a_reachable_gateway_fails(api: Api, tmp_path,
                                                                capsys) -> None:
    path = tmp_path / "c"
    path.write_text(CRONTAB)
    code, _ = await _cli(capsys, "crontab", "import", str(path), "--target", "emails",
                         "--api-key", "", "--api-url", "http://127.0.0.1:9")
    assert code == 2
    code, out = await _cli(capsys, "crontab", "import", str(path), "--target", "emails",
                           "--api-url", str(api.client.make_url("")), "--api-key", "hwk_bad")
    assert code == 1 and "401" in out
    code, _ = await _cli(capsys, "crontab", "compare", str(path), "--since", "yesterday",
                         "--until", "2027-01-01T00:00:00Z", *_gateway(api))
    assert code == 2


async def test_compare_agrees_with_the_dry_runs_and_finds_what_the_log_lacks(
        api: Api, schedulers, redis_client, key_prefix, clock, tmp_path, capsys) -> None:
    path = tmp_path / "billing.crontab"
    path.write_text(CRONTAB)
    assert (await _cli(capsys, "crontab", "import", str(path), "--target", "emails",
                       "--dry-run", *_gateway(api)))[0] == 0
    node = await schedulers()
    for _ in range(4):
        await advance(clock, 60, node)
        await node.settle()
    assert await ready(redis_client, key_prefix) == []  # dry: nothing published

    # From just after the import (a job's first fire is after its creation) to :04 included.
    since = sched.format_utc(T0 + timedelta(seconds=1))
    until = sched.format_utc(T0 + timedelta(minutes=4, seconds=1))
    minute = [sched.format_utc(T0 + timedelta(minutes=m)) for m in range(1, 5)]
    log = tmp_path / "old-cron.log"
    # The old cron: line 2 every minute but the third, line 3 at :02 late by 20 s and :04.
    log.write_text(f"{minute[0]} 2\n{minute[1]} 2\n{minute[3]} 2\n"
                   f"{sched.format_utc(T0 + timedelta(minutes=2, seconds=20))} 3\n"
                   f"{minute[3]} 3\n")
    code, out = await _cli(capsys, "crontab", "compare", str(path), "--since", since,
                           "--until", until, "--log", str(log), *_gateway(api))
    assert code == 0, out
    lines = out.splitlines()
    assert "line 2 (* * * * *, UTC): recorded vs crontab: 4 agree" in lines
    assert "line 3 (*/2 * * * *, UTC): recorded vs crontab: 2 agree" in lines
    assert "line 2 (* * * * *, UTC): recorded vs log: 3 agree, 1 extra" in lines
    assert f"  extra    {minute[2]} (recorded, not in the log)" in lines
    assert "line 3 (*/2 * * * *, UTC): recorded vs log: 1 agree, 1 shifted" in lines
    assert (f"  shifted  {sched.format_utc(T0 + timedelta(minutes=2, seconds=20))} in the "
            f"log, recorded {minute[1]} (-20 s)") in lines
    assert lines[0].startswith("line 4: not carried over: @reboot")
    code, _ = await _cli(capsys, "crontab", "compare", str(path), "--since", since,
                         "--until", until, "--log", str(log), "--strict", *_gateway(api))
    assert code == 1
    code, out = await _cli(capsys, "crontab", "compare", str(path), "--since", since,
                           "--until", until, "--strict", *_gateway(api))
    assert code == 0, out  # against the crontab alone, everything agrees
