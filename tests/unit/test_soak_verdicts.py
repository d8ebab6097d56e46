"""How `loadtest soak` judges a series flat: the first third is warm-up, the last third is
held against the second; RSS by means, the steady p99 by medians; too short a series is
not judged at all. And how the lag it judges is kept: by row, and bounded."""

from __future__ import annotations

import random
import uuid
from datetime import UTC, datetime, timedelta

from herdwick.loadtest import soak
from herdwick.loadtest.soak import (
    MIN_PER_THIRD,
    Leases,
    WindowLag,
    p99_flatness,
    rss_flatness,
    thirds,
    window_lag,
)


def test_the_warm_up_takes_the_first_third_and_what_does_not_divide() -> None:
    assert thirds(list(range(10))) == ([4, 5, 6], [7, 8, 9])
    assert thirds(list(range(3 * MIN_PER_THIRD - 1))) is None


def test_a_process_that_grows_while_warming_up_and_then_holds_is_flat() -> None:
    # Pools and caches fill in the first minutes; then nothing more is kept.
    series = [40 + min(i, 10) * 2.0 for i in range(30)]
    verdict = rss_flatness(series)
    assert verdict.flat is True
    assert verdict.second_third == verdict.last_third == 60.0
    assert verdict.change == 0.0


def test_a_process_that_leaks_is_not_flat() -> None:
    series = [60 * 1.01 ** i for i in range(30)]  # 1 % a sample
    verdict = rss_flatness(series)
    assert verdict.flat is False
    assert verdict.last_third > verdict.bound
    assert verdict.change > soak.RSS_GROWTH_MAX


def test_a_slow_leak_is_caught_and_noise_around_a_level_is_not() -> None:
    rng = random.Random(13)
    noisy = [60 + rng.uniform(-3, 3) for _ in range(60)]  # +-5 % from sample to sample
    assert rss_flatness(noisy).flat is True
    slow = [60 + 0.2 * i + rng.uniform(-3, 3) for i in range(60)]  # 4 MB a third
    assert rss_flatness(slow).flat is False


def test_a_steady_p99_with_a_spike_in_it_is_flat() -> None:
    # One row with a GC pause or a neighbour's burst moves the median not at all.
    rows = [50.0, 48, 52, 51, 49, 50, 900, 50, 51, 49, 50, 52]
    verdict = p99_flatness(rows)
    assert verdict.flat is True
    assert (verdict.second_third, verdict.last_third) == (50.0, 50.5)
    assert verdict.bound == 50 * (1 + soak.P99_GROWTH_MAX) + soak.P99_SLACK_MS


def test_a_p99_that_creeps_up_is_not_flat_and_jitter_within_the_slack_is() -> None:
    creeping = [40.0 + 10 * i for i in range(12)]  # +10 ms a minute: 340 ms by minute 30
    assert p99_flatness(creeping).flat is False
    jitter = [20.0, 22, 21, 20, 21, 20, 22, 20, 28, 29, 27, 28]  # +8 ms on 20: the slack
    assert p99_flatness(jitter).flat is True


def test_too_short_a_series_is_not_judged_and_fails_nothing() -> None:
    verdict = p99_flatness([50.0, 900.0, 2_000.0])
    assert verdict.flat is None and verdict.change is None and verdict.points == 3
    rss, p99 = soak.verdicts([], [])
    assert rss.flat is None and p99.flat is None
    assert "first third is warm-up" in rss.rule and "median" in p99.rule


def test_window_lags_are_nearest_rank() -> None:
    assert window_lag([]) == WindowLag(0, None, None, None)
    assert window_lag([float(v) for v in range(100, 0, -1)]) == WindowLag(100, 50, 99, 100)


async def test_leased_jobs_go_to_their_window_and_row_and_a_row_closes_when_all_are_leased(
        ) -> None:
    origin = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)
    leases = Leases(origin, row_s=10.0)
    herd = [(uuid.uuid4(), origin) for _ in range(3)]
    steady = [(uuid.uuid4(), origin + timedelta(seconds=s)) for s in (1, 2, 11)]
    leases.expect(herd, herd=True)
    leases.expect(steady, herd=False)
    started = {herd[0][0]: 5.0, herd[1][0]: 7.0, steady[0][0]: 1.0}
    db = _FakeDb(started)

    steady_lag, herd_lag = await leases.probe(db, origin + timedelta(seconds=3))
    assert (steady_lag.count, herd_lag.count) == (1, 2)
    assert db.asked == 5  # the jobs due by then, not the one due at 11 s
    assert leases.waiting == 3 and not leases.closed

    started.update({herd[2][0]: 9.0, steady[1][0]: 2.0, steady[2][0]: 3.0})
    steady_lag, herd_lag = await leases.probe(db, origin + timedelta(seconds=12))
    assert (steady_lag.count, herd_lag.count) == (2, 1)
    assert db.asked == 3  # only those still waiting
    assert list(leases.closed) == [0]  # row 1 runs until 20 s
    lags, steady0, herd0 = leases.closed[0]
    assert (lags.steady_jobs, lags.herd_jobs) == (2, 3)
    assert steady0 == WindowLag(2, 1.0, 2.0, 2.0) and herd0 == WindowLag(3, 7.0, 9.0, 9.0)
    assert lags.steady == lags.herd == []  # the row's lags let go
    leases.close_all()
    assert sorted(leases.closed) == [0, 1] and leases.closed[1][1].count == 1


class _FakeDb:
    """The lag statement's answer for the keys it is given: a lag for each started job."""

    def __init__(self, started: dict[uuid.UUID, float]) -> None:
        self.started, self.asked = started, 0

    def connection(self):
        return self

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        return None

    async def fetch(self, _sql: str, ids: list[uuid.UUID], _dues: list[datetime]) -> list[dict]:
        self.asked = len(ids)
        return [{"i": i + 1, "lag_ms": self.started[job]} for i, job in enumerate(ids)
                if job in self.started]
