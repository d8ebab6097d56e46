"""Driving /ui without a browser: log in as a form does, post forms with their CSRF token."""

from __future__ import annotations

import html
import re

from aiohttp.test_utils import TestClient

_CSRF = re.compile(r'name="csrf" value="([^"]*)"')


def csrf_in(page: str) -> str:
    found = _CSRF.search(page)
    assert found, page[:2000]
    return html.unescape(found.group(1))


async def login(client: TestClient, token: str) -> str:
    """Log in through the form, as a browser would; the session's CSRF token."""
    form = await client.get("/ui/login")
    assert form.status == 200, await form.text()
    resp = await client.post("/ui/login", data={"csrf": csrf_in(await form.text()),
                                                "token": token}, allow_redirects=False)
    assert resp.status == 303, await resp.text()
    overview = await client.get("/ui/")
    assert overview.status == 200, await overview.text()
    return csrf_in(await overview.text())


def logged_out(client: TestClient) -> None:
    client.session.cookie_jar.clear()
