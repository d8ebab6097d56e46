"""/openapi.json says what the server takes, and the server takes what it says.

Each edge is asked twice: of the published document (a JSON Schema validator
over its components) and of the server (a real request). The two must agree,
except where a description says why they cannot (runAt's moving upper bound,
an http target's address, a cron range that runs backwards).
"""

from __future__ import annotations

import base64
import re
import uuid
from datetime import timedelta

import jsonschema_rs  # comes with schemathesis (the dev extra); the validator it checks with
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from herdwick import schedule as sched
from herdwick.gateway.openapi import cron_pattern, document, zone_names
from herdwick.gateway.routes import EXECUTION_CURSOR_PATTERN, ID_CURSOR_PATTERN, ROUTES
from tests.conftest import T0
from tests.integration.conftest import Api, make_job
from tests.integration.gateway_client import ADMIN_TOKEN

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
DOC = document()


def conforms(component: str, value: object) -> bool:
    root = {"$ref": f"#/components/schemas/{component}", "components": DOC["components"]}
    return jsonschema_rs.Draft202012Validator(root, validate_formats=True).is_valid(value)


def fields_of(problem: dict) -> list[str]:
    return [e["field"] for e in problem["errors"]]


# --- integers --------------------------------------------------------------------------


def test_integer_fields_are_published_as_integers() -> None:
    schemas = DOC["components"]["schemas"]
    published = [schemas["JobSpec"]["properties"]["timeoutSeconds"],
                 schemas["RetryPolicy"]["properties"]["maxAttempts"],
                 schemas["TenantSpec"]["properties"]["weight"],
                 schemas["TenantSpec"]["properties"]["maxActiveJobs"]["anyOf"][0],
                 schemas["TenantPatch"]["properties"]["weight"],
                 *(schemas[s]["properties"]["jitterSeconds"]
                   for s in ("RunAtSchedule", "DelaySchedule", "CronSchedule"))]
    for schema in published:
        assert schema["type"] == "integer" and "multipleOf" not in schema, schema
    assert published[0]["minimum"] == 1 and published[0]["maximum"] == 7 * 24 * 3600


async def test_an_integral_float_is_an_integer_and_reads_back_as_one(api: Api) -> None:
    body = make_job(timeoutSeconds=5.0, retry={"maxAttempts": 3.0},
                    schedule={"delaySeconds": 30, "jitterSeconds": 60.0})
    assert conforms("JobSpec", body)
    resp = await api.submit(body)
    assert resp.status == 201, await resp.text()
    job_id = (await resp.json())["jobId"]
    read = await api.client.get(f"/v1/jobs/{job_id}", headers=api.auth())
    text = await read.text()
    assert '"timeoutSeconds":5,' in text and '"maxAttempts":3,' in text
    got = await read.json()
    assert got["timeoutSeconds"] == 5 and got["schedule"]["jitterSeconds"] == 60


@pytest.mark.parametrize(("overrides", "field"), [
    ({"timeoutSeconds": 5.5}, "timeoutSeconds"),
    ({"retry": {"maxAttempts": 2.5}}, "retry.maxAttempts"),
    ({"schedule": {"delaySeconds": 1, "jitterSeconds": 0.5}}, "schedule.jitterSeconds"),
    ({"timeoutSeconds": 604801.0}, "timeoutSeconds"),
])
async def test_a_fractional_or_out_of_bounds_integer_is_refused(api: Api, overrides,
                                                                field) -> None:
    body = make_job(**overrides)
    assert not conforms("JobSpec", body)
    resp = await api.submit(body)
    assert resp.status == 422
    problem = await resp.json()
    assert fields_of(problem) == [field]
    if "5" in str(overrides):
        assert problem["errors"][0]["message"].startswith("Expected an integer")


async def test_tenant_limits_take_integral_floats_too(api: Api) -> None:
    made = await api.client.post("/v1/tenants", headers=ADMIN,
                                 json={"name": "floaty", "weight": 2.0, "maxActiveJobs": 10.0})
    assert made.status == 201, await made.text()
    tenant_id = (await made.json())["tenantId"]
    patched = await api.client.patch(f"/v1/tenants/{tenant_id}", headers=ADMIN,
                                     json={"weight": 3.0})
    assert (await patched.json())["weight"] == 3
    half = await api.client.patch(f"/v1/tenants/{tenant_id}", headers=ADMIN,
                                  json={"weight": 2.5})
    assert half.status == 422 and fields_of(await half.json()) == ["weight"]


# --- one schema, one server: each edge asked of both -------------------------------------

QUEUE = {"type": "queue", "ref": "emails"}
EDGES = [
    # (what, JobSpec body, the document's verdict, the server's status, the field it names)
    ("queue ref of 63", make_job(target={"type": "queue", "ref": "a" * 63}), True, 201, None),
    ("queue ref of 64", make_job(target={"type": "queue", "ref": "a" * 64}), False, 422,
     "target.ref"),
    ("queue ref with a newline", make_job(target={"type": "queue", "ref": "emails\n"}), False,
     422, "target.ref"),
    ("the reserved pool", make_job(target={"type": "queue", "ref": "http"}), False, 422,
     "target.ref"),
    ("queue ref upper case", make_job(target={"type": "queue", "ref": "Emails"}), False, 422,
     "target.ref"),
    ("https ref", make_job(target={"type": "http", "ref": "https://example.com/hook"}), True,
     201, None),
    ("HTTP in capitals", make_job(target={"type": "http", "ref": "HTTP://example.com/"}), True,
     201, None),
    ("public IPv6 literal", make_job(target={"type": "http", "ref": "http://[2606:4700::1111]/"}),
     True, 201, None),
    ("port 65535", make_job(target={"type": "http", "ref": "http://example.com:65535/"}), True,
     201, None),
    ("port 65536", make_job(target={"type": "http", "ref": "http://example.com:65536/"}), False,
     422, "target.ref"),
    ("ftp ref", make_job(target={"type": "http", "ref": "ftp://example.com/"}), False, 422,
     "target.ref"),
    ("a space in the ref", make_job(target={"type": "http", "ref": "http://a b/"}), False, 422,
     "target.ref"),
    ("no host", make_job(target={"type": "http", "ref": "http:///x"}), False, 422,
     "target.ref"),
    ("brackets in userinfo", make_job(target={"type": "http", "ref": "http://a[b]@host/"}),
     False, 422, "target.ref"),
    # The one the pattern cannot see: the address is checked (HttpTarget's description).
    ("loopback", make_job(target={"type": "http", "ref": "http://127.0.0.1/"}), True, 422,
     "target.ref"),
    ("unknown target type", make_job(target={"type": "ftp", "ref": "x"}), False, 422,
     "target.type"),
    ("name of 200", make_job(name="n" * 200), True, 201, None),
    ("name of 201", make_job(name="n" * 201), False, 422, "name"),
    ("C1 control in a name", make_job(name="a\u0085b"), False, 422, "name"),
    ("no-break space in a name", make_job(name="a\u00a0b"), True, 201, None),
    ("two kinds", make_job(schedule={"delaySeconds": 1, "cron": "* * * * *"}), False, 422,
     "schedule"),
    ("no kind", make_job(schedule={"jitterSeconds": 5}), False, 422, "schedule"),
    ("tz on a one-off", make_job(schedule={"delaySeconds": 1, "tz": "UTC"}), False, 422,
     "schedule.tz"),
    ("jitter on a runAt", make_job(schedule={"runAt": "2027-01-01T00:00:00Z",
                                             "jitterSeconds": 60}), True, 201, None),
    ("cron with every option", make_job(schedule={
        "cron": "0 9 * * MON-FRI", "tz": "Europe/London", "jitterSeconds": 300,
        "overlap": "forbid", "misfire": "catch_up"}), True, 201, None),
    ("unknown zone", make_job(schedule={"cron": "0 9 * * *", "tz": "Mars/Olympus"}), False,
     422, "schedule.tz"),
    ("runAt at the epoch", make_job(schedule={"runAt": "1970-01-01T00:00:00Z"}), True, 201,
     None),
    ("runAt before it", make_job(schedule={"runAt": "1969-12-31T23:59:59Z"}), True, 422,
     "schedule.runAt"),
    ("runAt with an offset", make_job(schedule={"runAt": "2027-01-01T09:00:00+01:00"}), True,
     201, None),
    ("runAt without one", make_job(schedule={"runAt": "2027-01-01T09:00:00"}), False, 422,
     "schedule.runAt"),
    ("cron of four fields", make_job(schedule={"cron": "* * * *"}), False, 422,
     "schedule.cron"),
    ("minute 60", make_job(schedule={"cron": "60 * * * *"}), False, 422, "schedule.cron"),
    ("a macro in capitals", make_job(schedule={"cron": "@DAILY"}), True, 201, None),
    ("@reboot", make_job(schedule={"cron": "@reboot"}), False, 422, "schedule.cron"),
    # The pattern checks each field's range, not the order of a range's two ends.
    ("a backwards range", make_job(schedule={"cron": "30-10 * * * *"}), True, 422,
     "schedule.cron"),
    ("NUL in the payload", make_job(payload={"a": "\u0000"}), False, 422, "payload"),
    ("NUL in a payload key", make_job(payload={"\u0000": 1}), False, 422, "payload"),
    ("nested payload", make_job(payload={"a": [1, {"b": None, "c": "ü"}]}), True, 201, None),
]


@pytest.mark.parametrize(("body", "valid", "status", "field"), [e[1:] for e in EDGES],
                         ids=[e[0] for e in EDGES])
async def test_the_document_and_the_server_agree_at_the_edges(api: Api, body, valid, status,
                                                              field) -> None:
    assert conforms("JobSpec", body) is valid
    resp = await api.submit(body)
    assert resp.status == status, await resp.text()
    if field is not None:
        assert field in fields_of(await resp.json())


def test_runat_describes_its_bounds() -> None:
    run_at = DOC["components"]["schemas"]["RunAtSchedule"]["properties"]["runAt"]
    assert run_at["format"] == "date-time"
    assert "1970-01-01T00:00:00Z" in run_at["description"]
    assert "ten years from now" in run_at["description"]


async def test_runat_ten_years_on_is_the_last_accepted(api: Api) -> None:
    def at(when) -> dict:
        return make_job(schedule={"runAt": when.isoformat().replace("+00:00", "Z")})

    last = T0 + timedelta(days=3650)
    assert (await api.submit(at(last))).status == 201
    assert (await api.submit(at(last + timedelta(seconds=1)))).status == 422


async def test_a_batch_holds_one_to_a_thousand(api: Api) -> None:
    jobs = DOC["components"]["schemas"]["JobBatch"]["properties"]["jobs"]
    assert (jobs["minItems"], jobs["maxItems"]) == (1, 1000)
    for count, status in [(0, 422), (1001, 422), (1, 201)]:
        body = {"jobs": [make_job() for _ in range(count)]}
        assert conforms("JobBatch", body) is (status == 201)
        resp = await api.client.post("/v1/jobs:batch", json=body, headers=api.auth())
        assert resp.status == status, await resp.text()


async def test_a_tenant_name_follows_the_same_rule_as_a_job_name(api: Api) -> None:
    for name, status in [("a\u0085b", 422), ("a\tb", 422), ("a\u00a0b", 201), ("é €", 201)]:
        assert conforms("TenantSpec", {"name": name}) is (status == 201)
        resp = await api.client.post("/v1/tenants", json={"name": name}, headers=ADMIN)
        assert resp.status == status, (name, await resp.text())


# --- zones and cron ------------------------------------------------------------------


def test_every_published_zone_is_one_the_server_takes() -> None:
    names = DOC["components"]["schemas"]["ZoneName"]["enum"]
    assert names == list(zone_names())
    assert {"UTC", "Europe/London", "America/New_York"} <= set(names)
    assert "localtime" not in names and "Factory" not in names
    for name in names:
        sched.validate_zone(name)


ACCEPTED_CRONS = ["0 9 * * MON-FRI", "*/15 * * * *", "@daily", "@Hourly", "H H(0-5) * * *",
                  "0 0 1,15 * *", "0 9 * jan-mar sun", "5-55/10 0-23/2 1-31 1-12 0-7",
                  "00 09 * * *", " 0 9 * * * ", "0\t9 * * *", "H/15 * * * *", "0 0 * * 7",
                  "30 4 1/2 * *"]
REFUSED_CRONS = ["* * *", "* * * * * *", "61 * * * *", "* 24 * * *", "* * 0 * *", "* * * 13 *",
                 "* * * * 8", "*/61 * * * *", "@reboot", "@fortnightly", "h * * * *",
                 "0 9 * * MONDAY", "", "1,,2 * * * *"]


@pytest.mark.parametrize("expr", ACCEPTED_CRONS)
def test_cron_the_server_parses_matches_the_pattern(expr: str) -> None:
    sched.parse_cron(expr, job_id=uuid.uuid4())
    assert re.search(cron_pattern(), expr)


@pytest.mark.parametrize("expr", REFUSED_CRONS)
def test_cron_the_server_refuses_on_syntax_does_not_match(expr: str) -> None:
    with pytest.raises(sched.ScheduleError):
        sched.parse_cron(expr, job_id=uuid.uuid4())
    assert not re.search(cron_pattern(), expr)


@settings(max_examples=300, database=None, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.from_regex(re.compile(cron_pattern().removesuffix("$") + r"\Z")))
def test_cron_the_pattern_allows_fails_only_on_what_it_says_it_cannot_see(expr: str) -> None:
    try:
        sched.parse_cron(expr, job_id=uuid.UUID(int=7))
    except sched.ScheduleError as exc:
        assert "starts after it ends" in str(exc) or "never fires" in str(exc), (expr, exc)


# --- list cursors ----------------------------------------------------------------------


async def test_lists_issue_cursors_of_their_published_pattern(api: Api, clock) -> None:
    for _ in range(3):
        await api.submit(make_job())
    page = await (await api.client.get("/v1/jobs?limit=1", headers=api.auth())).json()
    assert re.fullmatch(ID_CURSOR_PATTERN.strip("^$"), page["nextCursor"])
    job_id = page["items"][0]["jobId"]
    for _ in range(2):
        clock.advance(1)
        triggered = await api.client.post(f"/v1/jobs/{job_id}:trigger", headers=api.auth())
        assert triggered.status == 202
    runs = await (await api.client.get(f"/v1/jobs/{job_id}/executions?limit=1",
                                       headers=api.auth())).json()
    assert re.fullmatch(EXECUTION_CURSOR_PATTERN.strip("^$"), runs["nextCursor"])


async def test_every_cursor_of_the_job_pattern_is_taken(api: Api) -> None:
    for raw in (bytes(16), b"\xff" * 16, uuid.uuid4().bytes):
        cursor = "j1." + base64.urlsafe_b64encode(raw).decode().rstrip("=")
        assert re.fullmatch(ID_CURSOR_PATTERN.strip("^$"), cursor)
        for path in ("/v1/jobs", "/v1/dead-letters"):
            resp = await api.client.get(path, params={"cursor": cursor}, headers=api.auth())
            assert resp.status == 200, await resp.text()
    off_pattern = "j1." + "A" * 21 + "B"  # decodes, but to bits a UUID has not got
    resp = await api.client.get("/v1/jobs", params={"cursor": off_pattern}, headers=api.auth())
    assert resp.status == 422 and fields_of(await resp.json()) == ["cursor"]


# --- operations and their answers ----------------------------------------------------


def test_every_operation_lists_what_it_can_answer() -> None:
    for route in ROUTES:
        op = DOC["paths"][route.path][route.method.lower()]
        codes = {int(c) for c in op["responses"]}
        params = [p for p in op.get("parameters", []) if p["in"] == "path"]
        for param in params:
            assert param["schema"] == {"type": "string", "format": "uuid"}
        if params:
            assert {404, 405} <= codes, route.path
        if route.auth != "none":
            assert {401, 503} <= codes, route.path
        if route.auth == "admin":
            assert 403 in codes
        if route.body is not None:
            assert {400, 413, 415, 422} <= codes, route.path
        for code, answer in op["responses"].items():
            if int(code) >= 400 and route.path != "/readyz":
                assert answer["content"] == {"application/problem+json": {
                    "schema": {"$ref": "#/components/schemas/Problem"}}}, (route.path, code)


async def test_a_malformed_path_id_is_a_problem_404(api: Api) -> None:
    resp = await api.client.get("/v1/jobs/not-a-uuid", headers=api.auth())
    assert resp.status == 404
    assert resp.headers["Content-Type"].startswith("application/problem+json")


async def test_an_id_that_makes_another_path_is_a_problem_405(api: Api) -> None:
    resp = await api.client.get(f"/v1/jobs/{uuid.uuid4()}:pause", headers=api.auth())
    assert resp.status == 405 and "POST" in resp.headers["Allow"]
    assert resp.headers["Content-Type"].startswith("application/problem+json")


async def test_two_triggers_at_one_instant_are_two_runs(api: Api) -> None:
    job_id = (await (await api.submit(make_job())).json())["jobId"]
    first = await api.client.post(f"/v1/jobs/{job_id}:trigger", headers=api.auth())
    assert first.status == 202
    second = await api.client.post(f"/v1/jobs/{job_id}:trigger", headers=api.auth())
    assert second.status == 202, await second.text()  # two triggers, two runs
    history = await (await api.client.get(f"/v1/jobs/{job_id}/executions",
                                          headers=api.auth())).json()
    assert len({e["scheduledFor"] for e in history["items"]}) == 2
