"""Retention's archives: their format, and the targets they are written to.

An archive is one day's executions as gzip'd JSON lines (`<name>.jsonl.gz`), one line
per execution with its attempts nested, beside a manifest (`<name>.manifest.json`) with
its counts and the sha256 of the data object's bytes. JSON lines rather than Parquet: an
operator reads it with zcat and jq, and a plain install needs no columnar library. Both
objects are deterministic (the rows in order, a gzip header with no time or name), so a
rerun after a crash writes the same bytes under the same keys.

A target is a directory (`/var/lib/herdwick/archive`, `file:///...`: written to a
temporary name, fsynced, renamed) or an S3-compatible bucket (`s3://bucket/prefix`,
through aiobotocore; credentials by botocore's usual chain). Every failure of a target
is ArchiveUnavailable, raised from the cause.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import hashlib
import io
import os
import tempfile
import urllib.parse
import uuid
from collections.abc import Iterator
from datetime import date
from pathlib import Path
from typing import BinaryIO, Protocol

import msgspec

from herdwick.errors import HerdwickError

DATA_SUFFIX = ".jsonl.gz"
MANIFEST_SUFFIX = ".manifest.json"
FORMAT = "herdwick-executions-jsonl/1"
# zlib's output for one input and level is fixed: the level is part of the format.
GZIP_LEVEL = 6
S3_CONTENT_TYPE = {DATA_SUFFIX: "application/gzip", MANIFEST_SUFFIX: "application/json"}
PROBE = ".herdwick-write-check"  # what a target's check writes


class ArchiveUnavailable(HerdwickError):
    """The archive target could not be written or read (permissions, a missing bucket,
    the network), or an archive read back does not match its manifest."""


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    """What an archive holds; written after its data object, so a data object without
    one is an archive whose writing did not finish."""

    format: str
    name: str
    day: date
    data: str  # the data object's key, beside the manifest
    executions: int
    attempts: int
    bytes: int
    sha256: str  # of the data object's bytes: `sha256sum` of the file


_manifest = msgspec.json.Encoder()
_read_manifest = msgspec.json.Decoder(Manifest)


def encode_manifest(manifest: Manifest) -> bytes:
    return _manifest.encode(manifest) + b"\n"


class _Hashing(io.RawIOBase):
    """The file under the gzip stream: hashes and counts what reaches the disk."""

    def __init__(self, raw: BinaryIO) -> None:
        self._raw = raw
        self.sha256 = hashlib.sha256()
        self.bytes = 0

    def writable(self) -> bool:
        return True

    def write(self, b: bytes) -> int:
        self._raw.write(b)
        self.sha256.update(b)
        self.bytes += len(b)
        return len(b)


class DataFile:
    """Builds one data object on local disk. Blocking: callers run `write` and `finish`
    in a thread (compression is CPU work the event loop must not wait on)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._raw = path.open("wb")
        self._hashing = _Hashing(self._raw)
        self._gzip = gzip.GzipFile(filename="", mode="wb", fileobj=self._hashing,
                                   compresslevel=GZIP_LEVEL, mtime=0)
        self.lines = 0

    def write(self, lines: list[bytes]) -> None:
        for line in lines:
            self._gzip.write(line)
            self._gzip.write(b"\n")
        self.lines += len(lines)

    def finish(self) -> tuple[int, str]:
        """Close and fsync it; (bytes, sha256 hex) of what is on disk."""
        self._gzip.close()
        self._raw.flush()
        os.fsync(self._raw.fileno())
        self._raw.close()
        return self._hashing.bytes, self._hashing.sha256.hexdigest()

    def discard(self) -> None:
        with contextlib.suppress(OSError):
            self._gzip.close()
        with contextlib.suppress(OSError):
            self._raw.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def read_lines(data: bytes, manifest: Manifest) -> Iterator[bytes]:
    """The executions of an archive, one JSON line each, once its bytes match the manifest."""
    if len(data) != manifest.bytes or hashlib.sha256(data).hexdigest() != manifest.sha256:
        raise ArchiveUnavailable(f"{manifest.data}: its bytes do not match its manifest")
    lines = gzip.decompress(data).splitlines()
    if len(lines) != manifest.executions:
        raise ArchiveUnavailable(f"{manifest.data}: {len(lines)} lines, its manifest says "
                                 f"{manifest.executions}")
    return iter(lines)


class Target(Protocol):
    """Where archives are written: a key is a file name (`<name>.jsonl.gz`)."""

    url: str

    def staging(self) -> Path:
        """The directory to build an object in before `put`."""
        ...

    async def check(self) -> None:
        """Raise ArchiveUnavailable unless the target takes writes: before anything leaves."""
        ...

    async def put(self, key: str, path: Path) -> str:
        """Publish the file at `path` as `key`, whole or not at all, replacing any object of
        that key; the file is gone after. Returns the object's URL."""
        ...

    async def get(self, key: str) -> bytes:
        ...

    async def keys(self, prefix: str) -> list[str]:
        """The keys that start with `prefix`, sorted."""
        ...

    async def close(self) -> None:
        ...


def open_target(url: str, *, s3_endpoint: str | None = None) -> Target:
    """The target of HERDWICK_ARCHIVE_URL (validated by Settings)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "s3":
        return S3Target(parts.netloc, parts.path.strip("/"), endpoint=s3_endpoint)
    if parts.scheme == "file":
        return DirectoryTarget(Path(urllib.parse.unquote(parts.path)))
    return DirectoryTarget(Path(url))


class DirectoryTarget:
    """A directory on a local or shared filesystem. Each object is written to a temporary
    name in the directory itself, fsynced, then renamed over its key (atomic on POSIX) and
    the directory fsynced: a crash leaves the old object or the new one, never half of one."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = str(root)

    def staging(self) -> Path:
        return self.root

    async def check(self) -> None:
        await asyncio.to_thread(self._check)

    def _check(self) -> None:
        # Root ignores permission bits, so the only proof of a writable directory is a write.
        probe = self.root / f"{PROBE}-{uuid.uuid4().hex}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise ArchiveUnavailable(f"archive directory {self.root}: {exc}") from exc

    async def put(self, key: str, path: Path) -> str:
        return await asyncio.to_thread(self._put, key, path)

    def _put(self, key: str, path: Path) -> str:
        final = self.root / key  # `path` is in the root: staging() says so
        try:
            with path.open("rb") as f:
                os.fsync(f.fileno())
            path.replace(final)
            directory = os.open(self.root, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
        except OSError as exc:
            raise ArchiveUnavailable(f"archive directory {self.root}: {exc}") from exc
        return str(final)

    async def get(self, key: str) -> bytes:
        try:
            return await asyncio.to_thread((self.root / key).read_bytes)
        except OSError as exc:
            raise ArchiveUnavailable(f"archive directory {self.root}: {exc}") from exc

    async def keys(self, prefix: str) -> list[str]:
        try:
            names = await asyncio.to_thread(os.listdir, self.root)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise ArchiveUnavailable(f"archive directory {self.root}: {exc}") from exc
        return sorted(n for n in names if n.startswith(prefix) and not n.startswith("."))

    async def close(self) -> None:
        return None


class S3Target:
    """An S3-compatible bucket, under a key prefix. A PUT replaces an object whole, so an
    object is the old one or the new one, never half; files are built in a local
    temporary directory first. One client for the target's life, opened on first use."""

    def __init__(self, bucket: str, prefix: str, *, endpoint: str | None = None) -> None:
        self.bucket = bucket
        self.prefix = f"{prefix}/" if prefix else ""
        # None: botocore's own resolution, which reads AWS_ENDPOINT_URL(_S3) if set.
        self.endpoint = endpoint
        self.url = f"s3://{bucket}/{self.prefix}"
        self._stack = contextlib.AsyncExitStack()
        self._client = None
        self._tmp: tempfile.TemporaryDirectory | None = None

    def staging(self) -> Path:
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="herdwick-archive-")
        return Path(self._tmp.name)

    async def _s3(self):
        if self._client is None:
            from aiobotocore.session import get_session

            self._client = await self._stack.enter_async_context(
                get_session().create_client("s3", endpoint_url=self.endpoint))
        return self._client

    @contextlib.asynccontextmanager
    async def _translated(self, what: str):
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            yield
        except (BotoCoreError, ClientError, OSError) as exc:
            raise ArchiveUnavailable(f"{self.url}: {what}: {exc}") from exc

    async def check(self) -> None:
        # A bucket may be readable and still refuse these credentials a PUT: only a write
        # proves it. The probe's key is always the same, so probes leave one small object.
        async with self._translated("write check"):
            await (await self._s3()).put_object(Bucket=self.bucket, Key=self.prefix + PROBE,
                                                Body=b"")

    async def put(self, key: str, path: Path) -> str:
        suffix = next((s for s in S3_CONTENT_TYPE if key.endswith(s)), "")
        async with self._translated(f"put {key}"):
            body = await asyncio.to_thread(path.read_bytes)
            await (await self._s3()).put_object(
                Bucket=self.bucket, Key=self.prefix + key, Body=body,
                ContentType=S3_CONTENT_TYPE.get(suffix, "application/octet-stream"))
        await asyncio.to_thread(path.unlink, missing_ok=True)
        return f"s3://{self.bucket}/{self.prefix}{key}"

    async def get(self, key: str) -> bytes:
        async with self._translated(f"get {key}"):
            reply = await (await self._s3()).get_object(Bucket=self.bucket,
                                                        Key=self.prefix + key)
            async with reply["Body"] as body:
                return await body.read()

    async def keys(self, prefix: str) -> list[str]:
        found: list[str] = []
        async with self._translated("list"):
            pages = (await self._s3()).get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self.prefix + prefix)
            async for page in pages:
                found += [o["Key"][len(self.prefix):] for o in page.get("Contents", [])]
        return sorted(found)

    async def close(self) -> None:
        await self._stack.aclose()
        self._client = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
