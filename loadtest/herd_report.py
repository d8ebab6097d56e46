"""What a `loadtest herd` run found: its figures, from what the consumers saw and the
probes read, and those figures as text (herd.py puts the report together)."""

from __future__ import annotations

import collections
import math
import os
from datetime import datetime

import msgspec

from herdwick import schedule as sched
from herdwick.loadtest.consumers import BACKGROUND, HERD, StreamCheck, Watch
from herdwick.loadtest.jobs import TenantRef, even_split
from herdwick.loadtest.measure import CpuMark, Lag, RedisMemory, lag_of
from herdwick.loadtest.raw_limits import (
    RAW_PUBLISH_BATCH,
    RAW_XADD_PIPELINE,
    HeapMemory,
    RawLimits,
)
from herdwick.loadtest.report import lag_header, lag_row, memory_line
from herdwick.loadtest.timeline import Timeline, at_epoch, per_second

MIN_LEAD_S = 2.5  # a shard loads every 2 s: a herd moved later than this may be loaded late
BUSY_WARN_SHARE = 0.2  # the machine busier than this before the load: other work skews it


class TenantLag(msgspec.Struct, frozen=True, kw_only=True):
    tenant: str
    expected: int
    seen: int
    lag: Lag


class HerdResult(msgspec.Struct, frozen=True, kw_only=True):
    jobs: int
    due_at: datetime
    insert_s: float
    insert_jobs_per_s: float
    move_s: float  # the transaction that moved the herd to its due second
    lead_s: float  # from the move's commit to the due second: the shards' time to load it
    check: StreamCheck
    first_after_due_ms: float
    last_after_due_ms: float
    jobs_per_s: float  # jobs / (last XADD - due second)
    peak_per_s: int  # most entries XADDed in one second after due
    lag: Lag
    tenants: list[TenantLag]


class BackgroundResult(msgspec.Struct, frozen=True, kw_only=True):
    rate: float
    duration_s: float
    delay_s: float
    check: StreamCheck
    generator_late_max_ms: float  # how far the generator's inserts fell behind its schedule
    lag: Lag
    tenants: list[TenantLag]


class SchedulerCost(msgspec.Struct, frozen=True, kw_only=True):
    """CPU and memory of the scheduler processes (psutil), all of them together."""

    processes: int
    window: str  # what the CPU window covers
    window_s: float
    jobs: int
    cpu_s: float
    cpu_s_per_1000: float
    idle_cpu_s_per_s: float  # before the load: shard loads, lease renewals
    net_cpu_s_per_1000: float  # with the idle rate over the window taken off
    machine_busy_share: float  # every CPU, every process, over the window
    idle_machine_busy_share: float  # the same before the load: other work on the machine
    baseline_rss_mb: list[float]
    peak_rss_mb: list[float]  # per process: the kernel's high-water mark (VmHWM)
    rss_growth_bytes_per_job: float  # (sum of peaks - sum of baselines) / jobs


class Ratio(msgspec.Struct, frozen=True, kw_only=True):
    figure: str
    herd: float
    raw: float
    herd_over_raw: float


class HerdTimes(msgspec.Struct, frozen=True, kw_only=True):
    """When the herd stage's steps happened; turned into the report by analysis."""

    due_at: datetime | None
    insert_s: float
    move_s: float
    lead_s: float
    idle: tuple[CpuMark, CpuMark]
    window: tuple[CpuMark, CpuMark]
    window_name: str
    baseline_rss: list[int]
    peak_rss: list[int]
    background_late_s: float


# --- the figures -------------------------------------------------------------------------------


def _lags_ms(entries: list[tuple[bytes, int, bytes]]) -> list[tuple[bytes, float]]:
    parsed: dict[bytes, float] = {}
    out = []
    for tenant, added_ms, scheduled_for in entries:
        due_ms = parsed.get(scheduled_for)
        if due_ms is None:
            due_ms = parsed[scheduled_for] = (
                datetime.fromisoformat(scheduled_for.decode()).timestamp() * 1000)
        out.append((tenant, added_ms - due_ms))
    return out


def tenant_lags(lags: list[tuple[bytes, float]], tenants: list[TenantRef],
                expected: list[int]) -> list[TenantLag]:
    by_tenant: dict[bytes, list[float]] = collections.defaultdict(list)
    for tenant, lag in lags:
        by_tenant[tenant].append(lag)
    return [TenantLag(tenant=t.name, expected=n, seen=len(by_tenant[t.key]),
                      lag=lag_of(by_tenant[t.key]))
            for t, n in zip(tenants, expected, strict=True)]


def herd_result(times: HerdTimes, watch: Watch, tenants: list[TenantRef],
                counts: list[int]) -> HerdResult | None:
    """`counts`: the herd's jobs by tenant, as inserted."""
    if times.due_at is None:
        return None
    due_ms = times.due_at.timestamp() * 1000
    added = [added_ms - due_ms for _, added_ms, _ in watch.entries[HERD]]
    lags = _lags_ms(watch.entries[HERD])
    last = max(added, default=0.0)
    per_second = collections.Counter(int(a // 1000) for a in added)
    return HerdResult(
        jobs=sum(counts), due_at=times.due_at, insert_s=times.insert_s,
        insert_jobs_per_s=sum(counts) / times.insert_s if times.insert_s else 0.0,
        move_s=times.move_s, lead_s=times.lead_s, check=watch.check(HERD),
        first_after_due_ms=min(added, default=0.0), last_after_due_ms=last,
        jobs_per_s=watch.seen[HERD] / (last / 1000) if last > 0 else 0.0,
        peak_per_s=max(per_second.values(), default=0),
        lag=lag_of([lag for _, lag in lags]),
        tenants=tenant_lags(lags, tenants, counts))


def background_result(rate: float, duration_s: float, delay_s: float, times: HerdTimes,
                      watch: Watch, tenants: list[TenantRef]) -> BackgroundResult | None:
    if rate <= 0:
        return None
    lags = _lags_ms(watch.entries[BACKGROUND])
    return BackgroundResult(
        rate=rate, duration_s=duration_s, delay_s=delay_s,
        check=watch.check(BACKGROUND), generator_late_max_ms=times.background_late_s * 1000,
        lag=lag_of([lag for _, lag in lags]),
        tenants=tenant_lags(lags, tenants, even_split(watch.expected[BACKGROUND], len(tenants))))


def timeline_of(times: HerdTimes, watch: Watch) -> Timeline | None:
    """The entries the consumers saw, by second of their XADD from the due second (without
    a herd, from the first background entry's second); lag as in the tables."""
    herd, background = watch.entries[HERD], watch.entries[BACKGROUND]
    if not herd and not background:
        return None
    if times.due_at is not None:
        origin_s = times.due_at.timestamp()
    else:
        origin_s = math.floor(min(added_ms for _, added_ms, _ in background) / 1000)
    series = []
    for name, entries in (("herd", herd), ("background", background)):
        lags = _lags_ms(entries)
        found = per_second(name, [(added_ms / 1000 - origin_s, lag, 1) for (_, added_ms, _), (
            _, lag) in zip(entries, lags, strict=True)])
        if found.seconds:
            series.append(found)
    return Timeline(origin=at_epoch(origin_s),
                    x_label="s after the herd's due second" if times.due_at is not None
                    else "s after the first background entry's second",
                    count_label="entries XADDed to the ready streams per second",
                    lag_label="due -> XADD lag, ms", series=series)


def scheduler_cost(processes: int, times: HerdTimes, watch: Watch) -> SchedulerCost:
    idle0, idle1 = times.idle
    idle_rate = (idle1.processes_s - idle0.processes_s) / (idle1.at - idle0.at)
    start, end = times.window
    window_s = end.at - start.at
    cpu_s = end.processes_s - start.processes_s
    jobs = watch.seen[HERD] if times.due_at is not None else watch.seen[BACKGROUND]
    per = 1000 / jobs if jobs else 0.0
    cpus = os.cpu_count() or 1
    mb = 1024 * 1024
    return SchedulerCost(
        processes=processes, window=times.window_name, window_s=window_s, jobs=jobs,
        cpu_s=cpu_s, cpu_s_per_1000=cpu_s * per, idle_cpu_s_per_s=idle_rate,
        net_cpu_s_per_1000=max(0.0, cpu_s - idle_rate * window_s) * per,
        machine_busy_share=(end.machine_busy_s - start.machine_busy_s) / (cpus * window_s)
        if window_s > 0 else 0.0,
        idle_machine_busy_share=(idle1.machine_busy_s - idle0.machine_busy_s)
        / (cpus * (idle1.at - idle0.at)),
        baseline_rss_mb=[r / mb for r in times.baseline_rss],
        peak_rss_mb=[r / mb for r in times.peak_rss],
        rss_growth_bytes_per_job=(sum(times.peak_rss) - sum(times.baseline_rss)) / jobs
        if jobs else 0.0)


def ratios(herd: HerdResult | None, raw: RawLimits | None) -> list[Ratio]:
    if herd is None or raw is None:
        return []
    pairs = [("jobs/s vs dispatch transaction rows/s", raw.dispatch_rows_per_s),
             ("jobs/s vs hw_publish entries/s", raw.publish_entries_per_s),
             ("jobs/s vs hw_publish via redis-py", raw.publish_client_entries_per_s),
             ("jobs/s vs XADD entries/s", raw.xadd_entries_per_s),
             ("jobs/s vs the slower raw stage", min(raw.dispatch_rows_per_s,
                                                    raw.publish_entries_per_s))]
    return [Ratio(figure=f, herd=herd.jobs_per_s, raw=r, herd_over_raw=herd.jobs_per_s / r)
            for f, r in pairs]


def warnings(herd: HerdResult | None, cost: SchedulerCost, watch: Watch) -> list[str]:
    found = []
    if herd is not None and herd.lead_s < MIN_LEAD_S:
        found.append(f"the herd was moved only {herd.lead_s:.1f} s before due (the move took "
                     f"{herd.move_s:.1f} s): shards may have loaded it late; raise --due-in")
    if cost.idle_machine_busy_share > BUSY_WARN_SHARE:
        found.append(f"the machine was {cost.idle_machine_busy_share:.0%} busy before the load "
                     "(other work on it): every figure is skewed")
    if watch.unknown:
        found.append(f"{watch.unknown} stream entries were of no job this run inserted")
    return found


# --- as text ------------------------------------------------------------------------------


def _lag_rows(lag: Lag, tenants: list[TenantLag]) -> list[str]:
    rows = [lag_header(), lag_row("all", sum(t.expected for t in tenants), lag.samples, lag)]
    return rows + [lag_row(t.tenant, t.expected, t.seen, t.lag) for t in tenants]


def _check_line(c: StreamCheck) -> str:
    verdict = "exactly once" if c.exact else "NOT exactly once"
    return (f"  on the streams: {c.seen} of {c.expected} jobs, {verdict} (duplicates "
            f"{c.duplicates}, missing {c.missing}, wrong tenant {c.wrong_tenant})")


def herd_lines(h: HerdResult) -> list[str]:
    return [
        f"herd: {h.jobs} jobs due at {sched.format_utc(h.due_at)}; inserted in "
        f"{h.insert_s:.1f} s ({h.insert_jobs_per_s:,.0f} jobs/s), moved in {h.move_s:.2f} s, "
        f"{h.lead_s:.1f} s before due",
        _check_line(h.check),
        f"  throughput: {h.jobs_per_s:,.0f} jobs/s (first entry {h.first_after_due_ms:.0f} ms, "
        f"last {h.last_after_due_ms:.0f} ms after due); peak {h.peak_per_s:,} in one second",
        *_lag_rows(h.lag, h.tenants), ""]


def background_lines(b: BackgroundResult) -> list[str]:
    return [
        f"background: {b.rate:g} jobs/s for {b.duration_s:g} s, delaySeconds {b.delay_s:g} "
        f"(generator at most {b.generator_late_max_ms:.0f} ms behind)",
        _check_line(b.check), *_lag_rows(b.lag, b.tenants), ""]


def cost_lines(c: SchedulerCost, heap: HeapMemory, memory: RedisMemory) -> list[str]:
    peaks = ", ".join(f"{p:.0f}" for p in c.peak_rss_mb)
    bases = ", ".join(f"{p:.0f}" for p in c.baseline_rss_mb)
    return [
        f"scheduler: {c.processes} process(es); window {c.window} = {c.window_s:.1f} s",
        f"  CPU {c.cpu_s:.2f} s for {c.jobs} jobs = {c.cpu_s_per_1000:.3f} s per 1,000 "
        f"(idle {c.idle_cpu_s_per_s:.3f} s/s; net of idle {c.net_cpu_s_per_1000:.3f}); "
        f"machine {c.machine_busy_share:.0%} busy "
        f"({c.idle_machine_busy_share:.0%} before the load)",
        f"  peak RSS {peaks} MB (idle {bases} MB): {c.rss_growth_bytes_per_job:.0f} B per job",
        f"  heap entry: {heap.tracemalloc_bytes_per_entry:.0f} B (tracemalloc), "
        f"{heap.getsizeof_bytes_per_entry:.0f} B (getsizeof) at {heap.entries:,} entries; "
        f"aim <= {heap.aim_bytes}", memory_line(memory), ""]


def raw_lines(raw: RawLimits, report_ratios: list[Ratio]) -> list[str]:
    rows = [
        (f"dispatch transaction (claim_due + finish_dispatch), {raw.dispatch_batch}/txn, "
         f"{raw.dispatch_connections} conn", raw.dispatch_rows_per_s, "rows/s"),
        (f"FCALL hw_publish, {RAW_PUBLISH_BATCH}/pipeline, hiredis-packed",
         raw.publish_entries_per_s, "entries/s"),
        ("the same through HotTier.publish (redis-py)", raw.publish_client_entries_per_s,
         "entries/s"),
        (f"XADD, {RAW_XADD_PIPELINE}/pipeline, hiredis-packed", raw.xadd_entries_per_s,
         "entries/s")]
    lines = [f"raw limits (same run, a second herd of {raw.jobs} jobs):"]
    lines += [f"  {label:<70} {value:>9,.0f} {unit}" for label, value, unit in rows]
    if report_ratios:
        lines += ["", f"  {'herd vs raw':<40} {'herd':>9} {'raw':>9} {'herd/raw':>9}"]
        lines += [f"  {r.figure:<40} {r.herd:>9,.0f} {r.raw:>9,.0f} {r.herd_over_raw:>9.2f}"
                  for r in report_ratios]
    return [*lines, ""]
