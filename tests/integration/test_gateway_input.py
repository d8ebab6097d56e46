"""Hostile and malformed input: a named field, a 4xx, problem+json, and nothing written."""

from __future__ import annotations

import io
import json
import socket

import pytest

from tests.integration.conftest import Api, make_job, tenant_api

GOOD_TARGET = {"type": "queue", "ref": "emails"}


def job(**overrides) -> bytes:
    return json.dumps(make_job(**overrides)).encode()


def with_schedule(schedule: dict) -> bytes:
    return job(schedule=schedule)


def with_target(ref: str, type_: str = "http") -> bytes:
    return job(target={"type": type_, "ref": ref})


CASES: list[tuple[str, bytes, int, str | None]] = [
    ("truncated JSON", b'{"name": "x"', 400, "body"),
    ("not an object", b"[]", 422, "body"),
    ("empty body", b"", 400, "body"),
    ("missing name", json.dumps({"target": GOOD_TARGET, "schedule": {"delaySeconds": 1}}).encode(),
     422, "name"),
    ("unknown top-level field", job(colour="red"), 422, "colour"),
    ("unknown schedule field", with_schedule({"delaySeconds": 1, "every": 5}), 422,
     "schedule.every"),
    ("name is a number", job(name=5), 422, "name"),
    ("empty name", job(name=""), 422, "name"),
    ("huge name", job(name="x" * 10_000), 422, "name"),
    ("NUL in name", job(name="a\u0000b"), 422, "name"),
    ("unknown target type", job(target={"type": "ftp", "ref": "x"}), 422, "target.type"),
    ("queue name with spaces", with_target("Bad Name", "queue"), 422, "target.ref"),
    ("queue name too long", with_target("a" * 64, "queue"), 422, "target.ref"),
    ("reserved pool", with_target("http", "queue"), 422, "target.ref"),
    ("queue name with a trailing newline", with_target("emails\n", "queue"), 422,
     "target.ref"),
    ("http ref not http", with_target("ftp://example.com/x"), 422, "target.ref"),
    ("http ref no host", with_target("http:///x"), 422, "target.ref"),
    ("http ref bad port", with_target("http://example.com:99999/"), 422, "target.ref"),
    ("loopback target", with_target("http://127.0.0.1:8080/hook"), 422, "target.ref"),
    ("localhost target", with_target("http://localhost/hook"), 422, "target.ref"),
    ("ipv6 loopback target", with_target("http://[::1]/hook"), 422, "target.ref"),
    ("private target", with_target("http://10.1.2.3/hook"), 422, "target.ref"),
    ("metadata target", with_target("http://169.254.169.254/latest"), 422, "target.ref"),
    ("mapped loopback", with_target("http://[::ffff:127.0.0.1]/"), 422, "target.ref"),
    ("decimal loopback", with_target("http://2130706433/"), 422, "target.ref"),
    ("hex loopback", with_target("http://0x7f000001/"), 422, "target.ref"),
    ("short hex loopback", with_target("http://0x7f.1/"), 422, "target.ref"),
    ("octal loopback", with_target("http://0177.0.0.1/"), 422, "target.ref"),
    ("short loopback", with_target("http://127.1:8080/"), 422, "target.ref"),
    ("full-width loopback", with_target("http://１２７.0.0.1/"), 422, "target.ref"),
    ("unspecified target", with_target("http://0.0.0.0/"), 422, "target.ref"),
    ("ipv6 unspecified target", with_target("http://[::]/"), 422, "target.ref"),
    ("multicast target", with_target("http://224.0.0.1/"), 422, "target.ref"),
    ("shared address target", with_target("http://100.64.0.1/"), 422, "target.ref"),
    ("link-local with a zone", with_target("http://[fe80::1%25eth0]/"), 422, "target.ref"),
    ("NAT64 loopback", with_target("http://[64:ff9b::7f00:1]/"), 422, "target.ref"),
    ("6to4 metadata", with_target("http://[2002:a9fe:a9fe::]/"), 422, "target.ref"),
    ("ipv6 metadata", with_target("http://[fd00:ec2::254]/"), 422, "target.ref"),
    ("a number that is no address", with_target("http://08.0.0.1/"), 422, "target.ref"),
    ("unknown zone", with_schedule({"cron": "0 9 * * *", "tz": "Mars/Olympus"}), 422,
     "schedule.tz"),
    ("path as zone", with_schedule({"cron": "0 9 * * *", "tz": "../../etc/passwd"}), 422,
     "schedule.tz"),
    ("bad cron", with_schedule({"cron": "61 * * * *"}), 422, "schedule.cron"),
    ("cron too few fields", with_schedule({"cron": "* * *"}), 422, "schedule.cron"),
    ("cron never fires", with_schedule({"cron": "0 0 30 2 *"}), 422, "schedule.cron"),
    ("negative delay", with_schedule({"delaySeconds": -1}), 422, "schedule.delaySeconds"),
    ("naive runAt", with_schedule({"runAt": "2026-12-24T09:00:00"}), 422, "schedule.runAt"),
    ("garbage runAt", with_schedule({"runAt": "tomorrow"}), 422, "schedule.runAt"),
    ("runAt in year 1", with_schedule({"runAt": "0001-01-01T00:00:00Z"}), 422, "schedule.runAt"),
    ("runAt before 1970", with_schedule({"runAt": "1969-12-31T23:59:59Z"}), 422,
     "schedule.runAt"),
    ("runAt in year 9999", with_schedule({"runAt": "9999-12-31T23:59:59Z", "jitterSeconds": 60}),
     422, "schedule.runAt"),
    ("runAt past ten years", with_schedule({"runAt": "2036-12-03T12:00:00Z"}), 422,
     "schedule.runAt"),
    ("two kinds", with_schedule({"delaySeconds": 1, "cron": "* * * * *"}), 422, "schedule"),
    ("no kind", with_schedule({}), 422, "schedule"),
    ("tz on a one-off", with_schedule({"delaySeconds": 1, "tz": "UTC"}), 422, "schedule.tz"),
    ("overlap on a one-off", with_schedule({"delaySeconds": 1, "overlap": "forbid"}), 422,
     "schedule.overlap"),
    ("bad overlap", with_schedule({"cron": "* * * * *", "overlap": "sometimes"}), 422,
     "schedule.overlap"),
    ("negative jitter", with_schedule({"cron": "* * * * *", "jitterSeconds": -5}), 422,
     "schedule.jitterSeconds"),
    ("maxAttempts 0", job(retry={"maxAttempts": 0}), 422, "retry.maxAttempts"),
    ("maxAttempts huge", job(retry={"maxAttempts": 10**30}), 422, "retry.maxAttempts"),
    ("negative backoff", job(retry={"backoffSeconds": -1}), 422, "retry.backoffSeconds"),
    ("timeout 0", job(timeoutSeconds=0), 422, "timeoutSeconds"),
    ("NUL in payload", b'{"name":"x","target":{"type":"queue","ref":"q"},'
                       b'"schedule":{"delaySeconds":1},"payload":{"a":"\\u0000"}}', 422, "payload"),
    ("unstorable number", b'{"name":"x","target":{"type":"queue","ref":"q"},'
                          b'"schedule":{"delaySeconds":1},"payload":1e999999}', 422, "payload"),
    ("lone surrogate", b'{"name":"\\ud800","target":{"type":"queue","ref":"q"},'
                       b'"schedule":{"delaySeconds":1}}', None, None),
    ("deep nesting", b'{"name":"x","target":{"type":"queue","ref":"q"},'
                     b'"schedule":{"delaySeconds":1},"payload":' + b"[" * 5000 + b"]" * 5000 + b"}",
     None, None),
    ("payload over 256 KiB", job(payload={"blob": "x" * (260 * 1024)}), 413, "payload"),
    ("body over the cap", job(payload={"blob": "x" * (1024 * 1024)}), 413, None),
    ("invalid utf-8", b'{"name":"\xff\xfe","target":{"type":"queue","ref":"q"},'
                      b'"schedule":{"delaySeconds":1}}', 400, "body"),
]


@pytest.mark.parametrize(("body", "status", "field"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
async def test_bad_submission_is_a_named_4xx_and_changes_nothing(api: Api, db, body, status,
                                                                 field) -> None:
    resp = await api.client.post("/v1/jobs", data=io.BytesIO(body),
                                 headers={**api.auth(), "Content-Type": "application/json"})
    assert 400 <= resp.status < 500, await resp.text()
    if status is not None:
        assert resp.status == status, await resp.text()
    assert resp.headers["Content-Type"].startswith("application/problem+json")
    problem = await resp.json()
    assert problem["status"] == resp.status
    assert problem["type"].startswith("https://")
    if field is not None:
        assert field in [e["field"] for e in problem["errors"]], problem
    async with db.connection() as conn:
        assert await conn.fetchval("SELECT count(*) FROM jobs") == 0
        assert await conn.fetchval("SELECT count(*) FROM due_index") == 0
        assert await conn.fetchval("SELECT count(*) FROM idempotency_keys") == 0


async def test_wrong_content_type_is_415(api: Api) -> None:
    resp = await api.client.post("/v1/jobs", data=job(),
                                 headers={**api.auth(), "Content-Type": "text/plain"})
    assert resp.status == 415


async def test_overlong_idempotency_key_is_422(api: Api) -> None:
    resp = await api.submit(make_job(), **{"Idempotency-Key": "k" * 256})
    assert resp.status == 422
    assert (await resp.json())["errors"][0]["field"] == "Idempotency-Key"


async def test_http_target_allowed_by_http_allow(db_url, services, key_prefix, clock) -> None:
    async with tenant_api(db_url, services.redis_url, key_prefix, clock,
                          http_allow=("127.0.0.0/8",), resolve=dns(hooks="127.0.0.1")) as api:
        for ref in ("http://127.0.0.1:9000/hook", "http://2130706433/", "http://0x7f.1/",
                    "http://0177.0.0.1/", "http://[::ffff:127.0.0.1]/", "http://localhost/",
                    "http://hooks.example:9000/hook"):
            ok = await api.submit(make_job(target={"type": "http", "ref": ref}))
            assert ok.status == 201, (ref, await ok.text())
        still_refused = await api.submit(make_job(
            target={"type": "http", "ref": "http://10.0.0.1/hook"}))
        assert still_refused.status == 422


def dns(**names: str):
    """A resolver of a few names (hooks=... answers hooks.example); others do not resolve."""
    async def resolve(host: str, port: int) -> list[str]:
        answer = names.get(host.removesuffix(".example"))
        if answer is None:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return answer.split(",")

    return resolve


async def test_a_name_resolving_to_a_private_address_is_422(db_url, services, key_prefix,
                                                            clock, db) -> None:
    resolve = dns(internal="10.0.0.5", metadata="8.8.8.8,169.254.169.254")
    async with tenant_api(db_url, services.redis_url, key_prefix, clock,
                          resolve=resolve) as api:
        resp = await api.submit(make_job(target={"type": "http",
                                                 "ref": "https://internal.example/hook"}))
        assert resp.status == 422
        [error] = (await resp.json())["errors"]
        assert error == {"field": "target.ref", "message": (
            "internal.example resolves to 10.0.0.5, a private address; "
            "HERDWICK_HTTP_ALLOW must list it to be a target")}

        batch = await api.client.post("/v1/jobs:batch", headers=api.auth(), json={"jobs": [
            make_job(target={"type": "http", "ref": "https://nowhere.example/"}),
            make_job(target={"type": "http", "ref": "https://metadata.example/latest"}),
            make_job(target={"type": "http", "ref": "https://internal.example/x"}),
        ]})
        assert batch.status == 422
        errors = (await batch.json())["errors"]
        assert [e["field"] for e in errors] == ["jobs[1].target.ref", "jobs[2].target.ref"]
        assert "169.254.169.254, a cloud metadata address" in errors[0]["message"]
    async with db.connection() as conn:
        assert await conn.fetchval("SELECT count(*) FROM jobs") == 0


async def test_a_name_that_does_not_resolve_is_accepted(db_url, services, key_prefix,
                                                        clock) -> None:
    # Delivery resolves it again, and that check decides where the request goes.
    async with tenant_api(db_url, services.redis_url, key_prefix, clock,
                          resolve=dns()) as api:
        resp = await api.submit(make_job(target={"type": "http",
                                                 "ref": "https://not-yet.example/hook"}))
        assert resp.status == 201, await resp.text()


async def test_public_http_target_and_hashed_cron_are_accepted(api: Api) -> None:
    resp = await api.submit(make_job(target={"type": "http", "ref": "https://example.com/hook"},
                                     schedule={"cron": "H H * * *", "tz": "Europe/London"}))
    assert resp.status == 201, await resp.text()


async def test_unknown_route_and_method_are_problem_json(api: Api) -> None:
    missing = await api.client.get("/v1/nothing-here")
    assert missing.status == 404
    assert missing.headers["Content-Type"].startswith("application/problem+json")
    wrong = await api.client.put("/v1/jobs", headers=api.auth())
    assert wrong.status == 405
    assert "Allow" in wrong.headers
