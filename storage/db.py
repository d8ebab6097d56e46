"""The Postgres pool and the boundary where driver errors become domain errors."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import asyncpg

from herdwick import logs, telemetry
from herdwick.errors import PartitionAttached, Rejected, StorageUnavailable
from herdwick.storage.sql import queries

log = logs.get("herdwick.storage")

T = TypeVar("T")

COMMAND_TIMEOUT_S = 10.0
RETRIES = 3
ACQUIRE_TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 5.0
# With several hosts in the DSN, each gets this long (HostByHost): a hung one leaves the
# next time to answer within one ACQUIRE_TIMEOUT_S.
HOST_TIMEOUT_S = 2.0

# What "the database is not there" looks like from asyncpg: connection-class
# SQLSTATEs (08xxx), operator intervention (57xxx: shutdown, cannot connect
# now), a closed connection, the socket failing, or a timeout.
_UNAVAILABLE = (
    OSError,
    TimeoutError,
    asyncpg.PostgresConnectionError,
    asyncpg.exceptions.OperatorInterventionError,
    asyncpg.exceptions.InsufficientResourcesError,
    asyncpg.InterfaceError,
    asyncpg.TargetServerAttributeNotMatched,  # every host answered; none takes writes
)


# What "this data is refused" looks like: data exceptions (22xxx: out of range,
# NUL in text, bad encoding), integrity violations (23xxx) and program limits
# (54xxx: a value too large to index). asyncpg raises DataError for a value it
# cannot encode, too.
_REJECTED = (
    asyncpg.DataError,
    asyncpg.IntegrityConstraintViolationError,
    asyncpg.exceptions.ProgramLimitExceededError,
)


@contextlib.contextmanager
def translated(replica: bool = False) -> object:
    """Turn driver-level unavailability into StorageUnavailable, refused data into Rejected.

    replica: a read replica's. A hot standby cancels a query whose snapshot or locks
    stand in the way of replaying the primary's WAL ("conflict with recovery", SQLSTATE
    40001): that replica cannot answer it now, which its caller reads as unavailable.
    """
    try:
        yield
    except _UNAVAILABLE as exc:
        raise StorageUnavailable(f"postgres unavailable: {type(exc).__name__}: {exc}") from exc
    except _REJECTED as exc:
        # Not the row's fault: it waited on the attach of its day's partition (which
        # moves that day out of the default one), then went where routing had sent it.
        if isinstance(exc, asyncpg.CheckViolationError) \
                and "violates partition constraint" in str(exc):
            raise PartitionAttached(f"postgres: {exc}") from exc
        raise Rejected(f"postgres refused it: {type(exc).__name__}: {exc}") from exc
    except asyncpg.SerializationError as exc:
        if not replica:
            raise
        raise StorageUnavailable(f"replica cancelled the query: {exc}") from exc


async def retrying(attempt: Callable[[], Awaitable[T]]) -> T:
    """Run a whole transaction again after a deadlock, a serialization failure or a
    partition attached under it.

    Only those are safe to retry blindly: the transaction rolled back and
    changed nothing. Bounded and jittered.
    """
    for tries in range(1, RETRIES + 1):
        try:
            return await attempt()
        except (asyncpg.DeadlockDetectedError, asyncpg.SerializationError, PartitionAttached):
            if tries == RETRIES:
                raise
            log.info("transaction_retried", tries=tries)
            await asyncio.sleep(random.uniform(0.005, 0.05) * tries)
    raise AssertionError("unreachable")


async def _keep_session(conn: asyncpg.Connection) -> None:
    """Pool release without asyncpg's reset query (advisory unlock, CLOSE ALL, UNLISTEN,
    RESET ALL): a second round trip per checkout, about 18 % of a single submit.

    Safe because herdwick keeps no session state on pooled connections but one
    it means to keep (the scheduler's plan_cache_mode, set at connect): its
    advisory locks are transaction-level, migrations use their own connection,
    and nothing LISTENs. asyncpg still rolls back an open transaction.
    """


async def _timed(conn: asyncpg.Connection) -> None:
    conn.add_query_logger(_observe)


async def _generic_plans(conn: asyncpg.Connection) -> None:
    """A SET once a connection opens, not a startup parameter: a pooler in front of
    Postgres (PgBouncer) refuses startup parameters it does not know."""
    await _timed(conn)
    await conn.execute("SET plan_cache_mode = force_generic_plan")


@functools.cache
def _names() -> dict[str, str]:
    return {text: name for name, text in queries().items()}


def _observe(record) -> None:
    """asyncpg's timing of each statement, by its name in storage/queries (else "other")."""
    telemetry.POSTGRES.labels(_names().get(record.query, "other")).observe(record.elapsed)


def host_dsns(dsn: str) -> list[str]:
    """A URL that names several hosts (postgresql://u@db-a:5432,db-b:5432/herdwick?...) as
    one URL a host, in its order, each with the rest of it; any other DSN as itself."""
    parts = urllib.parse.urlsplit(dsn)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    if parts.scheme not in ("postgres", "postgresql") or "," not in hosts:
        return [dsn]
    return [urllib.parse.urlunsplit(parts._replace(netloc=f"{userinfo}{at}{host}"))
            for host in hosts.split(",")]


# What sends a connection attempt on to the next host, as libpq does: anything that
# keeps this one from being a usable session.
_NEXT_HOST = (OSError, asyncpg.PostgresError, asyncpg.InterfaceError,
              asyncpg.TargetServerAttributeNotMatched)


class HostByHost:
    """Connects through a DSN of several hosts one host at a time, each within its own
    timeout (HOST_TIMEOUT_S at most), the host that last took a connection first.

    asyncpg gives all the hosts of a DSN one timeout together: a host that hangs (a
    frozen VM, a partition, rather than refusing) uses all of it, the next host is never
    tried, and a promoted standby stays out of reach for as long as the old primary
    hangs. Called with the options asyncpg's pool passes to connect().
    """

    def __init__(self, dsn: str) -> None:
        self._dsns = host_dsns(dsn)
        self._first = 0  # written here only

    async def __call__(self, *_dsn: object, **options: object) -> asyncpg.Connection:
        options["timeout"] = min(float(options.get("timeout") or HOST_TIMEOUT_S),
                                 HOST_TIMEOUT_S)
        last: BaseException | None = None
        for k in range(len(self._dsns)):
            i = (self._first + k) % len(self._dsns)
            try:
                conn = await asyncpg.connect(self._dsns[i], **options)
            except _NEXT_HOST as exc:
                last = exc
                continue
            self._first = i
            return conn
        assert last is not None
        raise last


class Database:
    """Owns the asyncpg pool. Every query goes through `connection()`."""

    def __init__(self, pool: asyncpg.Pool, *, replica: bool = False) -> None:
        self.pool = pool
        self.replica = replica  # a read replica's pool: see translated()

    @classmethod
    async def connect(cls, dsn: str, *, min_size: int = 1, max_size: int = 10,
                      command_timeout_s: float = COMMAND_TIMEOUT_S,
                      replica: bool = False, generic_plans: bool = False) -> Database:
        """`generic_plans`: plan each prepared statement once (plan_cache_mode), for a
        pool whose statements find their rows by key or by one index range whatever
        the arguments (the scheduler's). Postgres would otherwise re-plan a statement
        on every call when an array argument's length changes its estimate: the
        dispatch's insert of executions was planned afresh each transaction (with
        generic plans Postgres spends a tenth less CPU per execution in a herd).
        Not for the gateway: its list filters (`$n IS NULL OR ...`) need a plan made
        for the arguments given."""
        with translated():
            pool = await asyncpg.create_pool(
                dsn,
                min_size=min_size,
                max_size=max_size,
                command_timeout=command_timeout_s,
                timeout=CONNECT_TIMEOUT_S,
                server_settings={"timezone": "UTC", "application_name": "herdwick"},
                reset=_keep_session,
                init=_generic_plans if generic_plans else _timed,
                connect=HostByHost(dsn) if len(host_dsns(dsn)) > 1 else None,
            )
        return cls(pool, replica=replica)

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[asyncpg.Connection]:
        with translated(self.replica):
            async with self.pool.acquire(timeout=ACQUIRE_TIMEOUT_S) as conn:
                yield conn

    @contextlib.asynccontextmanager
    async def transaction(self, *, by_key: bool = False) -> AsyncIterator[asyncpg.Connection]:
        """`by_key`: its statements find a batch's rows by key, one index probe a row,
        whatever the statistics say (storage/queries/executions.sql plan_by_key)."""
        async with self.connection() as conn, conn.transaction():
            if by_key:
                await conn.execute(queries()["plan_by_key"])
            yield conn

    async def ping(self) -> None:
        async with self.connection() as conn:
            await conn.fetchval("SELECT 1")

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self.pool.close(), timeout=5)
        except (TimeoutError, *_UNAVAILABLE):
            self.pool.terminate()
