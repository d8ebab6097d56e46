"""The spiky-schedule warning: the seconds in which a submission joins a herd of the tenant's jobs.

A 201 carries a warning when, in one second, the request's jobs and the
tenant's occurrences already waiting then reach HERDWICK_HERD_WARN_JOBS. The
seconds checked are the request's busiest (by its jobs' first due times) and
the later fires within a day of its cron jobs without jitter, at most
HERD_SECONDS_MAX in all, counted in one statement inside the insert
(storage/queries/jobs.sql insert_jobs), so no request can make the check
expensive.

The tenant's side counts the occurrences waiting in due_index, each job's
next one only: a cron job counts in the second it fires next, not in the ones
after, so a herd that existing cron jobs form later in the day shows once they
get there, not at this submit. (due_index, not jobs: its narrow rows stay in
memory, and the count visits each one's page until a vacuum marks it visible.)
"""

from __future__ import annotations

import collections
from datetime import UTC, datetime, timedelta

import msgspec

from herdwick import schedule as sched
from herdwick.model import Schedule
from herdwick.storage.jobs import HerdCheck, NewJob

HERD_BUSIEST_SECONDS = 3  # of the request's first due times, the busiest checked
HERD_FIRES_PER_JOB = 24  # a cron job's fires counted, its first included...
HERD_HORIZON = timedelta(hours=24)  # ...that fall within this of the submit
HERD_FIRE_LISTS_MAX = 16  # distinct cron fire lists computed per request (~0.1 ms each)
HERD_SECONDS_MAX = 32  # seconds checked per request: each is an index range scan
HERD_SUGGESTED_JITTER_S = 60
# Where the warned response names its second until SQL knows which: no job is due
# then (runAt and delaySeconds end ten years out, cron fires end in 9998).
HERD_PLACEHOLDER = datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC)

_schedule_decoder = msgspec.json.Decoder(Schedule)


def _second(when: datetime) -> datetime:
    return when.replace(microsecond=0)


def herd_check(jobs: list[NewJob], now: datetime, limit: int) -> HerdCheck:
    """The seconds to check, with the request's own jobs due in each (first and later fires)."""
    first = collections.Counter(_second(j.next_run_at) for j in jobs)
    later = _later_fires(jobs, now)
    fires = first + later
    busiest = [s for s, _ in first.most_common(HERD_BUSIEST_SECONDS)]
    rest = sorted(later.keys() - set(busiest), key=lambda s: (-fires[s], s))
    seconds = busiest + rest[:HERD_SECONDS_MAX - len(busiest)]
    return HerdCheck(seconds=seconds, in_request=[fires[s] for s in seconds],
                     labels=[sched.format_utc(s) for s in seconds], limit=limit)


def _later_fires(jobs: list[NewJob], now: datetime) -> collections.Counter[datetime]:
    """The request's cron jobs' fires after their first, by whole second. Jittered ones
    are left out: they asked to be spread, and their fires differ job by job."""
    # The resolved expression (H filled in for the job), the zone and the first fire
    # fix the fires: jobs alike share one list, computed once.
    alike: dict[tuple[str, str | None, datetime], tuple[Schedule, NewJob]] = {}
    count: collections.Counter[tuple[str, str | None, datetime]] = collections.Counter()
    for job in jobs:
        # NewJob keeps the schedule as JSON text without defaults, so only a cron
        # schedule has the key: a batch of one-offs decodes nothing.
        if '"cron"' not in job.schedule:
            continue
        schedule = _schedule_decoder.decode(job.schedule)
        if schedule.jitter_seconds:
            continue
        key = (sched.parse_cron(schedule.cron, job_id=job.job_id).plain, schedule.tz,
               job.next_run_at)
        if key not in alike:
            if len(alike) == HERD_FIRE_LISTS_MAX:
                continue
            alike[key] = (schedule, job)
        count[key] += 1
    until = now + HERD_HORIZON
    fires: collections.Counter[datetime] = collections.Counter()
    for key, (schedule, job) in alike.items():
        for when in sched.next_fire_times(schedule, job.next_run_at, HERD_FIRES_PER_JOB - 1,
                                          job_id=job.job_id):
            if when <= until:
                fires[_second(when)] += count[key]
    return fires


def herd_warning(second: datetime, limit: int) -> str:
    return (f"at least {limit} of this tenant's jobs are due in the second "
            f"{sched.format_utc(second)}; spread them with schedule.jitterSeconds "
            f"(e.g. {HERD_SUGGESTED_JITTER_S})")
