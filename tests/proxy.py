"""A TCP proxy the tests can cut, to make Postgres vanish mid-run."""

from __future__ import annotations

import asyncio
import contextlib
import urllib.parse


class Proxy:
    def __init__(self, dsn: str) -> None:
        parts = urllib.parse.urlsplit(dsn)
        query = urllib.parse.parse_qs(parts.query)
        self._socket_dir = query.get("host", [None])[0]
        self._port = parts.port or 5432
        self._host = parts.hostname or "127.0.0.1"
        self._dsn = parts
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.StreamWriter] = set()
        self.port = 0

    def dsn(self) -> str:
        """The same DSN, through the proxy."""
        query = urllib.parse.parse_qs(self._dsn.query)
        query.pop("host", None)
        netloc = f"{self._dsn.username or 'postgres'}@127.0.0.1:{self.port}"
        return urllib.parse.urlunsplit(self._dsn._replace(
            netloc=netloc, query=urllib.parse.urlencode(query, doseq=True)))

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _upstream(self):
        if self._socket_dir:
            path = f"{self._socket_dir}/.s.PGSQL.{self._port}"
            return await asyncio.open_unix_connection(path)
        return await asyncio.open_connection(self._host, self._port)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await self._upstream()
        self._pipes |= {writer, up_writer}
        await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer),
                             return_exceptions=True)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()
            self._pipes.discard(writer)

    async def cut(self) -> None:
        """Refuse new connections and drop every open one."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for writer in list(self._pipes):
            writer.transport.abort()
        self._pipes.clear()

    async def restore(self) -> None:
        await self.start()

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.cut()
