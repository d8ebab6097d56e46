"""/ui: the dashboard, server-rendered HTML over the same storage and actions as /v1.

A sub-application mounted at /ui (gateway/app.py), so its routes stay out of
ROUTES and /openapi.json, and its errors are pages, not problem+json: its own
middleware renders any error (a bad cursor, an unknown job, another tenant's
job, a refused transition) as an HTML page with the status the API would give.
Every button calls the function the /v1 handler calls (gateway/jobs.py pause,
resume, cancel; gateway/executions.py trigger, retry), notifications included.
Everything a page loads is served from here (gateway/ui/static); the pages carry
a Content-Security-Policy that holds them to it.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path

import msgspec
from aiohttp import web
from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape

from herdwick import logs
from herdwick import schedule as sched
from herdwick.errors import NotFound
from herdwick.gateway import executions as execution_actions
from herdwick.gateway import jobs as job_actions
from herdwick.gateway import params, ui_session
from herdwick.gateway.body import within_read_timeout
from herdwick.gateway.context import CTX, Ctx
from herdwick.gateway.problems import HttpProblem, bad_field, from_domain
from herdwick.gateway.sparkline import sparkline
from herdwick.gateway.ui_session import CSRF_FIELD, UI_PATH, Viewer
from herdwick.model import JOB_STATES, Job, Schedule, ScheduleOut
from herdwick.storage import dashboard, history
from herdwick.storage import jobs as job_store
from herdwick.storage.db import Database

log = logs.get("herdwick.gateway")

ASSETS = Path(__file__).with_name("ui")
SPAN = timedelta(hours=1)  # the overview's window
HISTORY_PAGE = 20  # executions a job's page shows, each with every attempt
NEXT_FIRES = 5
MAX_NAME_FILTER = 200  # a job name's own limit
FORM_MAX_BYTES = 4096
JOB_ACTIONS = ("pause", "resume", "trigger", "cancel")
_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'self'; img-src 'self'; "
                               "form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}


def _when(value: datetime | None) -> str:
    return "–" if value is None else sched.format_utc(value)


def seconds_text(value: float | None) -> str:
    if value is None:
        return "–"
    if abs(value) < 1:
        return f"{value * 1000:.0f} ms"
    return f"{value:.2f} s" if abs(value) < 100 else f"{value:.0f} s"


def percent_text(value: float | None) -> str:
    return "–" if value is None else f"{value * 100:.1f}%"


def _schedule(s: ScheduleOut) -> str:
    if s.cron is not msgspec.UNSET:
        text = f"cron {s.cron} ({s.tz}), misfire {s.misfire}, overlap {s.overlap}"
    elif s.run_at is not msgspec.UNSET:
        text = f"once at {sched.format_utc(s.run_at)}"
    else:
        text = f"once, {s.delay_seconds:g} s after submit"
    return text + (f", jitter {s.jitter_seconds} s" if s.jitter_seconds else "")


def _raw(value: msgspec.Raw | None) -> str:
    return "" if value is None else bytes(value).decode(errors="replace")


_env = Environment(loader=FileSystemLoader(ASSETS / "templates"),
                   autoescape=select_autoescape(["html"]), undefined=StrictUndefined,
                   trim_blocks=True, lstrip_blocks=True)
_env.filters.update(when=_when, seconds=seconds_text, percent=percent_text, raw=_raw,
                    schedule=_schedule)
_env.globals.update(sparkline=sparkline, csrf_field=CSRF_FIELD, ui=UI_PATH)


def page(template: str, status: int = 200, **values: object) -> web.Response:
    return web.Response(status=status, text=_env.get_template(template).render(**values),
                        content_type="text/html")


def see_other(location: str) -> web.Response:
    return web.Response(status=303, headers={"Location": location})


class UiError(Exception):
    """A page-level refusal: rendered by the middleware as an error page."""

    def __init__(self, status: int, title: str, detail: str) -> None:
        super().__init__(detail)
        self.status, self.title, self.detail = status, title, detail


def _error_page(request: web.Request, status: int, title: str, detail: str) -> web.Response:
    viewer = request.get(VIEWER)
    return page("error.html", status, viewer=viewer, tenant=None, title=title, detail=detail)


@web.middleware
async def ui_middleware(request: web.Request, handler) -> web.StreamResponse:
    try:
        response = await handler(request)
    except UiError as exc:
        response = _error_page(request, exc.status, exc.title, exc.detail)
    except HttpProblem as exc:
        p = exc.problem
        response = exc.response(_error_page(request, p.status, p.title, p.detail))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        response = _error_page(request, exc.status, exc.reason, exc.text or exc.reason)
    except Exception as exc:
        mapped = from_domain(exc)
        if mapped is None:
            log.exception("ui_crashed", path=request.path)
            response = _error_page(request, 500, "Internal error",
                                   "an unexpected error; it has been logged")
        else:
            if mapped.problem.status >= 500:
                log.warning("ui_failed", status=mapped.problem.status, path=request.path,
                            error=exc)
            response = _error_page(request, mapped.problem.status, mapped.problem.title,
                                   mapped.problem.detail)
            response.headers.update(mapped.headers)
    response.headers.update(_HEADERS)
    if not request.path.startswith(f"{UI_PATH}/static/"):
        response.headers["Cache-Control"] = "no-store"  # pages show live, private data
    return response


# --- who, and which tenant ------------------------------------------------------------


VIEWER = web.RequestKey("herdwick_ui_viewer", Viewer)  # set by _viewer, read by error pages


def _ctx(request: web.Request) -> Ctx:
    return request.config_dict[CTX]


async def _viewer(request: web.Request) -> Viewer:
    """The logged-in viewer; a GET without one is sent to the login page."""
    found = await ui_session.viewer(request, _ctx(request))
    if found is None:
        if request.method == "GET":
            raise web.HTTPSeeOther(f"{UI_PATH}/login")
        raise UiError(401, "Not logged in", "log in at /ui/login first")
    request[VIEWER] = found
    return found


async def _tenant(request: web.Request, viewer: Viewer) -> dashboard.TenantName:
    """The path's tenant; 404 for one that does not exist or that the viewer may not see,
    as the API answers a tenant key asking for another tenant's things."""
    tenant_id = params.path_uuid(request, "tenantId", "tenant")
    found = await dashboard.tenants(_ctx(request).db, tenant_id) if viewer.may_see(
        tenant_id) else []
    if not found:
        raise NotFound(f"tenant {tenant_id} does not exist")
    return found[0]


async def _posted(request: web.Request) -> dict[str, str]:
    """A form's string fields, at most FORM_MAX_BYTES of them, read under the body deadline.

    A request is made by the root app, with its client_max_size (the batch cap): this
    sub-application's own does not bound post(), so the read takes the form's cap here.
    """
    if request.content_length is not None and request.content_length > FORM_MAX_BYTES:
        raise UiError(413, "Form too large", "this form is larger than any of ours")
    form = await within_read_timeout(request.clone(client_max_size=FORM_MAX_BYTES).post())
    return {k: v for k, v in form.items() if isinstance(v, str)}


async def _form(request: web.Request, viewer: Viewer) -> dict[str, str]:
    """A state-changing form's fields, once its CSRF token is checked (403 without)."""
    fields = await _posted(request)
    if not ui_session.csrf_matches(viewer.csrf, fields.get(CSRF_FIELD)):
        raise UiError(403, "Refused", "the form's CSRF token is missing or wrong; "
                      "reload the page and try again")
    return fields


# --- login ------------------------------------------------------------------------------


async def login_form(request: web.Request) -> web.Response:
    if await ui_session.viewer(request, _ctx(request)) is not None:
        return see_other(f"{UI_PATH}/")
    token, fresh = ui_session.login_csrf(request)
    response = page("login.html", viewer=None, tenant=None, error=None, token_csrf=token)
    if fresh:
        ui_session.remember_login_csrf(response, request, token)
    return response


async def login(request: web.Request) -> web.Response:
    fields = await _posted(request)
    expected = request.cookies.get(ui_session.LOGIN_COOKIE, "")
    if not expected or not ui_session.csrf_matches(expected, fields.get(CSRF_FIELD)):
        raise UiError(403, "Refused", "the login form's CSRF token is missing or wrong; "
                      "open /ui/login and try again")
    token = fields.get("token")
    found = await ui_session.viewer_of_token(_ctx(request), token.strip()) \
        if isinstance(token, str) else None
    if found is None:
        return page("login.html", 401, viewer=None, tenant=None, token_csrf=expected,
                    error="That is neither a tenant's API key nor the admin token.")
    response = see_other(f"{UI_PATH}/")
    ui_session.start(response, request, token.strip())
    return response


async def logout(request: web.Request) -> web.Response:
    viewer = await _viewer(request)
    await _form(request, viewer)
    response = see_other(f"{UI_PATH}/login")
    ui_session.end(response)
    return response


async def root(request: web.Request) -> web.Response:
    return see_other(f"{UI_PATH}/")


# --- pages ------------------------------------------------------------------------------


async def overview(request: web.Request) -> web.Response:
    viewer = await _viewer(request)
    ctx = _ctx(request)
    now = ctx.clock.now()
    # Whole minutes, the current one last: 60 points a chart.
    since = now.replace(second=0, microsecond=0) - SPAN + timedelta(minutes=1)
    tenants = await dashboard.tenants(ctx.db, viewer.tenant_id)
    spans = await dashboard.recent(ctx.db, since, now, viewer.tenant_id)
    empty = dashboard.TenantSpan(total=dashboard.Figures(),
                                 minutes=[dashboard.Figures()] * dashboard.minutes_between(
                                     since, now),
                                 depth=[0] * dashboard.minutes_between(since, now))
    rows = [(t, spans.get(t.tenant_id, empty)) for t in tenants]
    return page("overview.html", viewer=viewer, tenant=None, rows=rows, since=since, until=now,
                capped=viewer.is_admin and len(tenants) >= dashboard.TENANTS_MAX)


async def job_list(request: web.Request) -> web.Response:
    viewer = await _viewer(request)
    tenant = await _tenant(request, viewer)
    state = request.query.get("state") or None
    if state is not None and state not in JOB_STATES:
        raise bad_field("state", f"one of {', '.join(JOB_STATES)}")
    name = request.query.get("name", "").strip() or None
    if name is not None and len(name) > MAX_NAME_FILTER:
        raise bad_field("name", f"at most {MAX_NAME_FILTER} characters")
    after, limit = params.cursor(request, job_store.decode_cursor), params.limit(request)
    items, cursor = await _ctx(request).read(tenant.tenant_id, lambda db: job_store.list_jobs(
        db, tenant.tenant_id, state=state, name_contains=name, after=after, limit=limit))
    return page("jobs.html", viewer=viewer, tenant=tenant, jobs=items, next_cursor=cursor,
                state=state or "", name=name or "", states=JOB_STATES)


def _upcoming(job: Job, now: datetime) -> tuple[list[datetime], str | None]:
    """A cron job's next fire times after now, or why there are none to show."""
    if job.state not in ("active", "paused"):
        return [], f"none: the job is {job.state}"
    if job.schedule.cron is msgspec.UNSET:
        return ([job.next_run_at] if job.next_run_at else []), None
    schedule = msgspec.convert(msgspec.to_builtins(job.schedule), Schedule)
    try:
        return sched.next_fire_times(schedule, now, NEXT_FIRES, job_id=job.job_id), None
    except sched.ScheduleError as exc:
        return [], f"its schedule does not evaluate: {exc}"


async def job_page(request: web.Request) -> web.Response:
    viewer = await _viewer(request)
    tenant = await _tenant(request, viewer)
    ctx = _ctx(request)
    job_id = job_actions.job_id_of(request)

    async def reads(db: Database):  # all on one server, as the API's reads are
        job = await job_store.get_job(db, tenant.tenant_id, job_id)
        summaries, cursor = await history.job_executions(
            db, tenant.tenant_id, job.job_id, params.cursor(request, history.decode_cursor),
            HISTORY_PAGE)
        # Each through the API's own read (GET /v1/executions/{id}), so the page shows what
        # the API does, every attempt included: a page's worth of small indexed reads.
        runs = [await history.get_execution(db, tenant.tenant_id, s.execution_id)
                for s in summaries]
        return job, runs, cursor

    job, runs, cursor = await ctx.read(tenant.tenant_id, reads)
    fires, no_fires = _upcoming(job, ctx.clock.now())
    return page("job.html", viewer=viewer, tenant=tenant, job=job, runs=runs,
                next_cursor=cursor, fires=fires, no_fires=no_fires,
                schedule=msgspec.json.encode(job.schedule).decode(),
                payload=bytes(job.payload).decode(errors="replace"),
                did=request.query.get("did", ""))


async def execution_page(request: web.Request) -> web.Response:
    viewer = await _viewer(request)
    tenant = await _tenant(request, viewer)
    execution_id = params.path_uuid(request, "executionId", "execution")
    run = await _ctx(request).read(
        tenant.tenant_id, lambda db: history.get_execution(db, tenant.tenant_id, execution_id))
    return page("execution.html", viewer=viewer, tenant=tenant, run=run,
                did=request.query.get("did", ""))


async def dead_letter_list(request: web.Request) -> web.Response:
    viewer = await _viewer(request)
    tenant = await _tenant(request, viewer)
    after, limit = params.cursor(request, job_store.decode_cursor), params.limit(request)
    items, cursor = await _ctx(request).read(
        tenant.tenant_id, lambda db: history.dead_letters(db, tenant.tenant_id, after, limit))
    return page("dead_letters.html", viewer=viewer, tenant=tenant, items=items,
                next_cursor=cursor, did=request.query.get("did", ""))


# --- buttons ----------------------------------------------------------------------------


async def job_action(request: web.Request) -> web.Response:
    viewer = await _viewer(request)
    tenant = await _tenant(request, viewer)
    await _form(request, viewer)
    ctx = _ctx(request)
    job_id = job_actions.job_id_of(request)
    action = request.match_info["action"]
    here = f"{UI_PATH}/tenants/{tenant.tenant_id}/jobs/{job_id}"
    match action:
        case "pause":
            await job_actions.pause(ctx, tenant.tenant_id, job_id)
        case "resume":
            await job_actions.resume(ctx, tenant.tenant_id, job_id)
        case "cancel":
            await job_actions.cancel(ctx, tenant.tenant_id, job_id)
        case "trigger":
            execution_id = await execution_actions.trigger(ctx, tenant.tenant_id, job_id)
            return see_other(f"{UI_PATH}/tenants/{tenant.tenant_id}/executions/{execution_id}"
                             "?did=trigger")
        case _:
            raise UiError(404, "Not found", f"a job has no {action!r} button")
    return see_other(f"{here}?did={action}")


async def retry_action(request: web.Request) -> web.Response:
    viewer = await _viewer(request)
    tenant = await _tenant(request, viewer)
    await _form(request, viewer)
    execution_id = params.path_uuid(request, "executionId", "execution")
    await execution_actions.retry(_ctx(request), tenant.tenant_id, execution_id)
    return see_other(f"{UI_PATH}/tenants/{tenant.tenant_id}/executions/{execution_id}?did=retry")


_ID = "{%s:[0-9A-Za-z-]+}"


def create_ui() -> web.Application:
    """The /ui sub-application; mount it with app.add_subapp(UI_PATH, create_ui())."""
    ui = web.Application(middlewares=[ui_middleware], client_max_size=FORM_MAX_BYTES)
    tenant = "/tenants/" + _ID % "tenantId"
    ui.router.add_get("", root)
    ui.router.add_get("/", overview)
    ui.router.add_get("/login", login_form)
    ui.router.add_post("/login", login)
    ui.router.add_post("/logout", logout)
    ui.router.add_get(tenant + "/jobs", job_list)
    ui.router.add_get(tenant + "/jobs/" + _ID % "jobId", job_page)
    ui.router.add_post(tenant + "/jobs/" + _ID % "jobId" + "/{action:[a-z]+}", job_action)
    ui.router.add_get(tenant + "/executions/" + _ID % "executionId", execution_page)
    ui.router.add_post(tenant + "/executions/" + _ID % "executionId" + "/retry", retry_action)
    ui.router.add_get(tenant + "/dead-letters", dead_letter_list)
    ui.router.add_static("/static", ASSETS / "static")
    return ui
