"""Crontabs into herdwick: read a Vixie cron / cronie crontab, and compare fire times.

`parse` is pure: each line of a crontab becomes an Entry (a job to create) or a
Refused (why it cannot be carried over, by line number). `compare` is pure too:
two lists of fire times, paired into agreeing, missing, extra and shifted runs.
What talks to a gateway (import, reading the recorded executions back) is in
herdwick/crontab_client.py; the CLI wires both (docs/crontab.md).

The dialect, as cronie reads a crontab (crontab(5)):
- blank lines and lines whose first non-blank character is `#` are ignored;
- `NAME=value` (spaces allowed around `=`, the value optionally in single or
  double quotes) sets an environment variable for the lines after it;
  `CRON_TZ=Zone` sets the zone the lines after it are evaluated in, and so does
  `TZ=Zone` (which also stays in the commands' environment), CRON_TZ winning;
- an entry is five fields or a macro (@yearly @annually @monthly @weekly @daily
  @midnight @hourly), then, in /etc/crontab and /etc/cron.d (`system`), a user
  name, then the command: the rest of the line. A `%` not escaped as `\\%` ends
  the command; what follows is its standard input, each further `%` a newline.
  `@reboot` has no equivalent here and is reported, not carried over.
"""

from __future__ import annotations

import hashlib
import re
from datetime import UTC, datetime, timedelta

import msgspec

from herdwick import schedule as sched
from herdwick.model import Schedule

DEFAULT_SHIFT_S = 2 * 3600
_ENV = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)[ \t]*=[ \t]*(.*)$")
_FIELDS = re.compile(r"[ \t]+")
_MACROS = frozenset({"@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight",
                     "@hourly"})
_USER = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*\$?$")
_ZONE_VARIABLES = ("CRON_TZ", "TZ")


class Entry(msgspec.Struct, frozen=True, kw_only=True):
    """One crontab line that becomes a job."""

    line: int
    text: str  # the line as written
    cron: str  # five fields, or a macro
    tz: str
    command: str
    stdin: str | None  # what followed the first unescaped %
    user: str | None  # /etc/crontab's user field
    env: dict[str, str]  # the environment lines in effect at this line

    @property
    def schedule(self) -> Schedule:
        return Schedule(cron=self.cron, tz=self.tz)

    def digest(self, source: str) -> str:
        """Who this entry is, whatever line it is on: what makes an import idempotent.

        The line number is left out, so a line moved within the file is the same job.
        """
        identity = msgspec.json.encode([source, self.cron, self.tz, self.user, self.command,
                                        self.stdin, sorted(self.env.items())])
        return hashlib.sha256(identity).hexdigest()[:32]


class Refused(msgspec.Struct, frozen=True, kw_only=True):
    line: int
    text: str
    reason: str


class Crontab(msgspec.Struct, frozen=True, kw_only=True):
    entries: list[Entry]
    refused: list[Refused]


def _unquoted(value: str) -> str:
    value = value.strip()
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    return value


def _command_and_stdin(text: str) -> tuple[str, str | None]:
    parts, current, escaped = [], [], False
    for char in text:
        if escaped:
            current.append(char if char == "%" else "\\" + char)
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == "%" and not parts:
            parts.append("".join(current))
            current = []
        elif char == "%":
            current.append("\n")
        else:
            current.append(char)
    if escaped:
        current.append("\\")
    parts.append("".join(current))
    command = parts[0].strip()
    return command, (parts[1] if len(parts) > 1 else None)


class _State:
    def __init__(self, tz: str) -> None:
        self.env: dict[str, str] = {}
        self.tz = tz
        self.bad_zone: str | None = None  # why the zone in effect cannot be used
        self.zone_from: str | None = None  # the variable that set the zone


def parse(text: str, *, system: bool = False, tz: str = "UTC") -> Crontab:
    """Every line of a crontab, as an Entry or a Refused. tz: the zone before any
    CRON_TZ= or TZ= line (cron's own, which the old host's clock decided)."""
    state = _State(tz)
    entries: list[Entry] = []
    refused: list[Refused] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        env = _ENV.match(line)
        if env is not None:
            _set_variable(state, env.group(1), _unquoted(env.group(2)), number)
            continue
        outcome = _entry(state, number, raw, line, system)
        (entries if isinstance(outcome, Entry) else refused).append(outcome)
    return Crontab(entries=entries, refused=refused)


def _set_variable(state: _State, name: str, value: str, number: int) -> None:
    if name != "CRON_TZ":
        state.env[name] = value
    if name not in _ZONE_VARIABLES or (name == "TZ" and state.zone_from == "CRON_TZ"):
        return
    state.zone_from = name
    try:
        sched.validate_zone(value)
    except sched.ScheduleError:
        state.bad_zone = f"{name}={value} (line {number}) is not a zone this server knows"
        return
    state.tz, state.bad_zone = value, None


def _entry(state: _State, number: int, raw: str, line: str, system: bool) -> Entry | Refused:
    def refuse(reason: str) -> Refused:
        return Refused(line=number, text=raw, reason=reason)

    if line.startswith("@"):
        macro, *after = _FIELDS.split(line, maxsplit=1)
        if macro == "@reboot":
            return refuse("@reboot runs when cron starts; herdwick has no such moment, so it "
                          "is not carried over")
        if macro not in _MACROS:
            return refuse(f"{macro} is not a cron macro")
        cron, rest = macro, (after[0] if after else "")
    else:
        fields = _FIELDS.split(line, maxsplit=5)
        if len(fields) < 6:
            return refuse("an entry is five time fields and a command")
        cron, rest = " ".join(fields[:5]), fields[5]
    user = None
    if system:
        name, *after = _FIELDS.split(rest.strip(), maxsplit=1)
        if not _USER.match(name):
            return refuse("a system crontab names a user before the command")
        user, rest = name, (after[0] if after else "")
    command_text = rest.strip()
    if not command_text:
        return refuse("the entry has no command")
    if state.bad_zone is not None:
        return refuse(state.bad_zone)
    try:
        sched.parse_cron(cron)
    except sched.ScheduleError as exc:
        return refuse(f"{cron!r}: {exc}")
    command, stdin = _command_and_stdin(command_text)
    if not command:
        return refuse("the entry has no command before its %")
    return Entry(line=number, text=raw, cron=cron, tz=state.tz, command=command, stdin=stdin,
                 user=user, env=dict(state.env))


# --- comparing fire times ----------------------------------------------------------


class Shifted(msgspec.Struct, frozen=True):
    expected: datetime
    actual: datetime

    @property
    def by_s(self) -> float:
        return (self.actual - self.expected).total_seconds()


class Difference(msgspec.Struct, frozen=True, kw_only=True):
    """Actual fire times against the ones expected."""

    agree: int
    missing: list[datetime]  # expected, and nothing near it happened
    extra: list[datetime]  # happened, and nothing near it was expected
    shifted: list[Shifted]  # happened, off its expected time by at most the shift window

    @property
    def same(self) -> bool:
        return not (self.missing or self.extra or self.shifted)


def expected_fires(entry: Entry, since: datetime, until: datetime) -> list[datetime]:
    """The entry's fire times in [since, until), by the scheduler's own function."""
    fires: list[datetime] = []
    after = since - timedelta(microseconds=1)
    while True:
        batch = sched.next_fire_times(entry.schedule, after, 1000)
        fires += [t for t in batch if t < until]
        if len(batch) < 1000 or batch[-1] >= until:
            return fires
        after = batch[-1]


def compare(expected: list[datetime], actual: list[datetime],
            shift_s: float = DEFAULT_SHIFT_S) -> Difference:
    """Pair actual fire times with expected ones: equal times agree; of the rest, each
    expected time takes the nearest actual one within shift_s (a shifted run), in time
    order; what is left is missing (expected) or extra (actual)."""
    left = sorted(set(expected))
    right = sorted(actual)
    taken = set(left) & set(right)
    rest_right = [t for t in right if t not in taken]
    # an expected time run twice: one agrees, the other is extra
    rest_right += [t for t in taken for _ in range(right.count(t) - 1)]
    rest_right.sort()
    rest_left = [t for t in left if t not in taken]
    agree = len(taken)
    shifted: list[Shifted] = []
    missing: list[datetime] = []
    for want in rest_left:
        near = [t for t in rest_right if abs((t - want).total_seconds()) <= shift_s]
        if not near:
            missing.append(want)
            continue
        best = min(near, key=lambda t: (abs((t - want).total_seconds()), t))
        rest_right.remove(best)
        shifted.append(Shifted(want, best))
    return Difference(agree=agree, missing=missing, extra=rest_right, shifted=shifted)


class LogError(ValueError):
    """A --log line that is not `<RFC 3339 time> <line number>`."""


def parse_log(text: str) -> dict[int, list[datetime]]:
    """The old system's runs: one `<RFC 3339 time with offset> <crontab line number>` a
    line; blank lines and `#` comments ignored. By crontab line."""
    runs: dict[int, list[datetime]] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError("expected a time and a line number")
            when = datetime.fromisoformat(parts[0].replace("Z", "+00:00"))
            if when.tzinfo is None:
                raise ValueError("the time needs an offset or Z")
            entry_line = int(parts[1])
        except ValueError as exc:
            raise LogError(f"log line {number}: {exc}: {raw[:120]!r}") from None
        runs.setdefault(entry_line, []).append(when.astimezone(UTC))
    return runs


def _utc(when: datetime) -> str:
    return sched.format_utc(when)


def report(title: str, reference: str, diff: Difference) -> list[str]:
    """A comparison as text: a summary line, then each difference on a line of its own."""
    counts = [f"{diff.agree} agree"] + [f"{n} {what}" for n, what in (
        (len(diff.missing), "missing"), (len(diff.extra), "extra"),
        (len(diff.shifted), "shifted")) if n]
    lines = [f"{title}: recorded vs {reference}: {', '.join(counts)}"]
    lines += [f"  missing  {_utc(t)} (in the {reference}, not recorded)" for t in diff.missing]
    lines += [f"  extra    {_utc(t)} (recorded, not in the {reference})" for t in diff.extra]
    lines += [f"  shifted  {_utc(s.expected)} in the {reference}, recorded {_utc(s.actual)} "
              f"({s.by_s:+.0f} s)" for s in diff.shifted]
    return lines
