"""A hostile-input corpus at the HTTP level: each case its documented 4xx, and nothing changed.

Every body-taking route (submit, batch, create and patch a tenant, rotate its secret) is
sent bodies past their caps, malformed JSON, control characters (NUL, ESC, DEL, C1,
U+2028, lone surrogates escaped in JSON) in every string field of a job and a tenant,
numbers past what a field holds (1e309, 2**64, -0, NaN spelled out), payloads nested
10,000 deep, wrong content types and keys given twice. Each answer must be a 4xx
problem+json naming the field where there is one (docs/reference.md, Errors), and after
each every table of the database and every Redis key under the test's prefix is as it
was before. Slow clients are in tests/security/test_request_bounds.py.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import AsyncIterator

import pytest

from herdwick.gateway.jobs import BATCH_BODY_CAP, SINGLE_BODY_CAP
from herdwick.gateway.tenants import BODY_CAP as TENANT_BODY_CAP
from tests.integration.conftest import Api, make_job, tenant_api
from tests.integration.gateway_client import ADMIN_TOKEN

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
JSON = {"Content-Type": "application/json"}
SUBMIT, BATCH, TENANTS = "/v1/jobs", "/v1/jobs:batch", "/v1/tenants"
PATCH, ROTATE = "/v1/tenants/{tenant}", "/v1/tenants/{tenant}:rotate-secret"
METHODS = {PATCH: "PATCH"}
ADMIN_ROUTES = (TENANTS, PATCH, ROTATE)
CAPS = {SUBMIT: SINGLE_BODY_CAP, BATCH: BATCH_BODY_CAP, TENANTS: TENANT_BODY_CAP,
        PATCH: TENANT_BODY_CAP, ROTATE: TENANT_BODY_CAP}


class Case:
    def __init__(self, name: str, route: str, body: bytes, status: int, field: str | None,
                 headers: dict[str, str] | None = None) -> None:
        self.name, self.route, self.body = name, route, body
        self.status, self.field, self.headers = status, field, headers or JSON


def encoded(value: object) -> bytes:
    """JSON with every non-ASCII character escaped (\\u0000, \\ud800), as json.dumps does."""
    return json.dumps(value).encode()


def cron_job(**schedule) -> dict:
    return make_job(schedule={"cron": "0 9 * * MON", **schedule})


def http_job(ref: str) -> dict:
    return make_job(target={"type": "http", "ref": ref})


# --- control characters in every string field ------------------------------------------

# Each is refused wherever a name, ref, time, zone, cron or enum is read; a payload is data
# (only U+0000 is refused there: jsonb cannot hold it). U+2028 is no control character:
# names and an http target's path take it (test_what_is_data_is_taken_and_read_back).
CONTROLS = {"NUL": "\u0000", "ESC": "\u001b", "DEL": "\u007f", "NEL (C1)": "\u0085",
            "CSI (C1)": "\u009b"}
LINE_SEPARATOR = "\u2028"
LONE_SURROGATE = "\ud800"


def job_string_fields(c: str) -> list[tuple[str, dict, str]]:
    """(field, a job holding c in that field, the field the 422 names)."""
    return [
        ("name", make_job(name=f"nightly{c}report"), "name"),
        ("target.type", make_job(target={"type": f"que{c}ue", "ref": "emails"}), "target.type"),
        ("queue ref", make_job(target={"type": "queue", "ref": f"ema{c}ils"}), "target.ref"),
        ("http host", http_job(f"https://exa{c}mple.com/hook"), "target.ref"),
        ("http path", http_job(f"https://example.com/ho{c}ok"), "target.ref"),
        ("runAt", make_job(schedule={"runAt": f"2027-01-01T00:00:00{c}Z"}), "schedule.runAt"),
        ("cron", cron_job(cron=f"0 9 * * MON{c}"), "schedule.cron"),
        ("cron separator", cron_job(cron=f"0 9 *{c}* MON"), "schedule.cron"),
        ("tz", cron_job(tz=f"Europe/Lon{c}don"), "schedule.tz"),
        ("overlap", cron_job(overlap=f"for{c}bid"), "schedule.overlap"),
        ("misfire", cron_job(misfire=f"sk{c}ip"), "schedule.misfire"),
        ("a key", {**make_job(), f"na{c}me": "x"}, f"na{c}me"),
    ]


CASES: list[Case] = []
for label, char in CONTROLS.items():
    for field, body, named in job_string_fields(char):
        CASES.append(Case(f"{label} in a job's {field}", SUBMIT, encoded(body), 422, named))
    CASES.append(Case(f"{label} in a batch job's name", BATCH,
                      encoded({"jobs": [make_job(), make_job(name=f"a{char}b")]}), 422,
                      "jobs[1].name"))
    CASES.append(Case(f"{label} in a tenant's name", TENANTS, encoded({"name": f"a{char}b"}),
                      422, "name"))
CASES += [
    Case("NUL in a payload string", SUBMIT, encoded(make_job(payload={"a": "x\u0000"})), 422,
         "payload"),
    Case("NUL in a payload key", SUBMIT, encoded(make_job(payload={"\u0000": 1})), 422,
         "payload"),
]
for field, body, named in job_string_fields(LINE_SEPARATOR):
    if field not in ("name", "http path", "a key"):
        CASES.append(Case(f"U+2028 in a job's {field}", SUBMIT, encoded(body), 422, named))
# A lone surrogate is no Unicode text: malformed JSON, whichever string holds it.
for field, body, _ in job_string_fields(LONE_SURROGATE):
    CASES.append(Case(f"lone surrogate in a job's {field}", SUBMIT, encoded(body), 400, "body"))
CASES += [
    Case("lone surrogate in a payload", SUBMIT, encoded(make_job(payload=LONE_SURROGATE)), 400,
         "body"),
    Case("lone surrogate in a tenant's name", TENANTS, encoded({"name": LONE_SURROGATE}), 400,
         "body"),
    Case("raw NUL (unescaped) in a name", SUBMIT,
         encoded(make_job(name="NAME")).replace(b"NAME", b"a\x00b"), 400, "body"),
]

# --- numbers past what a field holds -----------------------------------------------------

HUGE = {"1e309": b"1e309", "2**64": str(2**64).encode(), "-0": b"-0", "-0.0": b"-0.0",
        "NaN": b"NaN", "Infinity": b"Infinity", "-1e309": b"-1e309"}
# field -> (route, body with NUMBER where the number goes, the field the 422 names); -0
# is a number every field below the ones >= 1 refuses, and those >= 0 take (not here).
NUMBER_FIELDS = {
    "timeoutSeconds": (SUBMIT, encoded(make_job(timeoutSeconds=0)).replace(
        b'"timeoutSeconds": 0', b'"timeoutSeconds": NUMBER'), "timeoutSeconds"),
    "retry.maxAttempts": (SUBMIT, encoded(make_job(retry={"maxAttempts": 0})).replace(
        b'"maxAttempts": 0', b'"maxAttempts": NUMBER'), "retry.maxAttempts"),
    "weight": (TENANTS, b'{"name": "t", "weight": NUMBER}', "weight"),
    "maxActiveJobs": (TENANTS, b'{"name": "t", "maxActiveJobs": NUMBER}', "maxActiveJobs"),
    "dispatchRate": (PATCH, b'{"dispatchRate": NUMBER}', "dispatchRate"),
    "burst": (PATCH, b'{"burst": NUMBER}', "burst"),
}
for label, number in HUGE.items():
    for field, (route, template, named) in NUMBER_FIELDS.items():
        body = template.replace(b"NUMBER", number)
        if number in (b"NaN", b"Infinity"):  # not JSON at all
            CASES.append(Case(f"{label} as {field}", route, body, 400, "body"))
        else:
            CASES.append(Case(f"{label} as {field}", route, body, 422, named))
    for route, template, named in (
            (SUBMIT, b'{"name": "n", "target": {"type": "queue", "ref": "q"}, '
                     b'"schedule": {"delaySeconds": NUMBER}}', "schedule.delaySeconds"),
            (ROTATE, b'{"overlapSeconds": NUMBER}', "overlapSeconds")):
        if number in (b"-0", b"-0.0"):
            continue  # 0: taken
        body = template.replace(b"NUMBER", number)
        status = 400 if number in (b"NaN", b"Infinity") else 422
        CASES.append(Case(f"{label} as {named}", route, body, status,
                          "body" if status == 400 else named))
CASES += [
    Case("1e309 in a payload", SUBMIT, encoded(make_job(payload=0)).replace(
        b'"payload": 0', b'"payload": 1e309'), 422, "payload"),
    Case("an integer of 5,000 digits in a payload", SUBMIT, encoded(make_job(payload=0)).replace(
        b'"payload": 0', b'"payload": ' + b"9" * 5000), 422, "payload"),
    Case("NaN in a payload", SUBMIT, encoded(make_job(payload=0)).replace(
        b'"payload": 0', b'"payload": NaN'), 400, "body"),
]

# --- nesting ---------------------------------------------------------------------------

DEPTH = 10_000


def nested(depth: int, kind: str = "array") -> bytes:
    if kind == "array":
        return b"[" * depth + b"]" * depth
    return b'{"a":' * depth + b"1" + b"}" * depth


PAYLOAD_AT = encoded(make_job(payload=0)).replace(b'"payload": 0', b'"payload": DEEP')
CASES += [
    Case("a payload of arrays 10,000 deep", SUBMIT, PAYLOAD_AT.replace(b"DEEP", nested(DEPTH)),
         400, "body"),
    Case("a payload of objects 10,000 deep", SUBMIT,
         PAYLOAD_AT.replace(b"DEEP", nested(DEPTH, "object")), 400, "body"),
    Case("a batch job's payload 10,000 deep", BATCH,
         b'{"jobs": [' + PAYLOAD_AT.replace(b"DEEP", nested(DEPTH)) + b"]}", 400, "body"),
    Case("a name 10,000 arrays deep", SUBMIT,
         encoded(make_job(name=0)).replace(b'"name": 0', b'"name": ' + nested(DEPTH)), 400,
         "body"),
    Case("a tenant's weight 3,000 deep", TENANTS,
         b'{"name": "t", "weight": ' + nested(3000) + b"}", 400, "body"),
    Case("a patch's weight 3,000 deep", PATCH, b'{"weight": ' + nested(3000) + b"}", 400,
         "body"),
    Case("jobs as a string", BATCH, b'{"jobs": "x"}', 422, "jobs"),
    Case("a batch of 1,001", BATCH, encoded({"jobs": [make_job()] * 1001}), 422, "jobs"),
]

# --- keys given twice ----------------------------------------------------------------------

CASES += [
    Case("name twice", SUBMIT, b'{"name": "a", "name": "b", "target": {"type": "queue", '
         b'"ref": "q"}, "schedule": {"delaySeconds": 1}}', 422, "name"),
    Case("schedule.delaySeconds twice", SUBMIT, b'{"name": "a", "target": {"type": "queue", '
         b'"ref": "q"}, "schedule": {"delaySeconds": 1, "delaySeconds": 2}}', 422,
         "schedule.delaySeconds"),
    Case("target.type twice", SUBMIT, b'{"name": "a", "target": {"type": "http", '
         b'"type": "queue", "ref": "q"}, "schedule": {"delaySeconds": 1}}', 422, "target.type"),
    Case("a payload key twice", SUBMIT, encoded(make_job(payload=0)).replace(
        b'"payload": 0', b'"payload": {"a": 1, "b": {"c": 1, "c": 2}}'), 422, "payload.b.c"),
    Case("a batch job's name twice", BATCH, b'{"jobs": [' + encoded(make_job()) + b", "
         + b'{"name": "a", "name": "b", "target": {"type": "queue", "ref": "q"}, '
         b'"schedule": {"delaySeconds": 1}}]}', 422, "jobs[1].name"),
    Case("jobs twice", BATCH, b'{"jobs": [], "jobs": [' + encoded(make_job()) + b"]}", 422,
         "jobs"),
    Case("a tenant's name twice", TENANTS, b'{"name": "a", "name": "b"}', 422, "name"),
    Case("a patch's weight twice", PATCH, b'{"weight": 2, "weight": 3}', 422, "weight"),
    Case("overlapSeconds twice", ROTATE, b'{"overlapSeconds": 1, "overlapSeconds": 2}', 422,
         "overlapSeconds"),
]

# --- malformed JSON, wrong content types, oversized bodies, for every body route ----------

MALFORMED = {"truncated": b'{"name": "x"', "trailing garbage": b'{"name": "x"} x',
             "single quotes": b"{'name': 'x'}", "a comment": b'{"name": "x" /* hi */}',
             "a byte-order mark": b'\xef\xbb\xbf{"name": "x"}', "not UTF-8": b'{"name": "\xff"}',
             "a trailing comma": b'{"name": "x",}'}
WRONG_TYPES = ("text/plain", "application/x-www-form-urlencoded",
               "multipart/form-data; boundary=x", "application/xml", "application/jsonx",
               "application/octet-stream")
for route in CAPS:
    for label, body in MALFORMED.items():
        CASES.append(Case(f"{label} to {route}", route, body, 400, "body"))
    for ctype in WRONG_TYPES:
        CASES.append(Case(f"{ctype} to {route}", route, b'{"name": "x"}', 415, None,
                          {"Content-Type": ctype}))
    CASES.append(Case(f"one byte past the cap to {route}", route,
                      b'{"name": "x"' + b" " * CAPS[route] + b"}", 413, None))
CASES += [
    Case("a payload past 256 KiB under the body cap", SUBMIT,
         encoded(make_job(payload={"blob": "x" * (260 * 1024)})), 413, "payload"),
    Case("an empty submit", SUBMIT, b"", 400, "body"),
    Case("null as a tenant", TENANTS, b"null", 422, "body"),
    Case("a list as a patch", PATCH, b"[]", 422, "body"),
]


# --- the run ---------------------------------------------------------------------------


@pytest.fixture
async def api(db_url, services, key_prefix, clock) -> AsyncIterator[Api]:
    async with tenant_api(db_url, services.redis_url, key_prefix, clock) as holder:
        # One job already there, so "nothing changed" is about a table with rows in it.
        created = await holder.submit(make_job())
        assert created.status == 201, await created.text()
        yield holder


async def snapshot(db, redis_client, key_prefix: str) -> dict[str, str]:
    """A digest of every table's rows and of every Redis key under the prefix."""
    found: dict[str, str] = {}
    async with db.connection() as conn:
        tables = await conn.fetch(
            "SELECT format('%I.%I', schemaname, tablename) AS name FROM pg_tables "
            "WHERE schemaname NOT IN ('pg_catalog', 'information_schema')")
        for row in tables:
            found[row["name"]] = await conn.fetchval(
                f"SELECT md5(coalesce(string_agg(t::text, '|' ORDER BY t::text), '')) "
                f"FROM {row['name']} t")
    async for key in redis_client.scan_iter(match=f"{key_prefix}*", count=1000):
        dumped = await redis_client.dump(key) or b""
        found[f"redis:{key!r}"] = hashlib.sha256(dumped).hexdigest()
    return found


async def send(api: Api, case: Case, tenant_id: str):
    path = case.route.format(tenant=tenant_id)
    auth = ADMIN if case.route in ADMIN_ROUTES else api.auth()
    return await api.client.request(METHODS.get(case.route, "POST"), path,
                                    data=io.BytesIO(case.body),
                                    headers={**auth, **case.headers})


async def check(api: Api, db, redis_client, key_prefix: str, case: Case) -> None:
    before = await snapshot(db, redis_client, key_prefix)
    resp = await send(api, case, api.tenant_id)
    text = await resp.text()
    assert resp.status == case.status, (case.name, text[:300])
    assert resp.headers["Content-Type"].startswith("application/problem+json")
    problem = json.loads(text)
    assert problem["status"] == resp.status and problem["type"].startswith("https://")
    if case.field is not None:
        assert case.field in [e["field"] for e in problem["errors"]], problem
    assert await snapshot(db, redis_client, key_prefix) == before
    jobs = await (await api.client.get("/v1/jobs", headers=api.auth())).json()
    assert len(jobs["items"]) == 1


async def test_hostile_input_is_its_documented_4xx_and_changes_nothing(
        api: Api, db, redis_client, key_prefix, subtests) -> None:
    # One gateway and database for the whole corpus (a fresh one a case would take minutes):
    # each case is its own subtest, and each checks that the one before changed nothing.
    for case in CASES:
        with subtests.test(msg=case.name):
            await check(api, db, redis_client, key_prefix, case)


def test_the_corpus_covers_every_body_route_and_field() -> None:
    routes = {c.route for c in CASES}
    assert routes == set(CAPS)
    named = {c.field for c in CASES if c.field}
    for field in ("name", "target.type", "target.ref", "schedule.runAt", "schedule.cron",
                  "schedule.tz", "schedule.overlap", "schedule.misfire", "payload",
                  "timeoutSeconds", "retry.maxAttempts", "weight", "maxActiveJobs",
                  "dispatchRate", "burst", "overlapSeconds", "schedule.delaySeconds"):
        assert field in named, field
    print(f"\n{len(CASES)} hostile cases over {len(routes)} routes")


# What is data is taken as it was sent: U+2028 in a name (no control character: the
# documented rule), any character but U+0000 in a payload, U+2028 in an http target's path.
ACCEPTED = [
    ("U+2028 in a name", make_job(name=f"a{LINE_SEPARATOR}b"), "name"),
    ("C1 and U+2028 in a payload", make_job(payload={"s": f"\u0085{LINE_SEPARATOR}\u001b"}),
     "payload"),
    ("-0 as delaySeconds", make_job(schedule={"delaySeconds": -0.0}), "schedule"),
    ("2**64 in a payload", make_job(payload=2**64), "payload"),
]


@pytest.mark.parametrize(("body", "field"), [a[1:] for a in ACCEPTED],
                         ids=[a[0] for a in ACCEPTED])
async def test_what_is_data_is_taken_and_read_back(api: Api, body: dict, field: str) -> None:
    resp = await api.client.post(SUBMIT, data=encoded(body), headers={**api.auth(), **JSON})
    assert resp.status == 201, await resp.text()
    job_id = (await resp.json())["jobId"]
    job = await (await api.client.get(f"/v1/jobs/{job_id}", headers=api.auth())).json()
    if field == "schedule":
        assert job["schedule"]["delaySeconds"] == 0
    else:
        assert job[field] == body[field]
