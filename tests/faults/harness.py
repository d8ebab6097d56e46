"""The fault harness: real processes, a herd, one fault at a seeded random moment, the history.

Every scenario in tests/faults/test_fault_*.py reads the same way:

    async with Stack.up(db_url, redis_url, prefix) as stack:
        result = await stack.run("kill -9 worker", window_s=(0.2, 1.0), inject=kill_a_worker)
    result.assert_sound()

`Stack.up` starts two `herdwick scheduler` and two `herdwick worker` processes
(tests/faults/fault_worker.py: 50-200 ms handlers, a 5 s lease), and a
`herdwick api` when asked, through loadtest/driver.py's process launcher, on
the test's scratch database and a key prefix (or a private Redis server). It
parks a herd of one-off jobs and a few cron jobs a day ahead before the
processes start. `run` moves the herd due in one second a few seconds on,
adds a steady rate beside it, calls `inject` once at a random point of the
window after the due second, measures the recovery, waits for the drain,
and checks the invariants over the whole history in Postgres
(tests/faults/history.py).

The random point (and every other choice a scenario makes: which process,
how long) comes from one RNG whose seed is printed with each row and is set
by HERDWICK_FAULT_SEED, so a failure replays the same choices. The processes'
own timing is not replayable; the choices are.

Each run's figures go to stdout, to `fault-table.md` in pytest's base temp
directory, and to the terminal summary (tests/faults/conftest.py):

- in flight: executions queued or running in Postgres when the fault hit
  (the api scenario: jobs in batch requests that had no answer yet);
- lost: one-off jobs without a finished execution, or dead for a reason the
  scenario does not allow, plus cron occurrences that fell due and never ran;
- duplicates: occurrences executed as two executions, one-offs with two;
- stale accepted: succeeded attempts that were not completed by the holder of
  the execution's current lease, or that the fence recorded as refused;
- re-runs: executions with more than one attempt that reached a worker (each
  such attempt may have done the job's work);
- recovery s: from the fault to the herd drained and no due work more than a
  second late (nothing overdue in due_index, nothing queued longer).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import ipaddress
import os
import random
import secrets
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import aiohttp
import asyncpg
import msgspec
import redis.asyncio as aioredis

from herdwick.actors.executions import GROUP as EVENTS_GROUP
from herdwick.errors import StorageUnavailable
from herdwick.gateway.submit import prepare
from herdwick.http_worker import HTTP_POOL
from herdwick.ids import shard_of, uuid7
from herdwick.loadtest.driver import (
    ApiProcess,
    Child,
    HttpWorkerProcess,
    SchedulerProcess,
    WorkerProcess,
    child_env,
    children,
    free_port,
    leases_settled,
)
from herdwick.loadtest.jobs import move_herd, parking_time
from herdwick.model import JobSpec, RetryPolicy, Schedule, Target, TenantSpec
from herdwick.redis_client import REDIS_ERRORS
from herdwick.redis_client import connect as connect_redis
from herdwick.storage import keys
from herdwick.storage.db import Database
from herdwick.storage.hot import HotTier
from herdwick.storage.jobs import NewJob, insert_jobs
from herdwick.storage.tenants import create_tenant
from tests.faults import history
from tests.faults.fault_worker import HANDLER_MS_ENV, LEASE_S_ENV, STARTS_ENV
from tests.faults.receiver import Receiver

SEED_ENV = "HERDWICK_FAULT_SEED"
POOL = "faults"
WORKER_APP = "tests.faults.fault_worker:worker"
SKEWED_MODULE = "tests.faults.skewed_scheduler"
SCHEDULERS = 2
HARNESS_CONNECTIONS = 6
WORKERS = 2
CONCURRENCY = 50  # per worker: 100 attempts in flight at most
HTTP_JOBS = 300  # with http=True: of the herd, these are http jobs to tests/faults/receiver.py
HTTP_WORKERS = 2
HTTP_CONCURRENCY = 32
HTTP_LEASE_S = 5.0  # as the queue workers': a dead http-worker's deliveries retry this soon
LOOPBACK = ipaddress.ip_network("127.0.0.0/8")  # HERDWICK_HTTP_ALLOW: the receiver is local
LEASE_S = 5.0
HANDLER_MS = (50, 200)
HERD_JOBS = 3_000  # due in one second: ~3 s of the two workers' capacity
CRON_JOBS = 5  # every minute, first due with the herd
INSERT_BATCH = 1_000
STEADY_RATE = 40.0  # jobs/s beside the herd
STEADY_DELAY_S = 2.5  # each steady job is due this long after its insert
STEADY_AFTER_DUE_S = 5.0  # the steady rate runs from the move until this long after due
STEADY_TICK_S = 0.1
DUE_IN_S = 2.5  # from the move to the herd's due second: every shard has loaded it by then
RETRY = RetryPolicy(max_attempts=5, backoff_seconds=1)
SETTLE_TIMEOUT_S = 30.0
DRAIN_TIMEOUT_S = 45.0  # from the fault: the slowest recovery (30 s) and its drain
LATE_S = 1.0  # "lag back under 1 s"
POLL_S = 0.2
# What the harness's own reads meet while Postgres is down or restarting: polled again.
DB_DOWN = (StorageUnavailable, OSError, asyncpg.InterfaceError, asyncpg.PostgresConnectionError,
           asyncpg.OperatorInterventionError)
HERD_NAME = "fault-herd"
STEADY_NAME = "fault-steady"
CRON_NAME = "fault-cron"

ROOT = Path(__file__).resolve().parents[2]  # the worker app and the launcher import from here

# --- the seed and the table ----------------------------------------------------------------

ROWS: list[str] = []  # this session's rows, for the terminal summary (conftest.py)
TABLE_FILE: Path | None = None  # set by conftest.py: pytest's base temp dir
HEADER = ("| fault | seed | in flight | lost | duplicates | stale accepted | re-runs | "
          "recovery s | notes |")
RULE = "|---|---:|---:|---:|---:|---:|---:|---:|---|"


def seeded() -> tuple[int, random.Random]:
    """The run's seed (HERDWICK_FAULT_SEED, else a fresh one) and its RNG."""
    given = os.environ.get(SEED_ENV)
    seed = int(given) if given else random.SystemRandom().randrange(2**31)
    return seed, random.Random(seed)


def record(row: str) -> None:
    ROWS.append(row)
    print(f"\n{HEADER}\n{row}", flush=True)
    if TABLE_FILE is not None:
        fresh = not TABLE_FILE.exists()
        with TABLE_FILE.open("a") as out:
            if fresh:
                out.write(f"{HEADER}\n{RULE}\n")
            out.write(row + "\n")


# --- jobs ----------------------------------------------------------------------------------


def _template(name: str, schedule: Schedule, target: Target) -> NewJob:
    spec = JobSpec(name=name, target=target, schedule=schedule,
                   payload=msgspec.Raw(b'{"fault": true}'), retry=RETRY)
    prepared = prepare(spec, now=datetime.now(UTC), allow=(LOOPBACK,))
    assert prepared.job is not None, prepared.errors
    return prepared.job


def make_jobs(name: str, count: int, due: datetime, cron: str | None = None,
              url: str | None = None, pool: str = POOL) -> list[NewJob]:
    """`count` jobs as the gateway would insert them, all due at `due`: for the queue
    workers of `pool`, or with `url` for the http-workers."""
    schedule = Schedule(cron=cron) if cron else Schedule(delay_seconds=60)
    target = Target(type="http", ref=url) if url else Target(type="queue", ref=pool)
    template = _template(name, schedule, target)
    now = datetime.now(UTC)
    jobs = []
    for _ in range(count):
        job_id = uuid7(now)
        jobs.append(msgspec.structs.replace(template, job_id=job_id, shard_id=shard_of(job_id),
                                            next_run_at=due))
    return jobs


def job_body(name: str, run_at: datetime) -> dict:
    """One job of a /v1/jobs:batch request."""
    return {"name": name, "target": {"type": "queue", "ref": POOL},
            "schedule": {"runAt": run_at.isoformat()}, "payload": {"fault": True},
            "retry": {"maxAttempts": RETRY.max_attempts,
                      "backoffSeconds": RETRY.backoff_seconds}}


async def insert(db: Database, tenant_id: uuid.UUID, jobs: list[NewJob]) -> None:
    for start in range(0, len(jobs), INSERT_BATCH):
        outcome = await insert_jobs(db, tenant_id, jobs[start:start + INSERT_BATCH],
                                    now=datetime.now(UTC))
        assert outcome.inserted


# --- the history's progress ------------------------------------------------------------------

# The harness's own statements on the scenario's scratch database.
_PROGRESS_SQL = """
SELECT (SELECT count(*) FROM jobs j WHERE j.schedule->>'cron' IS NULL AND NOT EXISTS (
            SELECT 1 FROM executions e WHERE e.job_id = j.job_id
              AND e.state IN ('succeeded', 'dead'))) AS unfinished_one_offs,
       (SELECT count(*) FROM jobs j WHERE j.name = $2) AS herd,
       (SELECT count(*) FROM jobs j WHERE j.name = $2 AND NOT EXISTS (
            SELECT 1 FROM executions e WHERE e.job_id = j.job_id
              AND e.state IN ('succeeded', 'dead'))) AS unfinished_herd,
       (SELECT count(*) FROM executions WHERE state IN ('queued', 'running')) AS in_flight,
       (SELECT count(*) FROM due_index
        WHERE next_run_at < now() - $1 * interval '1 second') AS overdue_rows,
       (SELECT count(*) FROM executions WHERE state = 'queued'
          AND queued_at < now() - $1 * interval '1 second') AS overdue_queued"""


# What a stuck drain has left, for its failure message: overdue due rows by shard owner.
_STUCK_SQL = """
SELECT l.owner, l.lease_until > now() AS live, count(*) AS rows, min(d.shard_id) AS shard,
       bool_or(d.execution_id IS NOT NULL) AS retries
FROM due_index d JOIN shard_leases l USING (shard_id)
WHERE d.next_run_at < now() - $1 * interval '1 second' GROUP BY 1, 2"""


class Progress(msgspec.Struct, frozen=True):
    unfinished_one_offs: int
    herd: int
    unfinished_herd: int
    in_flight: int
    overdue_rows: int
    overdue_queued: int

    def recovered(self, herd: int) -> bool:
        """The whole herd (`herd` jobs) ran, and nothing due is a second late."""
        return (self.herd >= herd and self.unfinished_herd == 0 and self.overdue_rows == 0
                and self.overdue_queued == 0)

    def drained(self, herd: int) -> bool:
        return self.recovered(herd) and self.unfinished_one_offs == 0 and self.in_flight == 0


async def progress(db: Database) -> Progress:
    async with db.connection() as conn:
        row = await conn.fetchrow(_PROGRESS_SQL, LATE_S, HERD_NAME)
    return Progress(*row)


# --- the processes ---------------------------------------------------------------------------


class SkewedSchedulerProcess(SchedulerProcess):
    """`herdwick scheduler` under tests/faults/skewed_scheduler.py: SIGUSR1 skews its clock."""

    module = SKEWED_MODULE


@dataclass
class Result:
    """A run's figures and its history's verdict."""

    fault: str
    seed: int
    in_flight: int
    recovery_s: float
    verdict: history.Verdict
    notes: dict = field(default_factory=dict)
    rerun_bound: int = WORKERS * CONCURRENCY
    receiver: Receiver | None = None
    http_jobs: int = 0

    def row(self) -> str:
        v = self.verdict
        notes = {**self.notes}
        if v.stale_recorded:
            notes["possible duplicates recorded"] = v.stale_recorded
        if v.attempt_gaps:
            notes["republished unleased"] = v.attempt_gaps
        if v.owner_unrecorded:
            notes["lease_owner not the winner's"] = v.owner_unrecorded
        if v.dead:
            notes["dead"] = dict(v.dead)
        if self.receiver is not None:
            notes["http deliveries"] = sum(self.receiver.deliveries.values())
            notes["http re-deliveries"] = self.receiver.repeated()
        text = "; ".join(f"{k} {val}" for k, val in notes.items())
        return (f"| {self.fault} | {self.seed} | {self.in_flight} | {v.lost} | {v.duplicates} | "
                f"{v.stale_accepted} | {v.reruns} | {self.recovery_s:.1f} | {text} |")

    def assert_sound(self) -> None:
        """The invariants hold, and re-runs stay within the attempts in flight."""
        assert self.verdict.problems == [], (
            f"seed {self.seed} ({SEED_ENV}={self.seed} replays it): {self.verdict.problems}")
        assert self.verdict.reruns <= self.rerun_bound, (
            f"seed {self.seed}: {self.verdict.reruns} re-runs, more than the "
            f"{self.rerun_bound} attempts in flight")
        if self.receiver is not None:
            # Every http job reached the receiver, signed; the history has its success.
            assert self.receiver.bad_signatures == 0, self.receiver.bad_signatures
            assert len(self.receiver.deliveries) == self.http_jobs, (
                f"seed {self.seed}: {len(self.receiver.deliveries)} of {self.http_jobs} "
                f"http jobs delivered")


Inject = Callable[["Stack"], Awaitable[None]]


class NotDrained(AssertionError):
    """The run did not drain in time after its fault: a stuck recovery."""


class Stack:
    """The running system of one scenario. Built by `Stack.up`; `run` drives it once."""

    def __init__(self, db: Database, exits: contextlib.AsyncExitStack, *, db_url: str,
                 redis_url: str, prefix: str, seed: int, rng: random.Random) -> None:
        self.db = db
        self._exits = exits
        self.db_url, self.redis_url, self.prefix = db_url, redis_url, prefix
        self.seed, self.rng = seed, rng
        self.schedulers: list[SchedulerProcess] = []
        self.workers: list[WorkerProcess] = []
        self.apis: list[ApiProcess] = []
        self.api_url = ""
        self.api_key = ""
        self.tenant_id: uuid.UUID | None = None
        self.down: set[int] = set()  # pids the scenario killed: not checked for life
        self.parked: datetime | None = None
        self.herd = 0  # one-off jobs named HERD_NAME the run must see finished
        self.due: datetime | None = None
        self.steady_via_api = False
        self.steady_statuses: dict[int, int] = {}  # the steady rate's answers, via the api
        self.http_workers: list[HttpWorkerProcess] = []
        self.receiver: Receiver | None = None  # with http=True
        self.pools: tuple[str, ...] = (POOL,)  # the queue pools the herd is spread over
        self.starts_dir = Path()  # where the SDK workers note each handler they began

    # --- starting --------------------------------------------------------------------

    @classmethod
    @contextlib.asynccontextmanager
    async def up(cls, db_url: str, redis_url: str, prefix: str, *, api: bool = False,
                 herd: int = HERD_JOBS, scheduler_db_url: str | None = None,
                 scheduler_redis_url: str | None = None, api_db_url: str | None = None,
                 skewed: int = 0, scheduler_env: dict[str, str] | None = None,
                 http: bool = False, schedulers: int = SCHEDULERS,
                 pools: tuple[str, ...] = (POOL,)) -> AsyncIterator[Stack]:
        """Everything started and the shards settled over the schedulers. `skewed` of the
        schedulers run under the clock-skew launcher; `scheduler_db_url` and
        `scheduler_redis_url` put the schedulers behind a proxy; `http` makes HTTP_JOBS of
        the herd http jobs, delivered by two `herdwick http-worker` to a local receiver;
        `pools` splits the herd over these pools, WORKERS workers each."""
        seed, rng = seeded()
        began = time.perf_counter()
        print(f"\nfault seed {seed} ({SEED_ENV}={seed} replays it)", flush=True)
        async with contextlib.AsyncExitStack() as exits:
            # All six open from the start: a test beside this one on the other xdist worker
            # may fill the server's connection slots for a moment, and the harness's own
            # steady inserts must not be what fails then (the stack's processes retry).
            db = await Database.connect(db_url, min_size=HARNESS_CONNECTIONS,
                                        max_size=HARNESS_CONNECTIONS)
            exits.push_async_callback(db.close)
            stack = cls(db, exits, db_url=db_url, redis_url=redis_url, prefix=prefix,
                        seed=seed, rng=rng)
            stack.pools = pools
            if http:
                stack.receiver = Receiver()
                await stack.receiver.start()
                exits.push_async_callback(stack.receiver.stop)
            await stack._prepare(herd)
            sched_env = child_env(
                HERDWICK_DATABASE_URL=scheduler_db_url or db_url,
                HERDWICK_REDIS_URL=scheduler_redis_url or redis_url,
                HERDWICK_KEY_PREFIX=prefix, HERDWICK_READY_MAX="auto",
                PYTHONPATH=str(ROOT), **(scheduler_env or {}))
            stack.starts_dir = Path(exits.enter_context(tempfile.TemporaryDirectory()))
            def worker_env(pool: str) -> dict[str, str]:
                return child_env(
                    HW_LOADTEST_REDIS_URL=redis_url, HW_LOADTEST_PREFIX=prefix,
                    HW_LOADTEST_POOL=pool, HW_LOADTEST_CONCURRENCY=str(CONCURRENCY),
                    **{LEASE_S_ENV: repr(LEASE_S),
                       HANDLER_MS_ENV: ",".join(map(str, HANDLER_MS)),
                       STARTS_ENV: str(stack.starts_dir)},
                    PYTHONPATH=str(ROOT))
            # Each process in a children() of its own, all starting at once: a start is
            # mostly imports, and one after the other they would cost a scenario seconds.
            kinds = [SkewedSchedulerProcess if i < skewed else SchedulerProcess
                     for i in range(schedulers)]
            started = await asyncio.gather(
                *(exits.enter_async_context(children(kind, 1, ["scheduler"], sched_env))
                  for kind in kinds),
                *(exits.enter_async_context(
                    children(WorkerProcess, 1, ["worker", WORKER_APP], worker_env(pool)))
                  for pool in pools for _ in range(WORKERS)),
                *(exits.enter_async_context(children(
                    HttpWorkerProcess, 1, ["http-worker", "--lease", f"{HTTP_LEASE_S:g}",
                                           "--concurrency", str(HTTP_CONCURRENCY)],
                    child_env(HERDWICK_REDIS_URL=redis_url, HERDWICK_KEY_PREFIX=prefix,
                              HERDWICK_HTTP_ALLOW=str(LOOPBACK))))
                  for _ in range(HTTP_WORKERS if http else 0)))
            for procs in started:
                kind = procs[0]
                (stack.schedulers if isinstance(kind, SchedulerProcess)
                 else stack.http_workers if isinstance(kind, HttpWorkerProcess)
                 else stack.workers).extend(procs)
            if api:
                stack._api_env = child_env(
                    HERDWICK_DATABASE_URL=api_db_url or db_url, HERDWICK_REDIS_URL=redis_url,
                    HERDWICK_KEY_PREFIX=prefix, HERDWICK_ADMIN_TOKEN=secrets.token_urlsafe(24),
                    HERDWICK_API_HOST="127.0.0.1", HERDWICK_API_PORT=str(free_port()))
                stack.api_url = f"http://127.0.0.1:{stack._api_env['HERDWICK_API_PORT']}"
                await stack.start_api()
            started = time.perf_counter()
            await leases_settled(db, stack.schedulers, time.perf_counter() + SETTLE_TIMEOUT_S)
            print(f"stack up in {time.perf_counter() - began:.1f} s (processes "
                  f"{started - began:.1f} s, shards settled {time.perf_counter() - started:.1f} s)",
                  flush=True)
            yield stack

    async def _prepare(self, herd: int) -> None:
        """The tenant, and the herd and cron jobs parked a day ahead (invisible until moved)."""
        created = await create_tenant(self.db, TenantSpec(name="faults"), datetime.now(UTC))
        self.tenant_id, self.api_key = created.tenant_id, created.api_key
        self.parked = parking_time()
        http = []
        if self.receiver is not None:
            self.receiver.secret = created.signing_secret
            http = make_jobs(HERD_NAME, HTTP_JOBS, self.parked, url=self.receiver.url)
        self.herd = herd + len(http)
        queued = [job for i, pool in enumerate(self.pools)
                  for job in make_jobs(HERD_NAME, herd // len(self.pools)
                                       + (i < herd % len(self.pools)), self.parked, pool=pool)]
        await insert(self.db, self.tenant_id, queued + http
                     + make_jobs(CRON_NAME, CRON_JOBS, self.parked, cron="* * * * *"))

    async def start_api(self) -> None:
        """A `herdwick api` (again, after a kill: what a process manager does)."""
        self.apis += await self._exits.enter_async_context(
            children(ApiProcess, 1, ["api"], self._api_env))

    # --- the processes -----------------------------------------------------------------

    def kill(self, child: Child) -> None:
        """kill -9."""
        self.down.add(child.pid)
        child.proc.kill()

    def alive(self) -> None:
        for child in [*self.schedulers, *self.workers, *self.http_workers, *self.apis]:
            if child.pid not in self.down:
                child.check_alive()

    def worker_id_of(self, child: Child) -> str:
        """The SDK's default worker id is host:pid:random."""
        return f":{child.pid}:"

    def begun(self, child: Child) -> set[tuple[str, int]]:
        """(execution_id, attempt) of each handler the worker process began."""
        path = self.starts_dir / str(child.pid)
        lines = path.read_text().split() if path.exists() else []
        return {(lines[i], int(lines[i + 1])) for i in range(0, len(lines) - 1, 2)}

    # --- a run -------------------------------------------------------------------------

    async def run(self, fault: str, window_s: tuple[float, float], inject: Inject, *,
                  in_flight: Callable[[Progress], int] | None = None,
                  allowed_dead: frozenset[str] = frozenset(), allow_gaps: bool = False,
                  notes: Callable[[], dict | Awaitable[dict]] | None = None,
                  drain_timeout_s: float | None = None) -> Result:
        """Move the herd due, run the steady rate, inject the fault at a random point of
        `window_s` (seconds after the due second), then recover, drain and check."""
        assert self.parked is not None
        self.due = datetime.fromtimestamp(int(time.time() + DUE_IN_S) + 1, UTC)
        client = connect_redis(self.redis_url, socket_timeout=5)
        try:  # announced, as the gateway announces a batch submit due this soon
            await move_herd(self.db, self.parked, self.due, hot=HotTier(client, self.prefix))
        finally:
            await client.aclose()
        drain_timeout_s = drain_timeout_s or DRAIN_TIMEOUT_S
        steady = asyncio.create_task(self._steady(self.due + timedelta(
            seconds=STEADY_AFTER_DUE_S)), name="the steady rate")
        try:
            offset_s = self.rng.uniform(*window_s)
            await self._sleep_until(self.due.timestamp() + offset_s, steady)
            before = await progress(self.db)
            fault_at = time.time()
            recovering = asyncio.create_task(self._recovered_after(fault_at, drain_timeout_s))
            await inject(self)
            recovery_s = await recovering
            stuck = await self._drain(steady, fault_at, drain_timeout_s)
        finally:
            steady.cancel()
            await asyncio.gather(steady, return_exceptions=True)
        verdict = await history.check(self.db, allowed_dead=allowed_dead, allow_gaps=allow_gaps)
        extra = notes() if notes else {}
        if inspect.isawaitable(extra):
            extra = await extra
        result = Result(fault=fault, seed=self.seed,
                        in_flight=in_flight(before) if in_flight else before.in_flight,
                        recovery_s=recovery_s, verdict=verdict,
                        notes={"at due +s": round(offset_s, 2), **extra},
                        rerun_bound=len(self.pools) * WORKERS * CONCURRENCY
                        + (HTTP_WORKERS * HTTP_CONCURRENCY if self.receiver else 0),
                        receiver=self.receiver,
                        http_jobs=HTTP_JOBS if self.receiver else 0)
        if stuck:
            result.notes["NOT DRAINED"] = stuck.splitlines()[0]
        record(result.row())
        if stuck:  # recorded first: a stuck run's row is the figure the table needs most
            raise NotDrained(stuck)
        return result

    async def _sleep_until(self, at: float, steady: asyncio.Task) -> None:
        while (left := at - time.time()) > 0:
            self._healthy(steady)
            await asyncio.sleep(min(left, POLL_S))

    def _healthy(self, steady: asyncio.Task) -> None:
        self.alive()
        if steady.done() and not steady.cancelled() and steady.exception() is not None:
            raise AssertionError("the steady rate failed") from steady.exception()

    async def _recovered_after(self, fault_at: float, timeout_s: float) -> float:
        deadline = fault_at + timeout_s
        while time.time() < deadline:
            with contextlib.suppress(*DB_DOWN):
                if (await progress(self.db)).recovered(self.herd):
                    return time.time() - fault_at
            await asyncio.sleep(POLL_S)
        return float("inf")

    async def events_unapplied(self) -> int:
        """Worker events not yet applied to Postgres: unread by the schedulers' group, or
        read and not acked. A stale call's record travels this way too."""
        client = connect_redis(self.redis_url, socket_timeout=5)
        unapplied = 0
        try:
            for pool in (*self.pools, HTTP_POOL) if self.receiver else self.pools:
                try:
                    groups = await client.xinfo_groups(keys.events_stream(self.prefix, pool))
                except aioredis.ResponseError:  # no stream yet (a Redis that came back empty)
                    continue
                except REDIS_ERRORS:  # a cluster's node failing over: look again later
                    return 1
                unapplied += sum((g.get("lag") or 0) + g["pending"] for g in groups
                                 if g["name"] == EVENTS_GROUP.encode())
        finally:
            await client.aclose()
        return unapplied

    async def _drain(self, steady: asyncio.Task, fault_at: float, timeout_s: float) -> str:
        """Wait until everything has run; '' then, else (past `timeout_s` from the fault)
        what is left and the processes' last lines."""
        deadline = fault_at + timeout_s
        while True:
            self._healthy(steady)
            try:
                found = await progress(self.db)
            except DB_DOWN:
                if time.time() > deadline:
                    raise
                await asyncio.sleep(POLL_S)
                continue
            if steady.done() and found.drained(self.herd) and not await self.events_unapplied():
                return ""
            if time.time() > deadline:
                async with self.db.connection() as conn:
                    stuck = await conn.fetch(_STUCK_SQL, LATE_S)
                unapplied = await self.events_unapplied()
                tails = "\n\n".join(f"{c.command} {c.pid}:\n" + "\n".join(list(c.tail)[-8:])
                                      for c in [*self.schedulers, *self.apis])
                return (f"{found.unfinished_one_offs} one-offs unfinished {timeout_s:g} s after "
                        f"the fault, {found.overdue_rows} due rows overdue, {unapplied} worker "
                        f"events unapplied, steady rate done: {steady.done()} (seed {self.seed})\n"
                        f"{found}\noverdue due rows by shard owner (owner, lease live, rows, "
                        f"a shard, retries): {[tuple(r) for r in stuck]}\n{tails}")
            await asyncio.sleep(POLL_S)

    # --- the steady rate ---------------------------------------------------------------

    async def _steady(self, until: datetime) -> None:
        """STEADY_RATE jobs/s, each due STEADY_DELAY_S after it is made, until `until`:
        inserted as the gateway does, or through the api when steady_via_api."""
        assert self.tenant_id is not None
        start = time.perf_counter()
        made = 0
        async with aiohttp.ClientSession() as session:
            k = 0
            while datetime.now(UTC) < until:
                await asyncio.sleep(max(0.0, start + k * STEADY_TICK_S - time.perf_counter()))
                k += 1
                count = round(STEADY_RATE * STEADY_TICK_S * k) - made
                made += count
                due = datetime.now(UTC) + timedelta(seconds=STEADY_DELAY_S)
                if self.steady_via_api:
                    await self._submit_steady(session, count, due)
                else:
                    await insert(self.db, self.tenant_id, make_jobs(STEADY_NAME, count, due))

    async def _submit_steady(self, session: aiohttp.ClientSession, count: int,
                             due: datetime) -> None:
        body = {"jobs": [job_body(STEADY_NAME, due) for _ in range(count)]}
        try:
            async with session.post(f"{self.api_url}/v1/jobs:batch", json=body,
                                    headers=self.auth(), timeout=aiohttp.ClientTimeout(5)) as r:
                status = r.status
        except (aiohttp.ClientError, TimeoutError):
            status = 0
        self.steady_statuses[status] = self.steady_statuses.get(status, 0) + 1

    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}
