"""/ui without a browser: every refusal is a 4xx page (never a 500, never problem+json),
another tenant's things are 404 as in the API, and a form without its CSRF token
changes nothing."""

from __future__ import annotations

import html
import uuid

import pytest
from aiohttp.test_utils import make_mocked_request
from aiohttp.web import Response

from herdwick.gateway import ui_session
from tests.integration.conftest import Api, make_job
from tests.integration.gateway_client import ADMIN_TOKEN
from tests.integration.ui_client import csrf_in, logged_out, login


async def submitted(api: Api, key: str | None = None, **overrides) -> str:
    resp = await api.submit(make_job(**overrides), key=key)
    assert resp.status == 201, await resp.text()
    return (await resp.json())["jobId"]


async def job_state(api: Api, job_id: str) -> str:
    resp = await api.client.get(f"/v1/jobs/{job_id}", headers=api.auth())
    return (await resp.json())["state"]


async def assert_page(resp, status: int, says: str = "") -> str:
    text = html.unescape(await resp.text())
    assert resp.status == status, text[:2000]
    assert resp.content_type == "text/html", resp.content_type
    assert says.lower() in text.lower(), text[:2000]
    return text


async def test_without_a_session_a_page_sends_you_to_log_in(api: Api) -> None:
    resp = await api.client.get("/ui/", allow_redirects=False)
    assert (resp.status, resp.headers["Location"]) == (303, "/ui/login")
    bare = await api.client.get("/ui", allow_redirects=False)
    assert (bare.status, bare.headers["Location"]) == (303, "/ui/")
    post = await api.client.post(f"/ui/tenants/{api.tenant_id}/jobs/{uuid.uuid4()}/pause")
    await assert_page(post, 401, "log in")


async def test_a_bad_token_is_refused_and_a_login_without_its_csrf_too(api: Api) -> None:
    form = await api.client.get("/ui/login")
    token = csrf_in(await form.text())
    bad = await api.client.post("/ui/login", data={"csrf": token, "token": "hw_not_a_key"})
    await assert_page(bad, 401, "neither a tenant")
    forged = await api.client.post("/ui/login", data={"csrf": "guess", "token": api.key})
    await assert_page(forged, 403, "csrf")
    assert "herdwick_ui" not in {c.key for c in api.client.session.cookie_jar}


async def test_the_session_cookie_is_http_only_strict_and_scoped_to_ui(api: Api) -> None:
    form = await api.client.get("/ui/login")
    resp = await api.client.post("/ui/login", data={"csrf": csrf_in(await form.text()),
                                                    "token": api.key}, allow_redirects=False)
    cookie = resp.cookies["herdwick_ui"]
    assert cookie.value == api.key
    assert (cookie["path"], cookie["httponly"], cookie["samesite"]) == ("/ui", True, "Strict")
    assert not cookie["secure"]  # plain http here; over https it is Secure (below)
    secure = make_mocked_request("POST", "/ui/login").clone(scheme="https")
    response = Response()
    ui_session.start(response, secure, api.key)
    assert response.cookies["herdwick_ui"]["secure"] is True


async def test_pages_are_held_to_what_herdwick_serves(api: Api) -> None:
    await login(api.client, api.key)
    resp = await api.client.get("/ui/")
    policy = resp.headers["Content-Security-Policy"]
    assert "default-src 'none'" in policy and "style-src 'self'" in policy
    assert resp.headers["Cache-Control"] == "no-store"
    css = await api.client.get("/ui/static/ui.css")
    assert css.status == 200 and css.content_type == "text/css"


@pytest.mark.parametrize("query, field", [
    ("cursor=j1.nope", "cursor"), ("limit=0", "limit"), ("limit=x", "limit"),
    ("state=sleeping", "state"), ("name=" + "n" * 201, "name")])
async def test_a_bad_filter_or_cursor_on_the_job_list_is_422(api: Api, query: str,
                                                              field: str) -> None:
    await login(api.client, api.key)
    resp = await api.client.get(f"/ui/tenants/{api.tenant_id}/jobs?{query}")
    await assert_page(resp, 422, field)


async def test_bad_cursors_elsewhere_are_422(api: Api) -> None:
    job_id = await submitted(api)
    await login(api.client, api.key)
    on_job = await api.client.get(f"/ui/tenants/{api.tenant_id}/jobs/{job_id}?cursor=e1.AAAA")
    await assert_page(on_job, 422, "cursor")
    dead = await api.client.get(f"/ui/tenants/{api.tenant_id}/dead-letters?cursor=zz")
    await assert_page(dead, 422, "cursor")


async def test_unknown_and_malformed_ids_are_404_pages(api: Api) -> None:
    await login(api.client, api.key)
    tenant = f"/ui/tenants/{api.tenant_id}"
    for path in (f"{tenant}/jobs/{uuid.uuid4()}", f"{tenant}/jobs/not-a-uuid",
                 f"{tenant}/executions/{uuid.uuid4()}", "/ui/tenants/nope/jobs",
                 "/ui/no-such-page"):
        await assert_page(await api.client.get(path), 404, "not")


async def test_a_tenant_key_sees_nothing_of_another_tenant(api: Api) -> None:
    other = await api.create_tenant("globex")
    theirs = await submitted(api, key=other["apiKey"], name="globex-secret")
    mine = await submitted(api, name="acme-report")
    await login(api.client, api.key)
    elsewhere = f"/ui/tenants/{other['tenantId']}"
    for path in (f"{elsewhere}/jobs", f"{elsewhere}/jobs/{theirs}",
                 f"{elsewhere}/dead-letters",
                 # their job under my tenant's path: the API's 404 for another tenant's job
                 f"/ui/tenants/{api.tenant_id}/jobs/{theirs}"):
        text = await assert_page(await api.client.get(path), 404, "does not exist")
        assert "globex" not in text
    overview = await (await api.client.get("/ui/")).text()
    assert "globex" not in overview and other["tenantId"] not in overview
    listed = await (await api.client.get(f"/ui/tenants/{api.tenant_id}/jobs")).text()
    assert mine in listed and theirs not in listed
    csrf = csrf_in(listed)
    refused = await api.client.post(f"{elsewhere}/jobs/{theirs}/pause", data={"csrf": csrf})
    await assert_page(refused, 404, "does not exist")
    assert await job_state(Api(api.client, other["apiKey"], other["tenantId"]), theirs) \
        == "active"


async def test_the_admin_sees_every_tenant_but_not_one_that_does_not_exist(api: Api) -> None:
    other = await api.create_tenant("globex")
    theirs = await submitted(api, key=other["apiKey"], name="globex-nightly")
    await login(api.client, ADMIN_TOKEN)
    overview = await (await api.client.get("/ui/")).text()
    assert "acme" in overview and "globex" in overview
    page = await api.client.get(f"/ui/tenants/{other['tenantId']}/jobs/{theirs}")
    await assert_page(page, 200, "globex-nightly")
    await assert_page(await api.client.get(f"/ui/tenants/{uuid.uuid4()}/jobs"), 404,
                      "does not exist")


async def test_a_form_without_its_csrf_token_changes_nothing(api: Api) -> None:
    job_id = await submitted(api)
    csrf = await login(api.client, api.key)
    pause = f"/ui/tenants/{api.tenant_id}/jobs/{job_id}/pause"
    for data in ({}, {"csrf": ""}, {"csrf": csrf[:-1] + "0" if csrf[-1] != "0" else "1"}):
        await assert_page(await api.client.post(pause, data=data), 403, "csrf")
    json_post = await api.client.post(pause, json={"csrf": csrf})
    await assert_page(json_post, 403, "csrf")
    assert await job_state(api, job_id) == "active"
    await assert_page(await api.client.post(f"/ui/tenants/{api.tenant_id}/jobs/{job_id}/explode",
                                            data={"csrf": csrf}), 404, "no 'explode' button")


async def test_a_transition_the_state_forbids_is_409(api: Api) -> None:
    job_id = await submitted(api)
    csrf = await login(api.client, api.key)
    base = f"/ui/tenants/{api.tenant_id}/jobs/{job_id}"
    done = await api.client.post(f"{base}/cancel", data={"csrf": csrf}, allow_redirects=False)
    assert (done.status, done.headers["Location"]) == (303, f"{base}?did=cancel")
    await assert_page(await api.client.post(f"{base}/pause", data={"csrf": csrf}), 409,
                      "canceled job cannot be paused")
    await assert_page(await api.client.post(f"{base}/trigger", data={"csrf": csrf}), 409,
                      "cannot be triggered")


async def test_retrying_what_is_not_dead_is_409(api: Api) -> None:
    job_id = await submitted(api)
    resp = await api.client.post(f"/v1/jobs/{job_id}:trigger", headers=api.auth())
    execution_id = (await resp.json())["executionId"]
    csrf = await login(api.client, api.key)
    retry = f"/ui/tenants/{api.tenant_id}/executions/{execution_id}/retry"
    await assert_page(await api.client.post(retry, data={"csrf": csrf}), 409,
                      "only a dead execution")


async def test_logout_needs_its_csrf_token_and_ends_the_session(api: Api) -> None:
    csrf = await login(api.client, api.key)
    await assert_page(await api.client.post("/ui/logout"), 403, "csrf")
    assert (await api.client.get("/ui/", allow_redirects=False)).status == 200
    out = await api.client.post("/ui/logout", data={"csrf": csrf}, allow_redirects=False)
    assert (out.status, out.headers["Location"]) == (303, "/ui/login")
    assert (await api.client.get("/ui/", allow_redirects=False)).status == 303
    logged_out(api.client)


async def test_ui_is_not_in_the_openapi_document(api: Api) -> None:
    document = await (await api.client.get("/openapi.json")).json()
    assert not [path for path in document["paths"] if path.startswith("/ui")]
