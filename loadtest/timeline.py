"""A run's figures second by second, for the plots of `--report`: how many things happened
in each second and their lag's percentiles.

Built after the run from what the load test recorded anyway (the stream entries the
consumers saw, the receivers' records, each request's finish time) or, for the runs
whose lag lives in Postgres, from one query over the executions once the run is over:
nothing here is polled while the load runs.
"""

from __future__ import annotations

import collections
import math
import uuid
from collections.abc import Iterable
from datetime import UTC, datetime

import msgspec

from herdwick.loadtest.measure import nearest_rank
from herdwick.storage.db import Database


class Second(msgspec.Struct, frozen=True, array_like=True):
    """One second of a series: [t_s, count, p50_ms, p99_ms, max_ms] in the JSON; the lag
    is None for a second with nothing in it."""

    t_s: int  # whole seconds from the timeline's origin (floor)
    count: int
    p50_ms: float | None
    p99_ms: float | None
    max_ms: float | None


class Series(msgspec.Struct, frozen=True, kw_only=True):
    """Every second from the first to the last in which something happened, the empty
    ones between included (count 0)."""

    name: str
    seconds: list[Second]


class Timeline(msgspec.Struct, frozen=True, kw_only=True):
    origin: datetime  # t = 0
    x_label: str  # what t counts from, e.g. "s after the herd's due second"
    count_label: str  # what a second's count is, e.g. "executions leased per second"
    lag_label: str  # what its lag is, e.g. "due -> lease lag, ms"
    series: list[Series]


def fill(name: str, found: dict[int, tuple[int, float | None, float | None, float | None]],
         ) -> Series:
    """A series from {t_s: (count, p50, p99, max)}, the seconds between filled with zeros."""
    if not found:
        return Series(name=name, seconds=[])
    first, last = min(found), max(found)
    return Series(name=name, seconds=[Second(t, *found.get(t, (0, None, None, None)))
                                      for t in range(first, last + 1)])


def per_second(name: str, points: Iterable[tuple[float, float, int]]) -> Series:
    """From (t_s, lag_ms, weight) points: a second's count is the sum of its points'
    weights (a batch request counts its jobs), its lag over every point in it."""
    weights: collections.Counter[int] = collections.Counter()
    lags: dict[int, list[float]] = collections.defaultdict(list)
    for t_s, lag_ms, weight in points:
        if not math.isfinite(t_s):
            continue
        second = math.floor(t_s)
        weights[second] += weight
        lags[second].append(lag_ms)
    found = {}
    for second, values in lags.items():
        values.sort()
        found[second] = (weights[second], round(nearest_rank(values, 0.5), 1),
                         round(nearest_rank(values, 0.99), 1), round(values[-1], 1))
    return fill(name, found)


def at_epoch(origin_s: float) -> datetime:
    return datetime.fromtimestamp(origin_s, UTC)


# The tool's own statement on its scratch database, as in loadtest/measure.py: per second
# of the lease (started_at, the Redis server's clock) after the origin ($3, epoch s), how
# many executions were leased and their due->lease lag. A tenant's executions go to its
# group ($1 ids, $2 group names); those of jobs made at or after $4 (a UUIDv7 floor, as
# measure.lease_lags_by_kind) are the steady load's.
_LEASES_PER_SECOND = """
WITH g AS (SELECT * FROM unnest($1::uuid[], $2::text[]) AS g(tenant_id, name)),
l AS (
    SELECT CASE WHEN e.job_id >= $4 THEN 'steady' ELSE g.name END AS name,
           floor(extract(epoch FROM e.started_at) - $3)::int AS t_s,
           extract(epoch FROM e.started_at - e.scheduled_for) * 1000 AS lag_ms
    FROM executions e JOIN g USING (tenant_id) WHERE e.started_at IS NOT NULL)
SELECT name, t_s, count(*) AS count,
       percentile_disc(ARRAY[0.5, 0.99, 1.0]) WITHIN GROUP (ORDER BY lag_ms) AS lag_ms
FROM l GROUP BY 1, 2"""


async def leases_per_second(db: Database, groups: dict[str, list[uuid.UUID]],
                            steady_from: uuid.UUID, origin_s: float) -> list[Series]:
    """One series per group that leased anything, then "steady" if the steady load did."""
    ids = [tenant for members in groups.values() for tenant in members]
    names = [name for name, members in groups.items() for _ in members]
    async with db.connection() as conn:
        rows = await conn.fetch(_LEASES_PER_SECOND, ids, names, origin_s, steady_from)
    by_name: dict[str, dict] = collections.defaultdict(dict)
    for row in rows:
        by_name[row["name"]][row["t_s"]] = (row["count"],
                                            *(round(float(v), 1) for v in row["lag_ms"]))
    names_seen = [name for name in dict.fromkeys([*groups, "steady"]) if name in by_name]
    return [fill(name, by_name[name]) for name in names_seen]
