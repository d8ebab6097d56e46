"""herdwick.schedule without DST: cron dialect, H, one-offs, jitter, misfire, retries.

Every expected instant is written out by hand (weekdays from the calendar),
never computed by the code under test. DST lives in test_schedule_dst.py.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from datetime import UTC, datetime, timedelta, timezone

import pytest

from herdwick.model import Schedule
from herdwick.schedule import (
    CATCH_UP_MAX,
    RETRY_CAP_S,
    SKIPPED_MAX,
    CronExpr,
    ScheduleError,
    first_run_at,
    format_utc,
    misfire_plan,
    missed_occurrences,
    next_fire_times,
    parse_cron,
    retry_delay_s,
    validate_zone,
)

JOB_A = uuid.UUID("0b6f3c2e-6f0e-4c1a-9a57-2f7d8d1c0a11")
JOB_B = uuid.UUID("5d0f1f8a-1b0c-4f67-8c0e-6f1a2b3c4d5e")
MANY_JOBS = [uuid.UUID(int=i * 7919 + 1) for i in range(200)]


def z(text: str) -> datetime:
    return datetime.fromisoformat(text)


def zs(*texts: str) -> list[datetime]:
    return [z(text) for text in texts]


def fires(expr: str, after: str, count: int, tz: str | None = None, **kw) -> list[datetime]:
    job_id = kw.pop("job_id", JOB_A)
    return next_fire_times(Schedule(cron=expr, tz=tz, **kw), z(after), count, job_id=job_id)


def h_value(job_id: uuid.UUID, field_index: int) -> int:
    """The H hash as the module docstring specifies it (a stored contract)."""
    digest = hashlib.blake2b(job_id.bytes + bytes([field_index]), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def jitter_ms(job_id: uuid.UUID, jitter_s: int) -> int:
    digest = hashlib.blake2b(job_id.bytes, digest_size=8, person=b"herdwick.jitter").digest()
    return int.from_bytes(digest, "big") % (jitter_s * 1000)


# --- the dialect ----------------------------------------------------------------------


def test_results_are_aware_utc_whole_minutes():
    got = fires("*/7 * * * *", "2026-05-01T10:00:30.5+02:00", 3)
    assert got == zs("2026-05-01T08:07:00Z", "2026-05-01T08:14:00Z", "2026-05-01T08:21:00Z")
    assert all(dt.tzinfo is UTC for dt in got)


def test_after_is_exclusive():
    assert fires("0 9 * * *", "2026-05-01T09:00:00Z", 1) == zs("2026-05-02T09:00:00Z")
    assert fires("0 9 * * *", "2026-05-01T08:59:59.999999Z", 1) == zs("2026-05-01T09:00:00Z")


def test_feb_29_fires_only_in_leap_years():
    assert fires("0 0 29 2 *", "2026-01-01T00:00:00Z", 2) == zs(
        "2028-02-29T00:00:00Z", "2032-02-29T00:00:00Z"
    )
    # 2100 is not a leap year (divisible by 100, not by 400)
    assert fires("0 0 29 2 *", "2096-03-01T00:00:00Z", 1) == zs("2104-02-29T00:00:00Z")


def test_day_of_month_or_day_of_week_when_both_are_restricted():
    # April 2026: Fridays 3, 10, 17, 24; the 13th is a Monday. May: Fri 1, 8, 15; 13th Wed.
    assert fires("0 0 13 * FRI", "2026-04-01T00:00:00Z", 9) == zs(
        "2026-04-03T00:00:00Z", "2026-04-10T00:00:00Z", "2026-04-13T00:00:00Z",
        "2026-04-17T00:00:00Z", "2026-04-24T00:00:00Z", "2026-05-01T00:00:00Z",
        "2026-05-08T00:00:00Z", "2026-05-13T00:00:00Z", "2026-05-15T00:00:00Z",
    )


def test_a_literal_star_leaves_the_other_day_field_alone():
    assert fires("0 0 13 * *", "2026-04-01T00:00:00Z", 2) == zs(
        "2026-04-13T00:00:00Z", "2026-05-13T00:00:00Z"
    )
    assert fires("0 0 * * FRI", "2026-04-01T00:00:00Z", 2) == zs(
        "2026-04-03T00:00:00Z", "2026-04-10T00:00:00Z"
    )


def test_a_day_field_starting_with_star_ands_the_day_fields_as_vixie_does():
    # `*/2` starts with `*`: Vixie sets DOM_STAR, so a day must be odd AND a Monday.
    # January 2026 Mondays: 5, 12, 19, 26; February: 2, 9, 16, 23.
    assert fires("0 0 */2 * MON", "2026-01-01T00:00:00Z", 4) == zs(
        "2026-01-05T00:00:00Z", "2026-01-19T00:00:00Z",
        "2026-02-09T00:00:00Z", "2026-02-23T00:00:00Z",
    )
    # `*,13` starts with `*`: Fridays only (Jan 2026: 2, 9, 16).
    assert fires("0 0 *,13 * FRI", "2026-01-01T00:00:00Z", 3) == zs(
        "2026-01-02T00:00:00Z", "2026-01-09T00:00:00Z", "2026-01-16T00:00:00Z"
    )


def test_a_full_range_is_restricted_so_it_ors():
    # `1-31` and `13,*` do not start with `*`: OR with every day = every day.
    for expr in ("0 0 1-31 * MON", "0 0 13,* * FRI", "0 0 13 * 0-6"):
        assert fires(expr, "2025-12-31T12:00:00Z", 3) == zs(
            "2026-01-01T00:00:00Z", "2026-01-02T00:00:00Z", "2026-01-03T00:00:00Z"
        ), expr


def test_an_impossible_day_of_month_still_fires_on_the_ored_weekday():
    # 31 February never happens, but Mondays in February do (first: 2 Feb 2026).
    assert fires("0 0 31 2 MON", "2026-01-01T00:00:00Z", 2) == zs(
        "2026-02-02T00:00:00Z", "2026-02-09T00:00:00Z"
    )


def test_names_any_case_and_sunday_is_0_and_7():
    # Jan 2026: Fri 2, Mon 5; 1 Jan 2027 is a Friday.
    for expr in ("0 9 * JAN mon-fri", "0 9 * jan MON-FRI", "0 9 * 1 1-5", "0 9 * Jan Mon-Fri"):
        assert fires(expr, "2026-01-01T12:00:00Z", 2) == zs(
            "2026-01-02T09:00:00Z", "2026-01-05T09:00:00Z"
        ), expr
    assert fires("0 9 * JAN MON-FRI", "2026-01-30T12:00:00Z", 1) == zs("2027-01-01T09:00:00Z")
    for expr in ("0 0 * * 0", "0 0 * * 7", "0 0 * * sun", "0 0 * * SUN"):
        assert fires(expr, "2026-01-01T00:00:00Z", 2) == zs(
            "2026-01-04T00:00:00Z", "2026-01-11T00:00:00Z"
        ), expr
    assert fires("0 0 * * 5-7", "2026-01-01T00:00:00Z", 4) == zs(
        "2026-01-02T00:00:00Z", "2026-01-03T00:00:00Z", "2026-01-04T00:00:00Z",
        "2026-01-09T00:00:00Z",
    )
    assert fires("0 0 1 JUN-AUG *", "2026-01-01T00:00:00Z", 4) == zs(
        "2026-06-01T00:00:00Z", "2026-07-01T00:00:00Z", "2026-08-01T00:00:00Z",
        "2027-06-01T00:00:00Z",
    )


def test_lists_ranges_and_steps():
    assert fires("5/20 * * * *", "2026-01-01T00:00:00Z", 4) == zs(
        "2026-01-01T00:05:00Z", "2026-01-01T00:25:00Z", "2026-01-01T00:45:00Z",
        "2026-01-01T01:05:00Z",
    )
    assert fires("10-30/10 3,5 * * *", "2026-01-01T00:00:00Z", 4) == zs(
        "2026-01-01T03:10:00Z", "2026-01-01T03:20:00Z", "2026-01-01T03:30:00Z",
        "2026-01-01T05:10:00Z",
    )
    assert fires("0 0 1 */5 *", "2026-01-01T00:00:00Z", 3) == zs(
        "2026-06-01T00:00:00Z", "2026-11-01T00:00:00Z", "2027-01-01T00:00:00Z"
    )


def test_every_field_accepts_its_edges():
    # Both day fields restricted: the 31st or a Sunday, in December (1 Dec 2026 is a Tuesday).
    assert fires("59 23 31 12 7", "2026-01-01T00:00:00Z", 1) == zs("2026-12-06T23:59:00Z")
    assert fires("59 23 31 12 *", "2026-01-01T00:00:00Z", 1) == zs("2026-12-31T23:59:00Z")
    assert fires("00 00 1 1 0", "2026-01-01T00:00:00Z", 1) == zs("2026-01-04T00:00:00Z")
    assert fires("  0\t0  * *  *  ", "2026-01-01T00:00:00Z", 1) == zs("2026-01-02T00:00:00Z")


@pytest.mark.parametrize(
    ("macro", "first"),
    [
        ("@yearly", "2027-01-01T00:00:00Z"),
        ("@annually", "2027-01-01T00:00:00Z"),
        ("@monthly", "2026-06-01T00:00:00Z"),
        ("@weekly", "2026-05-03T00:00:00Z"),  # 3 May 2026 is a Sunday
        ("@daily", "2026-05-02T00:00:00Z"),
        ("@midnight", "2026-05-02T00:00:00Z"),
        ("@hourly", "2026-05-01T11:00:00Z"),
        ("@DAILY", "2026-05-02T00:00:00Z"),
    ],
)
def test_macros(macro, first):
    assert fires(macro, "2026-05-01T10:30:00Z", 1) == zs(first)


def test_weekly_macro_is_sundays_only():
    assert fires("@weekly", "2026-05-01T10:30:00Z", 2) == zs(
        "2026-05-03T00:00:00Z", "2026-05-10T00:00:00Z"
    )


@pytest.mark.parametrize(
    "expr",
    [
        "", "   ", "* * * *", "* * * * * *", "0 0 1 1 * 2026",
        "60 * * * *", "* 24 * * *", "* * 0 * *", "* * 32 * *", "* * * 0 *", "* * * 13 *",
        "* * * * 8", "-1 * * * *", "0-60 * * * *", "* 0-24 * * *",
        "* * * FOO *", "* * * * FUNDAY", "JAN * * * *", "* MON * * *", "* * * JANUARY *",
        "1,,2 * * * *", ",1 * * * *", "1, * * * *", "* * * * MON,",
        "*/0 * * * *", "*/61 * * * *", "* */25 * * *", "* * * */13 *", "* * * * */8",
        "5-1 * * * *", "* * * * FRI-MON", "1-2-3 * * * *", "* * * * MON-", "*/ * * * *",
        "@reboot", "@fortnightly", "@", "0 0 L * *", "0 0 ? * *", "0 0 * * 1#2", "0 0 15W * *",
        "H(5-1) * * * *", "H(0-60) * * * *", "H/0 * * * *", "h * * * *", "H( * * * *",
        "0 0 30 2 *", "0 0 31 4 *", "0 0 31 2,4,6,9,11 *", "0 0 30,31 FEB *",
        "1.5 * * * *", "\u0661 * * * *",
    ],
)
def test_bad_expressions_are_refused_on_the_cron_field(expr):
    with pytest.raises(ScheduleError) as caught:
        parse_cron(expr, job_id=JOB_A)
    assert caught.value.field == "schedule.cron"
    assert isinstance(caught.value, ValueError)
    assert str(caught.value) == caught.value.message


@pytest.mark.parametrize(
    ("expr", "needle"),
    [
        ("0 0 30 2 *", "never fires"),
        ("0 0 31 4 *", "never fires"),
        ("60 * * * *", "minute 60 out of range 0-59"),
        ("* 24 * * *", "hour 24 out of range 0-23"),
        ("* * 32 * *", "day of month 32 out of range 1-31"),
        ("* * * 13 *", "month 13 out of range 1-12"),
        ("* * * * 8", "day of week 8 out of range 0-7"),
        ("*/0 * * * *", "step 0"),
        ("@reboot", "@reboot"),
        ("* * * *", "expected 5 fields"),
        ("H * * * *", "H needs a job id"),
    ],
)
def test_errors_say_what_is_wrong(expr, needle):
    with pytest.raises(ScheduleError, match=needle):
        parse_cron(expr)


def test_never_fires_detection_is_cheap():
    started = time.perf_counter()
    for minute in range(60):
        for expr in (f"{minute} 0 31 4,6 *", f"{minute} 1 30 2 *", f"{minute} 2 31 2,11 *"):
            with pytest.raises(ScheduleError, match="never fires"):
                parse_cron(expr)
    assert (time.perf_counter() - started) / 180 < 0.001


def test_parse_exposes_the_fields():
    cron = parse_cron("*/20 9-10 13 jan,MAR fri")
    assert isinstance(cron, CronExpr)
    assert cron.minutes == (0, 20, 40)
    assert cron.hours == (9, 10)
    assert cron.days_of_month == frozenset({13})
    assert cron.months == frozenset({1, 3})
    assert cron.days_of_week == frozenset({5})
    assert cron.days_and is False
    assert cron.hour_steps is False
    assert cron.plain == "*/20 9-10 13 jan,MAR fri"
    assert parse_cron("@hourly").plain == "0 * * * *"


@pytest.mark.parametrize(
    ("expr", "steps"),
    [("0 * * * *", True), ("0 */2 * * *", True), ("0 1-5/2 * * *", True), ("0 H/3 * * *", True),
     ("0 1 * * *", False), ("0 1-5 * * *", False), ("0 1,2 * * *", False), ("0 H * * *", False),
     ("* 1 * * *", False), ("@daily", False), ("@hourly", True)],
)
def test_which_hour_fields_run_in_real_time(expr, steps):
    assert parse_cron(expr, job_id=JOB_A).hour_steps is steps


# --- H ---------------------------------------------------------------------------------


def test_h_is_the_documented_hash_of_the_job_id():
    cron = parse_cron("H H H H H", job_id=JOB_A)
    assert cron.minutes == (h_value(JOB_A, 0) % 60,)
    assert cron.hours == (h_value(JOB_A, 1) % 24,)
    assert cron.days_of_month == {1 + h_value(JOB_A, 2) % 28}
    assert cron.months == {1 + h_value(JOB_A, 3) % 12}
    assert cron.days_of_week == {h_value(JOB_A, 4) % 7}
    assert parse_cron("H H H H H", job_id=JOB_A) == cron


def test_h_runs_at_the_hashed_time():
    minute, hour = h_value(JOB_A, 0) % 60, h_value(JOB_A, 1) % 24
    got = fires("H H * * *", "2026-05-01T23:59:00Z", 2, job_id=JOB_A)
    assert got == [datetime(2026, 5, 2, hour, minute, tzinfo=UTC),
                   datetime(2026, 5, 3, hour, minute, tzinfo=UTC)]


def test_h_stays_in_range_and_spreads_across_jobs():
    minutes, days = set(), set()
    for job_id in MANY_JOBS:
        cron = parse_cron("H H H * H", job_id=job_id)
        (minute,), (hour,) = cron.minutes, cron.hours
        (dom,), (dow,) = cron.days_of_month, cron.days_of_week
        assert 0 <= minute <= 59 and 0 <= hour <= 23
        assert 1 <= dom <= 28 and 0 <= dow <= 6
        minutes.add(minute)
        days.add(dom)
    assert len(minutes) > 40 and len(days) > 20


def test_h_steps_and_ranges():
    starts = set()
    for job_id in MANY_JOBS:
        quarter = parse_cron("H/15 * * * *", job_id=job_id)
        start = quarter.minutes[0]
        assert quarter.minutes == (start, start + 15, start + 30, start + 45)
        assert quarter.plain == f"{start}-59/15 * * * *"
        starts.add(start)
        ranged = parse_cron("H(0-29)/10 H(9-17) * * *", job_id=job_id)
        first = ranged.minutes[0]
        assert 0 <= first <= 9 and ranged.minutes == (first, first + 10, first + 20)
        assert 9 <= ranged.hours[0] <= 17
        assert ranged.hour_steps is False
    assert len(starts) == 15


def test_h_differs_between_jobs_and_fields():
    a = parse_cron("H H * * *", job_id=JOB_A)
    b = parse_cron("H H * * *", job_id=JOB_B)
    assert (a.minutes, a.hours) != (b.minutes, b.hours)
    assert len({parse_cron("H * * * *", job_id=j).minutes for j in MANY_JOBS[:20]}) > 10


def test_h_answers_are_each_job_s_own_though_kept_for_the_herd():
    """Fire times are kept per expression, zone and second (one herd asks them of every
    job), and per job only where H makes the job matter."""
    after, late = z("2026-05-01T23:59:00Z"), z("2026-05-02T03:00:00Z")
    for job_id in (JOB_A, JOB_B, JOB_A):
        minute, hour = h_value(job_id, 0) % 60, h_value(job_id, 1) % 24
        due = datetime(2026, 5, 2, hour, minute, tzinfo=UTC)
        assert fires("H H * * *", "2026-05-01T23:59:00Z", 1, job_id=job_id) == [due]
        missed = missed_occurrences(Schedule(cron="H H * * *"), after, late + timedelta(days=1),
                                    job_id=job_id)
        assert missed == ([due, due + timedelta(days=1)] if due <= late else [due])


def test_h_needs_a_job_id_but_thu_does_not():
    with pytest.raises(ScheduleError, match="H needs a job id"):
        next_fire_times(Schedule(cron="H * * * *"), z("2026-01-01T00:00:00Z"))
    assert parse_cron("0 0 * * THU").days_of_week == {4}
    # and an expression without H is parsed once for every job
    assert parse_cron("0 0 * * THU", job_id=JOB_A) is parse_cron("0 0 * * THU", job_id=JOB_B)
    # H as one item of a list
    mixed = parse_cron("H,30 * * * *", job_id=JOB_A)
    assert set(mixed.minutes) == {h_value(JOB_A, 0) % 60, 30}
    assert mixed.plain == f"{h_value(JOB_A, 0) % 60},30 * * * *"


def test_an_h_day_that_february_lacks_never_fires():
    # H(29-31) in February only: whichever day the hash picks, February lacks it
    # (29 exists in leap years, so only 30 and 31 fail).
    outcomes = set()
    for job_id in MANY_JOBS[:60]:
        try:
            parse_cron("0 0 H(30-31) 2 *", job_id=job_id)
            outcomes.add("ok")
        except ScheduleError as exc:
            outcomes.add(exc.message)
    assert outcomes == {"never fires: no month has that day"}


# --- zones ----------------------------------------------------------------------------


def test_validate_zone():
    assert validate_zone(None).key == "UTC"
    assert validate_zone("Europe/London").key == "Europe/London"
    assert validate_zone("America/Argentina/Buenos_Aires").key == "America/Argentina/Buenos_Aires"
    assert validate_zone("Etc/GMT+5").key == "Etc/GMT+5"


@pytest.mark.parametrize(
    "tz",
    ["", " ", "Not/AZone", "../etc", "../../etc/passwd", "/etc/passwd", "/usr/share/zoneinfo/UTC",
     "Europe/../Europe/London", "Europe//London", "Europe/London/", "Europe\\London",
     "Europe/London\x00", "America", "localtime", "posixrules", "right/UTC", "posix/UTC",
     "zone.tab", "leapseconds", "UTC ", "+01:00"],
)
def test_bad_zones_are_refused_on_the_tz_field(tz):
    with pytest.raises(ScheduleError) as caught:
        validate_zone(tz)
    assert caught.value.field == "schedule.tz"


def test_a_bad_zone_in_a_schedule():
    with pytest.raises(ScheduleError) as caught:
        next_fire_times(Schedule(cron="0 0 * * *", tz="Mars/Olympus"), z("2026-01-01T00:00:00Z"))
    assert caught.value.field == "schedule.tz"


def test_a_zone_without_dst_shifts_by_its_offset():
    # Asia/Kolkata is +05:30 all year.
    assert fires("0 9 * * *", "2026-07-01T00:00:00Z", 2, tz="Asia/Kolkata") == zs(
        "2026-07-01T03:30:00Z", "2026-07-02T03:30:00Z"
    )


# --- one-offs and first_run_at -----------------------------------------------------


def test_run_at_fires_once_if_after():
    schedule = Schedule(run_at=z("2026-10-16T09:00:00+01:00"))
    assert next_fire_times(schedule, z("2026-10-16T07:59:00Z"), 5) == zs("2026-10-16T08:00:00Z")
    assert next_fire_times(schedule, z("2026-10-16T08:00:00Z")) == []
    assert next_fire_times(schedule, z("2026-10-16T07:00:00Z"), 0) == []


def test_delay_counts_from_after():
    schedule = Schedule(delay_seconds=30.5)
    assert next_fire_times(schedule, z("2026-10-16T08:00:00Z")) == zs("2026-10-16T08:00:30.5Z")


def test_first_run_at_keeps_a_past_run_at():
    schedule = Schedule(run_at=z("2020-01-01T00:00:00Z"))
    assert first_run_at(schedule, z("2026-01-01T00:00:00Z"), job_id=JOB_A) == z(
        "2020-01-01T00:00:00Z"
    )


def test_first_run_at_for_each_kind():
    now = z("2026-05-01T10:30:00Z")
    assert first_run_at(Schedule(delay_seconds=90), now, job_id=JOB_A) == z("2026-05-01T10:31:30Z")
    assert first_run_at(Schedule(cron="0 9 * * MON-FRI", tz="Europe/London"), now,
                        job_id=JOB_A) == z("2026-05-04T08:00:00Z")  # Mon 4 May, BST
    assert first_run_at(Schedule(cron="30 10 * * *"), now, job_id=JOB_A) == z(
        "2026-05-02T10:30:00Z"
    )


@pytest.mark.parametrize(
    ("schedule", "field"),
    [
        (Schedule(), "schedule"),
        (Schedule(run_at=datetime(2026, 1, 1, tzinfo=UTC), delay_seconds=5), "schedule"),
        (Schedule(delay_seconds=5, cron="* * * * *"), "schedule"),
        (Schedule(run_at=datetime(2026, 1, 1, tzinfo=UTC), cron="* * * * *"), "schedule"),
        (Schedule(delay_seconds=5, tz="Europe/London"), "schedule.tz"),
        (Schedule(delay_seconds=5, overlap="forbid"), "schedule.overlap"),
        (Schedule(run_at=datetime(2026, 1, 1, tzinfo=UTC), misfire="catch_up"),
         "schedule.misfire"),
        (Schedule(delay_seconds=-1), "schedule.delaySeconds"),
        (Schedule(delay_seconds=float("nan")), "schedule.delaySeconds"),
        (Schedule(run_at=datetime(2026, 1, 1)), "schedule.runAt"),
        (Schedule(cron="0 0 30 2 *"), "schedule.cron"),
        (Schedule(cron="0 0 * * *", tz="Europe/Londres"), "schedule.tz"),
        (Schedule(delay_seconds=5, jitter_seconds=-1), "schedule.jitterSeconds"),
    ],
)
def test_first_run_at_validates(schedule, field):
    with pytest.raises(ScheduleError) as caught:
        first_run_at(schedule, z("2026-01-01T00:00:00Z"), job_id=JOB_A)
    assert caught.value.field == field


def test_tz_and_policies_are_fine_on_cron():
    schedule = Schedule(cron="0 0 * * *", tz="Europe/London", overlap="forbid",
                        misfire="catch_up")
    assert first_run_at(schedule, z("2026-01-01T12:00:00Z"), job_id=JOB_A) == z(
        "2026-01-02T00:00:00Z"
    )


def test_naive_times_are_refused():
    with pytest.raises(TypeError):
        next_fire_times(Schedule(cron="* * * * *"), datetime(2026, 1, 1))
    with pytest.raises(TypeError):
        first_run_at(Schedule(delay_seconds=1), datetime(2026, 1, 1), job_id=JOB_A)
    with pytest.raises(TypeError):
        format_utc(datetime(2026, 1, 1))


# --- jitter ---------------------------------------------------------------------------


def test_jitter_is_one_stable_offset_per_job():
    offset = timedelta(milliseconds=jitter_ms(JOB_A, 300))
    got = fires("0 * * * *", "2026-05-01T09:59:00Z", 3, jitter_seconds=300, job_id=JOB_A)
    assert got == [z("2026-05-01T10:00:00Z") + offset, z("2026-05-01T11:00:00Z") + offset,
                   z("2026-05-01T12:00:00Z") + offset]
    again = fires("0 * * * *", "2026-05-01T09:59:00Z", 3, jitter_seconds=300, job_id=JOB_A)
    assert again == got


def test_jitter_stays_in_the_window_and_spreads_jobs():
    offsets = set()
    for job_id in MANY_JOBS:
        (got,) = fires("0 10 * * *", "2026-05-01T09:00:00Z", 1, jitter_seconds=60, job_id=job_id)
        offset = got - z("2026-05-01T10:00:00Z")
        assert timedelta(0) <= offset < timedelta(seconds=60)
        assert offset.microseconds % 1000 == 0
        offsets.add(offset)
    assert len(offsets) > 190


def test_jitter_returns_the_next_jittered_time_after():
    offset = timedelta(milliseconds=jitter_ms(JOB_A, 600))
    nominal = z("2026-05-01T10:00:00Z")
    schedule = Schedule(cron="0 * * * *", jitter_seconds=600)
    just_before = nominal + offset - timedelta(milliseconds=1)
    assert next_fire_times(schedule, just_before, job_id=JOB_A) == [nominal + offset]
    assert next_fire_times(schedule, nominal + offset, job_id=JOB_A) == [
        nominal + timedelta(hours=1) + offset
    ]


def test_jitter_on_one_offs():
    offset = timedelta(milliseconds=jitter_ms(JOB_B, 30))
    run_at = Schedule(run_at=z("2026-05-01T10:00:00Z"), jitter_seconds=30)
    assert first_run_at(run_at, z("2026-01-01T00:00:00Z"), job_id=JOB_B) == (
        z("2026-05-01T10:00:00Z") + offset
    )
    delay = Schedule(delay_seconds=10, jitter_seconds=30)
    assert next_fire_times(delay, z("2026-05-01T10:00:00Z"), job_id=JOB_B) == [
        z("2026-05-01T10:00:10Z") + offset
    ]


def test_jitter_needs_a_job_id():
    with pytest.raises(ScheduleError) as caught:
        next_fire_times(Schedule(cron="* * * * *", jitter_seconds=5), z("2026-01-01T00:00:00Z"))
    assert caught.value.field == "schedule.jitterSeconds"


# --- counts and speed -----------------------------------------------------------------


def test_a_thousand_fire_times_quickly():
    started = time.perf_counter()
    got = fires("* * * * *", "2026-03-28T12:00:00Z", 1000, tz="Europe/London")
    assert len(got) == 1000
    assert got[0] == z("2026-03-28T12:01:00Z")
    assert got[-1] == z("2026-03-29T04:40:00Z")  # 1000 real minutes, gap or not
    assert time.perf_counter() - started < 0.25


def test_the_hot_path_is_fast():
    schedule = Schedule(cron="*/5 9-17 * * MON-FRI", tz="America/New_York")
    after = z("2026-06-03T12:00:00Z")
    started = time.perf_counter()
    for _ in range(2000):
        next_fire_times(schedule, after)
    assert (time.perf_counter() - started) / 2000 < 0.0005


# --- missed occurrences and misfire ---------------------------------------------------


def test_missed_occurrences_include_last_due_and_now():
    schedule = Schedule(cron="*/5 * * * *")
    got = missed_occurrences(schedule, z("2026-05-01T10:00:00Z"), z("2026-05-01T10:20:00Z"),
                             job_id=JOB_A)
    assert got == zs("2026-05-01T10:00:00Z", "2026-05-01T10:05:00Z", "2026-05-01T10:10:00Z",
                     "2026-05-01T10:15:00Z", "2026-05-01T10:20:00Z")
    assert missed_occurrences(schedule, z("2026-05-01T10:00:00Z"), z("2026-05-01T10:20:00Z"),
                              job_id=JOB_A, limit=2) == zs(
        "2026-05-01T10:15:00Z", "2026-05-01T10:20:00Z"
    )
    assert missed_occurrences(schedule, z("2026-05-01T10:21:00Z"), z("2026-05-01T10:20:00Z"),
                              job_id=JOB_A) == []


def test_missed_occurrences_with_jitter_and_one_offs():
    offset = timedelta(milliseconds=jitter_ms(JOB_A, 120))
    schedule = Schedule(cron="0 * * * *", jitter_seconds=120)
    got = missed_occurrences(schedule, z("2026-05-01T10:00:00Z") + offset,
                             z("2026-05-01T12:00:00Z") + offset, job_id=JOB_A)
    assert got == [z("2026-05-01T10:00:00Z") + offset, z("2026-05-01T11:00:00Z") + offset,
                   z("2026-05-01T12:00:00Z") + offset]
    once = Schedule(run_at=z("2026-05-01T10:00:00Z"))
    assert missed_occurrences(once, z("2026-05-01T10:00:00Z"), z("2026-05-03T00:00:00Z"),
                              job_id=JOB_A) == zs("2026-05-01T10:00:00Z")


def test_misfire_skip_runs_the_latest_and_skips_the_rest():
    schedule = Schedule(cron="*/5 * * * *")
    run, skipped = misfire_plan(schedule, z("2026-05-01T10:00:00Z"), z("2026-05-01T10:22:00Z"),
                                job_id=JOB_A)
    assert run == zs("2026-05-01T10:20:00Z")
    assert skipped == zs("2026-05-01T10:00:00Z", "2026-05-01T10:05:00Z", "2026-05-01T10:10:00Z",
                         "2026-05-01T10:15:00Z")


def test_misfire_catch_up_runs_each():
    schedule = Schedule(cron="*/5 * * * *", misfire="catch_up")
    run, skipped = misfire_plan(schedule, z("2026-05-01T10:00:00Z"), z("2026-05-01T10:22:00Z"),
                                job_id=JOB_A)
    assert run == zs("2026-05-01T10:00:00Z", "2026-05-01T10:05:00Z", "2026-05-01T10:10:00Z",
                     "2026-05-01T10:15:00Z", "2026-05-01T10:20:00Z")
    assert skipped == []


def test_misfire_caps_at_100_most_recent():
    # 00:00 .. 05:00 every minute is 301 occurrences.
    last_due, now = z("2026-01-01T00:00:00Z"), z("2026-01-01T05:00:00Z")
    run, skipped = misfire_plan(Schedule(cron="* * * * *", misfire="catch_up"), last_due, now,
                                job_id=JOB_A)
    assert CATCH_UP_MAX == SKIPPED_MAX == 100
    assert len(run) == 100 and run[0] == z("2026-01-01T03:21:00Z") and run[-1] == now
    assert len(skipped) == 100
    assert skipped[0] == z("2026-01-01T01:41:00Z") and skipped[-1] == z("2026-01-01T03:20:00Z")
    run, skipped = misfire_plan(Schedule(cron="* * * * *"), last_due, now, job_id=JOB_A)
    assert run == [now]
    assert len(skipped) == 100
    assert skipped[0] == z("2026-01-01T03:20:00Z") and skipped[-1] == z("2026-01-01T04:59:00Z")


def test_misfire_after_years_of_downtime_is_bounded_and_fast():
    started = time.perf_counter()
    run, skipped = misfire_plan(Schedule(cron="* * * * *", tz="Europe/London",
                                         misfire="catch_up"),
                                z("2019-01-01T00:00:00Z"), z("2026-01-01T00:00:00Z"),
                                job_id=JOB_A)
    assert len(run) == 100 and len(skipped) == 100
    assert run[-1] == z("2026-01-01T00:00:00Z")
    assert skipped[0] == z("2025-12-31T20:41:00Z")
    assert time.perf_counter() - started < 0.1


def test_misfire_with_nothing_missed():
    assert misfire_plan(Schedule(cron="0 0 1 1 *"), z("2026-01-02T00:00:00Z"),
                        z("2026-06-01T00:00:00Z"), job_id=JOB_A) == ([], [])


def test_misfire_of_a_yearly_job_over_a_decade():
    run, skipped = misfire_plan(Schedule(cron="@yearly"), z("2016-01-01T00:00:00Z"),
                                z("2026-06-01T00:00:00Z"), job_id=JOB_A)
    assert run == zs("2026-01-01T00:00:00Z")
    assert skipped == [datetime(year, 1, 1, tzinfo=UTC) for year in range(2016, 2026)]


# --- retry delay ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("attempt", "backoff_s", "low", "high"),
    [(1, 10, 5, 10), (2, 10, 10, 20), (3, 10, 20, 40), (1, 0.5, 0.25, 0.5),
     (9, 10, 1280, 2560), (10, 10, 1800, 3600), (1, 86400, 1800, 3600), (1, 0, 0, 0)],
)
def test_retry_delay_bounds(attempt, backoff_s, low, high):
    assert retry_delay_s(attempt, backoff_s, 0.0) == low
    assert retry_delay_s(attempt, backoff_s, 0.5) == pytest.approx((low + high) / 2)
    top = retry_delay_s(attempt, backoff_s, 0.999999)
    assert low <= top <= high
    assert top == pytest.approx(high, rel=1e-5, abs=1e-9)


def test_retry_delay_caps_at_an_hour_without_overflow():
    assert RETRY_CAP_S == 3600
    for attempt in (12, 100, 1024, 1025, 10_000, 10**9):
        assert retry_delay_s(attempt, 10, 0.0) == 1800
        assert retry_delay_s(attempt, 10, 0.999) < 3600


@pytest.mark.parametrize(("attempt", "backoff_s", "rand"),
                         [(0, 10, 0.5), (1, -1, 0.5), (1, 10, 1.0), (1, 10, -0.1),
                          (1, float("inf"), 0.5)])
def test_retry_delay_refuses_bad_input(attempt, backoff_s, rand):
    with pytest.raises(ValueError):
        retry_delay_s(attempt, backoff_s, rand)


# --- formatting -----------------------------------------------------------------------


def test_format_utc():
    assert format_utc(datetime(2026, 3, 29, 1, 0, tzinfo=UTC)) == "2026-03-29T01:00:00Z"
    assert format_utc(datetime(2026, 3, 29, 1, 0, 0, 250_000, tzinfo=UTC)) == (
        "2026-03-29T01:00:00.250Z"
    )
    assert format_utc(datetime(2026, 3, 29, 2, 0, tzinfo=timezone(timedelta(hours=1)))) == (
        "2026-03-29T01:00:00Z"
    )
    assert format_utc(datetime(2026, 3, 29, 1, 0, 0, 1_000, tzinfo=UTC)) == (
        "2026-03-29T01:00:00.001Z"
    )
    assert format_utc(datetime(2026, 3, 29, 1, 0, 0, 123_456, tzinfo=UTC)) == (
        "2026-03-29T01:00:00.123456Z"
    )
    assert format_utc(datetime(999, 1, 2, 3, 4, 5, tzinfo=UTC)) == "0999-01-02T03:04:05Z"
