"""A Postgres of one scenario's own, for the fault that crashes and restarts it.

The suite's shared server cannot be restarted without hurting every other test.
This one is the embedded server (herdwick/embedded.py, pgserver's binaries) in a
scratch directory, on a unix socket: it starts in about a second. A crash is
`pg_ctl stop -m immediate` (every backend quits at once, nothing is checkpointed),
so the start after it runs crash recovery from the WAL, as after a power cut.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

from herdwick.embedded import EmbeddedService, _import_pgserver, start_postgres
from herdwick.storage import migrate


class PostgresServer:
    """Start with `await PostgresServer.start()` (migrated); `crash_restart(down_s)`;
    `stop()` at the end."""

    def __init__(self, data_dir: Path) -> None:
        self._dir = data_dir
        self._service: EmbeddedService | None = None
        self.dsn = ""

    @classmethod
    async def start(cls) -> PostgresServer:
        server = cls(Path(tempfile.mkdtemp(prefix="hw-faults-pg-")))
        await server._launch()
        await migrate.apply(server.dsn)
        return server

    async def _launch(self) -> None:
        self._service = await asyncio.to_thread(start_postgres, self._dir)
        # The socket directory and port are the data directory's: the same after a restart.
        assert not self.dsn or self.dsn == self._service.url, (self.dsn, self._service.url)
        self.dsn = self._service.url

    def _crash(self) -> None:
        pgserver = _import_pgserver()
        pgdata = (self._dir / "postgres").resolve()
        server = pgserver.PostgresServer._instances[pgdata]
        pgserver.pg_ctl(["-w", "-m", "immediate", "stop"], pgdata=server.pgdata,
                        user=server.system_user)
        server.cleanup()  # bookkeeping; a start after this must not adopt the old handle
        pgserver.PostgresServer._instances.pop(pgdata, None)
        self._service = None

    async def crash_restart(self, down_s: float) -> None:
        """Every connection dies now; the server is back `down_s` seconds later."""
        await asyncio.to_thread(self._crash)
        await asyncio.sleep(down_s)
        await self._launch()

    def stop(self) -> None:
        if self._service is not None:
            self._service.stop()
            self._service = None
        shutil.rmtree(self._dir, ignore_errors=True)
