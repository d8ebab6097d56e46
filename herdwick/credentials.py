"""API keys and signing secrets: random, and only ever stored hashed."""

from __future__ import annotations

import hashlib
import hmac
import secrets

API_KEY_PREFIX = "hwk_"
SIGNING_SECRET_PREFIX = "whsec_"
_RANDOM_BYTES = 32  # 256 bits, well over the 128 the contract asks for


def new_api_key() -> str:
    return API_KEY_PREFIX + secrets.token_urlsafe(_RANDOM_BYTES)


def new_signing_secret() -> str:
    return SIGNING_SECRET_PREFIX + secrets.token_urlsafe(_RANDOM_BYTES)


def hash_api_key(key: str) -> bytes:
    """sha256 is enough: the key is high-entropy random, not a password."""
    return hashlib.sha256(key.encode()).digest()


def same_secret(a: str | bytes, b: str | bytes) -> bool:
    """Constant-time comparison."""
    a = a.encode() if isinstance(a, str) else a
    b = b.encode() if isinstance(b, str) else b
    return hmac.compare_digest(a, b)
