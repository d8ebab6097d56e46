"""Herdwick-Signature: what the http worker signs, a receiver checks, and what fails and why."""

from __future__ import annotations

import hashlib
import hmac

import msgspec
import pytest

import herdwick
from herdwick.signing import (
    SignatureError,
    SigningKeys,
    signature_header,
    verify_signature,
)

OLD = "whsec_old-secret"
NEW = "whsec_new-secret"
BODY = b'{"to":"a@example.com","n":1}'
T = 1_800_000_000


def test_a_header_is_stripes_scheme_keyed_with_the_whole_secret() -> None:
    header = signature_header([NEW], BODY, T)
    expected = hmac.new(NEW.encode(), f"{T}.".encode() + BODY, hashlib.sha256).hexdigest()
    assert header == f"t={T},v1={expected}"


def test_one_secret_round_trips() -> None:
    verify_signature(NEW, signature_header([NEW], BODY, T), BODY, now=T)


def test_during_an_overlap_either_secret_verifies_the_two_signature_header() -> None:
    header = signature_header([NEW, OLD], BODY, T)
    # The new secret's signature first, then the old one's.
    assert header == signature_header([NEW], BODY, T) + "," + signature_header(
        [OLD], BODY, T).split(",")[1]
    verify_signature(NEW, header, BODY, now=T)  # a receiver that switched already
    verify_signature(OLD, header, BODY, now=T)  # one that has not yet
    verify_signature([OLD, NEW], header, BODY, now=T)
    verify_signature([NEW], signature_header([NEW], BODY, T), BODY, now=T)
    with pytest.raises(SignatureError, match="no v1 signature matches"):
        verify_signature(OLD, signature_header([NEW], BODY, T), BODY, now=T)


def test_a_tampered_body_fails() -> None:
    header = signature_header([NEW], BODY, T)
    with pytest.raises(SignatureError, match="no v1 signature matches"):
        verify_signature(NEW, header, BODY.replace(b"1", b"2"), now=T)


def test_a_str_body_is_its_utf8_bytes() -> None:
    body = '{"name":"café"}'
    verify_signature(NEW, signature_header([NEW], body.encode(), T), body, now=T)


@pytest.mark.parametrize(("skew", "ok"), [(0, True), (300, True), (-300, True), (301, False),
                                          (-301, False), (86_400, False)])
def test_a_timestamp_passes_within_the_tolerance_either_side(skew: int, ok: bool) -> None:
    header = signature_header([NEW], BODY, T)
    if ok:
        verify_signature(NEW, header, BODY, now=T + skew)
    else:
        with pytest.raises(SignatureError, match="outside the tolerance of 300 s"):
            verify_signature(NEW, header, BODY, now=T + skew)


def test_the_tolerance_is_the_receivers_to_set_or_turn_off() -> None:
    header = signature_header([NEW], BODY, T)
    verify_signature(NEW, header, BODY, tolerance=3600, now=T + 3000)
    verify_signature(NEW, header, BODY, tolerance=None, now=T + 10**7)
    verify_signature(NEW, header, BODY, tolerance=0, now=T + 10**7)
    with pytest.raises(SignatureError, match="tolerance of 10 s"):
        verify_signature(NEW, header, BODY, tolerance=10, now=T + 11)


def test_the_default_clock_is_this_machines() -> None:
    with pytest.raises(SignatureError, match="outside the tolerance"):
        verify_signature(NEW, signature_header([NEW], BODY, T - 10**6), BODY)


def test_a_stale_header_with_a_forged_signature_says_it_does_not_match() -> None:
    # The signature is checked first: "stale" is only ever said of an authentic delivery.
    with pytest.raises(SignatureError, match="no v1 signature matches"):
        verify_signature(NEW, f"t={T},v1={'0' * 64}", BODY, now=T + 10**6)


def test_other_schemes_are_ignored_and_spaces_tolerated() -> None:
    v1 = signature_header([NEW], BODY, T).split(",")[1]
    verify_signature(NEW, f"t={T}, v0=deadbeef, {v1}, v2=abc", BODY, now=T)
    with pytest.raises(SignatureError, match="no v1= signature"):
        verify_signature(NEW, f"t={T},v0={v1[3:]}", BODY, now=T)


@pytest.mark.parametrize(("header", "reason"), [
    (None, "no Herdwick-Signature header"),
    ("", "no Herdwick-Signature header"),
    ("   ", "no Herdwick-Signature header"),
    ("v1=abc", "exactly one t="),
    (f"t={T},t={T},v1=abc", "exactly one t="),
    ("t=soon,v1=abc", "not a Unix time"),
    ("t=-5,v1=abc", "not a Unix time"),
    ("t=1e9,v1=abc", "not a Unix time"),
    ("t=" + "9" * 40 + ",v1=abc", "not a Unix time"),
    (f"t={T}", "no v1= signature"),
    (f"t={T},v1", "exactly one t=|no v1"),
    ("garbage", "exactly one t="),
])
def test_a_malformed_header_says_what_is_wrong(header, reason: str) -> None:
    with pytest.raises(SignatureError, match=reason):
        verify_signature(NEW, header, BODY, now=T)


def test_a_non_ascii_signature_is_a_mismatch_not_a_crash() -> None:
    with pytest.raises(SignatureError, match="no v1 signature matches"):
        verify_signature(NEW, f"t={T},v1=caf\u00e9\udcff", BODY, now=T)


def test_signature_errors_are_value_errors_and_exported_from_the_package() -> None:
    assert issubclass(SignatureError, ValueError)
    assert herdwick.verify_signature is verify_signature
    assert herdwick.SignatureError is SignatureError
    with pytest.raises(ValueError, match="non-empty secret"):
        verify_signature([], signature_header([NEW], BODY, T), BODY)
    with pytest.raises(ValueError, match="at least one secret"):
        signature_header([], BODY, T)


# --- SigningKeys: the Redis form ----------------------------------------------------------


def test_keys_sign_with_the_previous_secret_until_its_end_only() -> None:
    keys = SigningKeys(current=NEW, previous=OLD, previous_until_ms=5_000)
    assert keys.active(4_999) == [NEW, OLD]
    assert keys.active(5_000) == [NEW]
    assert SigningKeys(current=NEW).active(0) == [NEW]
    assert SigningKeys(current=NEW, previous=OLD).active(0) == [NEW]  # no end: never


def test_a_header_from_the_active_keys_verifies_with_either_secret() -> None:
    keys = SigningKeys(current=NEW, previous=OLD, previous_until_ms=(T + 60) * 1000)
    header = signature_header(keys.active(T * 1000), BODY, T)
    for secret in (NEW, OLD):
        verify_signature(secret, header, BODY, now=T)


def test_keys_encode_as_compact_json_and_decode_back() -> None:
    keys = SigningKeys(current=NEW, previous=OLD, previous_until_ms=1_800_000_000_000)
    encoded = keys.encode()
    assert encoded == (b'{"current":"whsec_new-secret","previous":"whsec_old-secret",'
                       b'"previous_until_ms":1800000000000}')
    assert SigningKeys.decode(encoded) == keys
    assert SigningKeys.decode(encoded.decode()) == keys
    assert SigningKeys.decode(SigningKeys(current=NEW).encode()) == SigningKeys(current=NEW)


@pytest.mark.parametrize("raw", [b"", b"not json", b"{}", b'{"current":""}', b"[1]",
                                 b'{"current":"x","previous_until_ms":"soon"}'])
def test_what_is_not_keys_fails_to_decode(raw: bytes) -> None:
    with pytest.raises(msgspec.DecodeError):
        SigningKeys.decode(raw)
