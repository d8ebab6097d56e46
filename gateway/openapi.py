"""The OpenAPI 3.1 document, generated from the route table and the msgspec models.

msgspec writes each model's schema; this module then says what msgspec cannot
see, so that a client (or a fuzzer) reading the document sends what the server
takes: the shapes a schedule and a target come in (oneOf), the patterns of the
fields the gateway checks in code (gateway/submit.py, herdwick/schedule.py), the
zones this server knows, and every status each operation can answer with.
"""

from __future__ import annotations

import inspect
import zoneinfo
from functools import cache

import msgspec
from aiohttp import web

from herdwick import schedule as sched
from herdwick.gateway.routes import _PARAM, ROUTES, Route
from herdwick.gateway.submit import HTTP_POOL, HTTP_REF_PATTERN
from herdwick.model import (
    LABEL_KEY_PATTERN,
    MAX_BATCH_JOBS,
    MAX_LABEL_VALUE_LEN,
    MAX_LABELS,
    MAX_PAYLOAD_BYTES,
    NAME_PATTERN,
    POOL_PATTERN,
    SCHEDULE_SHAPES,
    Problem,
)

_REF = "#/components/schemas/{name}"
_STATUS_TEXT = {
    200: "OK", 201: "Created", 202: "Accepted", 204: "No content", 400: "Malformed JSON",
    401: "No or bad credentials", 403: "Admin API disabled",
    404: "Not found: no such id (or another tenant's), or the path is not one of ours",
    405: "Method not allowed: the id made the path another operation's (Allow lists its "
         "methods)",
    408: "The body did not arrive in time (the connection closes)",
    409: "The state forbids this transition",
    412: "If-Match names another version than the job's (ETag: the current one)",
    413: "Too large", 415: "Not JSON", 428: "If-Match is missing",
    422: "Invalid field (errors[].field names it)", 429: "Over quota (Retry-After)",
    503: "Storage unavailable (Retry-After); nothing written",
}
_RETRY_AFTER = {"Retry-After": ("seconds to wait before trying again",
                                 {"type": "string", "pattern": "^[0-9]+$"})}
_PROBLEM_HEADERS = {
    401: {"WWW-Authenticate": ('Bearer realm="herdwick"', {"type": "string"})},
    405: {"Allow": ("the methods this path takes", {"type": "string"})},
    429: _RETRY_AFTER,
    503: _RETRY_AFTER,
}

# Any one of a list's entries will do (OpenAPI security: alternatives).
_SECURITY = {"tenant": [{"apiKey": []}], "admin": [{"adminToken": []}],
             "admin_or_tenant": [{"adminToken": []}, {"apiKey": []}]}


def _statuses(route: Route) -> list[int]:
    """Every error status the route can answer with: its own, and those its parts imply."""
    codes = set(route.errors)
    if route.auth != "none":
        codes |= {401, 503}  # a key is looked up in Postgres; admin handlers all reach it
    if route.auth == "admin":
        codes.add(403)
    if route.body is not None:
        codes |= {400, 408, 413, 415, 422}
    if _PARAM.search(route.path):
        # A malformed id cannot exist (404); one holding a ':' or '/' can turn the path into
        # another operation's, or into none (405, 404).
        codes |= {404, 405}
    return sorted(codes)


def _models() -> list[type]:
    found: list[type] = [Problem]
    for route in ROUTES:
        for model in (route.body, route.ok[1], *(m for _, m in route.also)):
            if model is not None and model not in found:
                found.append(model)
    return found


def _parameters(route: Route) -> list[dict]:
    params = [{"name": n, "in": "path", "required": True,
               "schema": {"type": "string", "format": "uuid"}}
              for n in _PARAM.findall(route.path)]
    params += [{"name": q.name, "in": "query", "description": q.description, "schema": q.schema}
               for q in route.query]
    params += [{"name": h.name, "in": "header", "description": h.description, "schema": h.schema,
                **({"required": True} if h.required else {})}
               for h in route.headers]
    return params


def _json(schema: dict, media_type: str = "application/json") -> dict:
    return {media_type: {"schema": schema}}


def _operation(route: Route, refs: dict[type, dict]) -> dict:
    op: dict = {"summary": route.summary, "operationId": route.handler.__name__,
                "responses": {}}
    if route.handler.__doc__:
        op["description"] = inspect.cleandoc(route.handler.__doc__)
    params = _parameters(route)
    if params:
        op["parameters"] = params
    if route.auth != "none":
        op["security"] = _SECURITY[route.auth]
    if route.body is not None:
        op["requestBody"] = {"required": not route.body_optional,
                             "content": {t: {"schema": refs[route.body]}
                                         for t in route.body_types}}
    for status, model in (route.ok, *route.also):
        answer: dict = {"description": _STATUS_TEXT.get(status, "OK")}
        if model is not None:
            answer["content"] = _json(refs[model])
        if status == route.ok[0] and route.links:
            answer["links"] = {link.name: {"operationId": link.handler.__name__,
                                           "parameters": link.parameters}
                               for link in route.links}
        if status == route.ok[0] and route.ok_headers:
            answer["headers"] = {h.name: {"required": h.required, "description": h.description,
                                          "schema": h.schema} for h in route.ok_headers}
        op["responses"][str(status)] = answer
    for code in _statuses(route):
        answer = {"description": _STATUS_TEXT.get(code, "Error"),
                  "content": _json(refs[Problem], "application/problem+json")}
        if code in _PROBLEM_HEADERS:
            answer["headers"] = {
                name: {"required": True, "description": text, "schema": schema}
                for name, (text, schema) in _PROBLEM_HEADERS[code].items()}
        op["responses"][str(code)] = answer
    return op


# --- what msgspec cannot see -------------------------------------------------------


def _ref(name: str) -> dict:
    return {"$ref": _REF.format(name=name)}


def _object(title: str, properties: dict, required: tuple[str, ...]) -> dict:
    return {"title": title, "type": "object", "properties": properties,
            "required": list(required), "additionalProperties": False}


def _integers(node: object) -> None:
    """A number that is a multiple of 1 (herdwick/model.py WholeNumber) is an integer."""
    if isinstance(node, dict):
        if node.get("type") == "number" and node.get("multipleOf") == 1:
            node["type"] = "integer"
            del node["multipleOf"]
        for value in node.values():
            _integers(value)
    elif isinstance(node, list):
        for value in node:
            _integers(value)


def _given(schema: dict) -> dict:
    """A field's schema without msgspec's `| None`: a shape names a field or leaves it out."""
    if "anyOf" not in schema:
        return schema
    [kept] = [s for s in schema["anyOf"] if s != {"type": "null"}]
    return {**kept, **{k: v for k, v in schema.items() if k not in ("anyOf", "default")}}


def _any_case(word: str) -> str:
    return "".join(f"[{c.upper()}{c.lower()}]" if c.isalpha() else c for c in word)


# Each cron field: the values it takes (digits, leading zeros allowed, or names) and the
# steps (1 to the field's span), as herdwick/schedule.py parses them.
_CRON_FIELDS = (
    ("0*[1-5]?[0-9]", "0*(?:[1-9]|[1-5][0-9]|60)"),
    ("0*(?:1?[0-9]|2[0-3])", "0*(?:[1-9]|1[0-9]|2[0-4])"),
    ("0*(?:[1-9]|[12][0-9]|3[01])", "0*(?:[1-9]|[12][0-9]|3[01])"),
    ("0*(?:[1-9]|1[0-2])|" + "|".join(_any_case(m) for m in (
        "JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC")),
     "0*(?:[1-9]|1[0-2])"),
    ("0*[0-7]|" + "|".join(_any_case(d) for d in ("SUN", "MON", "TUE", "WED", "THU", "FRI",
                                                   "SAT")),
     "0*[1-7]"),
)
_CRON_MACROS = ("yearly", "annually", "monthly", "weekly", "daily", "midnight", "hourly")


def _cron_field(values: str, steps: str) -> str:
    value = f"(?:{values})"
    item = rf"(?:\*|H(?:\({value}-{value}\))?|{value}(?:-{value})?)(?:/(?:{steps}))?"
    return f"{item}(?:,{item})*"


def cron_pattern() -> str:
    """Five fields, each in its range, or a macro: the syntax herdwick/schedule.py parses."""
    fields = "[ \t]+".join(_cron_field(values, steps) for values, steps in _CRON_FIELDS)
    macros = "@(?:" + "|".join(_any_case(m) for m in _CRON_MACROS) + ")"
    return f"^[ \t]*(?:{fields}|{macros})[ \t]*$"


@cache
def zone_names() -> tuple[str, ...]:
    """The zones a job may name on this host: those zoneinfo lists that validate_zone takes.

    The same two sources ZoneInfo reads (the system's zone files and the tzdata
    package), so the list is exact for the server that publishes it.
    """
    accepted = []
    for name in sorted(zoneinfo.available_timezones() | {"UTC"}):
        try:
            sched.validate_zone(name)
        except sched.ScheduleError:
            continue  # localtime, Factory: loadable, but not a zone a job may name
        accepted.append(name)
    return tuple(accepted)


_NO_NUL = "^[^\\u0000]*$"
_SCHEDULE_NAMES = {"runAt": "RunAtSchedule", "delaySeconds": "DelaySchedule",
                   "cron": "CronSchedule"}


def _schedules(components: dict) -> None:
    fields = {name: _given(schema)
              for name, schema in components["Schedule"]["properties"].items()}
    fields["runAt"]["description"] = (
        "RFC 3339 with an offset, from 1970-01-01T00:00:00Z to ten years from now; a time in "
        "the past runs at once. A leap second (:60) is refused.")
    fields["cron"].update(pattern=cron_pattern(), description=(
        "Five fields (minute hour day-of-month month day-of-week: numbers, names JAN-DEC "
        "and SUN-SAT in any case, ranges, lists, steps, Jenkins' H) or a macro (@yearly "
        "@annually @monthly @weekly @daily @midnight @hourly). The pattern checks the syntax "
        "and each field's range; the server still parses the expression, and refuses a range "
        "that runs backwards (30-10) or one that never fires (0 0 30 2 *)."))
    fields["tz"] = {**_ref("ZoneName"), "description": "the wall clock cron runs on; UTC if "
                                                        "absent"}
    components["ZoneName"] = {"title": "ZoneName",
                              "description": "an IANA time zone this server knows",
                              "enum": list(zone_names())}
    for kind, optional in SCHEDULE_SHAPES.items():
        name = _SCHEDULE_NAMES[kind]
        components[name] = _object(name, {f: fields[f] for f in (kind, *optional)}, (kind,))
    components["Schedule"] = {
        "title": "Schedule", "description": "When a job runs: exactly one of runAt, "
        "delaySeconds or cron; jitterSeconds applies to every kind, tz, overlap and misfire "
        "only to cron.",
        "oneOf": [_ref(_SCHEDULE_NAMES[kind]) for kind in SCHEDULE_SHAPES]}


def _targets(components: dict) -> None:
    ref = components["Target"]["properties"]["ref"]
    components["QueueTarget"] = _object("QueueTarget", {
        "type": {"const": "queue"},
        "ref": {"type": "string", "pattern": f"^{POOL_PATTERN}$", "not": {"const": HTTP_POOL},
                "description": f"the worker pool; '{HTTP_POOL}' is reserved for http targets"},
    }, ("type", "ref"))
    components["HttpTarget"] = _object("HttpTarget", {
        "type": {"const": "http"},
        "ref": {**ref, "pattern": HTTP_REF_PATTERN, "description": (
            "an http(s) URL with a host, no spaces or control characters and a port up to "
            "65535, to which herdwick POSTs the payload, signed (Herdwick-Signature). A host "
            "that is, or resolves to, an address that is not globally routable (private, "
            "loopback, link-local, shared, multicast, unspecified, reserved; localhost too; "
            "IPv4 in any spelling, IPv6 forms carrying one) or a cloud metadata address is "
            "refused unless HERDWICK_HTTP_ALLOW lists it: at submit, and again at delivery")},
    }, ("type", "ref"))
    components["Target"] = {
        "title": "Target", "description": "Where a job's executions go.",
        "oneOf": [_ref("QueueTarget"), _ref("HttpTarget")],
        "discriminator": {"propertyName": "type", "mapping": {
            "queue": _REF.format(name="QueueTarget"), "http": _REF.format(name="HttpTarget")}}}


def _payload(components: dict) -> None:
    # Type-specific keywords apply only to their type: strings (and keys) hold no NUL,
    # arrays and objects hold payloads. Postgres' jsonb cannot store U+0000.
    components["Payload"] = {
        "title": "Payload",
        "description": f"Any JSON, up to {MAX_PAYLOAD_BYTES} bytes as sent; no string in it, "
                       "keys included, may hold U+0000. Delivered as it was sent.",
        "pattern": _NO_NUL, "items": _ref("Payload"), "propertyNames": {"pattern": _NO_NUL},
        "additionalProperties": _ref("Payload")}
    components["JobSpec"]["properties"]["payload"] = {**_ref("Payload"), "default": None}
    components["JobPatch"]["properties"]["payload"] = {
        **_ref("Payload"), "description": "merged into the payload (RFC 7396): an object "
                                          "member by member, anything else replaces it"}


def _labels(components: dict) -> None:
    labels = {
        "type": "object", "maxProperties": MAX_LABELS, "default": {},
        "propertyNames": {"pattern": f"^{LABEL_KEY_PATTERN}$"},
        "additionalProperties": {"type": "string", "maxLength": MAX_LABEL_VALUE_LEN,
                                 "pattern": NAME_PATTERN},
        "description": f"Up to {MAX_LABELS} string pairs to find the job by "
                       "(GET /v1/jobs?label=key:value)"}
    for name in ("JobSpec", "Job"):
        components[name]["properties"]["labels"] = labels
    # A patch's labels merge: a null value removes that label.
    components["JobPatch"]["properties"]["labels"] = {
        "anyOf": [{**{k: v for k, v in labels.items() if k != "default"},
                   "additionalProperties": {"anyOf": [labels["additionalProperties"],
                                                      {"type": "null"}]}},
                  {"type": "null"}],
        "description": "merged into the labels: a null value removes that label; null "
                       "removes them all"}


def _exact(components: dict) -> None:
    """Tighten msgspec's schemas to what the server checks in code."""
    _integers(components)
    _schedules(components)
    _targets(components)
    _payload(components)
    _labels(components)
    components["JobBatch"]["properties"]["jobs"]["description"] = (
        f"1 to {MAX_BATCH_JOBS} jobs, inserted in one transaction: all or none")


def document() -> dict:
    models = _models()
    schemas, components = msgspec.json.schema_components(models, ref_template=_REF)
    refs = dict(zip(models, schemas, strict=True))
    _exact(components)
    paths: dict[str, dict] = {}
    for route in ROUTES:
        paths.setdefault(route.path, {})[route.method.lower()] = _operation(route, refs)
    paths["/openapi.json"] = {"get": {
        "summary": "This document", "operationId": "openapi",
        "responses": {"200": {"description": "OK", "content": _json({"type": "object"})}}}}
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
