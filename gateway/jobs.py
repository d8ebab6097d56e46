"""Tenant job handlers: submit (single and batch), read, list, pause, resume, cancel."""

from __future__ import annotations

import hashlib
import uuid
from datetime import datetime

import msgspec
from aiohttp import web

from herdwick import schedule as sched
from herdwick import telemetry
from herdwick.errors import Conflict, IdempotencyKeyReused, InvalidInput
from herdwick.gateway import params
from herdwick.gateway.auth import tenant_of
from herdwick.gateway.body import read_json_body
from herdwick.gateway.context import Ctx
from herdwick.gateway.decoding import decode, decode_collecting, well_formed
from herdwick.gateway.herd import HERD_PLACEHOLDER, herd_check, herd_warning
from herdwick.gateway.params import etag, json_response, path_uuid
from herdwick.gateway.problems import bad_field, invalid
from herdwick.gateway.submit import HTTP_POOL, prepare, refused_message
from herdwick.gateway.target_dns import target_name
from herdwick.ids import shard_of
from herdwick.model import (
    JOB_STATES,
    MAX_BATCH_JOBS,
    MAX_IDEMPOTENCY_KEY_LEN,
    MAX_LABEL_FILTERS,
    MAX_NAME_LEN,
    MAX_PAYLOAD_BYTES,
    BatchCreated,
    BatchItem,
    FieldError,
    Job,
    JobCreated,
    JobPage,
    JobSpec,
    Schedule,
    label_problem,
    valid_name,
)
from herdwick.storage import jobs as store
from herdwick.storage.jobs import NewIdempotency, NewJob, Submission, Transition

SINGLE_BODY_CAP = MAX_PAYLOAD_BYTES + 64 * 1024
BATCH_BODY_CAP = 16 * 1024 * 1024

_spec_decoder = msgspec.json.Decoder(JobSpec)
# The top level, then the jobs: an error in either names its field ("jobs", not msgspec's
# "[...]" for a dict's value).
_batch_decoder = msgspec.json.Decoder(dict[str, msgspec.Raw])
_items_decoder = msgspec.json.Decoder(list[msgspec.Raw])
_encoder = msgspec.json.Encoder()


def _idempotency_key(request: web.Request) -> str | None:
    key = request.headers.get("Idempotency-Key")
    if key is None:
        return None
    if not key or len(key) > MAX_IDEMPOTENCY_KEY_LEN or not key.isprintable():
        raise bad_field("Idempotency-Key",
                        f"1 to {MAX_IDEMPOTENCY_KEY_LEN} printable characters")
    return key


def _decode_batch(raw: bytes) -> list[JobSpec]:
    top = decode(_batch_decoder, raw)
    extra = sorted(set(top) - {"jobs"})
    if extra:
        well_formed(raw)  # jobs' text is not read yet: a body that is not JSON is 400 first
        raise bad_field(extra[0], "unknown field")
    if "jobs" not in top:
        raise bad_field("jobs", "required")
    items, errors = decode_collecting(_items_decoder, bytes(top["jobs"]), "jobs",
                                      duplicates=False)
    if errors:
        raise invalid(errors)
    if not 1 <= len(items) <= MAX_BATCH_JOBS:
        raise bad_field("jobs", f"a batch holds 1 to {MAX_BATCH_JOBS} jobs, not {len(items)}")
    specs, errors = [], []
    for i, item in enumerate(items):
        # The whole body's keys were checked for duplicates by the decode above.
        spec, errs = decode_collecting(_spec_decoder, bytes(item), f"jobs[{i}]",
                                       duplicates=False)
        specs.append(spec)
        errors += errs
    if errors:
        raise invalid(errors)
    return specs


async def prepare_all(ctx: Ctx, specs: list[JobSpec], batch: bool,
                      job_id: uuid.UUID | None = None) -> list[NewJob]:
    """Every check of a submission (a PATCH's merged job too: job_id is its own)."""
    now = ctx.clock.now()
    prefixes = [f"jobs[{i}]." if batch else "" for i in range(len(specs))]
    prepared = [prepare(s, now=now, allow=ctx.http_allow, prefix=p, job_id=job_id)
                for s, p in zip(specs, prefixes, strict=True)]
    # The names of the http targets that passed every other check, looked up together.
    names = {i: target_name(s.target.ref) for i, s in enumerate(specs)
             if s.target.type == "http"
             and all(e.field != f"{prefixes[i]}target.ref" for e in prepared[i].errors)}
    refused = await ctx.target_dns.refusals(n for n in names.values() if n is not None)
    errors: list[FieldError] = []
    for i, p in enumerate(prepared):
        errors += p.errors
        if (name := names.get(i)) in refused:
            errors.append(FieldError(field=f"{prefixes[i]}target.ref",
                                     message=refused_message(refused[name])))
    if errors:
        too_big = all(e.field.endswith("payload") and "limit" in e.message for e in errors)
        raise InvalidInput(errors, 413 if too_big else 422)
    return [p.job for p in prepared]


async def submit(request: web.Request) -> web.Response:
    ctx = Ctx.of(request)
    owner = await tenant_of(request, ctx.db, ctx.keys)
    key = _idempotency_key(request)
    body = await read_json_body(request, SINGLE_BODY_CAP)
    [job] = await prepare_all(ctx, [decode(_spec_decoder, body)], batch=False)

    def created(warnings: list[str]) -> JobCreated:
        return JobCreated(job_id=job.job_id, next_run_at=job.next_run_at, state="active",
                          warnings=warnings)

    return await _insert(request, ctx, owner, key, body, [job], created, coalesce=True)


async def submit_batch(request: web.Request) -> web.Response:
    ctx = Ctx.of(request)
    owner = await tenant_of(request, ctx.db, ctx.keys)
    key = _idempotency_key(request)
    body = await read_json_body(request, BATCH_BODY_CAP)
    jobs = await prepare_all(ctx, _decode_batch(body), batch=True)
    items = [BatchItem(job_id=j.job_id, next_run_at=j.next_run_at, state="active") for j in jobs]

    def created(warnings: list[str]) -> BatchCreated:
        return BatchCreated(items=items, warnings=warnings)

    return await _insert(request, ctx, owner, key, body, jobs, created)


async def _insert(request: web.Request, ctx: Ctx, owner, key: str | None, body: bytes,
                  jobs: list[NewJob], created, *, coalesce: bool = False) -> web.Response:
    limit = ctx.settings.herd_warn_jobs
    herd = herd_check(jobs, ctx.clock.now(), limit)
    plain = created([])
    request_hash = hashlib.sha256(request.path.encode() + b"\n" + body).digest()
    idem = None
    if key is not None:
        # The stored body must name the second the statement finds: it writes that
        # second over the placeholder's.
        warned = _encoder.encode(created([herd_warning(HERD_PLACEHOLDER, limit)]))
        at = warned.rindex(sched.format_utc(HERD_PLACEHOLDER).encode())
        idem = NewIdempotency(key=key, request_hash=request_hash, response=_encoder.encode(plain),
                              response_warned=warned, warned_second_at=at)
    for _ in range(2):
        if idem is None and coalesce:  # with others of the tenant's, in one statement
            outcome = await ctx.coalescer.insert(
                owner.tenant_id, Submission(jobs, herd), max_active_jobs=owner.max_active_jobs,
                sync=owner.durability == "sync")
        else:
            outcome = await store.insert_jobs(
                ctx.db, owner.tenant_id, jobs, now=ctx.clock.now(), idempotency=idem,
                max_active_jobs=owner.max_active_jobs, herd=herd,
                sync=owner.durability == "sync")
        if outcome.inserted:
            response = plain
            if outcome.herd_total >= limit:
                response = created([herd_warning(outcome.herd_second, limit)])
            telemetry.SUBMITTED.labels(telemetry.tenant_label(str(owner.tenant_id))).inc(len(jobs))
            await ctx.after_submit(owner.tenant_id, jobs)
            return json_response(201, response)
        record = await store.get_idempotency(ctx.db, owner.tenant_id, key)
        if record is None:
            continue  # expired and swept between the two statements: insert again
        if record.request_hash != request_hash:
            raise IdempotencyKeyReused(
                "this Idempotency-Key was used for a different request in the last 24 hours")
        # The original may have committed and died before its mark: mark it now.
        await ctx.wrote(owner.tenant_id)
        return web.Response(status=record.status, body=record.response,
                            content_type="application/json",
                            headers={"Idempotent-Replayed": "true"})
    raise Conflict("the Idempotency-Key is being used concurrently; retry")


def job_id_of(request: web.Request) -> uuid.UUID:
    return path_uuid(request, "jobId", "job")


async def get_job(request: web.Request) -> web.Response:
    ctx = Ctx.of(request)
    owner = await tenant_of(request, ctx.db, ctx.keys)
    job_id = job_id_of(request)
    job = await ctx.read(owner.tenant_id, lambda db: store.get_job(db, owner.tenant_id, job_id))
    return json_response(200, job, etag(job))


async def list_jobs(request: web.Request) -> web.Response:
    ctx = Ctx.of(request)
    owner = await tenant_of(request, ctx.db, ctx.keys)
    state = request.query.get("state") or None
    if state is not None and state not in JOB_STATES:
        raise bad_field("state", f"one of {', '.join(JOB_STATES)}")
    name = request.query.get("name")
    if name is not None and (not 1 <= len(name) <= MAX_NAME_LEN or not valid_name(name)):
        raise bad_field("name", f"a job name: 1 to {MAX_NAME_LEN} characters, no control "
                                "characters")
    after, limit = params.cursor(request, store.decode_cursor), params.limit(request)
    labels = _label_filter(request)
    items, cursor = await ctx.read(owner.tenant_id, lambda db: store.list_jobs(
        db, owner.tenant_id, state=state, after=after, limit=limit, name=name, labels=labels))
    return json_response(200, JobPage(items=items, next_cursor=cursor))


def _label_filter(request: web.Request) -> dict[str, str]:
    """`label=key:value`, repeatable: a job must carry every pair. A key given twice with
    two values matches nothing, so it is refused rather than answered with an empty page."""
    wanted: dict[str, str] = {}
    given = request.query.getall("label", [])
    if len(given) > MAX_LABEL_FILTERS:
        raise bad_field("label", f"at most {MAX_LABEL_FILTERS} label filters")
    for text in given:
        key, colon, value = text.partition(":")
        if not colon:
            raise bad_field("label", f"key:value, not {text[:80]!r}")
        if (problem := label_problem(key, value)) is not None:
            raise bad_field("label", problem)
        if wanted.get(key, value) != value:
            raise bad_field("label", f"the key {key!r} is given two values")
        wanted[key] = value
    return wanted


def _pause(job: Job, schedule: Schedule) -> Transition | None:
    if job.state == "paused":
        return None
    if job.state != "active":
        raise Conflict(f"a {job.state} job cannot be paused")
    # Pending retries keep their due rows: when one falls due, dispatch parks it
    # (requeue_retries) and the execution waits in retry_wait for the resume.
    return Transition(state="paused", next_run_at=job.next_run_at, clear_due="occurrences")


def _resumer(now):
    def decide(job: Job, schedule: Schedule) -> Transition | None:
        if job.state == "active":
            return None
        if job.state != "paused":
            raise Conflict(f"a {job.state} job cannot be resumed")
        when, skipped = resume_plan(schedule, job, now)
        return Transition(state="active", next_run_at=when,
                          add_due=(shard_of(job.job_id), when), unpark_retries=True,
                          skipped=tuple(skipped))
    return decide


def resume_plan(schedule: Schedule, job: Job, now) -> tuple[datetime, list[datetime]]:
    """Where a resumed job picks up, and the occurrences its misfire policy skips.

    Its pending time if that is still ahead. Else, for a cron job, the misfire
    policy over what fell due while it was paused: skip runs the latest and
    skips the rest, catch_up runs the latest hundred; those it skips are
    recorded as skipped executions, as after a scheduler's downtime.
    """
    pending = job.next_run_at
    if pending is None or pending > now or schedule.cron is None:
        return (pending if pending is not None else now), []
    to_run, skipped = sched.misfire_plan(schedule, pending, now, job_id=job.job_id)
    return (to_run[0] if to_run else pending), skipped


def _cancel(job: Job, schedule: Schedule) -> Transition | None:
    if job.state in ("canceled", "completed"):
        return None
    return Transition(state="canceled", next_run_at=None, clear_due="all",
                      cancel_executions=True)


async def _transition(ctx: Ctx, tenant_id: uuid.UUID, job_id: uuid.UUID, decide) -> Job:
    done = await store.transition_job(ctx.db, tenant_id, job_id, ctx.clock.now(), decide)
    await ctx.wrote(tenant_id)
    if done.canceled:
        await ctx.cancel_running(pool_of(done.job), done.canceled)
    if done.due:
        await ctx.notify_due([(shard, job_id, when, tenant_id, pool_of(done.job))
                              for shard, job_id, when in done.due])
    return done.job


# The transitions themselves, with what they tell the hot tier after the commit: the
# /v1 handlers below and the dashboard's buttons (gateway/ui.py) both call these.


async def pause(ctx: Ctx, tenant_id: uuid.UUID, job_id: uuid.UUID) -> Job:
    return await _transition(ctx, tenant_id, job_id, _pause)


async def resume(ctx: Ctx, tenant_id: uuid.UUID, job_id: uuid.UUID) -> Job:
    return await _transition(ctx, tenant_id, job_id, _resumer(ctx.clock.now()))


async def cancel(ctx: Ctx, tenant_id: uuid.UUID, job_id: uuid.UUID) -> Job:
    """Its unfinished executions are canceled and their workers told (LEASE_LOST)."""
    return await _transition(ctx, tenant_id, job_id, _cancel)


async def _transition_request(request: web.Request, change) -> Job:
    ctx = Ctx.of(request)
    owner = await tenant_of(request, ctx.db, ctx.keys)
    return await change(ctx, owner.tenant_id, job_id_of(request))


def pool_of(job: Job) -> str:
    return job.target.ref if job.target.type == "queue" else HTTP_POOL


async def pause_job(request: web.Request) -> web.Response:
    """No new attempt starts while the job is paused: neither its occurrences nor the
    retries of its executions (those stay in retry_wait). A running attempt finishes.
    Pausing a paused job changes nothing; a canceled or completed job is 409."""
    job = await _transition_request(request, pause)
    return json_response(200, job, etag(job))


async def resume_job(request: web.Request) -> web.Response:
    """The next occurrence follows the misfire policy if its time passed while paused;
    a retry held back by the pause runs at its retry time, or at once if that passed."""
    job = await _transition_request(request, resume)
    return json_response(200, job, etag(job))


async def cancel_job(request: web.Request) -> web.Response:
    """Nothing of the job runs again: its queued, running and retry_wait executions are
    canceled (a running attempt's worker gets LEASE_LOST)."""
    await _transition_request(request, cancel)
    return web.Response(status=204)
