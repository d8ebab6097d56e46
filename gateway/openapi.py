"""The OpenAPI 3.1 document, generated from the route table and the msgspec models."""

from __future__ import annotations

import msgspec
from aiohttp import web

from herdwick.gateway.routes import _PARAM, ROUTES, Route
from herdwick.model import Problem

_REF = "#/components/schemas/{name}"
_STATUS_TEXT = {
    200: "OK", 201: "Created", 202: "Accepted", 204: "No content", 400: "Malformed JSON",
    401: "No or bad credentials", 403: "Admin API disabled", 404: "Not found (or another tenant's)",
    409: "The state forbids this transition", 413: "Too large", 415: "Not JSON",
    422: "Invalid field (errors[].field names it)", 429: "Over quota (Retry-After)",
    503: "Storage unavailable (Retry-After); nothing written",
}


def _models() -> list[type]:
    found: list[type] = [Problem]
    for route in ROUTES:
        for model in (route.body, route.ok[1]):
            if model is not None and model not in found:
                found.append(model)
    return found


def _operation(route: Route, refs: dict[type, dict]) -> dict:
    op: dict = {"summary": route.summary, "operationId": route.handler.__name__,
                "responses": {}}
    if route.handler.__doc__:
        op["description"] = route.handler.__doc__.strip()
    params = [{"name": n, "in": "path", "required": True, "schema": {"type": "string"}}
              for n in _PARAM.findall(route.path)]
    params += [{"name": q.name, "in": "query", "description": q.description, "schema": q.schema}
               for q in route.query]
    params += [{"name": h.name, "in": "header", "description": h.description, "schema": h.schema}
               for h in route.headers]
    if params:
        op["parameters"] = params
    if route.auth != "none":
        op["security"] = [{"adminToken" if route.auth == "admin" else "apiKey": []}]
    if route.body is not None:
        op["requestBody"] = {"required": True,
                             "content": {"application/json": {"schema": refs[route.body]}}}
    status, model = route.ok
    ok: dict = {"description": _STATUS_TEXT.get(status, "OK")}
    if model is not None:
        ok["content"] = {"application/json": {"schema": refs[model]}}
    op["responses"][str(status)] = ok
    for code in route.errors:
        op["responses"][str(code)] = {
            "description": _STATUS_TEXT.get(code, "Error"),
            "content": {"application/problem+json": {"schema": refs[Problem]}}}
    return op


def document() -> dict:
    models = _models()
    schemas, components = msgspec.json.schema_components(models, ref_template=_REF)
    refs = dict(zip(models, schemas, strict=True))
    paths: dict[str, dict] = {}
    for route in ROUTES:
        paths.setdefault(route.path, {})[route.method.lower()] = _operation(route, refs)
    paths["/openapi.json"] = {"get": {"summary": "This document", "operationId": "openapi",
                                      "responses": {"200": {"description": "OK"}}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "herdwick", "version": "1",
                 "description": "A multi-tenant distributed job scheduler. Errors are "
                                "application/problem+json; times are RFC 3339 UTC."},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {
                "apiKey": {"type": "http", "scheme": "bearer",
                           "description": "a tenant's API key"},
                "adminToken": {"type": "http", "scheme": "bearer",
                               "description": "HERDWICK_ADMIN_TOKEN"},
            },
        },
    }


async def openapi(request: web.Request) -> web.Response:
    return web.Response(body=msgspec.json.encode(request.app[DOCUMENT]),
                        content_type="application/json")


DOCUMENT = web.AppKey("herdwick_openapi", dict)
