"""Which seconds the herd warning checks: few, whatever the request holds."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import msgspec

from herdwick import schedule as sched
from herdwick.gateway import herd
from herdwick.gateway.submit import prepare
from herdwick.model import JobSpec

NOW = datetime(2026, 12, 2, 12, 0, 0, tzinfo=UTC)


def job(**schedule):
    body = {"name": "n", "target": {"type": "queue", "ref": "q"}, "payload": {},
            "schedule": schedule}
    spec = msgspec.json.decode(msgspec.json.encode(body), type=JobSpec)
    return prepare(spec, now=NOW, allow=()).job


def check(jobs, monkeypatch) -> tuple[herd.HerdCheck, list[str]]:
    """herd_check at five jobs a second, and the cron expressions whose fires it computed
    (one entry a computation)."""
    computed: list[str] = []
    real = sched.next_fire_times

    def counting(schedule, after, count=1, **kw):
        computed.append(schedule.cron)
        return real(schedule, after, count, **kw)

    monkeypatch.setattr(sched, "next_fire_times", counting)
    return herd.herd_check(jobs, NOW, 5), computed


def test_one_offs_check_their_busiest_seconds_only(monkeypatch) -> None:
    jobs = [job(delaySeconds=60 + i // 2) for i in range(20)]  # two a second for ten seconds
    jobs += [job(delaySeconds=59) for _ in range(3)]
    got, computed = check(jobs, monkeypatch)
    assert got.seconds[0] == NOW + timedelta(seconds=59)
    assert got.in_request[0] == 3
    assert len(got.seconds) == herd.HERD_BUSIEST_SECONDS
    assert computed == []


def test_a_cron_job_adds_its_later_fires_within_a_day(monkeypatch) -> None:
    got, computed = check([job(cron="0 * * * *"), job(cron="0 * * * *")], monkeypatch)
    assert got.seconds == [NOW + timedelta(hours=h) for h in range(1, 25)]
    assert set(got.in_request) == {2}
    assert got.labels[0] == "2026-12-02T13:00:00Z"
    assert computed == ["0 * * * *"]  # one schedule, one computation


def test_jittered_cron_jobs_add_only_their_first_fire(monkeypatch) -> None:
    got, computed = check([job(cron="0 * * * *", jitterSeconds=30)], monkeypatch)
    assert len(got.seconds) == 1
    assert computed == []


def test_a_batch_of_distinct_cron_jobs_cannot_make_the_check_expensive(monkeypatch) -> None:
    jobs = [job(cron="H * * * *") for _ in range(1000)]  # H: one of 60 schedules each
    got, computed = check(jobs, monkeypatch)
    assert len(computed) == herd.HERD_FIRE_LISTS_MAX
    assert len(got.seconds) == herd.HERD_SECONDS_MAX
