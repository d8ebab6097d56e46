"""Identifiers: UUIDv7 (time-ordered, RFC 9562) and shard assignment."""

from __future__ import annotations

import os
import uuid
import zlib
from datetime import datetime

SHARD_COUNT = 256


def uuid7(now: datetime) -> uuid.UUID:
    """A UUIDv7 whose 48-bit prefix is `now` in Unix milliseconds; 74 random bits follow."""
    ms = int(now.timestamp() * 1000) & ((1 << 48) - 1)
    rand = int.from_bytes(os.urandom(10), "big")
    rand_a = rand >> 68 & 0xFFF  # 12 bits
    rand_b = rand & ((1 << 62) - 1)  # 62 bits
    value = ms << 80 | 0x7 << 76 | rand_a << 64 | 0b10 << 62 | rand_b
    return uuid.UUID(int=value)


def shard_of(job_id: uuid.UUID) -> int:
    """The logical shard (0..255) that owns a job, fixed for the job's life."""
    return zlib.crc32(job_id.bytes) % SHARD_COUNT
