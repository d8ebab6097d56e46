"""Every Prometheus metric herdwick exposes, named in one place (as storage/keys.py names
every Redis key), and the two ways a process serves them.

Tenants and pools are label values, and both are chosen by tenants, so neither may grow
a label without bound: each process gives its own label to the first LABEL_LIMIT
distinct tenants (and pools) it sees and counts the rest under "other" (a restart starts
the count again). Set HERDWICK_METRICS_TENANTS to change the limit.

Counters and histograms are observed where the work happens (a dict lookup and a lock
per observation: about a microsecond). Gauges are read only when scraped, from the
objects that own the numbers (`watch`), so they cost nothing in between.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Protocol

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

OTHER = "other"
disable_created_metrics()  # no *_created series: they double what a scrape carries
LABEL_LIMIT = int(os.environ.get("HERDWICK_METRICS_TENANTS", "100") or 100)

# Seconds: the p99 aim is 2 s and a herd's tail reaches minutes.
LAG_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0)
CALL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)
HANDLER_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0)


class _Bounded:
    """Label values for names chosen outside herdwick: the first `limit` seen, then OTHER."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, value: str) -> str:
        if value in self._seen:
            return value
        with self._lock:
            if len(self._seen) >= self._limit:
                return OTHER
            self._seen.add(value)
        return value


tenant_label = _Bounded(LABEL_LIMIT)
pool_label = _Bounded(LABEL_LIMIT)
target_label = _Bounded(LABEL_LIMIT)  # http targets' origins (scheme://host:port)

# --- the scheduler: dispatch and execution events ---------------------------------------

DISPATCH_LAG = Histogram(
    "herdwick_dispatch_lag_seconds",
    "First attempts: due time to published on the ready stream (stage=published) and to "
    "leased by a worker (stage=leased)",
    ["stage", "tenant", "pool"], buckets=LAG_BUCKETS)
EXECUTIONS = Counter(
    "herdwick_executions_finished_total",
    "Executions that ended, by outcome (succeeded, dead, canceled)",
    ["tenant", "pool", "outcome"])
ATTEMPTS = Counter(
    "herdwick_attempts_total",
    "Attempts that ended, by outcome (succeeded, failed, expired, deferred, canceled)",
    ["tenant", "pool", "outcome"])
RETRIES = Counter("herdwick_retries_total",
                  "Failed or expired attempts that will be tried again", ["tenant", "pool"])
DEAD_LETTERS = Counter("herdwick_dead_letters_total",
                       "Executions that ended dead (in GET /v1/dead-letters)", ["tenant", "pool"])
POSSIBLE_DUPLICATES = Counter(
    "herdwick_possible_duplicates_total",
    "Refused calls from workers whose attempt had lapsed or been replaced: their handler may "
    "have acted beside another attempt", ["tenant", "call"])

# --- calls to the stores ----------------------------------------------------------------

POSTGRES = Histogram("herdwick_postgres_query_seconds",
                     "Postgres statements by name (storage/queries), as asyncpg timed them",
                     ["query"], buckets=CALL_BUCKETS)
REDIS = Histogram("herdwick_redis_call_seconds",
                  "Redis calls and pipelines by what they do", ["call"], buckets=CALL_BUCKETS)

# --- workers --------------------------------------------------------------------------------

WORKER_ATTEMPTS = Counter(
    "herdwick_worker_attempts_total",
    "Attempts this worker process finished, by outcome (succeeded, failed, dead, deferred, "
    "lease_lost)", ["pool", "outcome"])
WORKER_HANDLER = Histogram("herdwick_worker_handler_seconds",
                           "Time in the handler, per attempt", ["pool"],
                           buckets=HANDLER_BUCKETS)
HTTP_DELIVERIES = Counter(
    "herdwick_http_deliveries_total",
    "HTTP callbacks by how they ended (the class of the recorded outcome: 2xx, 4xx, 5xx, 429, "
    "timeout, connection, dns, refused, breaker_open, ...)", ["outcome"])

# --- the api ------------------------------------------------------------------------------

API_REQUESTS = Histogram("herdwick_api_request_seconds",
                         "Gateway requests by route template, method and status",
                         ["route", "method", "status"], buckets=CALL_BUCKETS)
SUBMITTED = Counter("herdwick_jobs_submitted_total", "Jobs accepted (201)", ["tenant"])
SUBMIT_COALESCED = Histogram(
    "herdwick_submit_coalesced_requests",
    "Single submits of one tenant inserted by one statement (gateway/coalesce.py)",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))
READS = Counter(
    "herdwick_api_reads_total",
    "History reads by the server that answered (primary, or a replica as host:port/db) and "
    "why: fresh (a replica had the tenant's writes), own_write (none had its latest yet), "
    "no_replica (none within the lag bound, or none up), redis (its write mark unreadable), "
    "replica_failed (the replica failed the read; the primary answered)",
    ["server", "reason"])
WRITE_MARKS_FAILED = Counter(
    "herdwick_write_marks_failed_total",
    "Writes whose mark Redis refused: each waited for the replicas to replay it before its "
    "answer")


@contextmanager
def timed_redis(call: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        REDIS.labels(call).observe(time.perf_counter() - start)


# --- gauges, read at scrape time ----------------------------------------------------------

GAUGES = {
    "herdwick_ready_depth": "Ready-stream entries no worker has read yet, per pool",
    "herdwick_ready_pending": "Ready-stream entries read by a worker and not yet acked",
    "herdwick_fair_queue_depth": ("Work waiting in this scheduler's fair queue, per pool: due,"
                                  " or handed over up to 1 s before it falls due"),
    "herdwick_shards_owned": "Shards whose lease this scheduler holds",
    "herdwick_shard_heap_entries": "Due entries in each owned shard's heap",
    "herdwick_worker_in_flight": "Attempts this worker process is running, per pool",
    "herdwick_http_breakers": "Targets this http worker knows, by their breaker's state",
    "herdwick_http_breaker_state": "Each target's breaker as this http worker last saw it: "
                                   "0 closed, 1 half-open (probing), 2 open",
    "herdwick_replica_up": "1 while this gateway trusts the read replica (it answers, is in "
                           "recovery and streams), else 0",
    "herdwick_replica_lag_seconds": "How long ago the newest commit the replica is known to "
                                    "have was made (an upper bound, within the 0.1-0.2 s "
                                    "sampling)",
    "herdwick_replica_lag_bytes": "WAL the primary had written at the last sample that the "
                                  "replica had not replayed",
}


class GaugeSource(Protocol):
    def gauges(self) -> Iterable[tuple[str, dict[str, str], float]]:
        """(name from GAUGES, labels, value) for each gauge this object owns."""


class _Gauges(Collector):
    """Sums the gauges of every live source (several schedulers may share a process)."""

    def __init__(self) -> None:
        self._sources: weakref.WeakSet = weakref.WeakSet()

    def add(self, source: GaugeSource) -> None:
        self._sources.add(source)

    def discard(self, source: GaugeSource) -> None:
        self._sources.discard(source)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        totals: dict[str, dict[tuple, float]] = {name: {} for name in GAUGES}
        label_names: dict[str, tuple[str, ...]] = {}
        for source in list(self._sources):
            for name, labels, value in source.gauges():
                key = tuple(sorted(labels.items()))
                label_names[name] = tuple(k for k, _ in key)
                totals[name][key] = totals[name].get(key, 0.0) + value
        for name, help_text in GAUGES.items():
            family = GaugeMetricFamily(name, help_text, labels=label_names.get(name, ()))
            for key, value in totals[name].items():
                family.add_metric([v for _, v in key], value)
            yield family


_gauges = _Gauges()
REGISTRY.register(_gauges)


def watch(source: GaugeSource) -> None:
    """Scrapes read `source.gauges()` while it lives (held weakly) or until `unwatch`."""
    _gauges.add(source)


def unwatch(source: GaugeSource) -> None:
    _gauges.discard(source)


async def metrics(request: web.Request) -> web.Response:
    """GET /metrics: the text exposition format. Collected on the event loop, so gauges
    read their owners' state between two of their steps, never during one."""
    return web.Response(body=generate_latest(REGISTRY),
                        headers={"Content-Type": CONTENT_TYPE_LATEST})


async def serve(port: int, host: str = "0.0.0.0") -> web.AppRunner:
    """/metrics on a port of its own (scheduler, workers: --metrics-port); the caller
    cleans the runner up at shutdown."""
    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
