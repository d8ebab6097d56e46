"""The invariants of a fault run, checked over its whole history in Postgres.

Not what the workers saw (the fault worker records nothing): what Postgres
holds once the run has drained, as an owner reading the API would find it.

- none lost: every one-off job has exactly one execution, and it succeeded
  (or is dead for a reason the scenario allows);
- no occurrence executed twice as two executions: (job_id, scheduled_for) is
  unique, and a one-off has a single occurrence;
- no stale complete accepted: an execution's one succeeded attempt is its
  current attempt, completed by the worker that held that attempt's lease
  (executions.lease_owner), and is not among the calls the fence refused
  (stale_calls); no two attempts of one execution both succeeded;
- attempts numbered 1..n, each once, none above the execution's attempt,
  started in that order. A gap is a number the sweeper republished before
  any worker leased it (Redis lost it, or a scheduler died between commit
  and publish); only scenarios that cause that may have gaps;
- nothing left queued or running, no attempt left running, but for the cron
  occurrences that fell due within CRON_GRACE of the check: the stack keeps
  running, and a minute's occurrences may be in flight as it looks;
- cron continuations intact: every cron job still active with its next due
  row after its last occurrence, and no occurrence that fell due missing.
"""

from __future__ import annotations

import collections
import json
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from herdwick.storage.db import Database

# How long before the check a cron occurrence must have fallen due for its execution to
# be required, and finished (one closer may not have been dispatched or run yet).
CRON_GRACE = timedelta(seconds=3)

# The checks' own statements on the scenario's scratch database.
_JOBS_SQL = """
SELECT job_id, name, schedule->>'cron' IS NOT NULL AS cron, schedule->>'cron' AS cron_text,
       state, next_run_at, created_at
FROM jobs"""
_EXECUTIONS_SQL = """
SELECT execution_id, job_id, scheduled_for, attempt, state, lease_owner,
       error->>'type' AS error_type, stale_calls::text AS stale_calls
FROM executions"""
_ATTEMPTS_SQL = """
SELECT execution_id, attempt, worker_id, started_at, outcome
FROM execution_attempts ORDER BY execution_id, attempt"""
_DUE_SQL = "SELECT job_id, next_run_at, execution_id FROM due_index"
_NOW_SQL = "SELECT now()"


@dataclass
class Verdict:
    """What the history shows. The figures are counts; `problems` names each broken
    invariant with a few examples, empty when all hold."""

    jobs: int = 0
    executions: int = 0
    lost: int = 0
    duplicates: int = 0
    stale_accepted: int = 0
    reruns: int = 0  # executions with more than one attempt that reached a worker
    attempt_gaps: int = 0  # attempt numbers republished before any worker leased them
    stale_recorded: int = 0  # refused calls recorded as possible duplicates
    stale_workers: set[str] = field(default_factory=set)  # whose calls they were
    # Succeeded executions whose lease_owner does not name the attempt's worker: NULL, or an
    # earlier attempt's worker (see _attempts). The attempt row has the right worker.
    owner_unrecorded: int = 0
    dead: collections.Counter = field(default_factory=collections.Counter)  # by error type
    broken: dict[str, list] = field(default_factory=lambda: collections.defaultdict(list))

    def fail(self, what: str, examples: list) -> None:
        self.broken[what] += examples

    @property
    def problems(self) -> list[str]:
        return [f"{what}: {len(found)}, e.g. {found[:3]}"
                for what, found in self.broken.items() if found]


async def check(db: Database, *, allowed_dead: frozenset[str] = frozenset(),
                allow_gaps: bool = False) -> Verdict:
    # One snapshot: the stack keeps running, and a cron minute that fired between two
    # reads showed its leases among the attempts but not its executions.
    async with db.connection() as conn, \
            conn.transaction(isolation="repeatable_read", readonly=True):
        jobs = await conn.fetch(_JOBS_SQL)
        executions = await conn.fetch(_EXECUTIONS_SQL)
        attempts = await conn.fetch(_ATTEMPTS_SQL)
        due = await conn.fetch(_DUE_SQL)
        now = await conn.fetchval(_NOW_SQL)
    verdict = Verdict(jobs=len(jobs), executions=len(executions))
    by_job = collections.defaultdict(list)
    for e in executions:
        by_job[e["job_id"]].append(e)
    tries = collections.defaultdict(list)
    for a in attempts:
        tries[a["execution_id"]].append(a)

    _occurrences_unique(verdict, executions)
    _one_offs(verdict, [j for j in jobs if not j["cron"]], by_job, allowed_dead)
    crons = [j for j in jobs if j["cron"]]
    _crons(verdict, crons, by_job, due, now)
    for e in executions:
        _attempts(verdict, e, tries.get(e["execution_id"], []), allow_gaps)
    just_due = {e["execution_id"] for j in crons for e in by_job.get(j["job_id"], [])
                if e["scheduled_for"] > now - CRON_GRACE}
    verdict.fail("executions left queued or running", [
        str(e["execution_id"]) for e in executions
        if e["state"] in ("queued", "running") and e["execution_id"] not in just_due])
    verdict.fail("attempts left running", [
        str(a["execution_id"]) for a in attempts
        if a["outcome"] == "running" and a["execution_id"] not in just_due])
    return verdict


def _occurrences_unique(verdict: Verdict, executions: list) -> None:
    seen = collections.Counter((e["job_id"], e["scheduled_for"]) for e in executions)
    doubled = [str(k[0]) for k, n in seen.items() if n > 1]
    verdict.duplicates += len(doubled)
    verdict.fail("occurrences executed as two executions", doubled)


def _one_offs(verdict: Verdict, jobs: list, by_job: dict, allowed_dead: frozenset[str]) -> None:
    lost, twice, wrongly_dead = [], [], []
    for job in jobs:
        runs = by_job.get(job["job_id"], [])
        if len(runs) > 1:
            twice.append(str(job["job_id"]))
            continue
        if not runs or runs[0]["state"] not in ("succeeded", "dead"):
            lost.append(str(job["job_id"]))
            continue
        if runs[0]["state"] == "dead":
            reason = runs[0]["error_type"] or "?"
            verdict.dead[reason] += 1
            if reason not in allowed_dead:
                wrongly_dead.append((str(job["job_id"]), reason))
    verdict.lost += len(lost) + len(wrongly_dead)
    verdict.duplicates += len(twice)
    verdict.fail("one-off jobs without a finished execution (lost)", lost)
    verdict.fail("one-off jobs dead for a reason the scenario does not allow", wrongly_dead)
    verdict.fail("one-off jobs with more than one execution", twice)


def _crons(verdict: Verdict, jobs: list, by_job: dict, due: list, now: datetime) -> None:
    next_due = collections.defaultdict(list)
    for row in due:
        if row["execution_id"] is None:
            next_due[row["job_id"]].append(row["next_run_at"])
    broken, missing = [], []
    for job in jobs:
        runs = sorted(by_job.get(job["job_id"], []), key=lambda e: e["scheduled_for"])
        last = runs[-1]["scheduled_for"] if runs else None
        rows = next_due.get(job["job_id"], [])
        if (job["state"] != "active" or len(rows) != 1 or job["next_run_at"] is None
                or (last is not None and rows[0] <= last)):
            broken.append((str(job["job_id"]), job["state"], rows, last))
        if not runs:
            missing.append(str(job["job_id"]))
            continue
        # Every minute boundary from the first occurrence to the grace before now.
        at = runs[0]["scheduled_for"]
        fired = {e["scheduled_for"] for e in runs}
        while at <= now - CRON_GRACE:
            if at not in fired:
                missing.append((str(job["job_id"]), at.isoformat()))
            at = at.replace(second=0, microsecond=0) + timedelta(minutes=1)
    verdict.lost += len(missing)
    verdict.fail("cron jobs whose continuation is broken", broken)
    verdict.fail("cron occurrences that fell due and have no execution (lost)", missing)


def _attempts(verdict: Verdict, e, rows: list, allow_gaps: bool) -> None:
    numbers = [a["attempt"] for a in rows]
    eid = str(e["execution_id"])
    if numbers != sorted(set(numbers)) or (numbers and (numbers[0] < 1
                                                        or numbers[-1] > e["attempt"])):
        verdict.fail("attempt numbers not increasing within 1..attempt", [(eid, numbers)])
    starts = [a["started_at"] for a in rows if a["started_at"] is not None]
    if starts != sorted(starts):
        verdict.fail("attempts that started before an earlier-numbered one", [(eid, numbers)])
    gaps = len(set(range(1, e["attempt"] + 1)) - set(numbers)) if e["state"] != "dead" else 0
    verdict.attempt_gaps += gaps
    if gaps and not allow_gaps:
        verdict.fail("attempt numbers never leased (gaps) where nothing should republish",
                     [(eid, numbers, e["attempt"])])
    if sum(1 for a in rows if a["worker_id"] is not None) > 1:
        verdict.reruns += 1

    refused = set()
    for call in json.loads(e["stale_calls"] or "[]"):
        verdict.stale_recorded += call.get("count", 1)
        verdict.stale_workers.add(call.get("workerId", ""))
        if call.get("call") == "complete":
            refused.add((call.get("attempt"), call.get("workerId")))
    won = [a for a in rows if a["outcome"] == "succeeded"]
    owner = e["lease_owner"]
    # executions.lease_owner is the owner named by the last `leased` event applied to the
    # row, not per attempt: an attempt's `completed` event applied before its `leased`
    # one (two nodes share the events stream) leaves it NULL, or naming an earlier
    # attempt's worker (a retry's dispatch does not clear it). Either is a gap in the
    # record, counted apart; an owner that held no attempt of this execution is not.
    earlier = {a["worker_id"] for a in rows if won and a["attempt"] < won[0]["attempt"]}
    owner_stale = bool(won) and owner is not None and owner != won[0]["worker_id"] \
        and owner in earlier
    if e["state"] == "succeeded" and (owner is None or owner_stale):
        verdict.owner_unrecorded += 1
    accepted_stale = (
        len(won) > 1
        or (e["state"] == "succeeded" and (
            len(won) != 1 or won[0]["attempt"] != e["attempt"]
            or (owner is not None and not owner_stale and won[0]["worker_id"] != owner)
            or (won[0]["attempt"], won[0]["worker_id"]) in refused))
        or (e["state"] != "succeeded" and won))
    if accepted_stale:
        verdict.stale_accepted += 1
        verdict.fail("succeeded attempts not completed by the lease's holder (stale accepted)",
                     [(eid, e["state"], e["attempt"], e["lease_owner"],
                       [(a["attempt"], a["worker_id"], a["outcome"]) for a in rows])])
