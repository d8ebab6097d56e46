"""The built-in `http` pool: delivers http jobs as signed POSTs (CONTRACT.md "HTTP targets").

An http worker is a herdwick.Worker on the pool `http` whose handler is a
delivery: it speaks the worker protocol like any worker, and reads what it
needs besides (tenants' signing secrets, circuit breakers) from Redis, never
from Postgres. As many may run as you like; the breakers are shared in Redis.

One delivery: check the target's address (ssrf), ask its breaker, take a slot
of its concurrency cap, sign, POST (redirects not followed), classify:
2xx completes; 408, 429, 5xx, timeouts and connection errors retry (a
Retry-After sets the earliest next attempt); other statuses dead-letter. An
open breaker defers the execution (herdwick.Defer: no attempt is used up).
"""

from __future__ import annotations

import asyncio
import email.utils
import random
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import aiohttp
import msgspec
import redis.asyncio as aioredis
import yarl

from herdwick import logs, redis_client, ssrf, telemetry
from herdwick.redis_client import REDIS_ERRORS
from herdwick.signing import SigningKeys, signature_header
from herdwick.storage import keys
from herdwick.worker import Context, Defer, Permanent, RetryAfter, Worker, _Pipeline

log = logs.get("herdwick.http")

HTTP_POOL = "http"
DEFAULT_CONCURRENCY = 512
DEFAULT_TARGET_CONCURRENCY = 128
BODY_EXCERPT_BYTES = 1024  # of a response, kept as the result or in the error
CLOSED_TRUST_S = 1.0  # a closed breaker is believed this long before asking again
SUCCESS_FLUSH_S = 1.0  # successes are counted locally and reported this often
SECRETS_TTL_S = 5.0  # a tenant's signing keys are re-read this often (rotation lands)
NO_SECRET_DEFER_S = 5.0  # no keys in Redis yet (it restarted; the scheduler restores them)
# A slow target may hold at most a quarter of the worker's slots waiting for its cap, and
# only while a slot would take longer than BUSY_WAIT_S to free: past that its deliveries are
# put off (BUSY_DEFER_S), so other targets keep slots. A fast target's herd just waits.
BUSY_WAIT_S = 1.0
BUSY_DEFER_S = 1.0
LATENCY_WEIGHT = 0.1  # of each request in a target's smoothed latency
# The SDK's handler timer waits this long past the job's timeout, so the request's own
# timeout (a classified `timeout`) wins even when the event loop runs late.
HANDLER_GRACE_S = 2.0
MAX_RETRY_AFTER_S = 24 * 3600.0
DNS_CACHE_S = 10
URL_CACHE_SIZE = 10_000  # target URLs whose checks are remembered


@dataclass(frozen=True, kw_only=True)
class BreakerPolicy:
    """When a target's circuit opens, and for how long (hw_breaker_report)."""

    failures: int = 5  # within one window, and at least as many as the successes
    window_s: float = 30.0
    cooldown_s: float = 10.0  # the first open; doubled per failed probe
    max_cooldown_s: float = 300.0

    def report_head(self, base: str) -> tuple:
        return ("FCALL", "hw_breaker_report", 1, base, self.failures,
                round(self.window_s * 1000), round(self.cooldown_s * 1000),
                round(self.max_cooldown_s * 1000))


class HttpError(Exception):
    """A delivery that failed and may succeed later: retried with the job's backoff."""

    def __init__(self, kind: str, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.error_details = {"class": kind, **({"status": status} if status else {})}


class HttpRetryAfter(RetryAfter):
    """A 429 or 503 (or any retryable status) carrying Retry-After."""

    def __init__(self, seconds: float, kind: str, message: str, status: int) -> None:
        super().__init__(seconds, message)
        self.error_details = {"class": kind, "status": status, "retryAfterSeconds": seconds}


class HttpRejected(Permanent):
    """The target refused the delivery for good (a 4xx, a redirect): dead at once."""

    def __init__(self, kind: str, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.error_details = {"class": kind, **({"status": status} if status else {})}


class TargetRefused(Permanent):
    """The target's address is one herdwick must not reach (ssrf), or its URL is unusable."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.error_details = {"class": "target_refused"}


class CircuitOpen(Defer):
    """The target's breaker is open: put off without using up an attempt."""

    def __init__(self, seconds: float, origin: str, why: str) -> None:
        super().__init__(seconds, f"circuit open for {origin}: {why}; "
                                  f"deferred {seconds:.1f} s without using an attempt")
        self.error_details = {"class": "circuit_open", "target": origin}


class TargetMissing(Defer):
    """An entry published before streams carried the URL (library 13): put off, so that the
    scheduler publishes the next attempt, which carries it."""

    def __init__(self) -> None:
        super().__init__(1.0, "the ready entry carries no target URL (published by an "
                              "older herdwick); deferred, to come back with it")
        self.error_details = {"class": "target_missing"}


class TargetBusy(Defer):
    def __init__(self, seconds: float, origin: str, cap: int, wait_s: float) -> None:
        super().__init__(seconds, f"{origin} is slow: {cap} deliveries in flight, and a slot "
                                  f"would free in about {wait_s:.1f} s; deferred without "
                                  "using an attempt")
        self.error_details = {"class": "target_busy", "target": origin}


class SecretMissing(Defer):
    def __init__(self, seconds: float, tenant_id: str) -> None:
        super().__init__(seconds, f"no signing secret for tenant {tenant_id} in Redis yet "
                                  "(a scheduler restores them within seconds)")
        self.error_details = {"class": "secret_missing"}


def origin_of(url: urllib.parse.SplitResult) -> str:
    """scheme://host:port, the unit of a breaker and of a concurrency cap."""
    port = url.port or (443 if url.scheme == "https" else 80)
    host = url.hostname or ""
    return f"{url.scheme}://{'[' + host + ']' if ':' in host else host}:{port}"


def retry_after_s(value: str | None, now: float) -> float | None:
    """Retry-After as seconds from now: delta-seconds or an HTTP date; None if absent or bad."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return min(float(value), MAX_RETRY_AFTER_S)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None or when.tzinfo is None:
        return None
    return min(max(0.0, when.timestamp() - now), MAX_RETRY_AFTER_S)


def _excerpt(body: bytes) -> str:
    return body[:BODY_EXCERPT_BYTES].decode(errors="replace")


_RETRY_CLASS = {408: "request_timeout", 429: "rate_limited"}


_STATES = ("closed", "half_open", "open")  # herdwick_http_breaker_state's values: 0, 1, 2


class _Target:
    """What this process knows of one origin: its breaker as last seen, its slots."""

    __slots__ = ("breaker", "closed_until", "in_flight", "latency_s", "slots", "successes",
                 "waiting")

    def __init__(self, cap: int) -> None:
        self.breaker = "closed"  # as last seen: closed | half_open | open (for the gauges)
        self.closed_until = 0.0  # monotonic: believe the breaker closed until then
        self.in_flight = 0
        self.waiting = 0
        self.slots = asyncio.Semaphore(cap)
        self.successes = 0  # not yet reported
        self.latency_s = 0.0  # smoothed, of its requests (0: none yet)


class Delivery:
    """The http pool's handler, and the Redis state it shares with other http workers."""

    def __init__(self, client: aioredis.Redis, prefix: str, *,
                 allow: Sequence[ssrf.Network] = (), concurrency: int = DEFAULT_CONCURRENCY,
                 target_concurrency: int = DEFAULT_TARGET_CONCURRENCY,
                 breaker: BreakerPolicy | None = None,
                 resolver: aiohttp.abc.AbstractResolver | None = None) -> None:
        # resolver: what answers DNS (aiohttp's default when None); the guard wraps it.
        self._client = client
        self._prefix = prefix
        self._base = keys.pool_base(prefix, HTTP_POOL)
        self._signing = keys.signing_hash(prefix)
        self._allow = tuple(allow)
        self._busy_after = max(1, concurrency // 4)
        self._cap = target_concurrency
        self._breaker = breaker or BreakerPolicy()
        self._resolver = resolver
        self._targets: dict[str, _Target] = {}
        self._urls: dict[str, tuple[yarl.URL, str] | TargetRefused] = {}
        self._secrets: dict[str, tuple[float, SigningKeys | None]] = {}
        self._user_agent = f"herdwick/{_version()}"
        self._session: aiohttp.ClientSession | None = None
        self._pipeline: _Pipeline | None = None
        self._tasks: list[asyncio.Task] = []
        self._delivered: dict[str, object] = {}  # outcome class -> its counter child

    async def __aenter__(self) -> Delivery:
        self._guard = ssrf.GuardedResolver(self._allow, base=self._resolver)
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, ttl_dns_cache=DNS_CACHE_S,
                                         resolver=self._guard)
        self._session = aiohttp.ClientSession(
            connector=connector, cookie_jar=aiohttp.DummyCookieJar(),
            auto_decompress=False, skip_auto_headers=("Accept-Encoding",))
        self._pipeline = _Pipeline(self._client)
        telemetry.watch(self)
        self._tasks = [asyncio.create_task(self._pipeline.run()),
                       asyncio.create_task(self._report_successes())]
        return self

    async def __aexit__(self, *exc: object) -> None:
        telemetry.unwatch(self)
        await self._flush_successes()
        if self._pipeline is not None:
            self._pipeline.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            await self._guard.close()  # the connector leaves a resolver it was given open

    # --- the handler ---------------------------------------------------------------------

    async def __call__(self, ctx: Context) -> dict[str, Any]:
        """One delivery, counted by how it ended (herdwick_http_deliveries_total)."""
        try:
            result = await self._deliver(ctx)
        except Exception as exc:
            self._count(getattr(exc, "error_details", {}).get("class", "error"))
            raise
        self._count("success")
        return result

    def _count(self, outcome: str) -> None:
        child = self._delivered.get(outcome)
        if child is None:
            child = self._delivered[outcome] = telemetry.HTTP_DELIVERIES.labels(outcome)
        child.inc()

    def gauges(self):
        """telemetry.GaugeSource: the breakers of the targets this process has sent to."""
        states = dict.fromkeys(_STATES, 0)
        for origin, target in list(self._targets.items()):
            states[target.breaker] += 1
            yield ("herdwick_http_breaker_state", {"target": telemetry.target_label(origin)},
                   _STATES.index(target.breaker))
        for state, count in states.items():
            yield "herdwick_http_breakers", {"state": state}, count

    async def _deliver(self, ctx: Context) -> dict[str, Any]:
        began = time.monotonic()  # the SDK's handler timeout runs from about now
        if not ctx.target:
            raise TargetMissing()
        url, origin = self._checked_url(ctx.target)
        target = self._targets.get(origin)
        if target is None:
            target = self._targets[origin] = _Target(self._cap)
        cached = self._secrets.get(ctx.tenant_id)
        if cached is not None and cached[1] is not None and cached[0] > time.monotonic():
            signing = cached[1]  # checked here, not in _keys: no coroutine per delivery
        else:
            signing = await self._keys(ctx.tenant_id, cached)
        if target.waiting >= self._busy_after:
            wait_s = target.waiting * target.latency_s / self._cap
            if wait_s > BUSY_WAIT_S:
                raise TargetBusy(BUSY_DEFER_S * random.uniform(1, 2), origin, self._cap, wait_s)
        # last: a probe granted is a probe sent
        probe = False if time.monotonic() < target.closed_until else \
            await self._admit(origin, target)
        target.waiting += 1
        try:
            await target.slots.acquire()
        finally:
            target.waiting -= 1
        target.in_flight += 1
        sent = time.monotonic()
        try:
            return await self._post(ctx, url, origin, target, probe, signing, began)
        finally:
            took = time.monotonic() - sent
            target.latency_s += LATENCY_WEIGHT * (took - target.latency_s) if target.latency_s \
                else took
            target.in_flight -= 1
            target.slots.release()

    def _checked_url(self, ref: str) -> tuple[yarl.URL, str]:
        """The URL to send to and its origin, or TargetRefused. Remembered: the checks of
        a literal address depend on nothing but the URL and the allow list."""
        checked = self._urls.get(ref)
        if checked is None:
            if len(self._urls) >= URL_CACHE_SIZE:
                self._urls.clear()
            checked = self._urls[ref] = self._check_url(ref)
        if isinstance(checked, TargetRefused):
            raise TargetRefused(str(checked))
        return checked

    def _check_url(self, ref: str) -> tuple[yarl.URL, str] | TargetRefused:
        try:
            ssrf.check_url(ref, self._allow)
            split = urllib.parse.urlsplit(ref)
            split.port  # noqa: B018 - raises ValueError for a bad port
            url = yarl.URL(ref)
        except ssrf.TargetRefused as exc:
            return TargetRefused(str(exc))
        except ValueError as exc:
            return TargetRefused(f"not a usable URL: {exc}")
        return url, origin_of(split)

    async def _admit(self, origin: str, target: _Target) -> bool:
        """Ask the breaker (the caller trusts a fresh closed answer without asking): go,
        or raise CircuitOpen; True when this delivery is the half-open probe."""
        now = time.monotonic()
        probe_ms = round(self._breaker.window_s * 1000)
        try:
            wait_ms = await self._pipeline.submit_item(
                ("FCALL", "hw_breaker_check", 1, self._base, probe_ms), origin)
        except REDIS_ERRORS as exc:  # no breaker to ask: deliver (the attempt is fenced anyway)
            log.warning("breaker_unavailable", target=origin, error=exc)
            return False
        wait_ms = int(wait_ms)
        if wait_ms == 0:
            target.closed_until = now + CLOSED_TRUST_S
            target.breaker = "closed"
            return False
        if wait_ms < 0:
            target.breaker = "half_open"
            log.info("breaker_probe", target=origin)
            return True
        target.breaker = "open"
        wait_s = wait_ms / 1000
        # Spread the deferred ones over the cool-down, so they don't come back as one herd.
        raise CircuitOpen(wait_s + random.uniform(0, max(1.0, wait_s)), origin,
                          f"next probe in {wait_s:.1f} s")

    async def _keys(self, tenant_id: str,
                    cached: tuple[float, SigningKeys | None] | None) -> SigningKeys:
        """The tenant's keys read from Redis (the cache in `cached` is stale or empty)."""
        now = time.monotonic()
        try:
            raw = await self._pipeline.submit_item(("HMGET", self._signing), tenant_id)
        except REDIS_ERRORS:
            raw = None
            if cached is not None and cached[1] is not None:
                return cached[1]  # stale, but still the tenant's
        found = None
        if raw is not None:
            try:
                found = SigningKeys.decode(raw)
            except (msgspec.DecodeError, msgspec.ValidationError):
                log.error("signing_keys_malformed", tenant_id=tenant_id)
        self._secrets[tenant_id] = (now + SECRETS_TTL_S, found)
        if found is None:
            raise SecretMissing(NO_SECRET_DEFER_S * random.uniform(1, 1.5), tenant_id)
        return found

    async def _post(self, ctx: Context, url: yarl.URL, origin: str, target: _Target,
                    probe: bool, signing: SigningKeys, began: float) -> dict[str, Any]:
        body = ctx.payload_json.encode()
        now = time.time()
        headers = {
            "Content-Type": "application/json",
            "User-Agent": self._user_agent,
            "Idempotency-Key": ctx.idempotency_key,
            "Herdwick-Execution-Id": ctx.execution_id,
            "Herdwick-Attempt": str(ctx.attempt),
            # the key is job_id:scheduled_for, with scheduled_for as the stream has it
            "Herdwick-Scheduled-For": ctx.idempotency_key[len(ctx.job_id) + 1:],
            "Herdwick-Signature": signature_header(signing.active(int(now * 1000)), body,
                                                   int(now)),
        }
        # What is left of the job's timeout once a slot, its breaker and its keys were had,
        # so the request gives up (a `timeout`) before the SDK's timer does.
        timeout = aiohttp.ClientTimeout(
            total=max(0.05, ctx.timeout_s - (time.monotonic() - began)))
        try:
            async with self._session.post(url, data=body, headers=headers,
                                          allow_redirects=False, timeout=timeout) as response:
                excerpt = await response.content.read(BODY_EXCERPT_BYTES)
                status = response.status
                reason = response.reason or ""
                location = response.headers.get("Location")
                retry_after = response.headers.get("Retry-After")
        except ssrf.TargetRefused as exc:
            raise TargetRefused(str(exc)) from None
        except aiohttp.InvalidUrlClientError as exc:  # e.g. an allowed 2130706433-style host
            raise TargetRefused(f"aiohttp cannot send to this URL: {exc}") from None
        except TimeoutError:
            raise self._failed(HttpError("timeout", f"no response within {ctx.timeout_s:g} s"),
                               origin, target, probe) from None
        except aiohttp.ClientConnectorError as exc:
            kind = "dns" if isinstance(exc, aiohttp.ClientConnectorDNSError) else "connection"
            raise self._failed(HttpError(kind, f"{kind} error: {exc}"),
                               origin, target, probe) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise self._failed(HttpError("connection",
                                         f"connection error: {type(exc).__name__}: {exc}"),
                               origin, target, probe) from None
        text = f"{status} {reason}".strip()
        if 200 <= status < 300:
            self._succeeded(origin, target, probe)
            return {"status": status, "body": _excerpt(excerpt)}
        if status in _RETRY_CLASS or status >= 500:
            kind = _RETRY_CLASS.get(status, "server_error")
            message = f"HTTP {text} ({kind}, retried): {_excerpt(excerpt)}"
            after = retry_after_s(retry_after, time.time())
            if after is not None:
                raise self._failed(HttpRetryAfter(after, kind, message, status),
                                   origin, target, probe)
            raise self._failed(HttpError(kind, message, status), origin, target, probe)
        self._succeeded(origin, target, probe)  # the target answered: it is up
        if 300 <= status < 400:
            raise HttpRejected("redirect", f"HTTP {text}: redirects are not followed "
                                           f"(Location: {location})", status)
        raise HttpRejected("client_error", f"HTTP {text} (dead-lettered: a 4xx other than "
                                           f"408 and 429 is not retried): {_excerpt(excerpt)}",
                           status)

    # --- breaker reports -----------------------------------------------------------------

    def _failed(self, error: Exception, origin: str, target: _Target,
                probe: bool) -> Exception:
        """A failure goes to Redis at once (it may open the breaker); stop trusting 'closed'.
        A failed probe is a real attempt, and its error says it was the probe."""
        target.closed_until = 0.0
        self._report(origin, 0, 1, probe)
        if probe:
            error.error_details["probe"] = True
        return error

    def _succeeded(self, origin: str, target: _Target, probe: bool) -> None:
        if probe:
            target.breaker = "closed"
            self._report(origin, 1, 0, True)
        else:
            target.successes += 1

    def _report(self, origin: str, successes: int, failures: int, probe: bool) -> None:
        future = self._pipeline.submit_item(self._breaker.report_head(self._base),
                                            origin, successes, failures, int(probe))
        future.add_done_callback(lambda f: self._reported(origin, f))

    def _reported(self, origin: str, future: asyncio.Future) -> None:
        if future.cancelled():
            return
        if future.exception() is not None:
            log.warning("breaker_report_failed", target=origin, error=future.exception())
        elif int(future.result()) == 1:
            target = self._targets.get(origin)
            if target is not None:
                target.closed_until = 0.0
                target.breaker = "open"
            log.info("breaker_open", target=origin)

    async def _report_successes(self) -> None:
        while True:
            await asyncio.sleep(SUCCESS_FLUSH_S)
            await self._flush_successes()

    async def _flush_successes(self) -> None:
        for origin, target in self._targets.items():
            if target.successes:
                self._report(origin, target.successes, 0, False)
                target.successes = 0


def _version() -> str:
    try:
        return metadata.version("herdwick")
    except metadata.PackageNotFoundError:
        return "dev"


class HttpWorker:
    """`herdwick http-worker`: a Worker on the pool `http` running Delivery."""

    def __init__(self, redis_url: str | None = None, *, key_prefix: str | None = None,
                 allow: Sequence[ssrf.Network] = (), concurrency: int = DEFAULT_CONCURRENCY,
                 target_concurrency: int = DEFAULT_TARGET_CONCURRENCY,
                 breaker: BreakerPolicy | None = None, lease_s: float | None = None,
                 worker_id: str | None = None, redis: aioredis.Redis | None = None,
                 resolver: aiohttp.abc.AbstractResolver | None = None) -> None:
        if target_concurrency < 1:
            raise ValueError("target_concurrency must be at least 1")
        extra = {"lease_s": lease_s} if lease_s else {}
        self.worker = Worker(redis_url, HTTP_POOL, concurrency, key_prefix=key_prefix,
                             worker_id=worker_id, redis=redis, **extra)
        self.worker.decode_payload = False  # the body is the payload's JSON text as stored
        self.worker.timeout_grace_s = HANDLER_GRACE_S
        self._given = redis
        self._options = dict(allow=allow, concurrency=concurrency,
                             target_concurrency=target_concurrency, breaker=breaker,
                             resolver=resolver)

    async def run(self, stop: asyncio.Event | None = None) -> None:
        url, prefix = self.worker._resolve()
        client = self._given or redis_client.connect(url)
        try:
            async with Delivery(client, prefix, **self._options) as delivery:
                self.worker.handler(delivery.__call__)
                await self.worker.run(stop)
        finally:
            if self._given is None:
                await client.aclose()

    async def stop(self) -> None:
        await self.worker.stop()
