"""A Postgres primary and a streaming standby of the test's own, on free loopback ports.

Built from Debian's binaries (/usr/lib/postgresql/*/bin: initdb, postgres,
pg_basebackup -R), each server a `postgres` process started directly in a
session of its own, in a temporary directory. The suite's shared server
cannot be killed, paused or promoted without hurting every other test; this
pair is made for exactly that:

- `kill_primary()` is kill -9 of the primary's every process, the postmaster and
  every backend at once: what a host that dies does; `freeze_primary()` stops them
  all (SIGSTOP) instead: a host that hangs, whose connections neither answer nor
  fail;
- `promote()` makes the standby the primary (pg_promote);
- `pause_replay()` / `resume_replay()` stop and restart the standby's replay
  (pg_wal_replay_pause): it keeps receiving WAL, but its data stands still;
- `lag()` measures the standby's replication lag, in bytes and seconds (seconds from a
  heartbeat row the primary stamps every 50 ms once `start_heartbeat()` is called);
- with `link=True` the standby streams through a proxy (tests/faults/stall_proxy.py)
  that `stall_replication()` stops forwarding: the standby falls behind by as long
  as the stall lasts, as over a congested link, and `cut_replication()` drops what
  the link held (with a primary killed meanwhile: WAL that never reached the standby);
- `synchronous=True` names the standby in synchronous_standby_names with a
  server default of synchronous_commit = local, so only a transaction that
  asks for more (herdwick's sync tenants: remote_apply) waits for it.

Run as root (as this suite is in CI), the servers run as the `postgres` user,
which Postgres insists on; the temporary directory is given to it.

`python -m tests.fleet.postgres_pair [--synchronous]` starts a pair and holds it
until Ctrl-C or SIGTERM, printing its DSNs: for measuring by hand (BENCHMARKS.md,
"Past one machine").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import glob
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import asyncpg

from herdwick.loadtest.driver import free_port
from herdwick.storage import migrate
from tests.faults.stall_proxy import StallProxy

DATABASE = "herdwick"
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
POLL_S = 0.05
HEARTBEAT_S = 0.05
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# Every server's settings. fsync stays on: the figures taken against this pair (a sync
# tenant's submit latency) must pay for a real commit. Status every second, so the
# primary's pg_stat_replication is fresh while the test reads it.
_COMMON = {
    "listen_addresses": "127.0.0.1",
    "max_connections": "200",
    "shared_buffers": "64MB",
    "wal_level": "replica",
    "max_wal_senders": "5",
    "hot_standby": "on",
    "wal_receiver_status_interval": "1s",
    "logging_collector": "off",
    "log_min_messages": "warning",
    "log_line_prefix": "%m [%p] ",
}


def bin_dir() -> Path | None:
    """The newest Debian PostgreSQL's binaries, or None when none are installed."""
    found = [Path(p) for p in glob.glob("/usr/lib/postgresql/*/bin")
             if (Path(p) / "initdb").exists() and (Path(p) / "pg_basebackup").exists()]
    if not found:
        return None
    return max(found, key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0)


def _owner() -> pwd.struct_passwd | None:
    """Whom the servers run as: `postgres` when we are root (Postgres refuses root)."""
    if os.geteuid() != 0:
        return None
    return pwd.getpwnam("postgres")


def _dies_with_us():
    """A preexec_fn: the server gets SIGQUIT (immediate shutdown) if the test process dies,
    even by SIGKILL, so a killed run leaves no server behind."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    return lambda: libc.prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGQUIT))


@dataclass
class Lag:
    """How far the standby is behind the primary."""

    bytes: int  # WAL the primary has written that the standby has not replayed
    seconds: float  # how old the newest commit the standby has replayed is; 0 if caught up


class Server:
    """One `postgres` process over one data directory."""

    def __init__(self, name: str, data_dir: Path, port: int, settings: dict[str, str],
                 bins: Path, owner: pwd.struct_passwd | None) -> None:
        self.name = name
        self.data_dir = data_dir
        self.port = port
        self.settings = settings
        self._bins = bins
        self._owner = owner
        self.log = data_dir.parent / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def dsn(self, database: str = DATABASE) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _user_kwargs(self) -> dict:
        if self._owner is None:
            return {}
        return {"user": self._owner.pw_uid, "group": self._owner.pw_gid, "extra_groups": []}

    def run(self, tool: str, *args: str) -> None:
        """A tool of the same release (initdb, pg_basebackup), as the servers' user."""
        done = subprocess.run([str(self._bins / tool), *args], cwd=self.data_dir.parent,
                              capture_output=True, text=True, **self._user_kwargs())
        if done.returncode != 0:
            raise RuntimeError(f"{tool} failed ({done.returncode}): {done.stderr[-2000:]}")

    async def start(self) -> None:
        options = [f"-c{k}={v}" for k, v in {**self.settings, "port": str(self.port),
                                             "unix_socket_directories": str(
                                                 self.data_dir.parent)}.items()]
        out = self.log.open("ab")
        try:
            # A session of its own: kill() takes the postmaster and every backend at once.
            self.proc = subprocess.Popen(  # noqa: ASYNC220 - outlives no event loop
                [str(self._bins / "postgres"), "-D", str(self.data_dir), *options],
                cwd=self.data_dir.parent, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_dies_with_us(),
                **self._user_kwargs())
        finally:
            out.close()
        await self.wait_ready()

    async def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            with contextlib.suppress(OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
                conn = await asyncpg.connect(self.dsn("postgres"), timeout=2)
                await conn.close()
                return
            if not self.running or time.monotonic() > deadline:
                raise RuntimeError(f"postgres {self.name} on port {self.port} did not start:\n"
                                   + self.log_tail())
            await asyncio.sleep(POLL_S)

    def log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def processes(self) -> list[int]:
        """The postmaster's pid and its children's. Each child is in a session of its own
        (Postgres's doing), so no one signal to a process group reaches them all."""
        if self.proc is None or self.proc.poll() is not None:
            return []
        found = [self.proc.pid]
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile
            if ppid == self.proc.pid:
                found.append(int(entry))
        return found

    def _signal_all(self, sig: int) -> list[int]:
        pids = self.processes()
        if pids:
            # The postmaster first: stopped, it forks nothing and restarts no one meanwhile.
            with contextlib.suppress(ProcessLookupError):
                os.kill(pids[0], signal.SIGSTOP)
        for pid in [*pids[1:], *pids[:1]]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        return pids

    def kill(self) -> None:
        """kill -9 of the whole server: postmaster and every backend, within microseconds."""
        if self.proc is None:
            return
        pids = self._signal_all(signal.SIGKILL)
        self.proc.wait()
        self._gone(pids)

    def freeze(self) -> None:
        """SIGSTOP of the whole server: connections stay open and nothing answers."""
        self._signal_all(signal.SIGSTOP)

    def thaw(self) -> None:
        for pid in self.processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def stop(self) -> None:
        """A fast shutdown (SIGINT), SIGKILL past the deadline (a frozen server too)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.thaw()
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()

    @staticmethod
    def _gone(pids: list[int]) -> None:
        """Until every one of them has exited: none may hold the port, or write on."""
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}/stat")
                                                  and not _zombie(p) for p in pids):
            time.sleep(POLL_S)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


class PostgresPair:
    """Start with `await PostgresPair.start()`; `stop()` at the end, whatever happened."""

    def __init__(self, base: Path, primary: Server, standby: Server) -> None:
        self.base = base
        self.primary = primary
        self.standby = standby
        self.link: StallProxy | None = None  # between them, with link=True
        self._heartbeat: asyncio.Task | None = None

    @classmethod
    async def start(cls, *, synchronous: bool = False, migrated: bool = True,
                    link: bool = False,
                    standby_settings: dict[str, str] | None = None) -> PostgresPair:
        """A primary with the herdwick database (migrated), then a standby streaming from
        it: pg_basebackup -R of the running primary, so it starts as its replica.
        standby_settings: more of the standby's (max_standby_streaming_delay, say)."""
        bins = bin_dir()
        if bins is None:
            raise RuntimeError("no PostgreSQL binaries in /usr/lib/postgresql/*/bin")
        owner = _owner()
        base = Path(tempfile.mkdtemp(prefix="hw-pgpair-"))
        if owner is not None:
            os.chown(base, owner.pw_uid, owner.pw_gid)
        primary_settings = dict(_COMMON)
        if synchronous:
            # Any standby is the synchronous one, and a commit waits for it only if its
            # transaction asks (remote_apply): the default commits locally.
            primary_settings |= {"synchronous_standby_names": "*",
                                 "synchronous_commit": "local"}
        primary = Server("primary", base / "primary", free_port(), primary_settings, bins,
                         owner)
        standby = Server("standby", base / "standby", free_port(),
                         {**_COMMON, **(standby_settings or {})}, bins, owner)
        pair = cls(base, primary, standby)
        try:
            await asyncio.to_thread(primary.run, "initdb", "-D", str(primary.data_dir),
                                    "-U", "postgres", "-A", "trust", "-E", "UTF8",
                                    "--no-sync", "--no-instructions")
            await primary.start()
            conn = await asyncpg.connect(primary.dsn("postgres"))
            try:
                await conn.execute(f'CREATE DATABASE "{DATABASE}"')
            finally:
                await conn.close()
            if migrated:
                await migrate.apply(primary.dsn())
            await asyncio.to_thread(
                standby.run, "pg_basebackup", "-h", "127.0.0.1", "-p", str(primary.port),
                "-U", "postgres", "-D", str(standby.data_dir), "-R", "-X", "stream",
                "--checkpoint=fast", "--no-sync")
            if link:
                pair.link = StallProxy("127.0.0.1", primary.port)
                await pair.link.start()
                # The command line wins over the primary_conninfo -R wrote.
                standby.settings["primary_conninfo"] = (
                    f"host=127.0.0.1 port={pair.link.port} user=postgres "
                    "application_name=standby")
            await standby.start()
            await pair.wait_streaming()
        except BaseException:
            pair.stop()
            raise
        return pair

    # --- addresses ------------------------------------------------------------------

    @property
    def primary_dsn(self) -> str:
        return self.primary.dsn()

    @property
    def standby_dsn(self) -> str:
        return self.standby.dsn()

    @property
    def failover_dsn(self) -> str:
        """Both hosts, the primary first, and only a server that takes writes will do: what
        herdwick's processes are given so that they find the promoted standby by themselves."""
        return (f"postgresql://postgres@127.0.0.1:{self.primary.port},"
                f"127.0.0.1:{self.standby.port}/{DATABASE}?target_session_attrs=read-write")

    # --- the standby's state --------------------------------------------------------

    async def _standby(self, sql: str, *args) -> object:
        conn = await asyncpg.connect(self.standby.dsn("postgres"), timeout=5)
        try:
            return await conn.fetchval(sql, *args)
        finally:
            await conn.close()

    async def _primary(self, sql: str, *args) -> object:
        conn = await asyncpg.connect(self.primary.dsn("postgres"), timeout=5)
        try:
            return await conn.fetchval(sql, *args)
        finally:
            await conn.close()

    async def wait_streaming(self) -> None:
        """Until the primary sees the standby streaming (and, when synchronous, as sync)."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while await self._primary(
                "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'") == 0:
            if time.monotonic() > deadline:
                raise RuntimeError("the standby never streamed:\n" + self.standby.log_tail())
            await asyncio.sleep(POLL_S)

    async def caught_up(self, timeout_s: float = 10.0) -> None:
        """Until the standby has replayed everything the primary had written when asked."""
        target = await self._primary("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")
        deadline = time.monotonic() + timeout_s
        while await self._standby("SELECT pg_last_wal_replay_lsn() - '0/0'::pg_lsn") < target:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the standby did not catch up in {timeout_s} s")
            await asyncio.sleep(POLL_S)

    async def pause_replay(self) -> None:
        """The standby keeps receiving WAL and applies none of it until resume_replay()."""
        await self._standby("SELECT pg_wal_replay_pause()")
        deadline = time.monotonic() + READY_TIMEOUT_S
        while await self._standby("SELECT pg_get_wal_replay_pause_state()") != "paused":
            if time.monotonic() > deadline:
                raise RuntimeError("the standby's replay did not pause")
            await asyncio.sleep(POLL_S)

    async def resume_replay(self) -> None:
        await self._standby("SELECT pg_wal_replay_resume()")

    async def start_heartbeat(self, interval_s: float = HEARTBEAT_S) -> None:
        """From now until the primary dies, it stamps a row (database postgres, table
        hw_heartbeat) with its clock every interval: the standby's copy of the stamp says
        how many seconds behind it is (pt-heartbeat's way), to within the interval."""
        conn = await asyncpg.connect(self.primary.dsn("postgres"))
        await conn.execute("CREATE TABLE IF NOT EXISTS hw_heartbeat (id int PRIMARY KEY, "
                           "at timestamptz NOT NULL)")
        await conn.execute("INSERT INTO hw_heartbeat VALUES (1, clock_timestamp()) "
                           "ON CONFLICT (id) DO UPDATE SET at = excluded.at")
        self._heartbeat = asyncio.create_task(self._beat(conn, interval_s))

    @staticmethod
    async def _beat(conn: asyncpg.Connection, interval_s: float) -> None:
        try:
            while True:
                await conn.execute("UPDATE hw_heartbeat SET at = clock_timestamp()")
                await asyncio.sleep(interval_s)
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
            return  # the primary is gone
        finally:
            conn.terminate()

    async def lag(self) -> Lag:
        """Bytes: the primary's WAL position less the standby's replay position, read one
        after the other (the primary first, so the figure errs high). Seconds, when it is
        behind: the age of the newest heartbeat the standby has (start_heartbeat), else of
        the newest commit it has replayed (which overstates it when the primary had been
        quiet before)."""
        written = await self._primary("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")
        replayed = await self._standby("SELECT pg_last_wal_replay_lsn() - '0/0'::pg_lsn")
        behind = max(0, int(written - replayed))
        seconds = 0.0
        if behind:
            seconds = float(await self._standby(
                "SELECT extract(epoch FROM clock_timestamp() - at) FROM hw_heartbeat"
                if self._heartbeat is not None else
                "SELECT coalesce(extract(epoch FROM clock_timestamp() "
                "- pg_last_xact_replay_timestamp()), 0)"))
        return Lag(bytes=behind, seconds=max(0.0, seconds))

    # --- faults ---------------------------------------------------------------------

    def kill_primary(self) -> None:
        """kill -9 of the primary's every process: what a host that dies does."""
        self.primary.kill()

    def freeze_primary(self) -> None:
        """SIGSTOP of the primary's every process: a host that hangs rather than dies."""
        self.primary.freeze()

    def stall_replication(self) -> None:
        """The link holds every byte from now on: the standby falls behind (link=True)."""
        assert self.link is not None, "start the pair with link=True"
        self.link.stall()

    async def cut_replication(self) -> None:
        """The link drops what it held and every connection through it: that WAL never
        reaches the standby."""
        assert self.link is not None, "start the pair with link=True"
        await self.link.close()

    async def promote(self, timeout_s: float = 30.0) -> float:
        """Make the standby the primary; returns how long it took, in seconds."""
        began = time.monotonic()
        promoted = await self._standby("SELECT pg_promote(true, $1)", int(timeout_s))
        if not promoted:
            raise RuntimeError("the standby was not promoted:\n" + self.standby.log_tail())
        return time.monotonic() - began

    def stop_standby(self) -> None:
        self.standby.stop()

    async def start_standby(self) -> None:
        await self.standby.start()

    def stop(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        if self.link is not None and self.link._server is not None:
            self.link._server.close()  # no loop may be left to await it; its sockets go
        for server in (self.standby, self.primary):
            with contextlib.suppress(Exception):
                server.stop()
        shutil.rmtree(self.base, ignore_errors=True)


async def _hold(synchronous: bool) -> None:
    pair = await PostgresPair.start(synchronous=synchronous)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    try:
        print(f"primary  {pair.primary_dsn}", flush=True)
        kind = "synchronous, for transactions that ask" if synchronous else "asynchronous"
        print(f"standby  {pair.standby_dsn} ({kind})", flush=True)
        print(f"failover {pair.failover_dsn}", flush=True)
        await stop.wait()
    finally:
        pair.stop()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.fleet.postgres_pair",
                                     description="a Postgres primary and streaming standby "
                                                 "until Ctrl-C")
    parser.add_argument("--synchronous", action="store_true",
                        help="synchronous_standby_names = '*', synchronous_commit = local")
    asyncio.run(_hold(parser.parse_args().synchronous))


if __name__ == "__main__":
    main()
