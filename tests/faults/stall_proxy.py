"""A TCP proxy that can stop forwarding: a network stall between a process and its server.

tests/proxy.py cuts connections (they break at once, as when Postgres goes
away); this one keeps every connection open and holds the bytes, as a
congested or partitioned link does: neither end sees an error, replies just
stop coming until `resume()`.
"""

from __future__ import annotations

import asyncio
import contextlib


class StallProxy:
    def __init__(self, host: str, port: int) -> None:
        self._upstream = (host, port)
        self._server: asyncio.Server | None = None
        self._flowing = asyncio.Event()  # cleared while stalled; every pump waits on it
        self._flowing.set()
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._upstream)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}
        await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer),
                             return_exceptions=True)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                await self._flowing.wait()
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()
            self._writers.discard(writer)

    def stall(self) -> None:
        """Hold every byte in both directions from now on; connections stay open."""
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    async def close(self) -> None:
        self._flowing.set()
        for writer in list(self._writers):
            writer.transport.abort()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
