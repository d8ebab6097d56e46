"""herdwick.schedule across DST transitions (DESIGN.md "Time").

The rules under test: a wall time in a spring-forward gap runs once at the
first instant after the gap; a fall-back fold runs a fixed-hour expression
once, on the first pass, while a wildcard or step hour runs through both
passes in real time.

Each expected instant below is worked out by hand from the zone's rule in
tzdata 2026 (quoted above each table) and written out in UTC; the comment
next to it gives the local reading. The hypothesis tests at the end compare
against a brute-force oracle that walks real minutes instead of wall times.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from functools import cache
from itertools import pairwise
from zoneinfo import ZoneInfo

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from herdwick.model import Schedule
from herdwick.schedule import ScheduleError, missed_occurrences, next_fire_times

JOB = uuid.UUID("9a1f1c3e-2b4d-4e6f-8a0b-1c2d3e4f5a6b")


def z(text: str) -> datetime:
    return datetime.fromisoformat(text)


def fires(zone: str, expr: str, after: str, count: int) -> list[str]:
    got = next_fire_times(Schedule(cron=expr, tz=zone), z(after), count, job_id=JOB)
    return [dt.strftime("%Y-%m-%dT%H:%MZ") for dt in got]


def check(zone, expr, after, expected):
    assert fires(zone, expr, after, len(expected) + 1)[: len(expected)] == expected
    # and nothing is skipped or repeated just past the last expected instant
    assert fires(zone, expr, after, len(expected)) == expected


# Europe/London: GMT+0 / BST+1, changes at 01:00 UTC on the last Sunday of
# March (01:00 GMT -> 02:00 BST: 2026-03-29, 2027-03-28) and October (02:00 BST
# -> 01:00 GMT: 2026-10-25). In the fold, 01:xx BST = 00:xxZ, 01:xx GMT = 01:xxZ.
LONDON = [
    ("30 1 * * *", "2026-03-28T12:00Z",
     ["2026-03-29T01:00Z",  # 01:30 does not exist -> 02:00 BST
      "2026-03-30T00:30Z", "2026-03-31T00:30Z"]),  # 01:30 BST
    ("0,30 1,2 * * *", "2026-03-28T23:00Z",
     ["2026-03-29T01:00Z",  # 01:00, 01:30 (gap) and 02:00 BST collapse into one run
      "2026-03-29T01:30Z",  # 02:30 BST
      "2026-03-30T00:00Z"]),  # 01:00 BST next day
    ("0 * * * *", "2026-03-28T23:30Z",
     ["2026-03-29T00:00Z",  # 00:00 GMT
      "2026-03-29T01:00Z",  # 01:00 (gap) = 02:00 BST, once
      "2026-03-29T02:00Z"]),  # 03:00 BST
    ("*/15 * * * *", "2026-03-29T00:40Z",
     ["2026-03-29T00:45Z", "2026-03-29T01:00Z", "2026-03-29T01:15Z"]),
    ("30 1 * * *", "2026-10-24T12:00Z",
     ["2026-10-25T00:30Z",  # 01:30 BST, first pass only
      "2026-10-26T01:30Z"]),  # 01:30 GMT
    ("*/15 * * * *", "2026-10-24T23:50Z",
     ["2026-10-25T00:00Z", "2026-10-25T00:15Z", "2026-10-25T00:30Z", "2026-10-25T00:45Z",
      "2026-10-25T01:00Z", "2026-10-25T01:15Z", "2026-10-25T01:30Z", "2026-10-25T01:45Z",
      "2026-10-25T02:00Z"]),  # every 15 real minutes through both passes
    ("0 * * * *", "2026-10-24T22:30Z",
     ["2026-10-24T23:00Z",  # 00:00 BST
      "2026-10-25T00:00Z",  # 01:00 BST
      "2026-10-25T01:00Z",  # 01:00 GMT
      "2026-10-25T02:00Z"]),  # 02:00 GMT
    ("*/20 1 * * *", "2026-10-24T22:30Z",
     ["2026-10-25T00:00Z", "2026-10-25T00:20Z", "2026-10-25T00:40Z",  # first pass only
      "2026-10-26T01:00Z"]),
    ("30 1-3/2 * * *", "2026-10-24T23:00Z",  # a stepped hour: both passes
     ["2026-10-25T00:30Z", "2026-10-25T01:30Z", "2026-10-25T03:30Z"]),
    ("0 1-2 * * *", "2026-10-24T23:00Z",  # a range without a step is a fixed hour
     ["2026-10-25T00:00Z", "2026-10-25T02:00Z"]),
    # `after` inside the fold: first pass (01:50 BST) and second pass (01:10 GMT)
    ("*/30 * * * *", "2026-10-25T00:50Z",
     ["2026-10-25T01:00Z", "2026-10-25T01:30Z", "2026-10-25T02:00Z"]),
    ("*/30 * * * *", "2026-10-25T01:10Z", ["2026-10-25T01:30Z", "2026-10-25T02:00Z"]),
    ("30 1 * * *", "2026-10-25T00:50Z", ["2026-10-26T01:30Z"]),
    ("30 1 * * *", "2027-03-27T12:00Z", ["2027-03-28T01:00Z", "2027-03-29T00:30Z"]),
]

# America/New_York: EST-5 / EDT-4, 02:00 EST -> 03:00 EDT on the 2nd Sunday of
# March (2026-03-08, 2027-03-14, at 07:00Z) and 02:00 EDT -> 01:00 EST on the
# 1st Sunday of November (2026-11-01, 2027-11-07, at 06:00Z).
NEW_YORK = [
    ("30 2 * * *", "2026-03-07T12:00Z", ["2026-03-08T07:00Z", "2026-03-09T06:30Z"]),
    ("0 2 * * *", "2026-03-07T12:00Z", ["2026-03-08T07:00Z", "2026-03-09T06:00Z"]),
    ("30 1 * * *", "2026-10-31T12:00Z",
     ["2026-11-01T05:30Z",  # 01:30 EDT
      "2026-11-02T06:30Z"]),  # 01:30 EST
    ("0 2 * * *", "2026-10-31T12:00Z",  # 02:00 happens once on fold day (EST)
     ["2026-11-01T07:00Z", "2026-11-02T07:00Z"]),
    ("0 * * * *", "2026-11-01T04:30Z",
     ["2026-11-01T05:00Z", "2026-11-01T06:00Z", "2026-11-01T07:00Z"]),
    ("*/30 * * * *", "2026-11-01T04:50Z",
     ["2026-11-01T05:00Z", "2026-11-01T05:30Z", "2026-11-01T06:00Z", "2026-11-01T06:30Z",
      "2026-11-01T07:00Z"]),
    ("30 2 * * *", "2027-03-13T12:00Z", ["2027-03-14T07:00Z", "2027-03-15T06:30Z"]),
    ("30 1 * * *", "2027-11-06T12:00Z", ["2027-11-07T05:30Z", "2027-11-08T06:30Z"]),
]

# Australia/Lord_Howe: a 30-minute shift. LHST+10:30 / LHDT+11. First Sunday of
# October 02:00 LHST -> 02:30 LHDT (2026-10-04, at 2026-10-03T15:30Z); first
# Sunday of April 02:00 LHDT -> 01:30 LHST (2026-04-05, at 2026-04-04T15:00Z),
# so 01:30-01:59 happens twice.
LORD_HOWE = [
    ("15 2 * * *", "2026-10-03T00:00Z",
     ["2026-10-03T15:30Z",  # 02:15 does not exist -> 02:30 LHDT
      "2026-10-04T15:15Z"]),  # 02:15 LHDT on 5 Oct
    ("*/15 * * * *", "2026-10-03T15:10Z",
     ["2026-10-03T15:15Z",  # 01:45 LHST
      "2026-10-03T15:30Z",  # 02:00, 02:15 (gap) and 02:30 LHDT: once
      "2026-10-03T15:45Z"]),  # 02:45 LHDT
    ("45 1 * * *", "2026-04-04T00:00Z",
     ["2026-04-04T14:45Z",  # 01:45 LHDT on 5 Apr, first pass
      "2026-04-05T15:15Z"]),  # 01:45 LHST on 6 Apr
    ("*/15 * * * *", "2026-04-04T14:20Z",
     ["2026-04-04T14:30Z", "2026-04-04T14:45Z",  # 01:30, 01:45 LHDT
      "2026-04-04T15:00Z", "2026-04-04T15:15Z",  # 01:30, 01:45 LHST
      "2026-04-04T15:30Z"]),  # 02:00 LHST
    ("0 * * * *", "2026-04-04T13:30Z",
     ["2026-04-04T14:00Z",  # 01:00 LHDT: before the fold, once
      "2026-04-04T15:30Z",  # 02:00 LHST
      "2026-04-04T16:30Z"]),
]

# America/Havana: transitions at midnight. Cuba: "Mar Sun>=8 0:00s" and
# "Nov Sun>=1 0:00s". CST-5 / CDT-4. 2026-03-08 00:00 CST -> 01:00 CDT (at
# 05:00Z): midnight does not exist. 2026-11-01 01:00 CDT -> 00:00 CST (at
# 05:00Z): 00:00-00:59 happens twice.
HAVANA = [
    ("0 0 * * *", "2026-03-07T12:00Z",
     ["2026-03-08T05:00Z",  # 00:00 does not exist -> 01:00 CDT
      "2026-03-09T04:00Z"]),  # 00:00 CDT
    ("30 0 8 3 *", "2026-03-01T00:00Z",
     ["2026-03-08T05:00Z",  # 00:30 in the gap
      "2027-03-08T05:30Z"]),  # 2027's change is on 14 March: 00:30 CST
    ("0 0 * * SUN", "2026-03-07T12:00Z", ["2026-03-08T05:00Z", "2026-03-15T04:00Z"]),
    ("59 23 7 3 *", "2026-03-07T12:00Z", ["2026-03-08T04:59Z"]),  # the minute before the gap
    ("0 0 * * *", "2026-10-31T12:00Z",
     ["2026-11-01T04:00Z",  # 00:00 CDT, first pass
      "2026-11-02T05:00Z"]),  # 00:00 CST
    ("*/30 * * * *", "2026-11-01T03:45Z",
     ["2026-11-01T04:00Z", "2026-11-01T04:30Z", "2026-11-01T05:00Z", "2026-11-01T05:30Z",
      "2026-11-01T06:00Z"]),
]

# America/Santiago: -04 / -03. First Sunday of April at 03:00Z: 24:00 -03 ->
# 23:00 -04 on Saturday 2026-04-04 (23:00-23:59 twice). First Sunday of
# September at 04:00Z: 00:00 -04 -> 01:00 -03 on 2026-09-06.
SANTIAGO = [
    ("0 0 6 9 *", "2026-09-01T00:00Z", ["2026-09-06T04:00Z"]),
    ("0 23 * * *", "2026-04-04T12:00Z",
     ["2026-04-05T02:00Z",  # 23:00 -03 (Sat), first pass
      "2026-04-06T03:00Z"]),  # 23:00 -04 (Sun)
    ("30 * * * *", "2026-04-05T01:00Z",
     ["2026-04-05T01:30Z",  # 22:30 -03
      "2026-04-05T02:30Z",  # 23:30 -03
      "2026-04-05T03:30Z",  # 23:30 -04
      "2026-04-05T04:30Z"]),  # 00:30 -04 Sunday
]

# Asia/Beirut: EET+2 / EEST+3, "Mar lastSun 0:00" and "Oct lastSun 0:00":
# 2026-03-29 00:00 -> 01:00 (at 2026-03-28T22:00Z).
BEIRUT = [
    ("0 0 29 3 *", "2026-03-01T00:00Z", ["2026-03-28T22:00Z", "2027-03-28T21:00Z"]),
]

# Australia/Sydney: AEST+10 / AEDT+11. First Sunday of October 02:00 AEST ->
# 03:00 AEDT (2026-10-04, at 2026-10-03T16:00Z); first Sunday of April 03:00
# AEDT -> 02:00 AEST (2026-04-05, at 2026-04-04T16:00Z).
SYDNEY = [
    ("30 2 * * *", "2026-10-03T00:00Z", ["2026-10-03T16:00Z", "2026-10-04T15:30Z"]),
    ("30 2 * * *", "2026-04-04T00:00Z",
     ["2026-04-04T15:30Z",  # 02:30 AEDT, first pass
      "2026-04-05T16:30Z"]),  # 02:30 AEST on 6 Apr
    ("0 * * * *", "2026-04-04T14:30Z",
     ["2026-04-04T15:00Z", "2026-04-04T16:00Z", "2026-04-04T17:00Z"]),
    ("*/15 * * * *", "2026-10-03T15:50Z", ["2026-10-03T16:00Z", "2026-10-03T16:15Z"]),
]

CASES = [
    pytest.param(zone, expr, after, expected, id=f"{zone}|{expr}|{after}")
    for zone, table in [
        ("Europe/London", LONDON), ("America/New_York", NEW_YORK),
        ("Australia/Lord_Howe", LORD_HOWE), ("America/Havana", HAVANA),
        ("America/Santiago", SANTIAGO), ("Asia/Beirut", BEIRUT), ("Australia/Sydney", SYDNEY),
    ]
    for expr, after, expected in table
]


@pytest.mark.parametrize(("zone", "expr", "after", "expected"), CASES)
def test_dst(zone, expr, after, expected):
    check(zone, expr, after, expected)


def test_jitter_moves_a_gap_run_too():
    got = next_fire_times(Schedule(cron="30 1 * * *", tz="Europe/London", jitter_seconds=600),
                          z("2026-03-28T12:00Z"), 1, job_id=JOB)
    assert z("2026-03-29T01:00Z") <= got[0] < z("2026-03-29T01:10Z")


def test_missed_occurrences_across_a_fold():
    schedule = Schedule(cron="*/30 * * * *", tz="Europe/London")
    got = missed_occurrences(schedule, z("2026-10-25T00:00Z"), z("2026-10-25T02:00Z"), job_id=JOB)
    assert [dt.strftime("%H:%M") for dt in got] == ["00:00", "00:30", "01:00", "01:30", "02:00"]
    fixed = Schedule(cron="*/30 1 * * *", tz="Europe/London")
    got = missed_occurrences(fixed, z("2026-10-24T00:00Z"), z("2026-10-25T03:00Z"), job_id=JOB)
    assert [dt.strftime("%d %H:%M") for dt in got] == ["24 00:00", "24 00:30", "25 00:00",
                                                       "25 00:30"]


def test_missed_occurrences_up_to_a_now_in_the_second_pass():
    # now = 01:10 GMT: the first pass's 01:15-01:45 BST (00:15Z-00:45Z) are already past
    now = z("2026-10-25T01:10Z")
    wild = Schedule(cron="*/15 * * * *", tz="Europe/London")
    got = missed_occurrences(wild, z("2026-10-25T00:00Z"), now, job_id=JOB)
    assert [dt.strftime("%H:%M") for dt in got] == ["00:00", "00:15", "00:30", "00:45", "01:00"]
    fixed = Schedule(cron="*/15 1 * * *", tz="Europe/London")
    got = missed_occurrences(fixed, z("2026-10-25T00:00Z"), now, job_id=JOB)
    assert [dt.strftime("%H:%M") for dt in got] == ["00:00", "00:15", "00:30", "00:45"]


def test_missed_occurrences_across_a_gap():
    schedule = Schedule(cron="0,30 1,2 * * *", tz="Europe/London")
    got = missed_occurrences(schedule, z("2026-03-29T00:00Z"), z("2026-03-29T03:00Z"), job_id=JOB)
    assert [dt.strftime("%H:%M") for dt in got] == ["01:00", "01:30"]


# --- hypothesis: a brute-force oracle over real minutes -------------------------------

ZONES = [
    "Europe/London", "Europe/Dublin", "Europe/Berlin", "America/New_York", "America/St_Johns",
    "America/Havana", "America/Santiago", "Asia/Beirut", "Africa/Cairo", "Asia/Jerusalem",
    "Australia/Sydney", "Australia/Lord_Howe", "Pacific/Chatham", "Antarctica/Troll",
    "America/Nuuk", "America/Scoresbysund", "UTC",
]
RANGES = [(0, 59), (0, 23), (1, 31), (1, 12), (0, 6)]
MONTH_NAMES = "JAN FEB MAR APR MAY JUN JUL AUG SEP OCT NOV DEC".split()
DAY_NAMES = "SUN MON TUE WED THU FRI SAT".split()
MAX_DAYS = (0, 31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)
WINDOW = timedelta(days=2)
FAST = settings(max_examples=200, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])


def spell(index: int, value: int, draw, *, seven: bool = True) -> str:
    """Write a value as a number or a name; Sunday may be 7 (not as a range start)."""
    if index == 3 and draw(st.booleans()):
        return MONTH_NAMES[value - 1]
    if index == 4 and value == 0 and seven and draw(st.booleans()):
        return draw(st.sampled_from(["7", "SUN", "sun"]))
    if index == 4 and draw(st.booleans()):
        return DAY_NAMES[value]
    return str(value)


@st.composite
def cron_field(draw, index: int) -> tuple[str, frozenset[int]]:
    lo, hi = RANGES[index]
    kinds = ["star", "value", "list", "range", "step", "range_step"]
    # day fields lean to `*` so that more examples run on a transition's date
    kind = draw(st.sampled_from(kinds + ["star"] * (1 if index < 2 else 4)))
    if kind == "star":
        return "*", frozenset(range(lo, hi + 1))
    if kind == "value":
        value = draw(st.integers(lo, hi))
        return spell(index, value, draw), frozenset({value})
    if kind == "list":
        values = draw(st.lists(st.integers(lo, hi), min_size=2, max_size=4, unique=True))
        return ",".join(spell(index, v, draw) for v in values), frozenset(values)
    start = draw(st.integers(lo, hi))
    end = draw(st.integers(start, hi))
    if kind == "range" and index == 4 and start > 0 and draw(st.booleans()):
        return f"{spell(index, start, draw)}-7", frozenset(range(start, 7)) | {0}  # 7 = Sunday
    if kind == "range":
        text = f"{spell(index, start, draw, seven=False)}-{spell(index, end, draw, seven=False)}"
        return text, frozenset(range(start, end + 1))
    step = draw(st.integers(2, max(2, (hi - lo + 1) // 3)))
    if kind == "step":
        return f"*/{step}", frozenset(range(lo, hi + 1, step))
    return f"{start}-{end}/{step}", frozenset(range(start, end + 1, step))


@st.composite
def cron_exprs(draw):
    fields = [draw(cron_field(index)) for index in range(5)]
    text = " ".join(text for text, _ in fields)
    sets = tuple(values for _, values in fields)
    days_and = fields[2][0].startswith("*") or fields[4][0].startswith("*")
    hour_steps = fields[1][0].startswith("*") or "/" in fields[1][0]
    return text, sets, days_and, hour_steps


@cache
def transitions(zone_name: str) -> tuple[int, ...]:
    """Offset changes in 2024-2030, to the second, found by scanning days then bisecting."""
    zone = ZoneInfo(zone_name)
    found = []
    t = int(datetime(2024, 1, 1, tzinfo=UTC).timestamp())
    end = int(datetime(2031, 1, 1, tzinfo=UTC).timestamp())
    while t < end:
        lo, hi = t, t + 86400
        if offset(zone, lo) != offset(zone, hi):
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if offset(zone, mid) != offset(zone, lo) else (mid, hi)
            found.append(hi)
        t += 86400
    return tuple(found)


def offset(zone: ZoneInfo, t: int) -> timedelta:
    return datetime.fromtimestamp(t, zone).utcoffset()


@st.composite
def afters(draw, zone_name: str, *, near: bool = False) -> datetime:
    """An instant in 2024-2030; with `near` (or half the time), shortly before a transition."""
    marks = transitions(zone_name)
    if marks and (near or draw(st.booleans())):
        base = datetime.fromtimestamp(draw(st.sampled_from(marks)), UTC)
        # days before it (the window then crosses it) or hours around it (inside a fold)
        minutes = st.one_of(st.integers(-40 * 60, 2 * 60), st.integers(-120, 120))
        shift = timedelta(minutes=draw(minutes))
    else:
        base = datetime(2024, 1, 1, tzinfo=UTC)
        shift = timedelta(minutes=draw(st.integers(0, 7 * 365 * 1440)))
    return base + shift + timedelta(microseconds=draw(st.sampled_from([0, 0, 1, 30_000_000])))


def matches(wall: datetime, sets, days_and: bool) -> bool:
    minutes, hours, doms, months, dows = sets
    if wall.minute not in minutes or wall.hour not in hours or wall.month not in months:
        return False
    in_dom, in_dow = wall.day in doms, wall.isoweekday() % 7 in dows
    return (in_dom and in_dow) if days_and else (in_dom or in_dow)


def gap_walls(zone: ZoneInfo, t: datetime) -> list[datetime]:
    """Wall times skipped by a spring-forward transition exactly at t, else []."""
    before, after = offset(zone, int(t.timestamp()) - 1), t.astimezone(zone).utcoffset()
    if after <= before:
        return []
    start = t.astimezone(zone).replace(tzinfo=None) - (after - before)
    return [start + timedelta(minutes=k) for k in range((after - before) // timedelta(minutes=1))]


def oracle(zone: ZoneInfo, sets, days_and, hour_steps, after, end) -> list[datetime]:
    """Walk every real minute in (after, end] and decide whether the job runs then."""
    t = after.replace(second=0, microsecond=0) + timedelta(minutes=1)
    out = []
    while t <= end:
        local = t.astimezone(zone)
        second_pass = local.fold == 1
        runs = matches(local.replace(tzinfo=None), sets, days_and) and (
            hour_steps or not second_pass)
        runs = runs or any(matches(w, sets, days_and) for w in gap_walls(zone, t))
        if runs:
            out.append(t)
        t += timedelta(minutes=1)
    return out


def never_fires(sets, days_and) -> bool:
    _, _, doms, months, _ = sets
    return days_and and not any(d <= MAX_DAYS[m] for m in months for d in doms)


@FAST
@given(data=st.data(), expr=cron_exprs(), zone_name=st.sampled_from(ZONES))
def test_fire_times_agree_with_a_minute_by_minute_oracle(data, expr, zone_name):
    text, sets, days_and, hour_steps = expr
    schedule = Schedule(cron=text, tz=zone_name)
    after = data.draw(afters(zone_name, near=True))
    if never_fires(sets, days_and):
        with pytest.raises(ScheduleError, match="never fires"):
            next_fire_times(schedule, after)
        return
    end = after + WINDOW
    expected = oracle(ZoneInfo(zone_name), sets, days_and, hour_steps, after, end)
    crossed = [t for t in transitions(zone_name) if after.timestamp() < t <= end.timestamp()]
    event("window crosses a transition" if crossed else "window without a transition")
    got = next_fire_times(schedule, after, len(expected) + 1, job_id=JOB)
    assert got[: len(expected)] == expected
    assert len(got) == len(expected) + 1 and got[-1] > end


@FAST
@given(data=st.data(), expr=cron_exprs(), zone_name=st.sampled_from(ZONES))
def test_fire_time_invariants(data, expr, zone_name):
    text, sets, days_and, hour_steps = expr
    if never_fires(sets, days_and):
        return
    zone = ZoneInfo(zone_name)
    after = data.draw(afters(zone_name))
    got = next_fire_times(Schedule(cron=text, tz=zone_name), after, 40, job_id=JOB)
    assert len(got) == 40
    assert all(a < b for a, b in pairwise(got))
    assert got[0] > after
    walls = []
    for t in got:
        assert t.tzinfo is UTC and t.second == 0 and t.microsecond == 0
        wall = t.astimezone(zone).replace(tzinfo=None)
        assert matches(wall, sets, days_and) or any(
            matches(w, sets, days_and) for w in gap_walls(zone, t)), (t, wall)
        walls.append(wall)
    if not hour_steps:
        # a fixed hour never runs the same wall time twice (fold: first pass only)
        assert len(set(walls)) == len(walls)


@FAST
@given(data=st.data(), expr=cron_exprs(), zone_name=st.sampled_from(ZONES),
       jitter_s=st.integers(0, 3600), job_id=st.uuids())
def test_walking_back_finds_what_walking_forward_finds(data, expr, zone_name, jitter_s, job_id):
    text, sets, days_and, _ = expr
    if never_fires(sets, days_and):
        return
    schedule = Schedule(cron=text, tz=zone_name, jitter_seconds=jitter_s)
    last = data.draw(afters(zone_name))
    first = last - timedelta(minutes=data.draw(st.integers(0, 36 * 60)))
    forward = next_fire_times(schedule, first - timedelta(microseconds=1), 2200, job_id=job_id)
    inside = [t for t in forward if first <= t <= last]
    assert len(forward) == 2200 and forward[-1] > last
    back = missed_occurrences(schedule, first, last, job_id=job_id, limit=100)
    assert back == inside[-100:]


def folds(zone_name: str) -> list[tuple[int, int]]:
    """(transition, seconds repeated) for each fall-back in 2024-2030."""
    zone = ZoneInfo(zone_name)
    out = []
    for t in transitions(zone_name):
        repeated = (offset(zone, t - 1) - offset(zone, t)) // timedelta(seconds=1)
        if repeated > 0:
            out.append((t, repeated))
    return out


FOLD_ZONES = [name for name in ZONES if name != "UTC"]


@FAST
@given(data=st.data(), minute=cron_field(0), hour=cron_field(1),
       zone_name=st.sampled_from(FOLD_ZONES))
def test_around_a_fold_forward_and_back(data, minute, hour, zone_name):
    # `after` (and `now`) anywhere from before the first pass to after the second
    (t, repeated), = [data.draw(st.sampled_from(folds(zone_name)))]
    at = t + data.draw(st.integers(-repeated - 1800, repeated + 1800))
    moment = datetime.fromtimestamp(at, UTC)
    text = f"{minute[0]} {hour[0]} * * *"
    sets = (minute[1], hour[1], frozenset(range(1, 32)), frozenset(range(1, 13)),
            frozenset(range(7)))
    hour_steps = hour[0].startswith("*") or "/" in hour[0]
    zone = ZoneInfo(zone_name)
    schedule = Schedule(cron=text, tz=zone_name)

    end = moment + timedelta(hours=6)
    expected = oracle(zone, sets, True, hour_steps, moment, end)
    got = next_fire_times(schedule, moment, len(expected) + 1, job_id=JOB)
    assert got[: len(expected)] == expected and got[-1] > end

    start = moment - timedelta(hours=6)
    just_before = start - timedelta(microseconds=1)
    expected_back = oracle(zone, sets, True, hour_steps, just_before, moment)
    back = missed_occurrences(schedule, start, moment, job_id=JOB, limit=400)
    assert back == expected_back
