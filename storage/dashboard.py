"""The dashboard's reads: which tenants an overview shows, and each one's recent executions.

Every figure comes from Postgres executions over a span of scheduled_for, so a
query touches only that span's daily partitions. The statements in
queries/dashboard.sql say what each figure counts.
"""

from __future__ import annotations

import math
import uuid
from datetime import datetime, timedelta

import msgspec

from herdwick.storage.db import Database
from herdwick.storage.sql import q

TENANTS_MAX = 500  # an overview lists at most this many tenants, by name
_MINUTE = timedelta(minutes=1)


class TenantName(msgspec.Struct, frozen=True):
    tenant_id: uuid.UUID
    name: str


class Figures(msgspec.Struct, frozen=True, kw_only=True):
    """One tenant's executions over a span (the whole span, or one minute of it)."""

    executions: int = 0
    succeeded: int = 0
    dead: int = 0
    queued: int = 0
    queue_lag_p50_s: float | None = None
    queue_lag_p99_s: float | None = None
    start_lag_p50_s: float | None = None
    start_lag_p99_s: float | None = None

    @property
    def failure_rate(self) -> float | None:
        """Dead over finished (succeeded or dead); None before anything finished."""
        finished = self.succeeded + self.dead
        return self.dead / finished if finished else None


class TenantSpan(msgspec.Struct, frozen=True, kw_only=True):
    """A tenant's span: its figures, the same a minute, and its queue depth at each minute's end."""

    total: Figures
    minutes: list[Figures]
    depth: list[int]


def _figures(row) -> Figures:
    return Figures(executions=row["executions"], succeeded=row["succeeded"], dead=row["dead"],
                   queued=row["queued"], queue_lag_p50_s=row["queue_lag_p50_s"],
                   queue_lag_p99_s=row["queue_lag_p99_s"],
                   start_lag_p50_s=row["start_lag_p50_s"],
                   start_lag_p99_s=row["start_lag_p99_s"])


async def tenants(db: Database, only: uuid.UUID | None) -> list[TenantName]:
    """Every tenant (the first TENANTS_MAX by name) for None, else that one if it exists."""
    async with db.connection() as conn:
        rows = await conn.fetch(q("dashboard_tenants"), only, TENANTS_MAX)
    return [TenantName(r["tenant_id"], r["name"]) for r in rows]


def minutes_between(since: datetime, until: datetime) -> int:
    return max(1, math.ceil((until - since) / _MINUTE))


async def recent(db: Database, since: datetime, until: datetime,
                 only: uuid.UUID | None) -> dict[uuid.UUID, TenantSpan]:
    """The executions scheduled in [since, until) of each tenant that has any (of `only`
    if given). `since` must be a whole minute: minute i of a span starts at since + i min."""
    count = minutes_between(since, until)
    async with db.connection() as conn:
        figures = await conn.fetch(q("dashboard_hour"), since, until, only)
        moves = await conn.fetch(q("dashboard_queue_moves"), since, until, only)
    totals: dict[uuid.UUID, Figures] = {}
    minutes: dict[uuid.UUID, list[Figures]] = {}
    for row in figures:
        tenant = row["tenant_id"]
        if row["minute"] is None:
            totals[tenant] = _figures(row)
            minutes[tenant] = [Figures() for _ in range(count)]
        else:
            minutes[tenant][_index(since, row["minute"], count)] = _figures(row)
    deltas: dict[uuid.UUID, list[int]] = {}
    for row in moves:
        by_minute = deltas.setdefault(row["tenant_id"], [0] * count)
        by_minute[_index(since, row["minute"], count)] += row["delta"]
    return {tenant: TenantSpan(total=total, minutes=minutes[tenant],
                               depth=_running_sum(deltas.get(tenant, [0] * count)))
            for tenant, total in totals.items()}


def _index(since: datetime, minute: datetime, count: int) -> int:
    """A minute's place in the span; one outside it (a clock that disagrees) at its edge."""
    return min(max(round((minute - since) / _MINUTE), 0), count - 1)


def _running_sum(deltas: list[int]) -> list[int]:
    depth, level = [], 0
    for delta in deltas:
        level += delta
        depth.append(max(level, 0))
    return depth
