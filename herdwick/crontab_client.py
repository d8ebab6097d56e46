"""What the crontab commands ask of a gateway: create a crontab's jobs, read their runs.

Through the tenant HTTP API with the tenant's API key, as any client would: the
gateway's checks, idempotency and notifies apply unchanged, and the key names the
tenant (no database access, no admin token). Each entry's job carries the labels
`crontab` (the source's name) and `crontab.entry` (the entry's digest, which leaves
out the line number): an import looks for that label before it creates anything, so
running it again creates nothing new, however long after. A create also sends an
Idempotency-Key from the digest, so two imports at once still make one job.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any, Literal

import aiohttp
import msgspec

from herdwick.crontab import Crontab, Entry
from herdwick.model import MAX_NAME_LEN

SOURCE_LABEL = "crontab"
ENTRY_LABEL = "crontab.entry"
PAGE = 500
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_TIMEOUT = aiohttp.ClientTimeout(total=30)


class GatewayError(Exception):
    """The gateway answered with an error (its problem's detail), or could not be reached
    (status None)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class Imported(msgspec.Struct, frozen=True, kw_only=True):
    line: int
    # refused: by the parser, or by the gateway for what the entry holds; failed: the
    # gateway could not be asked (down, a bad key)
    outcome: Literal["created", "exists", "refused", "failed"]
    job_id: str | None = None
    detail: str = ""


def target_of(ref: str) -> dict[str, str]:
    kind = "http" if ref.lower().startswith(("http://", "https://")) else "queue"
    return {"type": kind, "ref": ref}


def job_body(entry: Entry, source: str, target: str, dry_run: bool) -> dict[str, Any]:
    """The job an entry becomes: its schedule, and a payload with all a worker needs to
    run the command as cron would (command, standard input, environment, user)."""
    payload: dict[str, Any] = {"command": entry.command, "env": entry.env,
                               "crontab": {"source": source, "line": entry.line}}
    if entry.stdin is not None:
        payload["stdin"] = entry.stdin
    if entry.user is not None:
        payload["user"] = entry.user
    return {"name": _CONTROL.sub(" ", entry.command)[:MAX_NAME_LEN],
            "target": target_of(target),
            "schedule": {"cron": entry.cron, "tz": entry.tz},
            "payload": payload, "dryRun": dry_run,
            "labels": {SOURCE_LABEL: source, ENTRY_LABEL: entry.digest(source)}}


class Gateway:
    """A tenant's view of one gateway."""

    def __init__(self, url: str, api_key: str) -> None:
        self._url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"}
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Gateway:
        self._session = aiohttp.ClientSession(timeout=_TIMEOUT, headers=self._headers)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._session is not None
        await self._session.close()

    async def _call(self, method: str, path: str, **kw) -> Any:
        assert self._session is not None
        try:
            async with self._session.request(method, self._url + path, **kw) as resp:
                body = await resp.json(content_type=None)
                if resp.status >= 400:
                    detail = body.get("detail") if isinstance(body, dict) else None
                    raise GatewayError(f"{resp.status} {detail or body}", resp.status)
                return body
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise GatewayError(f"{method} {path}: {exc or type(exc).__name__}") from exc

    async def job_with_label(self, key: str, value: str) -> dict | None:
        page = await self._call("GET", "/v1/jobs",
                                params=[("label", f"{key}:{value}"), ("limit", "1")])
        return page["items"][0] if page["items"] else None

    async def submit(self, body: dict, idempotency_key: str) -> dict:
        return await self._call("POST", "/v1/jobs", json=body,
                                headers={"Idempotency-Key": idempotency_key})

    async def fires(self, job_id: str, since: datetime, until: datetime) -> list[datetime]:
        """The job's executions scheduled in [since, until), but the skipped ones (which
        did not fire), oldest first. The list is newest first: read until before since."""
        found: list[datetime] = []
        cursor = None
        while True:
            params = [("limit", str(PAGE))] + ([("cursor", cursor)] if cursor else [])
            page = await self._call("GET", f"/v1/jobs/{job_id}/executions", params=params)
            for item in page["items"]:
                when = datetime.fromisoformat(item["scheduledFor"].replace("Z", "+00:00"))
                if when < since:
                    return sorted(found)
                if when < until and item["state"] != "skipped":
                    found.append(when)
            cursor = page["nextCursor"]
            if cursor is None:
                return sorted(found)


async def import_crontab(gateway: Gateway, crontab: Crontab, *, source: str, target: str,
                         dry_run: bool) -> list[Imported]:
    """Each line's outcome, in line order: created, already there (a job carries its
    digest), or refused (by the parser, or by the gateway: its reason)."""
    done = [Imported(line=r.line, outcome="refused", detail=r.reason) for r in crontab.refused]
    seen: dict[str, int] = {}
    for entry in crontab.entries:
        digest = entry.digest(source)
        if digest in seen:
            done.append(Imported(line=entry.line, outcome="refused",
                                 detail=f"the same entry as line {seen[digest]}"))
            continue
        seen[digest] = entry.line
        try:
            existing = await gateway.job_with_label(ENTRY_LABEL, digest)
            if existing is not None:
                done.append(Imported(line=entry.line, outcome="exists",
                                     job_id=existing["jobId"]))
                continue
            created = await gateway.submit(job_body(entry, source, target, dry_run),
                                           f"crontab-{digest}")
        except GatewayError as exc:
            outcome = "refused" if exc.status is not None and exc.status < 500 else "failed"
            if exc.status in (401, 403):
                outcome = "failed"
            done.append(Imported(line=entry.line, outcome=outcome, detail=str(exc)))
            continue
        done.append(Imported(line=entry.line, outcome="created", job_id=created["jobId"]))
    return sorted(done, key=lambda i: i.line)


async def recorded_fires(gateway: Gateway, crontab: Crontab, *, source: str,
                         since: datetime, until: datetime
                         ) -> dict[int, tuple[str | None, list[datetime]]]:
    """By entry line: its job (None: not imported) and the times its executions fired."""
    out: dict[int, tuple[str | None, list[datetime]]] = {}
    for entry in crontab.entries:
        job = await gateway.job_with_label(ENTRY_LABEL, entry.digest(source))
        if job is None:
            out[entry.line] = (None, [])
        else:
            out[entry.line] = (job["jobId"], await gateway.fires(job["jobId"], since, until))
    return out
