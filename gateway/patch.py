"""Changing a job: PATCH as a JSON merge patch under If-Match, and its revisions.

A patch (RFC 7396) applies to the job as GET shows it; the result is checked
exactly as a submission is (gateway/jobs.py prepare_all), so a change cannot
make a job that could not have been submitted. The version the client read is
checked twice: before the checks (a stale one is 412 without the work, DNS
lookups included) and again under the row lock, which is the check that counts.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec
from aiohttp import web

from herdwick.credentials import hash_api_key
from herdwick.errors import Conflict, VersionMismatch
from herdwick.gateway import params
from herdwick.gateway.auth import bearer, tenant_of
from herdwick.gateway.body import read_json_body
from herdwick.gateway.context import Ctx
from herdwick.gateway.decoding import MAX_DEPTH_MESSAGE, decode, decode_collecting
from herdwick.gateway.jobs import SINGLE_BODY_CAP, job_id_of, pool_of, prepare_all
from herdwick.gateway.params import etag, json_response
from herdwick.gateway.problems import HttpProblem, bad_field, invalid
from herdwick.gateway.submit import normalised
from herdwick.model import FieldChange, Job, JobPatch, JobSpec, RevisionPage, ScheduleOut
from herdwick.storage import jobs as store
from herdwick.storage.db import Database

_patch_decoder = msgspec.json.Decoder(JobPatch)
_spec_decoder = msgspec.json.Decoder(JobSpec)
_encode = msgspec.json.Encoder().encode
_ENTITY_TAG = re.compile(r'"([1-9][0-9]{0,9})"')
KEY_FINGERPRINT_HEX = 12  # revisions name the API key by this much of its SHA-256


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7396: objects merge member by member, null removes, anything else replaces."""
    if not isinstance(patch, dict):
        return patch
    merged = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = merge_patch(merged.get(key), value)
    return merged


def _shown(job: Job) -> dict[str, Any]:
    """The patchable fields of a job as GET shows them, as plain JSON values."""
    return {"name": job.name, "target": msgspec.to_builtins(job.target),
            "payload": msgspec.json.decode(job.payload),
            "schedule": msgspec.to_builtins(job.schedule),
            "retry": msgspec.to_builtins(job.retry), "timeoutSeconds": job.timeout_seconds,
            "labels": job.labels, "dryRun": job.dry_run}


def _shown_spec(spec: JobSpec) -> dict[str, Any]:
    """The same fields as GET will show them once `spec` is stored."""
    return {"name": spec.name, "target": msgspec.to_builtins(spec.target),
            "payload": msgspec.json.decode(spec.payload),
            "schedule": msgspec.to_builtins(ScheduleOut.of(normalised(spec.schedule))),
            "retry": msgspec.to_builtins(spec.retry), "timeoutSeconds": spec.timeout_seconds,
            "labels": spec.labels, "dryRun": spec.dry_run}


def if_match(request: web.Request) -> set[int]:
    """The versions If-Match names (`"3"`, a list of them); none that parse matches nothing.

    `*` is refused with the missing header: it would let a client overwrite a change
    it never saw, which is what the header is for.
    """
    header = request.headers.get("If-Match", "").strip()
    if not header or header == "*":
        raise HttpProblem(428, "precondition-required", "Precondition required",
                          'send If-Match with the ETag of the job as you read it (e.g. "3")')
    return {int(m.group(1)) for tag in header.split(",")
            if (m := _ENTITY_TAG.fullmatch(tag.strip()))}


def _stale(job: Job) -> VersionMismatch:
    return VersionMismatch(f"the job is at version {job.version}, not the one If-Match names",
                           job.version)


async def patch_job(request: web.Request) -> web.Response:
    """A JSON merge patch (RFC 7396) of the job as GET shows it, under `If-Match: "<version>"`
    (the ETag of every job read): a missing If-Match is 428, a stale one 412. null resets
    a field to its default (name, target and schedule cannot be null). The merged job is
    checked as a submission is; a schedule change moves nextRunAt (counted from now)
    and its due time at once. A canceled or completed job is 409. Each change leaves a
    revision; a patch that changes nothing changes nothing, version included."""
    ctx = Ctx.of(request)
    owner = await tenant_of(request, ctx.db, ctx.keys)
    job_id = job_id_of(request)
    body = await read_json_body(request, SINGLE_BODY_CAP)
    decode(_patch_decoder, body)  # the patch's own shape: unknown and read-only fields, types
    versions = if_match(request)
    current = await store.get_job(ctx.db, owner.tenant_id, job_id)
    if current.version not in versions:
        raise _stale(current)
    if current.state in ("canceled", "completed"):
        raise Conflict(f"a {current.state} job cannot be changed")
    before = _shown(current)
    try:
        # Python's own recursion (the merge, comparing values) stops short of msgspec's.
        merged = merge_patch(before, msgspec.json.decode(body))
        spec, errors = decode_collecting(_spec_decoder, _encode(merged), duplicates=False)
        if errors:
            raise invalid(errors)
        [new] = await prepare_all(ctx, [spec], batch=False, job_id=job_id)
        after = _shown_spec(spec)
        changed = [k for k in before if before[k] != after[k]]
    except RecursionError:
        raise bad_field("body", MAX_DEPTH_MESSAGE, status=400) from None
    changes = {k: FieldChange(before=msgspec.Raw(_encode(before[k])),
                              after=msgspec.Raw(_encode(after[k]))) for k in changed}
    if not changes:
        return json_response(200, current, etag(current))
    done = await store.update_job(
        ctx.db, owner.tenant_id, job_id, versions=versions, new=new,
        schedule_changed="schedule" in changes, revised_by=_who(request),
        changes=_encode(changes).decode(), now=ctx.clock.now())
    await ctx.wrote(owner.tenant_id)
    if done.due:
        await ctx.notify_due([(shard, jid, when, owner.tenant_id, pool_of(done.job))
                              for shard, jid, when in done.due])
    return json_response(200, done.job, etag(done.job))


def _who(request: web.Request) -> str:
    return "key:" + hash_api_key(bearer(request)).hex()[:KEY_FINGERPRINT_HEX]


async def job_revisions(request: web.Request) -> web.Response:
    """Every change PATCH made to the job, newest first: the version it made, who
    (`key:` and the first 12 hex digits of the SHA-256 of the API key), when, and each
    field it changed, before and after."""
    ctx = Ctx.of(request)
    owner = await tenant_of(request, ctx.db, ctx.keys)
    job_id = job_id_of(request)

    async def page(db: Database):  # both on one server: the job, then its revisions
        job = await store.get_job(db, owner.tenant_id, job_id)  # a missing job: 404 first
        return await store.job_revisions(
            db, owner.tenant_id, job.job_id,
            params.cursor(request, store.decode_revision_cursor), params.limit(request))

    items, cursor = await ctx.read(owner.tenant_id, page)
    return json_response(200, RevisionPage(items=items, next_cursor=cursor))
