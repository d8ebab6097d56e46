"""From a decoded submission to a row ready to insert: every check msgspec cannot make.

Each check names the field it rejects, with the batch index as a prefix
(`jobs[17].schedule.cron`), so one response lists every problem at once.
"""

from __future__ import annotations

import re
import urllib.parse
import uuid
from datetime import datetime, timedelta

import msgspec

from herdwick import schedule as sched
from herdwick import ssrf
from herdwick.ids import shard_of, uuid7
from herdwick.model import (
    EARLIEST_RUN_AT,
    MAX_DELAY_S,
    MAX_PAYLOAD_BYTES,
    POOL_PATTERN,
    FieldError,
    JobSpec,
    Schedule,
    label_problem,
    valid_name,
    valid_pool,
)
from herdwick.storage.jobs import NewJob

HTTP_POOL = "http"
# C0, DEL and C1 (Unicode Cc), as in names: a C1 control is no more a URL's than a C0 one.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")

# What _http_ref_problems takes, as far as a pattern can say it (gateway/openapi.py publishes
# it): an http(s) scheme in any case, no space or control character anywhere, an optional
# userinfo (without brackets, which urlsplit would read as an IPv6 host's), a host (a name,
# or an IPv6 address in brackets: RFC 3986's IPv6address) and a port up to 65535. Whether
# the host is, or resolves to, an address herdwick.ssrf refuses is checked in code, not by
# the pattern.
_H16 = "[0-9A-Fa-f]{1,4}"
_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_LS32 = f"(?:{_H16}:{_H16}|{_OCTET}(?:\\.{_OCTET}){{3}})"


def _ipv6_address() -> str:
    """RFC 3986's IPv6address: eight groups (the last two may be an IPv4 address), or
    fewer with one "::" standing for the zeros between."""
    def groups(n: int) -> str:
        return f"(?:{_H16}:){{{n}}}"

    def before(n: int) -> str:  # up to n groups before the "::"
        return f"(?:(?:{_H16}:){{0,{n - 1}}}{_H16})?"

    forms = [groups(6) + _LS32, "::" + groups(5) + _LS32]
    forms += [before(n) + "::" + groups(5 - n) + _LS32 for n in range(1, 6)]
    forms += [before(6) + "::" + _H16, before(7) + "::"]
    return "(?:" + "|".join(forms) + ")"


_PORT = "0*(?:6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[0-9]{1,4})"
HTTP_REF_PATTERN = (
    "^[Hh][Tt][Tt][Pp][Ss]?://"
    "(?:[^\\x00-\\x20\\x7f-\\x9f/?#@\\[\\]]*@)?"
    f"(?:\\[{_ipv6_address()}\\]|[^\\x00-\\x20\\x7f-\\x9f/?#@:\\[\\]]+)"
    f"(?::(?:{_PORT})?)?"
    "(?:[/?#][^\\x00-\\x20\\x7f-\\x9f]*)?$"
)

_encode_schedule = _encode_json = msgspec.json.Encoder().encode

Network = ssrf.Network


class Prepared(msgspec.Struct, frozen=True):
    job: NewJob | None
    errors: list[FieldError]


def _err(prefix: str, field: str, message: str) -> FieldError:
    return FieldError(field=f"{prefix}{field}", message=message)


def check_target(spec: JobSpec, prefix: str, allow: tuple[Network, ...]) -> list[FieldError]:
    ref = spec.target.ref
    if spec.target.type == "queue":
        if not valid_pool(ref):
            return [_err(prefix, "target.ref", f"a queue name is {POOL_PATTERN}")]
        if ref == HTTP_POOL:
            return [_err(prefix, "target.ref", "the pool 'http' is reserved for http targets")]
        return []
    return [_err(prefix, "target.ref", m) for m in _http_ref_problems(ref, allow)]


def _http_ref_problems(ref: str, allow: tuple[Network, ...]) -> list[str]:
    if _CONTROL.search(ref) or " " in ref:
        return ["an http target must not contain spaces or control characters"]
    try:
        url = urllib.parse.urlsplit(ref)
        url.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError as exc:
        return [f"not a valid URL: {exc}"]
    if url.scheme not in ssrf.SCHEMES:
        return ["an http target must be an http:// or https:// URL"]
    if not url.hostname:
        return ["an http target needs a host"]
    try:
        ssrf.check_url(ref, allow)  # a literal address in any spelling; names: target_dns
    except ssrf.TargetRefused as exc:
        return [refused_message(exc)]
    return []


def refused_message(exc: ssrf.TargetRefused) -> str:
    if exc.address is None:
        return exc.reason
    return f"{exc.reason}; HERDWICK_HTTP_ALLOW must list it to be a target"


def check_payload(raw: msgspec.Raw, prefix: str) -> list[FieldError]:
    if len(raw) > MAX_PAYLOAD_BYTES:
        return [_err(prefix, "payload", f"the payload is {len(raw)} bytes; "
                                        f"the limit is {MAX_PAYLOAD_BYTES}")]
    try:
        value = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        return [_err(prefix, "payload", f"not storable JSON: {exc}")]
    except RecursionError:
        return [_err(prefix, "payload", "nested too deeply")]
    if b"\\u0000" in bytes(raw) and _has_nul(value):
        return [_err(prefix, "payload", "strings must not contain \\u0000")]
    return []


def _has_nul(value: object) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if "\x00" in item:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def check_labels(labels: dict[str, str], prefix: str) -> list[FieldError]:
    """Every bad label, each naming the field `labels` (a key may be anything, even empty:
    it is quoted in the message, not made part of a field name)."""
    return [_err(prefix, "labels", problem) for key, value in labels.items()
            if (problem := label_problem(key, value)) is not None]


def check_times(schedule: Schedule, now: datetime, prefix: str) -> list[FieldError]:
    run_at = schedule.run_at
    if run_at is None:
        return []
    latest = now + timedelta(seconds=MAX_DELAY_S)
    if EARLIEST_RUN_AT <= run_at <= latest:
        return []
    return [_err(prefix, "schedule.runAt",
                 f"must be from {sched.format_utc(EARLIEST_RUN_AT)} to ten years from now "
                 f"({sched.format_utc(latest)}); a time in the past runs at once")]


def normalised(schedule: Schedule) -> Schedule:
    """The schedule as stored: a cron schedule's zone filled in."""
    if schedule.cron is not None and schedule.tz is None:
        return msgspec.structs.replace(schedule, tz="UTC")
    return schedule


def prepare(spec: JobSpec, *, now: datetime, allow: tuple[Network, ...],
            prefix: str = "", job_id: uuid.UUID | None = None) -> Prepared:
    """Validate one job and compute its first due time (from now). job_id: an existing
    job's, being changed (its hashed cron fields and jitter follow from it)."""
    errors: list[FieldError] = []
    if not valid_name(spec.name):
        errors.append(_err(prefix, "name", "must not contain control characters"))
    errors += check_target(spec, prefix, allow)
    errors += check_payload(spec.payload, prefix)
    errors += check_labels(spec.labels, prefix)
    errors += check_times(spec.schedule, now, prefix)
    job_id = job_id or uuid7(now)
    if errors:
        return Prepared(None, errors)
    try:
        first = sched.first_run_at(spec.schedule, now, job_id=job_id)
    except sched.ScheduleError as exc:
        errors.append(_err(prefix, exc.field, str(exc)))
        first = None
    else:
        if first is None:
            errors.append(_err(prefix, "schedule.cron", "the expression never fires"))
    if errors or first is None:
        return Prepared(None, errors)
    pool = spec.target.ref if spec.target.type == "queue" else HTTP_POOL
    job = NewJob(
        job_id=job_id, name=spec.name, target_type=spec.target.type, target_ref=spec.target.ref,
        pool=pool, payload=bytes(spec.payload).decode(),
        schedule=_encode_schedule(normalised(spec.schedule)).decode(),
        max_attempts=spec.retry.max_attempts, backoff_s=float(spec.retry.backoff_seconds),
        timeout_s=spec.timeout_seconds, next_run_at=first, shard_id=shard_of(job_id),
        labels=_encode_json(spec.labels).decode(), dry_run=spec.dry_run)
    return Prepared(job, [])
