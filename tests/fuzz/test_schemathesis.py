"""The gateway against its own /openapi.json, as a stranger's client would read it.

schemathesis generates requests from the document the server publishes, valid
ones (positive) and ones that break one rule each (negative), sends them to a
real gateway on a socket over this test's own database, and checks each answer
against the document: no 5xx, a documented status and content type, and a body
and headers that match their schemas. Ids the server handed out (jobs,
executions, tenants) are fed back into the operations that take one, so those
reach more than a 404. And it counts how many valid submissions the server
took: a document looser than the server generates requests that never reach
the logic behind a 201, and that fails here too.

A second run follows the document's links as a client would: sequences of
calls (submit, then read, pause, resume, trigger, read its executions,
cancel; create a tenant, then patch it and rotate its secret), each answer's
ids fed to the next call, every answer checked the same way. Both runs are
derandomized (one seed), bounded in examples, and print what they covered.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import random
import re
import time
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, Verbosity, given, seed, settings
from hypothesis import strategies as st
from hypothesis.errors import Flaky, Unsatisfiable
from hypothesis.stateful import run_state_machine_as_test
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.errors import FailureGroup

from herdwick.model import EARLIEST_RUN_AT, MAX_DELAY_S
from tests.conftest import T0
from tests.integration.conftest import tenant_api
from tests.integration.gateway_client import ADMIN_TOKEN

# schemathesis's negative generation draws from `random` inside a strategy now and then,
# which Hypothesis warns of (schemathesis/schemathesis#4518 is that kind of bug): its
# internals, not our server's answer, so the warning is not an error here.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Do not use the `random` module inside strategies:"
    "hypothesis.errors.HypothesisDeprecationWarning")

FUZZ_SEED = 911
POSITIVE, NEGATIVE = schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE
# Examples per operation and mode, and again (valid ones) with ids the server issued, for
# the operations that take one: about 1,100 requests, 20-35 s for the test on 2 cores.
EXAMPLES = {POSITIVE: 40, NEGATIVE: 20}
KNOWN_ID_EXAMPLES = 20
SUBMITS = ("POST /v1/jobs", "POST /v1/jobs:batch")
# Measured with this seed: 61 of 80 valid submissions (single and batch) created, and 0
# of 60 from the document as it was before issue 9. What stands between the rest and a
# 201 is what a schema cannot say: a runAt left past its moving upper bound (8; see
# _run_at_within_bounds), a cron range that runs backwards or never fires (12), an http
# target's host that the guard cannot read (2: a label IDNA refuses). Before issue 13 it
# was 36 of 80: Idempotency-Keys drawn again with another body (23; now three in four are
# fresh, _fresh_idempotency_key) and hosts with C1 controls, which the document allowed and
# the server refused (17; the pattern excludes them now). The floor sits under the
# measure, so a schemathesis that draws a little differently still passes, and far above
# what a loose document reaches.
CREATED_FLOOR = 0.5
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance, response_headers_conformance]
# Ids the server issues (201 and 202 bodies), by the name of the path parameter taking them.
ISSUED = ("jobId", "executionId", "tenantId")
# The stateful run: sequences (scenarios) of up to STEPS calls along the document's links,
# about 900 calls and 30 s on 2 cores with these figures.
SCENARIOS = 150
STEPS = 10
MAX_SUITES = 20


class TickingClock:
    """A clock that moves on a millisecond each time it is read, as a server's does between
    two requests; a frozen one would make two triggers of a job one instant, which the
    server refuses (see tests/integration/test_openapi.py)."""

    def __init__(self, start: datetime) -> None:
        self._now = start

    def now(self) -> datetime:
        self._now += timedelta(milliseconds=1)
        return self._now


@dataclasses.dataclass
class Run:
    statuses: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    failures: dict[tuple[str, str], str] = dataclasses.field(default_factory=dict)
    issued: dict[str, list[str]] = dataclasses.field(
        default_factory=lambda: collections.defaultdict(list))
    refused: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    requests: int = 0
    scenarios: int = 0  # the stateful run's: sequences run, and suites they took
    suites: int = 0

    def record(self, label: str, mode: str, response) -> None:
        self.requests += 1
        self.statuses[(label, mode, response.status_code)] += 1
        if label in SUBMITS and mode == POSITIVE.value and response.status_code == 422:
            # What stood between a valid submission and a 201, by field (batch index dropped).
            fields = {re.sub(r"^jobs\[\d+\]", "jobs[]", e["field"])
                      for e in response.json()["errors"]}
            self.refused.update(fields)
        if response.status_code in (201, 202) and response.content:
            body = response.json()
            for item in body.get("items", [body]):
                for name in ISSUED:
                    if name in item:
                        self.issued[name].append(item[name])


def _auth(operation, api_key: str) -> dict[str, str]:
    schemes = {name for entry in operation.definition.raw.get("security", []) for name in entry}
    if "adminToken" in schemes:
        return {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    if "apiKey" in schemes:
        return {"Authorization": f"Bearer {api_key}"}
    return {}


def _run_at_within_bounds(now: datetime):
    """runAt must fall before ten years from the server's now: a bound that moves, so the
    document says it in words, and a generator reading only the schema draws years up to
    9999. In three requests of four the runAts are redrawn inside the bound, so valid
    one-offs reach the logic; in the rest they stay as generated (and are refused, 422)."""
    latest = now + timedelta(seconds=MAX_DELAY_S) - timedelta(days=1)
    return st.datetimes(min_value=EARLIEST_RUN_AT.replace(tzinfo=None),
                        max_value=latest.replace(tzinfo=None), timezones=st.just(UTC))


def _fresh_idempotency_key(case, n: int) -> None:
    """The generator draws Idempotency-Keys from a small space, so one drawn again with
    another body is 422 (idempotency-key-reused): right, but it keeps a valid submission
    from the logic behind a 201. Three requests in four get a key of their own (n), the
    rest keep theirs, so replays and reuses are still sent."""
    key = (case.headers or {}).get("Idempotency-Key")
    if isinstance(key, str) and key:
        case.headers["Idempotency-Key"] = f"{key[:200]}~{n}"


def _schedules(body: object) -> list[dict]:
    jobs = body.get("jobs", [body]) if isinstance(body, dict) else []
    if not isinstance(jobs, list):  # an invalid batch, as generated: nothing to redraw
        return []
    return [job["schedule"] for job in jobs
            if isinstance(job, dict) and isinstance(job.get("schedule"), dict)]


@dataclasses.dataclass
class Fuzzer:
    base_url: str
    api_key: str
    now: datetime
    session: requests.Session
    run: Run = dataclasses.field(default_factory=Run)

    def every_operation(self, document: dict) -> Run:
        schema = schemathesis.openapi.from_dict(document)
        operations = [result.ok() for result in schema.get_all_operations()]
        # Cancel last: before it, the operations that take a job id see live jobs.
        for operation in sorted(operations, key=lambda op: op.method.upper() == "DELETE"):
            for mode, examples in EXAMPLES.items():
                self.one(operation, mode, examples)
            taken = [n for n in ISSUED if "{" + n + "}" in operation.path]
            if taken and self.run.issued[taken[0]]:
                self.one(operation, POSITIVE, KNOWN_ID_EXAMPLES, issued=taken[0])
        return self.run

    def one(self, operation, mode, examples: int, issued: str | None = None) -> None:
        headers = _auth(operation, self.api_key)
        label = operation.label
        if issued is None:
            cases = operation.as_strategy(generation_mode=mode)
        else:
            ids = list(dict.fromkeys(self.run.issued[issued]))
            cases = st.sampled_from(ids).flatmap(lambda value: operation.as_strategy(
                generation_mode=mode, path_parameters={issued: value}))
        run_ats = _run_at_within_bounds(self.now)
        within_bounds = st.sampled_from([True, True, True, False])

        @seed(FUZZ_SEED)
        @settings(max_examples=examples, database=None, deadline=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(case=cases, data=st.data())
        def one(case, data) -> None:
            schedules = [s for s in _schedules(case.body) if "runAt" in s]
            if mode is POSITIVE and schedules and data.draw(within_bounds):
                for schedule in schedules:
                    schedule["runAt"] = data.draw(run_ats).isoformat()
            if mode is POSITIVE and data.draw(within_bounds):
                _fresh_idempotency_key(case, self.run.requests)
            response = case.call(base_url=self.base_url, session=self.session, headers=headers)
            self.run.record(label, mode.value, response)
            try:
                case.validate_response(response, checks=CHECKS, headers=headers,
                                       transport_kwargs={"base_url": self.base_url})
            except FailureGroup as group:
                for failure in group.exceptions:
                    self.run.failures.setdefault((label, failure.title), f"{mode.value}: {group}")

        try:
            one()
        except Unsatisfiable:
            # An operation with no parameters and no body has nothing to break.
            raw = operation.definition.raw
            if mode is POSITIVE or raw.get("parameters") or raw.get("requestBody"):
                raise


def stateful(document: dict, base_url: str, api_key: str, now: datetime) -> Run:
    """Scenarios along the document's links (its own, none inferred), each answer checked
    as in the run above.

    The server's state carries over from one scenario to the next, and its ids are its
    own, so a sequence Hypothesis replays can meet other answers than the first time
    (a 409 where a 200 was, an empty list); Hypothesis calls that flaky and ends the
    suite. As schemathesis's own runner does, that suite's scenarios stand and the next
    suite starts, on the next seed, until SCENARIOS have run.
    """
    schema = schemathesis.openapi.from_dict(document)
    schema.config.phases.stateful.inference.algorithms = []
    # Valid requests only: the run above sends the invalid ones, and here every step that
    # goes through takes the sequence further.
    schema.config.phases.stateful.generation.update(modes=[POSITIVE])
    run = Run()
    rng = random.Random(FUZZ_SEED)  # the steering below, as deterministic as the generation
    run_ats = [now + timedelta(seconds=rng.randrange(MAX_DELAY_S - 86400))
               for _ in range(64)]

    with requests.Session() as session:
        class Sequences(schema.as_state_machine()):
            def before_call(self, case) -> None:
                # As in the run above: runAts inside their moving bound, fresh keys, three
                # times in four.
                for schedule in _schedules(case.body):
                    if "runAt" in schedule and rng.random() < 0.75:
                        schedule["runAt"] = rng.choice(run_ats).isoformat()
                if rng.random() < 0.75:
                    _fresh_idempotency_key(case, run.requests)

            def get_call_kwargs(self, case) -> dict:
                return {"base_url": base_url, "session": session,
                        "headers": _auth(case.operation, api_key)}

            def after_call(self, response, case) -> None:
                super().after_call(response, case)
                run.record(case.operation.label, "stateful", response)

            def validate_response(self, response, case, additional_checks=None,
                                  **kwargs) -> None:
                try:
                    case.validate_response(response, checks=CHECKS,
                                           headers=kwargs.get("headers"),
                                           transport_kwargs={"base_url": base_url})
                except FailureGroup as group:
                    for failure in group.exceptions:
                        run.failures.setdefault((case.operation.label, failure.title),
                                                f"stateful: {group}")

            def teardown(self) -> None:
                run.scenarios += 1
                super().teardown()

        for suite in range(MAX_SUITES):
            if run.scenarios >= SCENARIOS:
                break
            run.suites += 1
            try:
                run_state_machine_as_test(seed(FUZZ_SEED + suite)(Sequences), settings=settings(
                    max_examples=SCENARIOS - run.scenarios, stateful_step_count=STEPS,
                    database=None, deadline=None, phases=[Phase.generate],
                    suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet))
            except Flaky:
                continue
    return run


async def _public(host: str, port: int) -> list[str]:
    return ["93.184.215.14"]


def fuzz(document: dict, base_url: str, api_key: str, now: datetime) -> Run:
    with requests.Session() as session:
        return Fuzzer(base_url, api_key, now, session).every_operation(document)


def _created(run: Run) -> tuple[int, int]:
    created = total = 0
    for (label, mode, status), n in run.statuses.items():
        if label in SUBMITS and mode == POSITIVE.value:
            total += n
            created += n if status == 201 else 0
    return created, total


def _operations(document: dict) -> set[str]:
    return {f"{method.upper()} {path}" for path, ops in document["paths"].items()
            for method in ops}


def _report(name: str, run: Run, document: dict, took_s: float) -> str:
    """What a run covered, in the form BENCHMARKS.md records."""
    covered = {label for label, _, _ in run.statuses}
    operations = _operations(document)
    summary = "\n".join(f"  {label} {mode} {status}: {n}"
                        for (label, mode, status), n in sorted(run.statuses.items()))
    missing = sorted(operations - covered)
    return (f"\n{name}: {len(covered & operations)} of {len(operations)} operations, "
            f"{run.requests} requests in {took_s:.1f} s, {len(run.failures)} failures"
            f"{'; not reached: ' + ', '.join(missing) if missing else ''}\n{summary}")


@asynccontextmanager
async def _fuzzed_api(db_url: str, redis_url: str, key_prefix: str):
    clock = TickingClock(T0)
    # Which addresses a target may reach is not the document's to say (tests/unit/test_ssrf.py
    # and tests/integration/test_gateway_input.py check it): every address is allowed here,
    # and every name resolves to a public one, so no generated name goes out to DNS.
    async with tenant_api(db_url, redis_url, key_prefix, clock,
                          http_allow=("0.0.0.0/0", "::/0"), resolve=_public) as api:
        document = await (await api.client.get("/openapi.json")).json()
        base_url = str(api.client.make_url("")).rstrip("/")
        yield api, document, base_url, clock.now()


async def test_fuzz_every_operation_against_its_schema(db_url, services, key_prefix,
                                                       redis_client) -> None:
    started = time.perf_counter()
    async with _fuzzed_api(db_url, services.redis_url, key_prefix) as (api, document,
                                                                        base_url, now):
        # The fuzzer is synchronous (requests); the server answers on this loop meanwhile.
        run = await asyncio.to_thread(fuzz, document, base_url, api.key, now)
    created, total = _created(run)
    print(_report("operations", run, document, time.perf_counter() - started)
          + f"\n{created} of {total} valid submissions created; refused for "
            f"{dict(run.refused)}")
    assert not run.failures, "\n\n".join(f"{k}: {v}" for k, v in run.failures.items())
    assert created >= CREATED_FLOOR * total, (
        f"{created} of {total} created; refused for {dict(run.refused)}")
    assert {label for label, _, _ in run.statuses} == _operations(document)


# Measured with this seed: every linked operation reached with 2xx answers, not only 404s.
# The server's state (ids, clock) differs run to run, so the sequences do too: a run may
# miss one of them (in CI once, the execution read, two links from a create).
LINKED_2XX = ("GET /v1/jobs/{jobId}", "POST /v1/jobs/{jobId}:pause",
              "POST /v1/jobs/{jobId}:resume", "POST /v1/jobs/{jobId}:trigger",
              "GET /v1/jobs/{jobId}/executions", "DELETE /v1/jobs/{jobId}",
              "GET /v1/executions/{executionId}", "PATCH /v1/tenants/{tenantId}",
              "POST /v1/tenants/{tenantId}:rotate-secret")


async def test_fuzz_sequences_along_the_documents_links(db_url, services, key_prefix,
                                                        redis_client) -> None:
    started = time.perf_counter()
    async with _fuzzed_api(db_url, services.redis_url, key_prefix) as (api, document,
                                                                        base_url, now):
        run = await asyncio.to_thread(stateful, document, base_url, api.key, now)
    print(_report("sequences", run, document, time.perf_counter() - started)
          + f"\n{run.scenarios} scenarios of up to {STEPS} calls in {run.suites} suites")
    assert not run.failures, "\n\n".join(f"{k}: {v}" for k, v in run.failures.items())
    ok = {label for (label, _, status), n in run.statuses.items() if 200 <= status < 300}
    assert len(set(LINKED_2XX) - ok) <= 1, sorted(set(LINKED_2XX) - ok)
    assert run.scenarios >= SCENARIOS


def test_every_link_leads_to_an_operation_and_fills_its_path() -> None:
    from herdwick.gateway.openapi import document

    doc = document()
    operations = {op["operationId"]: (path, op) for path, ops in doc["paths"].items()
                  for op in ops.values()}
    links = 0
    for ops in doc["paths"].values():
        for op in ops.values():
            for answer in op["responses"].values():
                for link in answer.get("links", {}).values():
                    links += 1
                    path, _ = operations[link["operationId"]]
                    assert {"{" + p + "}" for p in link["parameters"]} <= set(
                        re.findall(r"\{\w+\}", path)), link
    assert links >= 30
