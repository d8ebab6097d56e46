"""JSON bodies to msgspec structs, with every failure a named 400 or 422."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from herdwick.gateway.problems import bad_field, from_validation_error, invalid
from herdwick.model import FieldError

MAX_DEPTH_MESSAGE = "nested too deeply"
DUPLICATE_MESSAGE = "this key is given twice in one object"
# An integer field is a float that must be a multiple of 1 to msgspec (herdwick/model.py
# WholeNumber); its message for 5.5 should say what the field takes.
_WHOLE = "`float` that's a multiple of 1.0"


class _Duplicate(Exception):
    pass


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found = dict(pairs)
    if len(found) != len(pairs):
        raise _Duplicate
    return found


def _first_duplicate(node: Any, path: str) -> str | None:
    """The path of the first key that an object holds twice (objects kept as pair lists)."""
    if isinstance(node, _Pairs):
        seen: set[str] = set()
        for key, value in node:
            here = f"{path}.{key}" if path else key
            if key in seen:
                return here
            seen.add(key)
            if (found := _first_duplicate(value, here)) is not None:
                return found
    elif isinstance(node, list):
        for i, value in enumerate(node):
            if (found := _first_duplicate(value, f"{path}[{i}]")) is not None:
                return found
    return None


class _Pairs(list):
    pass


def duplicate_key(raw: bytes) -> str | None:
    """The field (`payload.a`, `jobs[3].name`) of the first key an object of this JSON
    holds twice, or None. msgspec keeps the last of two and jsonb too, so without this a
    body would mean one thing to a proxy or log that reads the first and another to us.

    The stdlib parser, for its object_pairs_hook: a second pass over a body msgspec has
    already taken (so well formed and not too deep), about as long as msgspec's own.
    The path is found only once a duplicate is known, by parsing again keeping pairs.
    """
    try:
        json.loads(raw, object_pairs_hook=_unique_object)
        return None
    except _Duplicate:
        return _first_duplicate(json.loads(raw, object_pairs_hook=_Pairs), "") or "body"
    except (ValueError, RecursionError):
        return None  # what msgspec took and this parser does not: msgspec's answer stands


def decode_collecting(decoder: msgspec.json.Decoder, raw: bytes,
                      prefix: str = "", *, duplicates: bool = True) -> tuple[Any, list[FieldError]]:
    """Decode, returning field errors instead of raising them (batches collect them all).

    Malformed JSON still raises: there is no field to name inside broken syntax. A key
    given twice in one object is a field error (duplicates=False: the caller checked).
    """
    try:
        value = decoder.decode(raw)
        if duplicates and (field := duplicate_key(raw)) is not None:
            return None, [FieldError(field=".".join(p for p in (prefix, field) if p)
                                     .replace(".[", "["), message=DUPLICATE_MESSAGE)]
        return value, []
    except msgspec.ValidationError as exc:
        # msgspec checks a field as it reaches it, before it has seen the rest of the text:
        # a body that is not JSON at all is 400 for that, whatever field came first.
        well_formed(raw, prefix)
        error = from_validation_error(exc, prefix)
        return None, [FieldError(field=error.field,
                                 message=error.message.replace(_WHOLE, "an integer"))]
    except msgspec.DecodeError as exc:
        raise bad_field(prefix or "body", f"malformed JSON: {exc}", status=400) from None
    except RecursionError:
        raise bad_field(prefix or "body", MAX_DEPTH_MESSAGE, status=400) from None


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def well_formed(raw: bytes, prefix: str = "") -> None:
    """400 unless raw is JSON text: asked only once a field was refused, so it costs
    nothing on the way to a 201. The stdlib parser, as msgspec's untyped one refuses a
    number past a float's range (1e309), which is JSON, and a field's to refuse (422)."""
    try:
        json.loads(raw, parse_constant=_no_constant)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError: not JSON, not UTF-8
        raise bad_field(prefix or "body", f"malformed JSON: {exc}", status=400) from None
    except RecursionError:
        raise bad_field(prefix or "body", MAX_DEPTH_MESSAGE, status=400) from None


def decode(decoder: msgspec.json.Decoder, raw: bytes) -> Any:
    value, errors = decode_collecting(decoder, raw)
    if errors:
        raise invalid(errors)
    return value
