"""The `herdwick` command (CONTRACT.md "CLI").

This is the composition root: it alone imports from every tier (lazily,
inside each command), so the library packages keep their one-way imports.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from typing import Any

from herdwick.config import ENV, ConfigError, Settings, from_env

log = logging.getLogger("herdwick.cli")

NOT_YET = {
    "http-worker": "the http worker pool",
}


def _config_flags() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("configuration (each overrides its environment variable)")
    for field, var in ENV.items():
        group.add_argument("--" + field.replace("_", "-"), dest=field, default=None,
                           help=f"default: ${var}")
    return parent


def _parser() -> argparse.ArgumentParser:
    config = _config_flags()
    parser = argparse.ArgumentParser(prog="herdwick",
                                     description="A distributed, multi-tenant job scheduler.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("dev", parents=[config],
                   help="api + scheduler + http worker in one process; embedded Postgres/Redis "
                        "unless URLs are set")
    sub.add_parser("migrate", parents=[config], help="apply migrations (idempotent)")
    sub.add_parser("api", parents=[config], help="the tenants' HTTP gateway")
    sub.add_parser("scheduler", parents=[config],
                   help="shard coordinator, shard actors, dispatch, pool queues")
    sub.add_parser("http-worker", parents=[config],
                   help="the built-in http worker pool (not yet implemented)")
    worker = sub.add_parser("worker",
                            help="run a herdwick.Worker from user code until SIGINT/SIGTERM")
    worker.add_argument("target", metavar="MODULE:ATTR")
    tenant = sub.add_parser("tenant", help="manage tenants")
    tenant_sub = tenant.add_subparsers(dest="tenant_command", required=True, metavar="ACTION")
    create = tenant_sub.add_parser("create", parents=[config],
                                   help="create a tenant; prints its id and API key")
    create.add_argument("name")
    create.add_argument("--weight", type=int, default=1)
    create.add_argument("--rate", type=float, default=None, help="dispatches per second")
    create.add_argument("--max-active-jobs", type=int, default=None)
    cron = sub.add_parser("cron", help="print the next fire times of a cron expression")
    cron.add_argument("expr")
    cron.add_argument("--tz", default="UTC", help="IANA zone (default UTC)")
    cron.add_argument("--after", default=None, help="RFC 3339 instant (default now)")
    cron.add_argument("--count", type=int, default=5)
    cron.add_argument("--jitter", type=int, default=0, metavar="S")
    cron.add_argument("--job-id", default=None, help="seeds jitter and H fields")
    _loadtest_parser(sub)
    return parser


def _loadtest_parser(sub: argparse._SubParsersAction) -> None:
    loadtest = sub.add_parser("loadtest", help="load generators against this machine")
    actions = loadtest.add_subparsers(dest="loadtest_command", required=True, metavar="ACTION")
    submit = actions.add_parser(
        "submit", help="POST /v1/jobs and /v1/jobs:batch rates, against the raw insert",
        description="Measures single and batch submits over HTTP and the same inserts "
                    "straight through asyncpg, in a fresh database it drops afterwards.")
    submit.add_argument("--clients", type=int, metavar="N",
                        help="concurrent single-submit clients; default 64")
    submit.add_argument("--raw-clients", type=int, metavar="N",
                        help="connections of the raw single-insert baseline; default --clients")
    submit.add_argument("--batch-clients", type=int, metavar="C",
                        help="concurrent batch clients; default 4")
    submit.add_argument("--batch-size", type=int, metavar="JOBS",
                        help="jobs per batch request; default 1000")
    submit.add_argument("--duration", type=float, metavar="S",
                        help="measured seconds per phase; default 10")
    submit.add_argument("--warmup", type=float, metavar="S",
                        help="warm-up seconds before each phase is measured; default 2")
    submit.add_argument("--phases", metavar="LIST",
                        help="comma-separated subset of http-single,raw-single,http-batch,"
                             "raw-batch; default all")
    submit.add_argument("--api-processes", type=int, metavar="K",
                        help="herdwick api processes to start on one port; default 1")
    submit.add_argument("--url", help="target a running API (loopback only) instead")
    submit.add_argument("--api-key", help="a tenant's API key for --url")
    submit.add_argument("--database-url", help="Postgres server for the scratch database; "
                        "default $HERDWICK_DATABASE_URL, else postgres@127.0.0.1:5432")
    submit.add_argument("--redis-url", help="default $HERDWICK_REDIS_URL, else 127.0.0.1:6379")
    submit.add_argument("--keep", action="store_true", help="keep the scratch database")
    submit.add_argument("--json", action="store_true", help="the report as JSON")
    herd = actions.add_parser(
        "herd", help="a herd of jobs due in one second, against the raw dispatch limits",
        description="Inserts a herd due in the same second (and an optional steady "
                    "background), runs `herdwick scheduler` processes and no-op stream "
                    "consumers, and reports dispatch lag, throughput, CPU and memory beside "
                    "this machine's raw limits for the same work.")
    from herdwick.loadtest.herd import add_arguments as herd_arguments

    herd_arguments(herd)
    e2e = actions.add_parser(
        "e2e", help="a herd or a steady rate through SDK workers to outcomes in Postgres",
        description="A herd due in one second (--jobs), a steady rate (--rate, --duration) "
                    "or both, through `herdwick scheduler` and `herdwick worker` processes "
                    "with a no-op handler; reports the time until every execution "
                    "succeeded in Postgres, due->lease lag, the events and ready streams' "
                    "backlog, and Postgres transactions and Redis commands per execution.")
    from herdwick.loadtest.e2e import add_arguments as e2e_arguments

    e2e_arguments(e2e)


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
    return from_env(**overrides)


def _run(main: Coroutine[Any, Any, int]) -> int:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        return asyncio.run(main)
    return uvloop.run(main)


def _stop_on_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)


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
                                "dispatch_rate": args.rate,
                                "max_active_jobs": args.max_active_jobs}, TenantSpec,
                               from_attributes=False)
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


async def _api(settings: Settings) -> int:
    from herdwick.gateway.app import create_app, serve

    stop = asyncio.Event()
    _stop_on_signals(stop)
    await serve(create_app(settings), settings.api_host, settings.api_port, stop)
    return 0


def cmd_loadtest(args: argparse.Namespace) -> int:
    if args.loadtest_command == "submit":
        from herdwick.loadtest import submit as action
    elif args.loadtest_command == "e2e":
        from herdwick.loadtest import e2e as action
    else:
        from herdwick.loadtest import herd as action
    try:
        return _run(action.command(args))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("herdwick loadtest: interrupted; cleaned up", file=sys.stderr)
        return 130


async def _scheduler(settings: Settings) -> int:
    from herdwick.actors.scheduler import Scheduler

    stop = asyncio.Event()
    _stop_on_signals(stop)
    node = await Scheduler(settings).start()
    try:
        await stop.wait()
    finally:
        await node.stop()
    return 0


async def _dev(settings: Settings) -> int:
    from herdwick.dev import run_dev

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
    return _run(_worker(worker))


async def _worker(worker: Any) -> int:
    stop = asyncio.Event()
    _stop_on_signals(stop)
    await worker.run(stop)
    return 0


def _production(fn: Callable[..., Coroutine[Any, Any, int]],
                database_only: bool = False) -> Callable[..., int]:
    def command(args: argparse.Namespace) -> int:
        settings = _settings(args)
        if database_only and settings.database_url:
            pass
        else:
            settings.require_services()
        return _run(fn(settings, args) if fn.__code__.co_argcount == 2 else fn(settings))
    return command


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if args.command in NOT_YET:
        print(f"herdwick {args.command}: {NOT_YET[args.command]} is not yet implemented",
              file=sys.stderr)
        return 2
    commands: dict[str, Callable[[argparse.Namespace], int]] = {
        "cron": cmd_cron,
        "migrate": _production(_migrate, database_only=True),
        "api": _production(_api),
        "scheduler": _production(_scheduler),
        "tenant": _production(_tenant_create, database_only=True),
        "dev": lambda a: _run(_dev(_settings(a))),
        "loadtest": cmd_loadtest,
        "worker": cmd_worker,
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
