"""When a job runs: cron parsing, fire times across DST, jitter, misfire and retry delay.

Everything here is a pure function: no I/O and no clock reads; callers pass
`now` or `after`. Every datetime returned is aware UTC.

Cron dialect: Vixie cron's five fields (minute hour day-of-month month
day-of-week) with ranges, lists, steps, the names JAN-DEC and SUN-SAT (any
case), 0 and 7 both Sunday, the macros @yearly @annually @monthly @weekly
@daily @midnight @hourly (not @reboot), plus two common extensions: `a/n`
means `a-<max>/n` (as croniter reads it) and Jenkins' hashed `H`, `H/n`,
`H(a-b)`, `H(a-b)/n`. A step larger than its field (`*/90` minutes) is refused
rather than silently meaning "once an hour".

Day rule, as Vixie cron implements it (entry.c sets DOM_STAR/DOW_STAR when the
field's first character is `*`; cron.c then ANDs the day fields if either flag
is set and ORs them otherwise): if either day field starts with `*` a day must
match both fields, so a literal `*` leaves the other field alone and
`0 0 */2 * MON` means Mondays that fall on odd dates; if neither starts with
`*` a day matching either field runs, so `0 0 13 * FRI` runs on every 13th and
every Friday, and `0 0 1-31 * MON` runs daily. croniter's default differs for
`*/2`-style fields (it ORs them), which is one reason this module evaluates
expressions itself instead of through croniter.

Time zones (DESIGN.md "Time"): an expression is evaluated on the wall clock of
its IANA zone. A wall time that falls in a spring-forward gap runs at the first
instant after the gap (several gap times collapse into that one run). A wall
time repeated by a fall-back fold runs once, on the first pass, unless the hour
field is a wildcard or a step (starts with `*` or contains `/`): those keep
running in real time through both passes, so `0 * * * *` runs at 01:00 BST and
at 01:00 GMT. Results are strictly increasing and never repeat an instant.

Hashes are part of the stored contract (changing them moves every job):
  H value    = blake2b(job_id.bytes + bytes([field_index]), digest_size=8),
               big-endian, mod the span; field_index 0 = minute ... 4 = day of week.
               Bare H and H/n pick from 1-28 for the day of month (so it fires
               in every month) and 0-6 for the day of week, as Jenkins does.
  jitter ms  = blake2b(job_id.bytes, digest_size=8, person=b"herdwick.jitter"),
               big-endian, mod jitter_seconds * 1000; the same for every
               occurrence of the job.
"""

from __future__ import annotations

import hashlib
import math
import re
import uuid
from bisect import bisect_left, bisect_right
from calendar import monthrange
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from functools import lru_cache
from heapq import heappop, heappush
from itertools import dropwhile, islice, takewhile
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from herdwick.model import Schedule

__all__ = [
    "CATCH_UP_MAX",
    "MISSED_LIMIT_DEFAULT",
    "RETRY_CAP_S",
    "SKIPPED_MAX",
    "CronExpr",
    "ScheduleError",
    "first_run_at",
    "format_utc",
    "misfire_plan",
    "missed_occurrences",
    "next_fire_times",
    "parse_cron",
    "retry_delay_s",
    "validate_zone",
]

RETRY_CAP_S = 3600.0
CATCH_UP_MAX = 100
SKIPPED_MAX = 100
MISSED_LIMIT_DEFAULT = 100

_UTC = UTC
_EPOCH = datetime(1970, 1, 1, tzinfo=_UTC)
_EPOCH_ORDINAL = date(1970, 1, 1).toordinal()
_SECOND = timedelta(seconds=1)
_DAY_S = 86_400
# A fold's second pass revisits wall times behind the current one; look this
# far ahead (or back) for an offset change so those wall times are not missed.
_FOLD_WINDOW_S = 26 * 3600
# Stay a year inside datetime's range so UTC conversions cannot overflow.
_FIRST_YEAR, _LAST_YEAR = 2, 9998
_UTC_KEYS = frozenset({"UTC", "Etc/UTC"})
_CRON_FIELD = "schedule.cron"
_TZ_FIELD = "schedule.tz"


class ScheduleError(ValueError):
    """A schedule that cannot be accepted; `field` names it as the API spells it.

    str() is the message alone, ready for a FieldError(field, message).
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


# --- parsing --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Field:
    name: str
    lo: int
    hi: int  # highest value written (7 for day of week: Sunday again)
    top: int  # where `*` and `a/n` end
    hash_lo: int
    hash_hi: int
    names: tuple[str, ...] = ()  # names[i] is value names_base + i
    names_base: int = 0


_FIELDS = (
    _Field("minute", 0, 59, 59, 0, 59),
    _Field("hour", 0, 23, 23, 0, 23),
    _Field("day of month", 1, 31, 31, 1, 28),
    _Field("month", 1, 12, 12, 1, 12,
           ("JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC"),
           1),
    _Field("day of week", 0, 7, 6, 0, 6, ("SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT")),
)
_MACROS = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
_ITEM = re.compile(
    r"(?:(?P<star>\*)"
    r"|(?P<hash>H)(?:\((?P<hlo>[0-9A-Za-z]+)-(?P<hhi>[0-9A-Za-z]+)\))?"
    r"|(?P<lo>[0-9A-Za-z]+)(?:-(?P<hi>[0-9A-Za-z]+))?)"
    r"(?:/(?P<step>[0-9]+))?"
)
_USES_H = re.compile(r"(?<![A-Za-z])H(?![A-Za-z])")
# Most days a month can have, February counting its leap day.
_MONTH_MAX_DAYS = (0, 31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)


@dataclass(frozen=True, slots=True)
class CronExpr:
    """A parsed cron expression, with any H resolved for one job.

    `plain` is the same schedule as a plain Vixie expression (macro expanded,
    H replaced by numbers or `start-end/step`), e.g. for `herdwick cron`.
    """

    expr: str
    plain: str
    minutes: tuple[int, ...]
    hours: tuple[int, ...]
    days_of_month: frozenset[int]
    months: frozenset[int]
    days_of_week: frozenset[int]  # 0 = Sunday
    days_and: bool  # Vixie: a day field starts with `*`, so a day must match both
    hour_steps: bool  # hour is `*` or a step: runs through both passes of a fold
    minutes_of_day: tuple[int, ...]  # hour * 60 + minute, ascending


def parse_cron(expr: str, *, job_id: uuid.UUID | None = None) -> CronExpr:
    """Parse and validate a 5-field cron expression; H fields hash `job_id`.

    Raises ScheduleError(field "schedule.cron") for a malformed expression, H
    without a job id, or an expression that can never fire (`0 0 30 2 *`).
    Results are cached per expression (and per job when it uses H).
    """
    # Key the cache on the job only when H is used, so `0 9 * * THU` is parsed once.
    return _parse(expr, _seed(expr, job_id))


def _seed(expr: str, job_id: uuid.UUID | None) -> bytes | None:
    return job_id.bytes if job_id is not None and _USES_H.search(expr) else None


# Fields are separated by spaces and tabs only, as /openapi.json's cron pattern says: str.split()
# would also split on a newline, U+0085 or U+2028, and take a name holding them.
_FIELD_SEPARATOR = re.compile(r"[ \t]+")


@lru_cache(maxsize=8192)
def _parse(expr: str, seed: bytes | None) -> CronExpr:
    text = _expand_macro(expr.strip(" \t"))
    parts = _FIELD_SEPARATOR.split(text) if text else []
    if len(parts) != 5:
        raise _cron_error(
            f"expected 5 fields (minute hour day-of-month month day-of-week), got {len(parts)}"
        )
    fields = [_parse_field(text, index, seed) for index, text in enumerate(parts)]
    (minutes, _), (hours, _), (doms, _), (months, _), (dows, _) = fields
    cron = CronExpr(
        expr=expr,
        plain=" ".join(plain for _, plain in fields),
        minutes=tuple(sorted(minutes)),
        hours=tuple(sorted(hours)),
        days_of_month=doms,
        months=months,
        days_of_week=frozenset(dow % 7 for dow in dows),
        days_and=parts[2].startswith("*") or parts[4].startswith("*"),
        hour_steps=parts[1].startswith("*") or "/" in parts[1],
        minutes_of_day=tuple(sorted(h * 60 + m for h in hours for m in minutes)),
    )
    if _never_fires(cron):
        raise _cron_error("never fires: no month has that day")
    return cron


def _cron_error(message: str) -> ScheduleError:
    return ScheduleError(_CRON_FIELD, message)


def _expand_macro(text: str) -> str:
    if not text.startswith("@"):
        return text
    name = text.lower()
    if name == "@reboot":
        raise _cron_error("@reboot is not supported: a job has no boot to run at")
    if name not in _MACROS:
        raise _cron_error(f"unknown macro {text!r}")
    return _MACROS[name]


def _parse_field(text: str, index: int, seed: bytes | None) -> tuple[frozenset[int], str]:
    field = _FIELDS[index]
    values: set[int] = set()
    plains = []
    for item in text.split(","):
        if not item:
            raise _cron_error(f"empty list item in {field.name} {text!r}")
        lo, hi, step, plain = _parse_item(item, field, index, seed)
        values.update(range(lo, hi + 1, step))
        plains.append(plain)
    return frozenset(values), ",".join(plains)


def _parse_item(
    item: str, field: _Field, index: int, seed: bytes | None
) -> tuple[int, int, int, str]:
    """Return (lo, hi, step, plain text) for one list item."""
    match = _ITEM.fullmatch(item)
    if match is None:
        raise _cron_error(f"bad {field.name} {item!r}")
    step = _step(match["step"], field) if match["step"] else None
    if match["hash"]:
        return _hashed(match, field, index, seed, step)
    if match["star"]:
        return field.lo, field.top, step or 1, item
    lo = _value(match["lo"], field)
    hi = _value(match["hi"], field) if match["hi"] else (max(field.top, lo) if step else lo)
    if lo > hi:
        raise _cron_error(f"{field.name} range {item!r} starts after it ends")
    return lo, hi, step or 1, item


def _hashed(
    match: re.Match[str], field: _Field, index: int, seed: bytes | None, step: int | None
) -> tuple[int, int, int, str]:
    if seed is None:
        raise _cron_error("H needs a job id")
    lo, hi = field.hash_lo, field.hash_hi
    if match["hlo"] is not None:
        lo, hi = _value(match["hlo"], field), _value(match["hhi"], field)
        if lo > hi:
            raise _cron_error(f"{field.name} range {match[0]!r} starts after it ends")
    digest = hashlib.blake2b(seed + bytes([index]), digest_size=8).digest()
    hashed = int.from_bytes(digest, "big")
    if step is None:
        value = lo + hashed % (hi - lo + 1)
        return value, value, 1, str(value)
    start = lo + hashed % min(step, hi - lo + 1)
    return start, hi, step, f"{start}-{hi}/{step}"


def _value(token: str, field: _Field) -> int:
    if token.isascii() and token.isdigit():
        value = int(token)
    elif token.upper() in field.names:
        value = field.names.index(token.upper()) + field.names_base
    else:
        raise _cron_error(f"bad {field.name} {token!r}")
    if not field.lo <= value <= field.hi:
        raise _cron_error(f"{field.name} {value} out of range {field.lo}-{field.hi}")
    return value


def _step(token: str, field: _Field) -> int:
    step, span = int(token), field.top - field.lo + 1
    if not 1 <= step <= span:
        raise _cron_error(f"{field.name} step {step} must be 1-{span}")
    return step


def _never_fires(cron: CronExpr) -> bool:
    # ORed day fields always fire (every month has every weekday). ANDed ones
    # fire as soon as some allowed month has an allowed day: each date, Feb 29
    # included, falls on every weekday within a 28-year cycle.
    if not cron.days_and:
        return False
    return not any(
        dom <= _MONTH_MAX_DAYS[month] for month in cron.months for dom in cron.days_of_month
    )


# --- zones ------------------------------------------------------------------------

_ZONE_KEY = re.compile(r"[A-Za-z][A-Za-z0-9_+\-]*(?:/[A-Za-z0-9_+\-]+)*")
# Loadable from the host's zoneinfo directory but not a zone a job may name:
# localtime is whatever the host is set to; posix/ and right/ are copies (right/
# counts leap seconds, which Unix time does not).
_NOT_ZONES = frozenset({"localtime", "posixrules", "Factory"})


def validate_zone(tz: str | None) -> ZoneInfo:
    """Return the ZoneInfo for an IANA zone name; None means UTC.

    Raises ScheduleError(field "schedule.tz") for an empty, unknown or
    path-like name.
    """
    return _zone("UTC" if tz is None else tz)


@lru_cache(maxsize=1024)
def _zone(key: str) -> ZoneInfo:
    if (
        not isinstance(key, str)
        or not _ZONE_KEY.fullmatch(key)
        or key in _NOT_ZONES
        or key.split("/", 1)[0] in ("posix", "right")
    ):
        raise ScheduleError(_TZ_FIELD, f"not an IANA time zone name: {key!r}")
    try:
        return ZoneInfo(key)
    except (ZoneInfoNotFoundError, ValueError, OSError) as exc:
        raise ScheduleError(_TZ_FIELD, f"unknown time zone {key!r}") from exc


def _offset_at(zone: ZoneInfo, instant_s: int) -> int:
    offset = datetime.fromtimestamp(instant_s, zone).utcoffset()
    assert offset is not None
    return offset // _SECOND


# --- wall-clock candidates ----------------------------------------------------------
# Instants and wall times are int seconds since 1970-01-01 (wall times as if
# the local clock were UTC); ints are cheap to compare, negate and heap.


@lru_cache(maxsize=16384)
def _month_days(
    doms: frozenset[int], dows: frozenset[int], days_and: bool, year: int, month: int
) -> tuple[int, ...]:
    first_dow = date(year, month, 1).isoweekday() % 7
    days = []
    for dom in range(1, monthrange(year, month)[1] + 1):
        in_dom, in_dow = dom in doms, (first_dow + dom - 1) % 7 in dows
        if (in_dom and in_dow) if days_and else (in_dom or in_dow):
            days.append(dom)
    return tuple(days)


def _dates(cron: CronExpr, start: date, step: int) -> Iterator[tuple[int, int, int, int]]:
    """(year, month, day, ordinal) of matching local dates from `start` on, in `step` order."""
    year, month, start_ordinal = start.year, start.month, start.toordinal()
    while _FIRST_YEAR <= year <= _LAST_YEAR:
        if month in cron.months:
            days = _month_days(
                cron.days_of_month, cron.days_of_week, cron.days_and, year, month
            )
            base = date(year, month, 1).toordinal() - 1
            for dom in days if step > 0 else reversed(days):
                if (base + dom - start_ordinal) * step >= 0:
                    yield year, month, dom, base + dom
        month += step
        if not 1 <= month <= 12:
            year, month = year + step, 1 if step > 0 else 12


def _day_minutes(times: tuple[int, ...], bound: int | None, step: int) -> Iterable[int]:
    if step > 0:
        return times if bound is None else times[bisect_left(times, bound):]
    return reversed(times if bound is None else times[: bisect_right(times, bound)])


def _walls(cron: CronExpr, start_wall_s: int, step: int) -> Iterator[tuple[int, datetime]]:
    """Matching wall times from start_wall_s on (inclusive), as (seconds, naive datetime)."""
    day, second = divmod(start_wall_s, _DAY_S)
    bound = -(-second // 60) if step > 0 else second // 60
    start_ordinal = _EPOCH_ORDINAL + day
    for year, month, dom, ordinal in _dates(cron, date.fromordinal(start_ordinal), step):
        day_s = (ordinal - _EPOCH_ORDINAL) * _DAY_S
        first = bound if ordinal == start_ordinal else None
        for minute in _day_minutes(cron.minutes_of_day, first, step):
            yield day_s + minute * 60, datetime(year, month, dom, minute // 60, minute % 60)


def _instants(zone: ZoneInfo, wall_s: int, naive: datetime, both_passes: bool) -> tuple[int, ...]:
    """The instants a wall time runs at, ascending (PEP 495: fold=0 is the first pass)."""
    first = wall_s - zone.utcoffset(naive) // _SECOND
    second = wall_s - zone.utcoffset(naive.replace(fold=1)) // _SECOND
    if first == second:
        return (first,)
    if first < second:  # a fold: the wall time happens twice
        return (first, second) if both_passes else (first,)
    return (_gap_end(zone, second, first),)  # a gap: in a gap fold=0 is the later reading


def _gap_end(zone: ZoneInfo, before: int, after: int) -> int:
    """The first instant after a gap: the transition between `before` and `after`."""
    target = _offset_at(zone, after)
    while after - before > 1:
        mid = (before + after) // 2
        if _offset_at(zone, mid) == target:
            after = mid
        else:
            before = mid
    return after


def _fire_instants(cron: CronExpr, zone: ZoneInfo, start_wall_s: int, step: int) -> Iterator[int]:
    """Fire instants of the walls from start_wall_s on: ascending if step is 1, else descending.

    A fold's second pass puts an instant behind later wall times, so instants
    wait in a heap until no later wall can produce an earlier one: the first
    (last, going down) instant of each wall never moves backwards.
    """
    utc = zone.key in _UTC_KEYS
    pending: list[int] = []  # step * instant
    last = None
    for wall_s, naive in _walls(cron, start_wall_s, step):
        found = (wall_s,) if utc else _instants(zone, wall_s, naive, cron.hour_steps)
        for instant in found:
            heappush(pending, step * instant)
        bound = step * (found[0] if step > 0 else found[-1])
        while pending and pending[0] <= bound:
            instant = step * heappop(pending)
            if instant != last:
                last = instant
                yield instant
    while pending:
        instant = step * heappop(pending)
        if instant != last:
            last = instant
            yield instant


def _start_up(zone: ZoneInfo, instant_s: int) -> int:
    # The earliest wall time any later instant can show: a fold ahead lowers it.
    offset = min(_offset_at(zone, instant_s), _offset_at(zone, instant_s + _FOLD_WINDOW_S))
    return instant_s + offset


def _start_down(zone: ZoneInfo, instant_s: int) -> int:
    offset = max(_offset_at(zone, instant_s), _offset_at(zone, instant_s - _FOLD_WINDOW_S))
    return instant_s + offset


# --- fire times -----------------------------------------------------------------------


def next_fire_times(
    schedule: Schedule, after: datetime, count: int = 1, *, job_id: uuid.UUID | None = None
) -> list[datetime]:
    """The next `count` fire times strictly after `after`, ascending, jitter applied.

    A cron schedule is evaluated in its zone with the DST rules in the module
    docstring. A run_at gives [run_at + jitter] if that is after `after`, else
    []; delay_seconds gives [after + delay + jitter] (pass the submit time).
    With jitter every occurrence moves by the job's offset and the result is
    the next jittered times after `after`. H or jitter need `job_id`.
    """
    _require_aware(after, "after")
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    jitter = _jitter(schedule, job_id)
    if schedule.cron is None:
        return _one_off(schedule, after, jitter)[:count]
    instants = _instants_after(schedule.cron, _seed(schedule.cron, job_id), schedule.tz,
                               _floor_s(after - jitter), count)
    return [_at(instant, jitter) for instant in instants]


# A top-of-the-hour herd asks the same question of tens of thousands of jobs (one
# expression and zone, one due second): the answers are kept, keyed on what decides them.
@lru_cache(maxsize=4096)
def _instants_after(expr: str, seed: bytes | None, tz: str | None, floor_s: int,
                    count: int) -> tuple[int, ...]:
    cron = _parse(expr, seed)
    zone = validate_zone(tz)
    instants = _fire_instants(cron, zone, _start_up(zone, floor_s), 1)
    later = dropwhile(lambda instant: instant <= floor_s, instants)
    return tuple(islice(later, count))


def first_run_at(schedule: Schedule, now: datetime, *, job_id: uuid.UUID) -> datetime | None:
    """Validate a submitted schedule and return the job's first next_run_at.

    A run_at is kept even when it is in the past (it runs as soon as possible);
    delay_seconds counts from `now`; cron gives its first fire after `now`.
    Raises ScheduleError naming the offending field: "schedule" unless exactly
    one of runAt, delaySeconds and cron is set; "schedule.tz", ".overlap" or
    ".misfire" when set on a one-off; "schedule.cron"/"schedule.tz" when invalid.
    """
    _require_aware(now, "now")
    _validate(schedule, job_id)
    jitter = _jitter(schedule, job_id)
    if schedule.run_at is not None:
        return schedule.run_at.astimezone(_UTC) + jitter
    if schedule.delay_seconds is not None:
        return now.astimezone(_UTC) + timedelta(seconds=schedule.delay_seconds) + jitter
    fires = next_fire_times(schedule, now, 1, job_id=job_id)
    return fires[0] if fires else None


def missed_occurrences(
    schedule: Schedule,
    last_due: datetime,
    now: datetime,
    *,
    job_id: uuid.UUID | None,
    limit: int = MISSED_LIMIT_DEFAULT,
) -> list[datetime]:
    """Occurrences in [last_due, now] (jitter applied), the `limit` most recent, ascending.

    `last_due` is the due time that was missed. Found walking back from `now`,
    so a years-long downtime costs no more than `limit` occurrences. A one-off's
    only occurrence is its due time: [last_due] if it is not after `now`.
    """
    _require_aware(last_due, "last_due")
    _require_aware(now, "now")
    if limit <= 0 or last_due > now:
        return []
    if schedule.cron is None:
        return [last_due.astimezone(_UTC)]
    jitter = _jitter(schedule, job_id)
    recent = _instants_within(schedule.cron, _seed(schedule.cron, job_id), schedule.tz,
                              _ceil_s(last_due - jitter), _floor_s(now - jitter), limit)
    return [_at(instant, jitter) for instant in recent]


@lru_cache(maxsize=4096)  # as _instants_after: a herd dispatched late asks this of every job
def _instants_within(expr: str, seed: bytes | None, tz: str | None, lo_s: int, hi_s: int,
                     limit: int) -> tuple[int, ...]:
    """The `limit` most recent fire instants in [lo_s, hi_s], ascending."""
    cron = _parse(expr, seed)
    zone = validate_zone(tz)
    instants = _fire_instants(cron, zone, _start_down(zone, hi_s), -1)
    down = dropwhile(lambda instant: instant > hi_s, instants)
    return tuple(reversed(list(islice(takewhile(lambda instant: instant >= lo_s, down), limit))))


def misfire_plan(
    schedule: Schedule, last_due: datetime, now: datetime, *, job_id: uuid.UUID | None
) -> tuple[list[datetime], list[datetime]]:
    """Split the occurrences missed in [last_due, now] into (to_run, skipped), ascending.

    misfire "skip" runs only the latest; "catch_up" runs the CATCH_UP_MAX most
    recent. `skipped` (recorded as skipped executions) holds at most the
    SKIPPED_MAX most recent of the rest, so a long downtime stays bounded.
    """
    missed = missed_occurrences(
        schedule, last_due, now, job_id=job_id, limit=CATCH_UP_MAX + SKIPPED_MAX
    )
    run_count = CATCH_UP_MAX if schedule.misfire == "catch_up" else 1
    split = max(len(missed) - run_count, 0)
    return missed[split:], missed[:split][-SKIPPED_MAX:]


def _one_off(schedule: Schedule, after: datetime, jitter: timedelta) -> list[datetime]:
    if schedule.run_at is not None:
        _require_aware(schedule.run_at, "schedule.run_at")
        due = schedule.run_at.astimezone(_UTC) + jitter
        return [due] if due > after else []
    if schedule.delay_seconds is not None:
        return [after.astimezone(_UTC) + timedelta(seconds=schedule.delay_seconds) + jitter]
    raise ScheduleError("schedule", "exactly one of runAt, delaySeconds or cron is required")


def _validate(schedule: Schedule, job_id: uuid.UUID) -> None:
    given = [name for name, value in (("runAt", schedule.run_at),
                                       ("delaySeconds", schedule.delay_seconds),
                                       ("cron", schedule.cron)) if value is not None]
    if len(given) != 1:
        got = f" (got {' and '.join(given)})" if given else ""
        raise ScheduleError("schedule", f"exactly one of runAt, delaySeconds or cron{got}")
    if schedule.jitter_seconds < 0:
        raise ScheduleError("schedule.jitterSeconds", "must be >= 0")
    if schedule.cron is not None:
        parse_cron(schedule.cron, job_id=job_id)
        validate_zone(schedule.tz)
        return
    for name, value, default in (("tz", schedule.tz, None), ("overlap", schedule.overlap, "allow"),
                                 ("misfire", schedule.misfire, "skip")):
        if value != default:
            raise ScheduleError(f"schedule.{name}", "only valid with cron")
    if schedule.run_at is not None and schedule.run_at.utcoffset() is None:
        raise ScheduleError("schedule.runAt", "needs a UTC offset")
    delay_s = schedule.delay_seconds
    if delay_s is not None and not (math.isfinite(delay_s) and delay_s >= 0):
        raise ScheduleError("schedule.delaySeconds", "must be a finite number >= 0")


def _jitter(schedule: Schedule, job_id: uuid.UUID | None) -> timedelta:
    if schedule.jitter_seconds <= 0:
        return timedelta(0)
    if job_id is None:
        raise ScheduleError("schedule.jitterSeconds", "jitter needs a job id")
    digest = hashlib.blake2b(job_id.bytes, digest_size=8, person=b"herdwick.jitter").digest()
    return timedelta(milliseconds=int.from_bytes(digest, "big") % (schedule.jitter_seconds * 1000))


def _require_aware(dt: datetime, name: str) -> None:
    if dt.tzinfo is None or dt.utcoffset() is None:
        raise TypeError(f"{name} must be a timezone-aware datetime")


def _floor_s(dt: datetime) -> int:
    return (dt - _EPOCH) // _SECOND


def _ceil_s(dt: datetime) -> int:
    return -((_EPOCH - dt) // _SECOND)


def _at(instant_s: int, jitter: timedelta) -> datetime:
    return _EPOCH + timedelta(seconds=instant_s) + jitter


# --- retries and formatting -----------------------------------------------------------


def retry_delay_s(attempt: int, backoff_s: float, rand: float) -> float:
    """Delay before retrying after failed attempt `attempt` (from 1), in seconds.

    Uniform in [d/2, d) with d = backoff_s * 2**(attempt-1) capped at
    RETRY_CAP_S (the cap applies before halving); `rand` in [0, 1) is the
    caller's random draw.
    """
    if attempt < 1:
        raise ValueError(f"attempt must be >= 1, got {attempt}")
    if not (math.isfinite(backoff_s) and backoff_s >= 0):
        raise ValueError(f"backoff_s must be a finite number >= 0, got {backoff_s}")
    if not 0.0 <= rand < 1.0:
        raise ValueError(f"rand must be in [0, 1), got {rand}")
    # ldexp(x, 1000) stays finite for any backoff up to ~1e7 s, far above the cap.
    full_s = min(math.ldexp(backoff_s, min(attempt - 1, 1000)), RETRY_CAP_S)
    return full_s / 2 + rand * full_s / 2


def format_utc(dt: datetime) -> str:
    """RFC 3339 in UTC with a `Z`: seconds, plus .mmm when there are milliseconds.

    Sub-millisecond digits, which no fire time has, are kept (.ffffff) rather
    than dropped.
    """
    _require_aware(dt, "dt")
    utc = dt.astimezone(_UTC)
    text = (f"{utc.year:04d}-{utc.month:02d}-{utc.day:02d}"
            f"T{utc.hour:02d}:{utc.minute:02d}:{utc.second:02d}")
    if utc.microsecond % 1000:
        return f"{text}.{utc.microsecond:06d}Z"
    if utc.microsecond:
        return f"{text}.{utc.microsecond // 1000:03d}Z"
    return f"{text}Z"
