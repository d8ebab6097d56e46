"""A callback receiver for `loadtest http`: answers every request with 200 and "ok".

    python -m herdwick.loadtest.receiver --port 8123 --record /tmp/r.bin

A raw asyncio.Protocol HTTP/1.1 responder (keep-alive, pipelining, Content-Length
bodies), not aiohttp.web: on this 2-core machine every cycle the receiver spends is
one the http worker does not get, and aiohttp.web costs several times as much CPU
per request (BENCHMARKS.md "HTTP callbacks"). It understands just what herdwick's
http worker sends: a request line, headers, a Content-Length body (a chunked body is
answered 411 and the connection closed).

Per request it keeps the arrival time and the Herdwick-Scheduled-For header's
instant (both this machine's wall clock), and writes them on SIGTERM/SIGINT to
--record as float64 pairs (seconds since the epoch), which `receiver.read_record`
reads back. It prints `event=receiver_listening` once it accepts connections.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import signal
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

LISTENING = "event=receiver_listening"
MAX_HEAD_BYTES = 64 * 1024
_END_OF_HEAD = b"\r\n\r\n"
_OK = (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n"
       b"\r\nok")
_BAD = (b"HTTP/1.1 %d %s\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
_SCHEDULED = b"\r\nherdwick-scheduled-for:"
_LENGTH = b"\r\ncontent-length:"
_CHUNKED = b"\r\ntransfer-encoding:"
_CLOSE = b"\r\nconnection: close"


class Record:
    """What the receiver saw: arrival and due instants, one pair a request. Written by the
    protocols (one event loop), read once at exit."""

    def __init__(self) -> None:
        self.times = array.array("d")  # arrival, due, arrival, due, ...
        self._due: dict[bytes, float] = {}  # header value -> instant: a herd repeats one

    def add(self, arrived: float, scheduled: bytes | None) -> None:
        due = float("nan")
        if scheduled is not None:
            due = self._due.get(scheduled, -1.0)
            if due < 0:
                due = self._due[scheduled] = _instant(scheduled)
        self.times.append(arrived)
        self.times.append(due)

    def write(self, path: str) -> None:
        with Path(path).open("wb") as f:
            self.times.tofile(f)


def _instant(value: bytes) -> float:
    try:
        return datetime.fromisoformat(value.strip().decode().replace("Z", "+00:00")).timestamp()
    except ValueError:
        return float("nan")


def read_record(path: str) -> list[tuple[float, float]]:
    """(arrival, due) per request, as written by a receiver; [] if it wrote nothing."""
    times = array.array("d")
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return []
    times.frombytes(data[:len(data) - len(data) % (2 * times.itemsize)])
    return list(zip(times[0::2], times[1::2], strict=True))


def _header(head_lower: bytes, head: bytes, name: bytes) -> bytes | None:
    at = head_lower.find(name)
    if at < 0:
        return None
    start = at + len(name)
    end = head.find(b"\r\n", start)
    return head[start:end if end >= 0 else len(head)]


class Responder(asyncio.Protocol):
    """One connection: parse requests off the buffer as they complete, answer each 200."""

    def __init__(self, record: Record) -> None:
        self._record = record
        self._buffer = bytearray()
        self._transport: Any = None
        self._body_left = 0  # bytes of the current request's body still to come
        self._close_after = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # uvloop's is no asyncio.Transport subclass

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        out = []
        while True:
            if self._body_left:
                taken = min(self._body_left, len(buffer))
                del buffer[:taken]
                self._body_left -= taken
                if self._body_left:
                    break
                out.append(_OK)
                if self._close_after:
                    break
                continue
            end = buffer.find(_END_OF_HEAD)
            if end < 0:
                if len(buffer) > MAX_HEAD_BYTES:
                    self._refuse(out, 431, b"Request Header Fields Too Large")
                break
            head = bytes(buffer[:end])
            del buffer[:end + 4]
            if not self._request(head, out):
                break
            if self._close_after:
                break
        if out:
            self._transport.write(b"".join(out))
        if self._close_after and not self._body_left:
            self._transport.close()

    def _request(self, head: bytes, out: list[bytes]) -> bool:
        """A request's head has arrived: note it; False if the connection is to close now."""
        lower = head.lower()
        if _header(lower, head, _CHUNKED) is not None:
            self._refuse(out, 411, b"Length Required")
            return False
        self._close_after = _CLOSE in lower
        length = _header(lower, head, _LENGTH)
        try:
            self._body_left = int(length) if length is not None else 0
        except ValueError:
            self._refuse(out, 400, b"Bad Request")
            return False
        self._record.add(time.time(), _header(lower, head, _SCHEDULED))
        if not self._body_left:
            out.append(_OK)
        return True

    def _refuse(self, out: list[bytes], status: int, reason: bytes) -> None:
        out.append(_BAD % (status, reason))
        self._close_after = True
        self._body_left = 0


async def serve(host: str, port: int, record_path: str | None) -> None:
    loop = asyncio.get_running_loop()
    record = Record()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    server = await loop.create_server(lambda: Responder(record), host, port, backlog=1024,
                                      reuse_address=True)
    print(f"{LISTENING} host={host} port={port}", flush=True)
    try:
        await stop.wait()
    finally:
        server.close()
        if record_path:
            record.write(record_path)
    print(f"event=receiver_stopped requests={len(record.times) // 2}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m herdwick.loadtest.receiver",
                                     description="answer every HTTP request with 200 ok")
    parser.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1")
    parser.add_argument("--port", type=int, required=True, help="the port to listen on")
    parser.add_argument("--record", default=None, metavar="PATH",
                        help="on exit, write each request's arrival and due instants here")
    args = parser.parse_args(argv)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        asyncio.run(serve(args.host, args.port, args.record))
    else:
        uvloop.run(serve(args.host, args.port, args.record))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
