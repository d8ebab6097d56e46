"""JSON bodies to msgspec structs, with every failure a named 400 or 422."""

from __future__ import annotations

from typing import Any

import msgspec

from herdwick.gateway.problems import bad_field, from_validation_error, invalid
from herdwick.model import FieldError

MAX_DEPTH_MESSAGE = "nested too deeply"
# An integer field is a float that must be a multiple of 1 to msgspec (herdwick/model.py
# WholeNumber); its message for 5.5 should say what the field takes.
_WHOLE = "`float` that's a multiple of 1.0"


def decode_collecting(decoder: msgspec.json.Decoder, raw: bytes,
                      prefix: str = "") -> tuple[Any, list[FieldError]]:
    """Decode, returning field errors instead of raising them (batches collect them all).

    Malformed JSON still raises: there is no field to name inside broken syntax.
    """
    try:
        return decoder.decode(raw), []
    except msgspec.ValidationError as exc:
        error = from_validation_error(exc, prefix)
        return None, [FieldError(field=error.field,
                                 message=error.message.replace(_WHOLE, "an integer"))]
    except msgspec.DecodeError as exc:
        raise bad_field(prefix or "body", f"malformed JSON: {exc}", status=400) from None
    except RecursionError:
        raise bad_field(prefix or "body", MAX_DEPTH_MESSAGE, status=400) from None


def decode(decoder: msgspec.json.Decoder, raw: bytes) -> Any:
    value, errors = decode_collecting(decoder, raw)
    if errors:
        raise invalid(errors)
    return value
