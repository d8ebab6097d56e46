"""The `herdwick` command (CONTRACT.md "CLI").

This is the composition root: it alone imports from every tier (lazily,
inside each command), so the library packages keep their one-way imports.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import signal
import sys
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from typing import Any

from herdwick import logs
from herdwick.config import ENV, ConfigError, Settings, from_env

NOT_YET: dict[str, str] = {}
DURABILITIES = ("async", "sync")  # herdwick.model.Durability

# What each setting means, for --help.
_SETTING_HELP = {
    "database_url": "Postgres DSN",
    "read_database_url": "read replicas for history reads: postgresql:// URLs, comma-"
                         "separated, one server each (unset: every read on the primary)",
    "read_max_lag_s": "a replica further behind than this many seconds serves no read "
                      "(default 5)",
    "redis_url": "Redis URL (redis://, rediss:// or unix://)",
    "key_prefix": "prefix of every Redis key (default hw)",
    "admin_token": "bearer token of the admin API (16+ characters; unset: admin API off)",
    "http_allow": "comma-separated CIDRs an http target may resolve to besides public ones",
    "api_host": "address the gateway binds (default 127.0.0.1)",
    "api_port": "port the gateway binds (default 8080)",
    "dispatch_order": "fair (weighted fair queuing across tenants, the default) or fifo "
                      "(by due time alone, for comparison)",
    "ready_max": "most undelivered entries a pool's ready stream holds: auto (from the "
                 "workers' lease rate), a number, or pool=number pairs, comma-separated",
    "herd_warn_jobs": "a submit warns when this many of a tenant's jobs fall due in one "
                      "second (default 1000)",
    "retention_days": "executions older than this many days leave, by whole days, once "
                      "archived (default 30)",
    "archive_url": "where they are archived: a directory, file:// or s3://bucket/prefix "
                   "(default ./archive)",
    "db_pool_max": "most Postgres connections this process opens (default: api 20, "
                   "scheduler 16; at least 4)",
    "archive_s3_endpoint": "an S3-compatible server's URL for s3:// archives (default: AWS, "
                           "or $AWS_ENDPOINT_URL)",
}
# The settings each command reads; a command shows only these flags.
_SERVICE = ("database_url", "redis_url", "key_prefix", "db_pool_max")
_ARCHIVE = ("retention_days", "archive_url", "archive_s3_endpoint")
_USES = {
    "dev": tuple(ENV),
    "migrate": ("database_url",),
    "api": (*_SERVICE, "admin_token", "http_allow", "api_host", "api_port", "herd_warn_jobs",
            "read_database_url", "read_max_lag_s"),
    "scheduler": (*_SERVICE, "dispatch_order", "ready_max", *_ARCHIVE),
    "retention": ("database_url", *_ARCHIVE),
    "http-worker": ("redis_url", "key_prefix", "http_allow"),
    "tenant create": ("database_url",),
    "tenant update": ("database_url",),
    "tenant rotate-secret": ("database_url", "redis_url", "key_prefix"),
    "worker": ("redis_url", "key_prefix"),
}


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _port(text: str) -> int:
    value = _positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"not a TCP port: {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be above 0, not {text}")
    return value


def _config_flags(command: str) -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("configuration (each flag overrides its variable)")
    for field in _USES[command]:
        group.add_argument("--" + field.replace("_", "-"), dest=field, default=None,
                           metavar="VALUE", help=f"{_SETTING_HELP[field]}; ${ENV[field]}")
    return parent


def _log_flags() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("logging")
    group.add_argument("--log-level", choices=logs.LEVELS, default=None,
                       help=f"default ${logs.LEVEL_ENV}, else {logs.DEFAULT_LEVEL}")
    group.add_argument("--log-format", choices=logs.FORMATS, default=None,
                       help=f"text, or json: one object a line; default ${logs.FORMAT_ENV}, "
                            f"else {logs.DEFAULT_FORMAT}")
    return parent


def _parser(loadtest_flags: bool = False) -> argparse.ArgumentParser:
    """Every command; the loadtest actions' flags (heavy imports) only when asked for."""
    logging_ = _log_flags()

    def command(sub, name: str, help: str, config: str | None = None, **kw):
        parents = [logging_] + ([_config_flags(config)] if config else [])
        return sub.add_parser(name, parents=parents, help=help, description=help, **kw)

    parser = argparse.ArgumentParser(prog="herdwick",
                                     description="A distributed, multi-tenant job scheduler.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    command(sub, "dev", "api + scheduler + http worker in one process; embedded Postgres and "
                        "Redis unless URLs are set (one per data directory)", "dev")
    command(sub, "migrate", "apply the database migrations (idempotent)", "migrate")
    api = command(sub, "api", "the tenants' HTTP gateway", "api")
    api.add_argument("--reuse-port", action="store_true",
                     help="share the port with other herdwick api processes on this host "
                          "(SO_REUSEPORT); off by default, so a busy port is an error")
    sched = command(sub, "scheduler", "shard coordinator, shard actors, dispatch, pool queues, "
                                      "execution events, reaper and sweeper", "scheduler")
    http = command(sub, "http-worker", "the built-in http pool: delivers http jobs as signed "
                                       "POSTs until SIGINT/SIGTERM", "http-worker")
    http.add_argument("--concurrency", type=_positive_int, default=512,
                      help="deliveries in flight at once (default 512)")
    http.add_argument("--target-concurrency", type=_positive_int, default=128,
                      help="most deliveries in flight to one scheme://host:port (default 128)")
    http.add_argument("--breaker-failures", type=_positive_int, default=5,
                      help="failures within a window that open a target's circuit, when at "
                           "least as many as its successes (default 5)")
    http.add_argument("--breaker-window", type=_positive_float, default=30.0, metavar="SECONDS",
                      help="the window those failures are counted over (default 30)")
    http.add_argument("--breaker-cooldown", type=_positive_float, default=10.0,
                      metavar="SECONDS", help="how long a circuit stays open before one probe "
                                              "(doubled per failed probe, up to 300; default 10)")
    http.add_argument("--lease", type=_positive_float, default=30.0, metavar="SECONDS",
                      help="each delivery's lease, renewed while it runs: how soon another "
                           "http-worker retries the deliveries of one that died (default 30)")
    worker = command(sub, "worker", "run a herdwick.Worker from user code until SIGINT/SIGTERM "
                                    "(in-flight work drains first)", "worker")
    worker.add_argument("target", metavar="MODULE:ATTR",
                        help="where the Worker is, e.g. app:worker (imported from the "
                             "current directory)")
    for served in (api, sched, http, worker):
        served.add_argument("--metrics-port", type=_port, default=None, metavar="PORT",
                            help="serve Prometheus metrics at http://HOST:PORT/metrics "
                                 "(unauthenticated; off by default)")
        served.add_argument("--metrics-host", default="0.0.0.0", metavar="HOST",
                            help="the address --metrics-port listens on (default 0.0.0.0)")
    tenant = sub.add_parser("tenant", help="manage tenants", description="manage tenants")
    tenant_sub = tenant.add_subparsers(dest="tenant_command", required=True, metavar="ACTION")
    create = command(tenant_sub, "create", "create a tenant; prints its id, API key and "
                                           "signing secret", "tenant create")
    create.add_argument("name", help="a label (names need not be unique)")
    create.add_argument("--weight", type=int, default=1,
                        help="its share of each pool's dispatch under contention; default 1")
    create.add_argument("--rate", type=float, default=None, metavar="PER_S",
                        help="most dispatches a second; default unlimited")
    create.add_argument("--burst", type=float, default=None, metavar="TOKENS",
                        help="dispatches the rate quota lets through at once; default one "
                             "second of --rate")
    create.add_argument("--max-active-jobs", type=int, default=None, metavar="N",
                        help="most active or paused jobs at once; default unlimited")
    create.add_argument("--durability", choices=DURABILITIES, default="async",
                        help="sync: its submits and dispatches wait for the synchronous "
                             "standbys to apply them (remote_apply); default async")
    update = command(tenant_sub, "update", "change a tenant's share and limits; every "
                                           "scheduler applies them within seconds",
                     "tenant update")
    update.add_argument("tenant_id", metavar="TENANT_ID", help="the id tenant create printed")
    update.add_argument("--weight", type=int, default=None, help="its share under contention")
    update.add_argument("--rate", default=None, metavar="PER_S|none",
                        help="most dispatches a second, or none to lift the quota")
    update.add_argument("--burst", default=None, metavar="TOKENS|none",
                        help="the quota's burst, or none for one second of the rate")
    update.add_argument("--max-active-jobs", default=None, metavar="N|none",
                        help="most active or paused jobs, or none to lift the limit")
    update.add_argument("--durability", choices=DURABILITIES, default=None,
                        help="sync: its submits and dispatches wait for the synchronous "
                             "standbys to apply them; async: the server's setting")
    rotate = command(tenant_sub, "rotate-secret", "give a tenant a new signing secret; the "
                                                  "old one signs too until the overlap ends",
                     "tenant rotate-secret")
    rotate.add_argument("tenant_id", metavar="TENANT_ID", help="the id tenant create printed")
    rotate.add_argument("--overlap", type=int, default=None, metavar="SECONDS",
                        help="how long the old secret goes on signing beside the new one, "
                             "0 to 604800; default 86400 (a day), 0 stops it at once")
    retention = command(sub, "retention", "archive, then drop, the days of executions older "
                                          "than the retention now (each scheduler tries every "
                                          "15 minutes)", "retention")
    mode = retention.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true",
                      help="print what a pass would archive and drop, and change nothing")
    mode.add_argument("--read", metavar="DAY", default=None,
                      help="print the archived executions of DAY (YYYY-MM-DD), one JSON object "
                           "a line, each archive checked against its manifest")
    _crontab_parser(sub, command)
    cron = command(sub, "cron", "print the next fire times of a cron expression: the function "
                                "the scheduler uses")
    cron.add_argument("expr", help="five fields, or a macro such as @daily")
    cron.add_argument("--tz", default="UTC", help="IANA zone (default UTC)")
    cron.add_argument("--after", default=None, help="RFC 3339 instant (default now)")
    cron.add_argument("--count", type=int, default=5, help="how many (default 5)")
    cron.add_argument("--jitter", type=int, default=0, metavar="S",
                      help="the job's jitterSeconds (default 0)")
    cron.add_argument("--job-id", default=None, help="the job id that seeds jitter and H")
    _loadtest_parser(sub, logging_, loadtest_flags)
    return parser


def _crontab_parser(sub: argparse._SubParsersAction, command) -> None:
    crontab = sub.add_parser("crontab", help="move a crontab onto herdwick: import its lines "
                                             "as jobs, compare fire times",
                             description="move a crontab onto herdwick (docs/crontab.md)")
    crontab_sub = crontab.add_subparsers(dest="crontab_command", required=True,
                                         metavar="ACTION")
    imp = command(crontab_sub, "import", "create a job for each line of a crontab "
                                         "(idempotent); report the lines it cannot carry over")
    imp.add_argument("--target", required=True, metavar="QUEUE|URL",
                     help="where the jobs go: a worker pool's name, or an http(s) URL")
    imp.add_argument("--dry-run", action="store_true",
                     help="create them as dry runs: fire times recorded, nothing run")
    cmp = command(crontab_sub, "compare", "compare the fire times a crontab's jobs recorded "
                                          "with the crontab's, and with a log of real runs")
    cmp.add_argument("--since", required=True, metavar="RFC3339",
                     help="the window's start (inclusive)")
    cmp.add_argument("--until", required=True, metavar="RFC3339",
                     help="the window's end (exclusive)")
    cmp.add_argument("--log", default=None, metavar="FILE",
                     help="the old system's runs: `<RFC 3339 time> <crontab line>` a line")
    cmp.add_argument("--shift-within", type=_positive_float, default=7200.0, metavar="SECONDS",
                     help="a run this close to an expected one is shifted, not missing and "
                          "extra (default 7200)")
    cmp.add_argument("--strict", action="store_true",
                     help="exit 1 if anything differs (default: report, exit 0)")
    for action in (imp, cmp):
        action.add_argument("file", metavar="FILE", help="the crontab")
        action.add_argument("--source", default=None, metavar="NAME",
                            help="the name its jobs are labelled with (crontab=NAME); "
                                 "default the file's name")
        action.add_argument("--system", action="store_true",
                            help="a system crontab (/etc/crontab, /etc/cron.d): each line "
                                 "names a user before its command")
        action.add_argument("--tz", default="UTC", metavar="ZONE",
                            help="the zone of lines before any CRON_TZ= or TZ= (default UTC)")
        action.add_argument("--api-url", default=None, metavar="URL",
                            help="the gateway; default $HERDWICK_API_URL, else "
                                 "http://$HERDWICK_API_HOST:$HERDWICK_API_PORT")
        action.add_argument("--api-key", default=None, metavar="KEY",
                            help="the tenant's API key (it names the tenant); default "
                                 "$HERDWICK_API_KEY")


def _loadtest_parser(sub: argparse._SubParsersAction, logging_: argparse.ArgumentParser,
                     flags: bool) -> None:
    loadtest = sub.add_parser(
        "loadtest", help="load generators against this machine (loopback only)",
        description="Load generators: each makes its own scratch database and Redis key "
                    "prefix on the servers it is given and removes them after.")
    actions = loadtest.add_subparsers(dest="loadtest_command", required=True, metavar="ACTION")
    submit = actions.add_parser(
        "submit", parents=[logging_],
        help="POST /v1/jobs and /v1/jobs:batch rates, against the raw insert",
        description="Measures single and batch submits over HTTP and the same inserts "
                    "straight through asyncpg, in a fresh database it drops afterwards.")
    herd = actions.add_parser(
        "herd", parents=[logging_],
        help="a herd of jobs due in one second, against the raw dispatch limits",
        description="Inserts a herd due in the same second (and an optional steady "
                    "background), runs `herdwick scheduler` processes and no-op stream "
                    "consumers, and reports dispatch lag, throughput, CPU and memory beside "
                    "this machine's raw limits for the same work.")
    e2e = actions.add_parser(
        "e2e", parents=[logging_],
        help="a herd or a steady rate through SDK workers to outcomes in Postgres",
        description="A herd due in one second (--jobs), a steady rate (--rate, --duration) "
                    "or both, through `herdwick scheduler` and `herdwick worker` processes "
                    "with a no-op handler; reports the time until every execution "
                    "succeeded in Postgres, due->lease lag, the events and ready streams' "
                    "backlog, and Postgres transactions and Redis commands per execution.")
    noisy = actions.add_parser(
        "noisy-neighbour", parents=[logging_],
        help="one tenant's herd beside quiet tenants, with fair queuing on or off",
        description="One noisy tenant with --jobs due in one second and --quiet-tenants "
                    "with --quiet-jobs each due in the same second, through `herdwick "
                    "scheduler` and `herdwick worker` processes whose handler sleeps "
                    "--handler-ms (the workers are the bottleneck); reports each "
                    "tenant's due->lease lag, the noisy tenant's drain rate beside its "
                    "share and quota, Jain's index over the quiet tenants, the ready "
                    "stream's length and Redis memory. --fair off for first-in "
                    "first-out dispatch.")
    http = actions.add_parser(
        "http", parents=[logging_],
        help="http jobs through `herdwick http-worker` to local receivers: callbacks/s, "
             "lag, breakers",
        description="A herd of http jobs due in one second (--jobs), a steady rate or both, "
                    "split over --targets local receivers (--down-targets of them refuse "
                    "connections), through `herdwick scheduler` and `herdwick http-worker` "
                    "processes; reports callbacks/s until every healthy job succeeded in "
                    "Postgres, due->arrival and due->lease lag, the attempts burned and "
                    "deferred on down targets, and CPU by process kind per 1,000 callbacks.")
    soak = actions.add_parser(
        "soak", parents=[logging_],
        help="steady load with a herd every minute for --minutes: is RSS flat, is p99 flat",
        description="A steady rate (--rate) with a herd (--herd) due at the top of each "
                    "minute (--herd-every), for --minutes, through `herdwick scheduler` and "
                    "`herdwick worker` processes (and `herdwick api` with --api); samples each "
                    "process's RSS and CPU, the due->lease lag and the streams every "
                    "--sample-every seconds; reports a row per minute and whether RSS and "
                    "the steady jobs' p99 stayed flat. Exit 1 if either grew, or a job was "
                    "lost or left unfinished.")
    if not flags:
        return
    from herdwick.loadtest.e2e import add_arguments as e2e_arguments
    from herdwick.loadtest.herd import add_arguments as herd_arguments
    from herdwick.loadtest.http import add_arguments as http_arguments
    from herdwick.loadtest.noisy import add_arguments as noisy_arguments
    from herdwick.loadtest.soak import add_arguments as soak_arguments
    from herdwick.loadtest.submit import add_arguments as submit_arguments

    submit_arguments(submit)
    herd_arguments(herd)
    e2e_arguments(e2e)
    noisy_arguments(noisy)
    http_arguments(http)
    soak_arguments(soak)


def _settings(args: argparse.Namespace) -> Settings:
    overrides: dict[str, Any] = {f: getattr(args, f, None) for f in ENV}
    if overrides.get("http_allow") is not None:
        overrides["http_allow"] = tuple(
            p.strip() for p in overrides["http_allow"].split(",") if p.strip())
    if overrides.get("api_port") is not None:
        try:
            overrides["api_port"] = int(overrides["api_port"])
        except ValueError:
            raise ConfigError("--api-port must be a port number") from None
    if overrides.get("retention_days") is not None:
        try:
            overrides["retention_days"] = int(overrides["retention_days"])
        except ValueError:
            raise ConfigError("--retention-days must be a whole number of days") from None
    if overrides.get("herd_warn_jobs") is not None:
        try:
            overrides["herd_warn_jobs"] = int(overrides["herd_warn_jobs"])
        except ValueError:
            raise ConfigError("--herd-warn-jobs must be a whole number of jobs") from None
    if overrides.get("db_pool_max") is not None:
        try:
            overrides["db_pool_max"] = int(overrides["db_pool_max"])
        except ValueError:
            raise ConfigError("--db-pool-max must be a whole number of connections") from None
    if overrides.get("read_max_lag_s") is not None:
        try:
            overrides["read_max_lag_s"] = float(overrides["read_max_lag_s"])
        except ValueError:
            raise ConfigError("--read-max-lag-s must be a number of seconds") from None
    return from_env(**overrides)


GC_SERVICE_THRESHOLDS = (50_000, 20, 100)
# The interpreter's own, as the command started (they differ between Python versions).
_GC_AT_START = gc.get_threshold()


def _collect_less() -> None:
    """For a long-running command: a herd allocates millions of short-lived objects, and
    at Python's default thresholds the scheduler and workers ran a full collection every
    0.3-1.5 s (50-160 ms each, finding nothing). Young cycles are still collected; what
    was loaded at start is never rescanned. Thresholds the code set itself are kept."""
    if gc.get_threshold() != _GC_AT_START:
        return
    gc.freeze()
    gc.set_threshold(*GC_SERVICE_THRESHOLDS)


def _run(main: Coroutine[Any, Any, int]) -> int:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        return asyncio.run(main)
    return uvloop.run(main)


def _stop_on_signals(stop: asyncio.Event) -> None:
    """SIGINT/SIGTERM set `stop`; SIGUSR2 logs where every task is waiting (a stuck process)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, _stopping, stop, sig)
    loop.add_signal_handler(signal.SIGUSR2, _dump_tasks)


def _stopping(stop: asyncio.Event, sig: signal.Signals) -> None:
    if not stop.is_set():
        logs.get("herdwick").info("stopping", signal=sig.name)
    stop.set()


def _dump_tasks() -> None:
    """Every task's stack to stderr: what a process that will not stop is waiting for."""
    tasks = asyncio.all_tasks()
    logs.get("herdwick").warning("tasks_dumped", tasks=len(tasks))
    for task in tasks:
        print(f"--- {task.get_name()}: {task.get_coro()!r:.200}", file=sys.stderr)
        task.print_stack(file=sys.stderr)
    sys.stderr.flush()


# --- commands -------------------------------------------------------------------------


def cmd_cron(args: argparse.Namespace) -> int:
    import uuid

    from herdwick import schedule as sched
    from herdwick.model import Schedule

    try:
        after = (datetime.fromisoformat(args.after.replace("Z", "+00:00")) if args.after
                 else datetime.now(UTC))
        if after.tzinfo is None:
            raise ValueError("--after needs a UTC offset or Z")
        job_id = uuid.UUID(args.job_id) if args.job_id else None
    except ValueError as exc:
        print(f"herdwick cron: {exc}", file=sys.stderr)
        return 2
    if not 1 <= args.count <= 10_000:
        print("herdwick cron: --count must be 1..10000", file=sys.stderr)
        return 2
    try:
        schedule = Schedule(cron=args.expr, tz=args.tz, jitter_seconds=args.jitter)
        times = sched.next_fire_times(schedule, after, args.count, job_id=job_id)
    except sched.ScheduleError as exc:
        print(f"herdwick cron: {exc.field}: {exc}", file=sys.stderr)
        return 2
    for when in times:
        print(sched.format_utc(when))
    return 0


def cmd_crontab(args: argparse.Namespace) -> int:
    import os
    from pathlib import Path

    from herdwick import crontab
    from herdwick import schedule as sched

    name = f"herdwick crontab {args.crontab_command}"
    key = args.api_key or os.environ.get("HERDWICK_API_KEY")
    if not key:
        print(f"{name}: give the tenant's API key (--api-key or HERDWICK_API_KEY)",
              file=sys.stderr)
        return 2
    url = args.api_url or os.environ.get("HERDWICK_API_URL") or (
        f"http://{os.environ.get('HERDWICK_API_HOST', '127.0.0.1')}:"
        f"{os.environ.get('HERDWICK_API_PORT', '8080')}")
    try:
        sched.validate_zone(args.tz)
        text = Path(args.file).read_text()
        log = Path(args.log).read_text() if getattr(args, "log", None) else None
        runs = crontab.parse_log(log) if log is not None else None
        window = (_instant(args.since, "--since"), _instant(args.until, "--until")) \
            if args.crontab_command == "compare" else None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    parsed = crontab.parse(text, system=args.system, tz=args.tz)
    source = args.source or Path(args.file).name
    if window is None:
        return _run(_crontab_import(url, key, parsed, source, args))
    return _run(_crontab_compare(url, key, parsed, source, window, runs, args))


def _instant(text: str, flag: str) -> datetime:
    when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    if when.tzinfo is None:
        raise ValueError(f"{flag} needs a UTC offset or Z")
    return when.astimezone(UTC)


async def _crontab_import(url: str, key: str, parsed, source: str,
                          args: argparse.Namespace) -> int:
    from herdwick.crontab_client import Gateway, import_crontab

    entries = {e.line: e for e in parsed.entries}
    async with Gateway(url, key) as gateway:
        done = await import_crontab(gateway, parsed, source=source, target=args.target,
                                    dry_run=args.dry_run)
    for item in done:
        entry = entries.get(item.line)
        what = f" {entry.cron} ({entry.tz}) {entry.command}" if entry else ""
        if item.outcome in ("created", "exists"):
            print(f"line {item.line}: {item.outcome} {item.job_id}{what}")
        else:
            print(f"line {item.line}: not carried over: {item.detail}")
    counts = {o: sum(i.outcome == o for i in done) for o in ("created", "exists", "refused",
                                                             "failed")}
    print(f"created {counts['created']}, already there {counts['exists']}, not carried over "
          f"{counts['refused'] + counts['failed']}")
    return 1 if counts["failed"] else 0


async def _crontab_compare(url: str, key: str, parsed, source: str,
                           window: tuple[datetime, datetime], runs, args) -> int:
    from herdwick import crontab
    from herdwick.crontab_client import Gateway, recorded_fires

    since, until = window
    async with Gateway(url, key) as gateway:
        recorded = await recorded_fires(gateway, parsed, source=source, since=since,
                                        until=until)
    differs = False
    for refused in parsed.refused:
        print(f"line {refused.line}: not carried over: {refused.reason}")
    for entry in parsed.entries:
        job_id, fires = recorded[entry.line]
        title = f"line {entry.line} ({entry.cron}, {entry.tz})"
        if job_id is None:
            print(f"{title}: no job (not imported from this source)")
            differs = True
            continue
        references = [("crontab", crontab.expected_fires(entry, since, until))]
        if runs is not None:
            references.append(("log", [t for t in runs.get(entry.line, [])
                                       if since <= t < until]))
        for name, times in references:
            diff = crontab.compare(times, fires, args.shift_within)
            differs |= not diff.same
            for line in crontab.report(title, name, diff):
                print(line)
    return 1 if differs and args.strict else 0


async def _migrate(settings: Settings) -> int:
    from herdwick.storage import migrate

    applied = await migrate.apply(settings.database_url)
    for m in applied:
        print(f"applied {m.version:04d}_{m.name}")
    print(f"schema at version {migrate.latest_version()}")
    return 0


async def _tenant_create(settings: Settings, args: argparse.Namespace) -> int:
    import msgspec

    from herdwick.clock import SystemClock
    from herdwick.model import TenantSpec
    from herdwick.storage.db import Database
    from herdwick.storage.tenants import create_tenant

    try:
        spec = msgspec.convert({"name": args.name, "weight": args.weight,
                                "dispatchRate": args.rate, "burst": args.burst,
                                "maxActiveJobs": args.max_active_jobs,
                                "durability": args.durability}, TenantSpec)
    except msgspec.ValidationError as exc:
        print(f"herdwick tenant create: {exc}", file=sys.stderr)
        return 2
    db = await Database.connect(settings.database_url, max_size=1)
    try:
        created = await create_tenant(db, spec, SystemClock().now())
    finally:
        await db.close()
    print(f"tenant id:      {created.tenant_id}")
    print(f"api key:        {created.api_key}")
    print(f"signing secret: {created.signing_secret}")
    return 0


def cmd_retention(args: argparse.Namespace) -> int:
    settings = _settings(args)
    if args.read is not None:
        try:
            day = datetime.strptime(args.read, "%Y-%m-%d").date()
        except ValueError:
            print(f"herdwick retention: --read {args.read!r} is not a day (YYYY-MM-DD)",
                  file=sys.stderr)
            return 2
        return _run(_retention_read(settings, day))
    settings.require_database()
    return _run(_retention(settings, args.dry_run))


async def _retention(settings: Settings, dry_run: bool) -> int:
    from herdwick.clock import SystemClock
    from herdwick.storage import retention
    from herdwick.storage.db import Database

    policy = retention.RetentionPolicy.from_settings(settings)
    now = SystemClock().now()
    print(f"first day kept: {retention.first_day_kept(now, policy.days)} "
          f"({policy.days} days); archive: {policy.archive_url}")
    db = await Database.connect(settings.database_url, max_size=2)
    try:
        if dry_run:
            days = await retention.plan(db, now, policy.days)
            report = None
        else:
            report = await retention.run_pass(db, policy, now)
    finally:
        await db.close()
    if report is not None and not report.leased:
        print("herdwick retention: another node holds the retention lease and is running a "
              "pass; nothing done", file=sys.stderr)
        return 0
    rows = ([(d.partition, d.day, d.executions, _planned(d)) for d in days] if dry_run else
            [(o.partition, o.day, o.executions, _result(o)) for o in report.outcomes])
    if not rows:
        print("nothing is older than that")
        return 0
    print(f"{'PARTITION':<22}{'DAY':<12}{'EXECUTIONS':>10}  {'WOULD' if dry_run else 'DONE'}")
    for partition, day, executions, what in rows:
        print(f"{partition:<22}{day!s:<12}{executions:>10}  {what}")
    return 1 if report is not None and any(o.result == "failed" for o in report.outcomes) else 0


def _planned(day: Any) -> str:
    if day.unfinished:
        return f"keep: {day.unfinished} unfinished"
    if day.source == "default":
        return f"move to executions_{day.digits}, archive as {day.name}, drop"
    if day.source == "detached":
        return f"finish: archive as {day.name} (detached already), drop"
    return f"archive as {day.name}, drop"


def _result(outcome: Any) -> str:
    if outcome.result == "dropped":
        return f"dropped; {outcome.attempts} attempts; archive {outcome.url}"
    return f"{outcome.result}: {outcome.reason}"


async def _retention_read(settings: Settings, day: Any) -> int:
    from herdwick.storage.archive import open_target
    from herdwick.storage.retention import read_day

    target = open_target(settings.archive_url, s3_endpoint=settings.archive_s3_endpoint)
    found = 0
    try:
        async for line in read_day(target, day):
            sys.stdout.buffer.write(line + b"\n")
            found += 1
    finally:
        await target.close()
    sys.stdout.flush()
    if not found:
        print(f"herdwick retention: no archived execution of {day} in {settings.archive_url}",
              file=sys.stderr)
    return 0


def _patch_value(text: str | None) -> object:
    """A flag of tenant update: absent, `none` (lift the limit), or a number."""
    if text is None:
        return None
    if text.lower() == "none":
        return "none"
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{text!r} is not a number or none") from None


async def _tenant_update(settings: Settings, args: argparse.Namespace) -> int:
    import uuid

    import msgspec

    from herdwick.model import TenantPatch
    from herdwick.storage.db import Database
    from herdwick.storage.tenants import patch_tenant

    fields = {"weight": args.weight, "dispatchRate": _patch_value(args.rate),
              "burst": _patch_value(args.burst),
              "maxActiveJobs": _patch_value(args.max_active_jobs)}
    body = {k: (None if v == "none" else v) for k, v in fields.items() if v is not None}
    if args.durability is not None:
        body["durability"] = args.durability
    try:
        tenant_id = uuid.UUID(args.tenant_id)
        patch = msgspec.convert(body, TenantPatch)
    except (ValueError, msgspec.ValidationError) as exc:
        print(f"herdwick tenant update: {exc}", file=sys.stderr)
        return 2
    if not body:
        print("herdwick tenant update: nothing to change (give --weight, --rate, --burst, "
              "--max-active-jobs or --durability)", file=sys.stderr)
        return 2
    db = await Database.connect(settings.database_url, max_size=1)
    try:
        tenant = await patch_tenant(db, tenant_id, patch)
    finally:
        await db.close()
    print(msgspec.json.encode(tenant).decode())
    return 0


async def _tenant_rotate_secret(settings: Settings, args: argparse.Namespace) -> int:
    import uuid

    import msgspec

    from herdwick.clock import SystemClock
    from herdwick.model import MAX_SECRET_OVERLAP_S, SecretRotation
    from herdwick.schedule import format_utc
    from herdwick.storage.db import Database
    from herdwick.storage.tenants import rotate_signing_secret

    body = {} if args.overlap is None else {"overlapSeconds": args.overlap}
    try:
        tenant_id = uuid.UUID(args.tenant_id)
    except ValueError:
        print(f"herdwick tenant rotate-secret: {args.tenant_id!r} is not a tenant id",
              file=sys.stderr)
        return 2
    try:
        rotation = msgspec.convert(body, SecretRotation)
    except msgspec.ValidationError:
        print(f"herdwick tenant rotate-secret: --overlap must be 0 to {MAX_SECRET_OVERLAP_S} "
              "seconds", file=sys.stderr)
        return 2
    db = await Database.connect(settings.database_url, max_size=1)
    try:
        rotated = await rotate_signing_secret(db, tenant_id, rotation.overlap_seconds,
                                              SystemClock().now())
    finally:
        await db.close()
    await _publish_signing_keys(settings, str(tenant_id), rotated.keys)
    expires = rotated.shown.previous_secret_expires_at
    print(f"signing secret:             {rotated.shown.signing_secret}")
    print(f"previous secret expires at: {format_utc(expires) if expires else 'now (no overlap)'}")
    return 0


async def _publish_signing_keys(settings: Settings, tenant_id: str, keys: Any) -> None:
    """Hand the http workers the new keys at once when Redis is configured; otherwise (or if
    it fails) the schedulers copy them from Postgres within seconds."""
    if not settings.redis_url:
        return
    from herdwick import redis_client
    from herdwick.errors import StorageUnavailable
    from herdwick.storage import signing

    client = redis_client.connect(settings.redis_url, socket_timeout=5,
                                   socket_connect_timeout=5)
    try:
        await signing.publish(client, settings.key_prefix, {tenant_id: keys})
    except StorageUnavailable as exc:
        print(f"herdwick tenant rotate-secret: rotated; the http workers get the new secret "
              f"from the schedulers within seconds ({exc})", file=sys.stderr)
    finally:
        await client.aclose()


async def _tenant(settings: Settings, args: argparse.Namespace) -> int:
    if args.tenant_command == "update":
        return await _tenant_update(settings, args)
    if args.tenant_command == "rotate-secret":
        return await _tenant_rotate_secret(settings, args)
    return await _tenant_create(settings, args)


async def _api(settings: Settings, args: argparse.Namespace) -> int:
    from herdwick.gateway.app import create_app, serve

    _collect_less()
    stop = asyncio.Event()
    _stop_on_signals(stop)
    async with _metrics_server(args):
        await serve(create_app(settings), settings.api_host, settings.api_port, stop,
                    reuse_port=args.reuse_port)
    return 0


@contextlib.asynccontextmanager
async def _metrics_server(args: argparse.Namespace):
    """--metrics-port's /metrics for as long as the command runs."""
    if args.metrics_port is None:
        yield
        return
    from herdwick import telemetry

    try:
        runner = await telemetry.serve(args.metrics_port, args.metrics_host)
    except OSError as exc:
        raise ConfigError(f"--metrics-port {args.metrics_port}: cannot listen on "
                          f"{args.metrics_host}: {exc.strerror or exc}") from None
    try:
        yield
    finally:
        await runner.cleanup()


def cmd_loadtest(args: argparse.Namespace) -> int:
    if args.loadtest_command == "submit":
        from herdwick.loadtest import submit as action
    elif args.loadtest_command == "e2e":
        from herdwick.loadtest import e2e as action
    elif args.loadtest_command == "noisy-neighbour":
        from herdwick.loadtest import noisy as action
    elif args.loadtest_command == "http":
        from herdwick.loadtest import http as action
    elif args.loadtest_command == "soak":
        from herdwick.loadtest import soak as action
    else:
        from herdwick.loadtest import herd as action
    try:
        return _run(action.command(args))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("herdwick loadtest: interrupted; cleaned up", file=sys.stderr)
        return 130


async def _scheduler(settings: Settings, args: argparse.Namespace) -> int:
    from herdwick.actors.scheduler import Scheduler

    _collect_less()
    stop = asyncio.Event()
    _stop_on_signals(stop)
    async with _metrics_server(args):
        node = await Scheduler(settings).start()
        try:
            await stop.wait()
        finally:
            await node.stop()
    return 0


async def _http_worker(settings: Settings, args: argparse.Namespace) -> int:
    from herdwick.http_worker import BreakerPolicy, HttpWorker

    # (aiohttp's short-lived cycles: 13 % less CPU a callback with _collect_less, measured)
    _collect_less()
    stop = asyncio.Event()
    _stop_on_signals(stop)
    breaker = BreakerPolicy(failures=args.breaker_failures, window_s=args.breaker_window,
                            cooldown_s=args.breaker_cooldown,
                            max_cooldown_s=max(300.0, args.breaker_cooldown))
    async with _metrics_server(args):
        await HttpWorker(settings.redis_url, key_prefix=settings.key_prefix,
                         allow=settings.http_allow_networks, concurrency=args.concurrency,
                         target_concurrency=args.target_concurrency, breaker=breaker,
                         lease_s=args.lease).run(stop)
    return 0


async def _dev(settings: Settings) -> int:
    from herdwick.dev import run_dev

    _collect_less()
    stop = asyncio.Event()
    _stop_on_signals(stop)
    return await run_dev(settings, stop)


def cmd_worker(args: argparse.Namespace) -> int:
    """Import MODULE:ATTR, a herdwick.Worker, and run it; SIGINT/SIGTERM drain it and exit."""
    import importlib
    import os

    from herdwick.worker import Worker

    module_name, _, attr = args.target.partition(":")
    if not module_name or not attr:
        print("herdwick worker: the target must be MODULE:ATTR", file=sys.stderr)
        return 2
    if os.getcwd() not in sys.path:  # as with `python -m`: the user's modules are in the cwd
        sys.path.insert(0, os.getcwd())
    try:
        worker = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        print(f"herdwick worker: cannot load {args.target}: {exc}", file=sys.stderr)
        return 2
    if not isinstance(worker, Worker):
        print(f"herdwick worker: {args.target} is a {type(worker).__name__}, "
              "not a herdwick.Worker", file=sys.stderr)
        return 2
    # A flag wins over what the code says, and the code over the environment.
    settings = _settings(args)  # validates the flags and the environment
    worker.configure(redis_url=args.redis_url or worker.redis_url or settings.redis_url,
                     key_prefix=args.key_prefix or worker.key_prefix or settings.key_prefix)
    if worker.redis_url is None:
        raise ConfigError("HERDWICK_REDIS_URL is not set, and the Worker names no Redis URL "
                          "(`herdwick dev` prints the one to use)")
    _collect_less()  # after the handler's module: what it loaded is never rescanned
    return _run(_worker(worker, args))


async def _worker(worker: Any, args: argparse.Namespace) -> int:
    stop = asyncio.Event()
    _stop_on_signals(stop)
    async with _metrics_server(args):
        await worker.run(stop)
    return 0


def _production(fn: Callable[..., Coroutine[Any, Any, int]],
                database_only: bool = False, redis_only: bool = False) -> Callable[..., int]:
    def command(args: argparse.Namespace) -> int:
        settings = _settings(args)
        if database_only:
            settings.require_database()
        elif redis_only:
            settings.require_redis()
        else:
            settings.require_services()
        return _run(fn(settings, args) if fn.__code__.co_argcount == 2 else fn(settings))
    return command


def _configure_logging(args: argparse.Namespace) -> None:
    import os

    level = (getattr(args, "log_level", None) or os.environ.get(logs.LEVEL_ENV)
             or logs.DEFAULT_LEVEL)
    fmt = (getattr(args, "log_format", None) or os.environ.get(logs.FORMAT_ENV)
           or logs.DEFAULT_FORMAT)
    try:
        logs.configure(level.lower(), fmt.lower())
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser(loadtest_flags=argv[:1] == ["loadtest"]).parse_args(argv)
    try:
        _configure_logging(args)
    except ConfigError as exc:
        print(f"herdwick: {exc}", file=sys.stderr)
        return 2
    if args.command in NOT_YET:
        print(f"herdwick {args.command}: {NOT_YET[args.command]} is not yet implemented",
              file=sys.stderr)
        return 2
    commands: dict[str, Callable[[argparse.Namespace], int]] = {
        "cron": cmd_cron,
        "crontab": cmd_crontab,
        "retention": cmd_retention,
        "migrate": _production(_migrate, database_only=True),
        "api": _production(_api),
        "scheduler": _production(_scheduler),
        "tenant": _production(_tenant, database_only=True),
        "dev": lambda a: _run(_dev(_settings(a))),
        "loadtest": cmd_loadtest,
        "worker": cmd_worker,
        "http-worker": _production(_http_worker, redis_only=True),
    }
    try:
        return commands[args.command](args)
    except ConfigError as exc:
        print(f"herdwick: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        from herdwick.errors import HerdwickError

        if isinstance(exc, HerdwickError):
            print(f"herdwick: {exc}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
