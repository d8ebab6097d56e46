"""kill -9 of each process kind in the middle of a herd: nothing lost, nothing run twice.

docs/design.md, "When things fail": a process that dies at any line leaves
what it committed standing, and what it had not is redone by another. A
killed worker's leases lapse (5 s) and its attempts run again elsewhere; a
killed scheduler's shards move to the survivor once their 10 s leases lapse.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import aiohttp
import msgspec
import pytest
import redis.asyncio as aioredis

from herdwick.actors.executions import GROUP as EVENTS_GROUP
from herdwick.storage import keys
from tests.faults.harness import HERD_NAME, POOL, Stack, job_body

MID_BATCH_WAIT_S = 3.0
BATCHES = 30  # the api scenario's herd: 30 requests of 100 jobs, four at a time
BATCH_JOBS = 100
SUBMIT_LANES = 4
KILL_AFTER_BATCHES = (2, 15)  # the api dies once this many batches had their 201
API_HERD_DUE_IN_S = 1.0  # the herd is due this long after its submission starts

pytestmark = pytest.mark.slow


async def test_kill_a_worker_mid_handler(db_url, services, key_prefix) -> None:
    async def kill_a_worker(stack: Stack) -> None:
        stack.kill(stack.rng.choice(stack.workers))

    async with Stack.up(db_url, services.redis_url, key_prefix) as stack:
        result = await stack.run("kill -9 worker mid-handler", (0.3, 1.2), kill_a_worker)
    result.assert_sound()


async def test_kill_an_http_worker_mid_delivery(db_url, services, key_prefix) -> None:
    """Its deliveries in flight lapse with their 5 s leases (`--lease 5`) and the other
    http-worker delivers them again, with the same Idempotency-Key."""
    async def kill_an_http_worker(stack: Stack) -> None:
        stack.kill(stack.rng.choice(stack.http_workers))

    async with Stack.up(db_url, services.redis_url, key_prefix, http=True) as stack:
        result = await stack.run("kill -9 http-worker mid-delivery", (0.2, 0.8),
                                 kill_an_http_worker)
    result.assert_sound()


async def test_kill_a_scheduler_mid_dispatch(db_url, services, key_prefix) -> None:
    async def kill_a_scheduler(stack: Stack) -> None:
        stack.kill(stack.rng.choice(stack.schedulers))

    async with Stack.up(db_url, services.redis_url, key_prefix) as stack:
        # A dispatch committed and not yet published is republished by the sweeper as the
        # next attempt: that leaves a number no worker leased (a gap), by design.
        result = await stack.run("kill -9 scheduler mid-dispatch", (0.0, 0.8), kill_a_scheduler,
                                 allow_gaps=True)
    result.assert_sound()


async def pending_events(stack: Stack) -> dict[str, int]:
    """Events each scheduler's consumer has read and not acked (applied), by consumer."""
    client = aioredis.from_url(stack.redis_url)
    try:
        found = await client.xpending(keys.events_stream(stack.prefix, POOL), EVENTS_GROUP)
    finally:
        await client.aclose()
    return {c["name"].decode(): c["pending"] for c in found["consumers"]}


async def test_kill_a_scheduler_while_its_event_actor_is_mid_batch(
        db_url, services, key_prefix) -> None:
    """The dead node's consumer read a batch of outcomes and never acked it: the survivor
    claims those events (after actors/executions.py STALE_MS) and applies them."""
    seen: dict[str, int] = {}

    async def kill_mid_batch(stack: Stack) -> None:
        victim = stack.rng.choice(stack.schedulers)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + MID_BATCH_WAIT_S
        while loop.time() < deadline:  # until the victim holds events it has not applied
            held = {n: c for n, c in (await pending_events(stack)).items()
                    if stack.worker_id_of(victim) in n}
            if sum(held.values()) > 0:
                break
            await asyncio.sleep(0.005)
        stack.kill(victim)
        seen["held at kill"] = sum(held.values())
        seen["victim"] = next(iter(held), "")

    async with Stack.up(db_url, services.redis_url, key_prefix) as stack:
        result = await stack.run(
            "kill -9 scheduler mid-event-batch", (0.3, 1.5), kill_mid_batch, allow_gaps=True,
            notes=lambda: {"events held by the dead node": seen["held at kill"]})
        left = (await pending_events(stack)).get(seen["victim"], 0)
    assert seen["held at kill"] > 0, "the victim never held a batch: the kill was not mid-batch"
    assert left == 0, f"{left} events still pending on the dead node's consumer"
    result.assert_sound()


@dataclass
class Batches:
    """The api scenario's client: BATCHES requests of BATCH_JOBS jobs, each with its own
    Idempotency-Key and body bytes (a retry must send the very same request)."""

    bodies: list[bytes] = field(default_factory=list)
    answered: dict[int, list[str]] = field(default_factory=dict)  # batch -> job ids (201)
    unanswered: set[int] = field(default_factory=set)
    in_flight: set[int] = field(default_factory=set)

    def make(self, run_at) -> None:
        self.bodies = [msgspec.json.encode({"jobs": [
            {**job_body(HERD_NAME, run_at), "payload": {"batch": b}} for _ in range(BATCH_JOBS)]})
            for b in range(BATCHES)]

    async def submit(self, stack: Stack, session: aiohttp.ClientSession, b: int) -> None:
        self.in_flight.add(b)
        try:
            async with session.post(
                    f"{stack.api_url}/v1/jobs:batch", data=self.bodies[b],
                    headers={**stack.auth(), "Idempotency-Key": f"fault-batch-{b}",
                             "Content-Type": "application/json"},
                    timeout=aiohttp.ClientTimeout(total=10)) as resp:
                if resp.status == 201:
                    got = await resp.json()
                    self.answered[b] = [item["jobId"] for item in got["items"]]
                    self.unanswered.discard(b)
                    return
                self.unanswered.add(b)
        except (aiohttp.ClientError, TimeoutError):
            self.unanswered.add(b)
        finally:
            self.in_flight.discard(b)

    async def submit_all(self, stack: Stack, which: list[int]) -> None:
        async with aiohttp.ClientSession() as session:
            pending = iter(which)

            async def lane() -> None:
                for b in pending:
                    await self.submit(stack, session, b)

            await asyncio.gather(*(lane() for _ in range(SUBMIT_LANES)))


async def jobs_per_batch(stack: Stack) -> dict[int, int]:
    async with stack.db.connection() as conn:
        rows = await conn.fetch("SELECT (payload->>'batch')::int AS b, count(*) AS n FROM jobs "
                                "WHERE name = $1 GROUP BY 1", HERD_NAME)
    return {r["b"]: r["n"] for r in rows}


async def test_kill_the_api_mid_batch_submit(db_url, services, key_prefix) -> None:
    """Jobs whose 201 the client received all exist and run; a batch without a 201 is all
    there or not at all, and its retry with the same Idempotency-Key makes it whole, once."""
    client = Batches()
    seen: dict[str, object] = {}

    async def kill_the_api_mid_submit(stack: Stack) -> None:
        client.make(datetime.now(UTC) + timedelta(seconds=API_HERD_DUE_IN_S))
        submitting = asyncio.create_task(client.submit_all(stack, list(range(BATCHES))))
        kill_after = stack.rng.randint(*KILL_AFTER_BATCHES)
        while len(client.answered) < kill_after and not submitting.done():  # noqa: ASYNC110
            await asyncio.sleep(0.002)  # a poll: the kill's moment is a count of 201s
        seen["in flight"] = len(client.in_flight) * BATCH_JOBS
        stack.kill(stack.apis[-1])
        await submitting
        seen["before retry"] = await jobs_per_batch(stack)
        seen["unanswered"] = sorted(client.unanswered)
        await stack.start_api()  # the process manager's restart
        await client.submit_all(stack, sorted(client.unanswered))

    async with Stack.up(db_url, services.redis_url, key_prefix, api=True, herd=0) as stack:
        stack.herd = BATCHES * BATCH_JOBS  # recovered once all of it ran
        result = await stack.run(
            "kill -9 api mid-batch-submit", (-1.5, -1.0),
            kill_the_api_mid_submit, in_flight=lambda _: seen["in flight"],
            notes=lambda: {"batches without a 201": len(seen["unanswered"]),
                           "of them committed": sum(1 for b in seen["unanswered"]
                                                    if seen["before retry"].get(b))})
        async with stack.db.connection() as conn:
            present = {str(r["job_id"]) for r in await conn.fetch(
                "SELECT job_id FROM jobs WHERE name = $1", HERD_NAME)}
        after = await jobs_per_batch(stack)
    assert seen["unanswered"], "the kill hit no request: every batch had its 201"
    before: dict[int, int] = seen["before retry"]  # type: ignore[assignment]
    half = {b: n for b, n in before.items() if n not in (0, BATCH_JOBS)}
    assert half == {}, f"batches half present after the kill: {half}"
    answered = [j for ids in client.answered.values() for j in ids]
    assert set(answered) <= present and len(answered) == BATCHES * BATCH_JOBS
    assert client.unanswered == set() and after == {b: BATCH_JOBS for b in range(BATCHES)}
    result.assert_sound()
