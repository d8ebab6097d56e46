"""Wire and domain structs shared by every tier.

Request structs forbid unknown fields so a typo is a 422, not a silently
ignored option. Value limits live in the aliases at the top, in one place.
"""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

# --- value limits -----------------------------------------------------------

MAX_PAYLOAD_BYTES = 256 * 1024
MAX_BATCH_JOBS = 1000
MAX_DELAY_S = 10 * 365 * 24 * 3600
MAX_JITTER_S = 24 * 3600
MAX_TIMEOUT_S = 7 * 24 * 3600
MAX_BACKOFF_S = 24 * 3600
MAX_ATTEMPTS = 100
MAX_IDEMPOTENCY_KEY_LEN = 255
MAX_NAME_LEN = 200
# runAt must fall in [EARLIEST_RUN_AT, submit time + MAX_DELAY_S]: a time in the past
# runs as soon as possible, and the bounds keep every stored time finite and ordinary.
EARLIEST_RUN_AT = datetime(1970, 1, 1, tzinfo=UTC)
LIST_LIMIT_DEFAULT = 50
LIST_LIMIT_MAX = 500
# A job's labels: at most MAX_LABELS pairs; a key is LABEL_KEY_PATTERN (no ':', which
# separates key from value in the list filter `label=key:value`), a value 0 to
# MAX_LABEL_VALUE_LEN characters without control characters. Checked by
# gateway/submit.py check_labels; published by gateway/openapi.py.
MAX_LABELS = 32
LABEL_KEY_PATTERN = "[A-Za-z0-9][A-Za-z0-9_./-]{0,62}"
MAX_LABEL_VALUE_LEN = 255
MAX_LABEL_FILTERS = 8

# Names (of jobs and tenants) hold no control character (Unicode Cc: C0, DEL and C1).
# The check is valid_name; the pattern is what /openapi.json publishes for it.
_CONTROL_CHARACTERS = r"\x00-\x1f\x7f-\x9f"
_CONTROL = re.compile(f"[{_CONTROL_CHARACTERS}]")
NAME_PATTERN = f"^[^{_CONTROL_CHARACTERS}]*$"


def valid_name(name: str) -> bool:
    return _CONTROL.search(name) is None


_LABEL_KEY = re.compile(LABEL_KEY_PATTERN)


def label_problem(key: str, value: str) -> str | None:
    """What is wrong with one label, or None."""
    if _LABEL_KEY.fullmatch(key) is None:
        return f"the key {key[:80]!r} is not {LABEL_KEY_PATTERN}"
    if len(value) > MAX_LABEL_VALUE_LEN or not valid_name(value):
        return (f"the value of {key!r} must be at most {MAX_LABEL_VALUE_LEN} characters "
                "without control characters")
    return None


# JSON Schema calls 5.0 an integer, so any client or fuzzer working from /openapi.json may
# send one; msgspec refuses a float for an int field (its lax mode would, but would take
# "5" too). So a request's integer fields are floats that must be a multiple of 1 (5 and 5.0
# pass, 5.5 does not), the structs turn them back into ints after decoding (_as_ints in
# __post_init__), and gateway/openapi.py publishes them as "type": "integer".
WholeNumber = Annotated[float, Meta(multiple_of=1)]

JobName = Annotated[str, Meta(min_length=1, max_length=MAX_NAME_LEN,
                              extra_json_schema={"pattern": NAME_PATTERN})]
TargetRef = Annotated[str, Meta(min_length=1, max_length=2048)]
DelaySeconds = Annotated[float, Meta(ge=0, le=MAX_DELAY_S)]
JitterSeconds = Annotated[WholeNumber, Meta(ge=0, le=MAX_JITTER_S)]
Attempts = Annotated[WholeNumber, Meta(ge=1, le=MAX_ATTEMPTS)]
BackoffSeconds = Annotated[float, Meta(ge=0, le=MAX_BACKOFF_S)]
TimeoutSeconds = Annotated[WholeNumber, Meta(ge=1, le=MAX_TIMEOUT_S)]
# Keys and values are checked in code (label_problem), so an error names `labels`.
Labels = Annotated[dict[str, str], Meta(max_length=MAX_LABELS)]
CronText = Annotated[str, Meta(min_length=1, max_length=200)]
ZoneName = Annotated[str, Meta(min_length=1, max_length=64)]
AwareTime = Annotated[datetime, Meta(tz=True)]
Weight = Annotated[WholeNumber, Meta(ge=1, le=1000)]
DispatchRate = Annotated[float, Meta(gt=0, le=1_000_000)]
Burst = Annotated[float, Meta(ge=1, le=100_000_000)]  # tokens; unset: one second of the rate
MaxActiveJobs = Annotated[WholeNumber, Meta(ge=1, le=100_000_000)]
TenantName = Annotated[str, Meta(min_length=1, max_length=200,
                                 extra_json_schema={"pattern": NAME_PATTERN})]
# How long a rotated-out signing secret keeps signing deliveries beside the new one.
SECRET_OVERLAP_DEFAULT_S = 24 * 3600
MAX_SECRET_OVERLAP_S = 7 * 24 * 3600
SecretOverlapSeconds = Annotated[WholeNumber, Meta(ge=0, le=MAX_SECRET_OVERLAP_S)]


def _as_ints(struct: msgspec.Struct, *fields: str) -> None:
    """A WholeNumber field decoded as 5.0 holds 5 from here on (frozen structs too)."""
    for name in fields:
        value = getattr(struct, name)
        if type(value) is float:
            msgspec.structs.force_setattr(struct, name, int(value))


# A queue target's ref, which is its worker pool's name. Checked with fullmatch:
# re's `$` would also match before a trailing newline.
POOL_PATTERN = "[a-z0-9][a-z0-9_.-]{0,62}"
_POOL = re.compile(POOL_PATTERN)


def valid_pool(name: str) -> bool:
    return _POOL.fullmatch(name) is not None


TargetType = Literal["http", "queue"]
Overlap = Literal["allow", "forbid", "replace"]
Misfire = Literal["skip", "catch_up"]
JobState = Literal["active", "paused", "canceled", "completed"]
# A tenant's: "sync" submits and dispatches commit with synchronous_commit = remote_apply
# (they wait for the synchronous standbys); "async" leaves the server's setting.
Durability = Literal["async", "sync"]
ExecutionState = Literal[
    "queued", "running", "retry_wait", "succeeded", "dead", "canceled", "skipped", "dry_run"
]

JOB_STATES: tuple[str, ...] = ("active", "paused", "canceled", "completed")

# --- schedules ----------------------------------------------------------------


class Schedule(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True,
               rename="camel"):
    """When a job runs: exactly one of runAt, delaySeconds or cron.

    jitterSeconds applies to every kind; tz, overlap and misfire only to cron
    (the gateway's validation says so by field name).
    """

    run_at: AwareTime | None = None
    delay_seconds: DelaySeconds | None = None
    cron: CronText | None = None
    tz: ZoneName | None = None
    jitter_seconds: JitterSeconds = 0
    overlap: Overlap = "allow"
    misfire: Misfire = "skip"

    def __post_init__(self) -> None:
        _as_ints(self, "jitter_seconds")

    @property
    def kind(self) -> Literal["once", "cron"]:
        return "cron" if self.cron is not None else "once"


# A Schedule's three shapes: the field naming its kind, and the optional fields that kind
# takes (herdwick/schedule.py refuses any other; gateway/openapi.py publishes each shape).
SCHEDULE_SHAPES: dict[str, tuple[str, ...]] = {
    "runAt": ("jitterSeconds",),
    "delaySeconds": ("jitterSeconds",),
    "cron": ("tz", "jitterSeconds", "overlap", "misfire"),
}


class ScheduleOut(msgspec.Struct, kw_only=True, rename="camel"):
    """A schedule as read back: the fields of its kind, every default filled in."""

    run_at: datetime | msgspec.UnsetType = msgspec.UNSET
    delay_seconds: float | msgspec.UnsetType = msgspec.UNSET
    cron: str | msgspec.UnsetType = msgspec.UNSET
    tz: str | msgspec.UnsetType = msgspec.UNSET
    jitter_seconds: int = 0
    overlap: Overlap | msgspec.UnsetType = msgspec.UNSET
    misfire: Misfire | msgspec.UnsetType = msgspec.UNSET

    @classmethod
    def of(cls, s: Schedule) -> ScheduleOut:
        if s.cron is not None:
            return cls(cron=s.cron, tz=s.tz or "UTC", jitter_seconds=s.jitter_seconds,
                       overlap=s.overlap, misfire=s.misfire)
        if s.run_at is not None:
            return cls(run_at=s.run_at, jitter_seconds=s.jitter_seconds)
        return cls(delay_seconds=s.delay_seconds, jitter_seconds=s.jitter_seconds)


class Target(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    type: TargetType
    ref: TargetRef


class RetryPolicy(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True,
                  rename="camel"):
    max_attempts: Attempts = 5
    backoff_seconds: BackoffSeconds = 10

    def __post_init__(self) -> None:
        _as_ints(self, "max_attempts")


DEFAULT_RETRY = RetryPolicy()
DEFAULT_TIMEOUT_S = 300


class JobSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, rename="camel"):
    """The body of POST /v1/jobs (and each item of a batch)."""

    name: JobName
    target: Target
    schedule: Schedule
    payload: msgspec.Raw = msgspec.field(default_factory=lambda: msgspec.Raw(b"null"))
    retry: RetryPolicy = DEFAULT_RETRY
    timeout_seconds: TimeoutSeconds = DEFAULT_TIMEOUT_S
    labels: Labels = msgspec.field(default_factory=dict)
    # Each occurrence is recorded as a dry_run execution, never published.
    dry_run: bool = False

    def __post_init__(self) -> None:
        _as_ints(self, "timeout_seconds")


# PATCH /v1/jobs/{jobId} is a JSON merge patch (RFC 7396) of the job as GET shows it:
# these structs check a patch's shape (and publish it: a member may be null, which
# removes it, so the field takes its default); the merged job is then checked as a
# submission is (JobSpec, gateway/submit.py).


class SchedulePatch(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, rename="camel"):
    run_at: AwareTime | msgspec.UnsetType | None = msgspec.UNSET
    delay_seconds: DelaySeconds | msgspec.UnsetType | None = msgspec.UNSET
    cron: CronText | msgspec.UnsetType | None = msgspec.UNSET
    tz: ZoneName | msgspec.UnsetType | None = msgspec.UNSET
    jitter_seconds: JitterSeconds | msgspec.UnsetType | None = msgspec.UNSET
    overlap: Overlap | msgspec.UnsetType | None = msgspec.UNSET
    misfire: Misfire | msgspec.UnsetType | None = msgspec.UNSET


class TargetPatch(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: TargetType | msgspec.UnsetType = msgspec.UNSET
    ref: TargetRef | msgspec.UnsetType = msgspec.UNSET


class RetryPatch(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, rename="camel"):
    max_attempts: Attempts | msgspec.UnsetType | None = msgspec.UNSET
    backoff_seconds: BackoffSeconds | msgspec.UnsetType | None = msgspec.UNSET


class JobPatch(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, rename="camel"):
    """The body of PATCH /v1/jobs/{jobId}: name, target and schedule cannot be null."""

    name: JobName | msgspec.UnsetType = msgspec.UNSET
    target: TargetPatch | msgspec.UnsetType = msgspec.UNSET
    schedule: SchedulePatch | msgspec.UnsetType = msgspec.UNSET
    payload: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    retry: RetryPatch | msgspec.UnsetType | None = msgspec.UNSET
    timeout_seconds: TimeoutSeconds | msgspec.UnsetType | None = msgspec.UNSET
    labels: dict[str, str | None] | msgspec.UnsetType | None = msgspec.UNSET
    dry_run: bool | msgspec.UnsetType | None = msgspec.UNSET


class FieldChange(msgspec.Struct, kw_only=True):
    before: msgspec.Raw
    after: msgspec.Raw


class Revision(msgspec.Struct, kw_only=True, rename="camel"):
    """One PATCH of a job: the version it made, who (an API key's fingerprint), when, and
    each top-level field it changed, as GET showed it before and after."""

    version: int
    revised_at: datetime
    revised_by: str
    changes: dict[str, FieldChange]


class RevisionPage(msgspec.Struct, kw_only=True, rename="camel"):
    items: list[Revision]
    next_cursor: str | None


class JobBatch(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The body of POST /v1/jobs:batch."""

    jobs: Annotated[list[JobSpec], Meta(min_length=1, max_length=MAX_BATCH_JOBS)]


class JobCreated(msgspec.Struct, kw_only=True, rename="camel"):
    job_id: uuid.UUID
    next_run_at: datetime | None
    state: JobState
    warnings: list[str] = []


class BatchItem(msgspec.Struct, kw_only=True, rename="camel"):
    job_id: uuid.UUID
    next_run_at: datetime | None
    state: JobState


class BatchCreated(msgspec.Struct, kw_only=True):
    items: list[BatchItem]
    warnings: list[str] = []


class Job(msgspec.Struct, kw_only=True, rename="camel"):
    """A job as read back: every field of the submission with defaults filled in."""

    job_id: uuid.UUID
    name: str
    target: Target
    payload: msgspec.Raw
    schedule: ScheduleOut
    retry: RetryPolicy
    timeout_seconds: int
    labels: dict[str, str]
    dry_run: bool
    state: JobState
    next_run_at: datetime | None
    created_at: datetime
    updated_at: datetime
    version: int


class JobPage(msgspec.Struct, kw_only=True, rename="camel"):
    items: list[Job]
    next_cursor: str | None


# --- tenants --------------------------------------------------------------------


class TenantSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, rename="camel"):
    """The body of POST /v1/tenants."""

    name: TenantName
    weight: Weight = 1
    dispatch_rate: DispatchRate | None = None
    burst: Burst | None = None
    max_active_jobs: MaxActiveJobs | None = None
    dry_run: bool = False  # every job of the tenant runs dry
    durability: Durability = "async"

    def __post_init__(self) -> None:
        _as_ints(self, "weight", "max_active_jobs")


class TenantPatch(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, rename="camel"):
    """The body of PATCH /v1/tenants/{tenantId}; an absent field is left as it is.

    dispatchRate, burst and maxActiveJobs may be set to null to lift the limit (burst:
    back to one second of the rate).
    """

    weight: Weight | msgspec.UnsetType = msgspec.UNSET
    dispatch_rate: DispatchRate | msgspec.UnsetType | None = msgspec.UNSET
    burst: Burst | msgspec.UnsetType | None = msgspec.UNSET
    max_active_jobs: MaxActiveJobs | msgspec.UnsetType | None = msgspec.UNSET
    dry_run: bool | msgspec.UnsetType = msgspec.UNSET
    durability: Durability | msgspec.UnsetType = msgspec.UNSET

    def __post_init__(self) -> None:
        _as_ints(self, "weight", "max_active_jobs")


class TenantCreated(msgspec.Struct, kw_only=True, rename="camel"):
    tenant_id: uuid.UUID
    api_key: str
    signing_secret: str


class Tenant(msgspec.Struct, kw_only=True, rename="camel"):
    tenant_id: uuid.UUID
    name: str
    weight: int
    dispatch_rate: float | None
    burst: float | None
    max_active_jobs: int | None
    dry_run: bool
    durability: Durability
    created_at: datetime
    updated_at: datetime


class SecretRotation(msgspec.Struct, kw_only=True, forbid_unknown_fields=True,
                     rename="camel"):
    """The body of POST /v1/tenants/{tenantId}:rotate-secret; an empty body is all defaults.

    overlapSeconds: how long the secret being replaced goes on signing deliveries beside
    the new one (0: it stops at once).
    """

    overlap_seconds: SecretOverlapSeconds = SECRET_OVERLAP_DEFAULT_S

    def __post_init__(self) -> None:
        _as_ints(self, "overlap_seconds")


class SigningSecret(msgspec.Struct, kw_only=True, rename="camel"):
    """A rotation's answer: the new secret, and when the one it replaced stops signing
    (null: it already has)."""

    signing_secret: str
    previous_secret_expires_at: AwareTime | None


# --- errors ---------------------------------------------------------------------


class FieldError(msgspec.Struct, kw_only=True, frozen=True):
    field: str
    message: str


class Problem(msgspec.Struct, kw_only=True):
    """An RFC 9457 problem document, as every error response carries."""

    type: str
    title: str
    status: int
    detail: str
    errors: list[FieldError] = []


# --- executions -----------------------------------------------------------------


class ExecutionSummary(msgspec.Struct, kw_only=True, rename="camel"):
    execution_id: uuid.UUID
    job_id: uuid.UUID
    scheduled_for: datetime
    attempt: int
    state: ExecutionState
    started_at: datetime | None
    finished_at: datetime | None
    error: msgspec.Raw | None = None


class ExecutionPage(msgspec.Struct, kw_only=True, rename="camel"):
    items: list[ExecutionSummary]
    next_cursor: str | None


class Attempt(msgspec.Struct, kw_only=True, rename="camel"):
    attempt: int
    worker_id: str | None
    started_at: datetime | None  # its lease granted
    finished_at: datetime | None
    outcome: str | None
    error: msgspec.Raw | None = None
    lease_until: datetime | None = None  # the lease's expiry as granted (heartbeats extend it)


class StaleCall(msgspec.Struct, kw_only=True, rename="camel"):
    """Calls the fence refused from a worker whose attempt had lapsed or been replaced:
    its handler may have acted while another attempt ran (a possible duplicate)."""

    attempt: int  # the stale worker's attempt
    worker_id: str
    call: Literal["heartbeat", "complete", "fail"]
    count: int
    first_at: datetime
    last_at: datetime


class Execution(msgspec.Struct, kw_only=True, rename="camel"):
    """One execution with every attempt it took."""

    execution_id: uuid.UUID
    job_id: uuid.UUID
    scheduled_for: datetime
    attempt: int
    state: ExecutionState
    queued_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    error: msgspec.Raw | None = None
    result: msgspec.Raw | None = None
    attempts: list[Attempt] = []
    possible_duplicates: list[StaleCall] = []


class Triggered(msgspec.Struct, kw_only=True, rename="camel"):
    execution_id: uuid.UUID
