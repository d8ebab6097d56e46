"""Reading crontabs, and comparing fire times (herdwick/crontab.py): pure, no services."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from herdwick import crontab

EVERY_CONSTRUCT = """\
# nightly jobs of the billing host
SHELL=/bin/bash
MAILTO="ops@example.com"
PATH = /usr/local/bin:/usr/bin

*/15 * * * * /usr/bin/poll --quiet
CRON_TZ=Europe/London
30 1 * * MON-FRI /usr/bin/report --day yesterday > /tmp/r.log 2>&1
\t@daily\t/usr/bin/rotate-logs
@midnight /usr/bin/midnight
@hourly echo tick
@weekly /usr/bin/weekly
@monthly /usr/bin/monthly
@yearly /usr/bin/yearly
@annually /usr/bin/annually
TZ=America/New_York
0 9 * * * mail -s hello ops%Dear ops,%all is 100\\% well
@reboot /usr/bin/start-agent
61 * * * * /usr/bin/bad-minute
0 9 * * /usr/bin/too-few-fields
@fortnightly /usr/bin/nope
0 0 30 2 * /usr/bin/never
5 4 * * sun
CRON_TZ='Mars/Olympus'
0 0 * * * /usr/bin/on-mars
CRON_TZ=Asia/Tokyo
0 0 1 * * /usr/bin/month-start
"""


def test_every_construct_and_every_broken_line() -> None:
    parsed = crontab.parse(EVERY_CONSTRUCT)
    got = {e.line: (e.cron, e.tz, e.command) for e in parsed.entries}
    assert got == {
        6: ("*/15 * * * *", "UTC", "/usr/bin/poll --quiet"),
        8: ("30 1 * * MON-FRI", "Europe/London",
            "/usr/bin/report --day yesterday > /tmp/r.log 2>&1"),
        9: ("@daily", "Europe/London", "/usr/bin/rotate-logs"),
        10: ("@midnight", "Europe/London", "/usr/bin/midnight"),
        11: ("@hourly", "Europe/London", "echo tick"),
        12: ("@weekly", "Europe/London", "/usr/bin/weekly"),
        13: ("@monthly", "Europe/London", "/usr/bin/monthly"),
        14: ("@yearly", "Europe/London", "/usr/bin/yearly"),
        15: ("@annually", "Europe/London", "/usr/bin/annually"),
        # TZ= after CRON_TZ= goes into the environment; the zone stays CRON_TZ's
        17: ("0 9 * * *", "Europe/London", "mail -s hello ops"),
        27: ("0 0 1 * *", "Asia/Tokyo", "/usr/bin/month-start"),
    }
    by_line = {e.line: e for e in parsed.entries}
    assert by_line[6].env == {"SHELL": "/bin/bash", "MAILTO": "ops@example.com",
                              "PATH": "/usr/local/bin:/usr/bin"}
    assert by_line[17].env["TZ"] == "America/New_York"
    assert "CRON_TZ" not in by_line[17].env
    assert by_line[17].stdin == "Dear ops,\nall is 100% well"
    assert by_line[6].stdin is None and by_line[6].user is None

    refused = {r.line: r.reason for r in parsed.refused}
    assert set(refused) == {18, 19, 20, 21, 22, 23, 25}
    assert "@reboot" in refused[18] and "not carried over" in refused[18]
    assert "minute" in refused[19]
    assert "five time fields" in refused[20]
    assert "@fortnightly" in refused[21]
    assert "never" in refused[22]
    assert "five time fields" in refused[23]  # "sun" is its fifth field: no command
    assert "Mars/Olympus" in refused[25] and "line 24" in refused[25]


def test_a_system_crontab_names_a_user_before_the_command() -> None:
    parsed = crontab.parse("17 * * * * root cd / && run-parts --report /etc/cron.hourly\n"
                           "@daily backup /usr/bin/backup --all\n"
                           "25 6 * * *\n"
                           "25 6 * * * 9lives /bin/true\n", system=True)
    assert [(e.line, e.user, e.command) for e in parsed.entries] == [
        (1, "root", "cd / && run-parts --report /etc/cron.hourly"),
        (2, "backup", "/usr/bin/backup --all")]
    assert [r.line for r in parsed.refused] == [3, 4]


def test_an_entry_s_digest_ignores_its_line_but_not_what_it_runs() -> None:
    a = crontab.parse("0 9 * * * /usr/bin/report\n").entries[0]
    moved = crontab.parse("\n\n# moved down\n0 9 * * * /usr/bin/report\n").entries[0]
    other_env = crontab.parse("X=1\n0 9 * * * /usr/bin/report\n").entries[0]
    assert a.line != moved.line and a.digest("app") == moved.digest("app")
    assert a.digest("app") != other_env.digest("app")
    assert a.digest("app") != a.digest("other-source")


def _t(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(UTC)


def test_compare_finds_the_shifted_and_the_missing_run_across_spring_forward() -> None:
    """Europe/London springs forward at 01:00 GMT on 2027-03-28: 01:30 does not exist that
    night. herdwick runs it at the first instant after the gap (02:00 BST, 01:00Z); the
    old cron ran it at 02:30 BST (01:30Z) and, on the 29th, not at all. The dry run
    recorded every night but the 29th's (its scheduler was down)."""
    [entry] = crontab.parse("CRON_TZ=Europe/London\n30 1 * * * /usr/bin/report\n").entries
    since, until = _t("2027-03-26T00:00:00Z"), _t("2027-03-31T00:00:00Z")
    expected = crontab.expected_fires(entry, since, until)
    assert expected == [_t(t) for t in ("2027-03-26T01:30:00Z", "2027-03-27T01:30:00Z",
                                        "2027-03-28T01:00:00Z", "2027-03-29T00:30:00Z",
                                        "2027-03-30T00:30:00Z")]
    recorded = [t for t in expected if t != _t("2027-03-29T00:30:00Z")]
    log = crontab.parse_log("# old cron's runs\n"
                            "2027-03-26T01:30:00+00:00 2\n2027-03-27T01:30:00Z 2\n"
                            "2027-03-28T02:30:00+01:00 2\n2027-03-30T01:30:00+01:00 2\n")

    against_crontab = crontab.compare(expected, recorded)
    assert (against_crontab.agree, against_crontab.missing) == (4, [_t("2027-03-29T00:30:00Z")])
    assert against_crontab.extra == [] and against_crontab.shifted == []

    against_log = crontab.compare(log[2], recorded)
    assert against_log.agree == 3 and against_log.missing == [] and against_log.extra == []
    [shifted] = against_log.shifted
    assert (shifted.expected, shifted.actual, shifted.by_s) == (
        _t("2027-03-28T01:30:00Z"), _t("2027-03-28T01:00:00Z"), -1800)
    report = crontab.report("line 2", "log", against_log)
    assert report[0] == "line 2: recorded vs log: 3 agree, 1 shifted"
    assert "2027-03-28T01:30:00Z in the log, recorded 2027-03-28T01:00:00Z (-1800 s)" \
        in report[1]
    missing = crontab.report("line 2", "crontab", against_crontab)
    assert missing[1].startswith("  missing  2027-03-29T00:30:00Z")


def test_a_run_too_far_off_is_missing_and_extra_and_a_double_run_is_extra() -> None:
    noon, late = _t("2027-01-01T12:00:00Z"), _t("2027-01-01T18:00:00Z")
    far = crontab.compare([noon], [late], shift_s=3600)
    assert (far.missing, far.extra, far.shifted) == ([noon], [late], [])
    twice = crontab.compare([noon], [noon, noon])
    assert (twice.agree, twice.extra) == (1, [noon])
    assert crontab.compare([noon], [noon]).same


@pytest.mark.parametrize("bad", ["2027-01-01T00:00:00 3", "yesterday 3", "2027-01-01T00:00Z",
                                 "2027-01-01T00:00:00Z three"])
def test_a_bad_log_line_is_named(bad: str) -> None:
    with pytest.raises(crontab.LogError, match="log line 2"):
        crontab.parse_log("2027-01-01T00:00:00Z 1\n" + bad + "\n")
