"""Signed HTTP deliveries: the Herdwick-Signature header, made and checked (Stripe's scheme).

A delivery carries `Herdwick-Signature: t=<unix seconds>,v1=<hex>`, the v1 being the
HMAC-SHA256 of `<t>.<raw body>` keyed with the tenant's signing secret (its whole text,
`whsec_` included, as UTF-8). During a rotation's overlap both secrets sign, newest first
(`t=...,v1=<new>,v1=<old>`), and a receiver accepts if any v1 matches any secret it knows.

No I/O here: the http worker signs with the SigningKeys storage/signing.py keeps in Redis,
and receivers check with `verify_signature` (importable as `herdwick.verify_signature`).
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Sequence
from typing import Annotated

import msgspec

HEADER = "Herdwick-Signature"
SCHEME = "v1"
TOLERANCE_S = 300  # how far a delivery's t may be from the receiver's clock, either way
_MAX_TIMESTAMP_DIGITS = 12  # past the year 33658: anything longer is garbage, not a time

Secret = Annotated[str, msgspec.Meta(min_length=1)]


class SignatureError(ValueError):
    """A delivery's signature does not check out; the message says why."""


class SigningKeys(msgspec.Struct, frozen=True):
    """A tenant's signing secrets as the http workers read them (one field of a Redis hash).

    `previous` is the secret a rotation replaced; it signs too while now is before
    `previous_until_ms` (Unix milliseconds). A `previous` without an end is never used.
    """

    current: Secret
    previous: Secret | None = None
    previous_until_ms: int | None = None

    def active(self, now_ms: int) -> list[str]:
        """The secrets to sign with at now_ms: the current one first, then the previous."""
        if (self.previous is not None and self.previous_until_ms is not None
                and now_ms < self.previous_until_ms):
            return [self.current, self.previous]
        return [self.current]

    def encode(self) -> bytes:
        return _encoder.encode(self)

    @classmethod
    def decode(cls, data: bytes | str) -> SigningKeys:
        """Raises msgspec.DecodeError (a ValidationError too) for anything not ours."""
        return _decoder.decode(data)


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(SigningKeys)


def _digest(secret: str, body: bytes, timestamp: str) -> str:
    signed = timestamp.encode() + b"." + body
    return hmac.digest(secret.encode(), signed, "sha256").hex()  # OpenSSL's one-shot: fast


def _raw(body: bytes | bytearray | memoryview | str) -> bytes:
    return body.encode() if isinstance(body, str) else bytes(body)


def signature_header(secrets: Sequence[str], body: bytes, timestamp: int) -> str:
    """`t=<timestamp>,v1=<hex>[,v1=<hex>...]`, one v1 a secret, in the order given."""
    if not secrets:
        raise ValueError("signature_header needs at least one secret")
    t = str(int(timestamp))
    raw = _raw(body)
    return ",".join([f"t={t}", *(f"{SCHEME}={_digest(s, raw, t)}" for s in secrets)])


def _parse(header: str | None) -> tuple[str, list[str]]:
    """The header's t (digits, as sent) and its v1 values; other schemes are ignored."""
    if not header or not header.strip():
        raise SignatureError(f"no {HEADER} header")
    stamps: list[str] = []
    signatures: list[str] = []
    for item in header.split(","):
        key, _, value = item.strip().partition("=")
        if key == "t":
            stamps.append(value.strip())
        elif key == SCHEME:
            signatures.append(value.strip())
    if len(stamps) != 1:
        raise SignatureError(f"malformed {HEADER} header: it needs exactly one t=")
    stamp = stamps[0]
    if not (stamp.isascii() and stamp.isdigit()) or len(stamp) > _MAX_TIMESTAMP_DIGITS:
        raise SignatureError(f"malformed {HEADER} header: t= is not a Unix time in seconds")
    if not signatures:
        raise SignatureError(f"malformed {HEADER} header: no {SCHEME}= signature")
    return stamp, signatures


def verify_signature(secrets: str | Sequence[str], header: str | None,
                     body: bytes | str, tolerance: int | None = TOLERANCE_S, *,
                     now: float | None = None) -> None:
    """Check a delivery's Herdwick-Signature header; raise SignatureError if it fails.

    `secrets` is the tenant's signing secret, or every secret you accept (during a
    rotation: the new and the old). `body` is the request body exactly as received (a
    str is taken as its UTF-8 bytes; parse JSON only after this check). The delivery
    passes when any v1 matches any secret, compared in constant time, and its t is
    within `tolerance` seconds of `now` (default: this machine's clock), either side;
    a tolerance of None or 0 skips the time check (replays are then yours to stop).
    Schemes other than v1 (say v0=) are ignored, as Stripe's libraries do.
    """
    keys = [secrets] if isinstance(secrets, str) else list(secrets)
    if not keys or not all(keys):
        raise ValueError("verify_signature needs at least one non-empty secret")
    stamp, signatures = _parse(header)
    raw = _raw(body)
    expected = [_digest(secret, raw, stamp).encode() for secret in keys]
    given = [s.encode("utf-8", "replace") for s in signatures]
    if not any(hmac.compare_digest(e, g) for e in expected for g in given):
        raise SignatureError("no v1 signature matches the body with the given secrets")
    if tolerance:
        skew = abs((time.time() if now is None else now) - int(stamp))
        if skew > tolerance:
            raise SignatureError(f"timestamp is {skew:.0f} s from now, outside the "
                                 f"tolerance of {tolerance} s")
