"""Domain errors. The gateway's one error middleware maps each to problem+json."""

from __future__ import annotations

import msgspec

from herdwick.model import FieldError

ROW_ERROR_MESSAGE_MAX = 1_000
_encode = msgspec.json.Encoder().encode


def row_error(kind: str, exc: BaseException | str) -> str:
    """What is recorded on a row an actor could not process: {"type", "message"}, JSON text."""
    message = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    return _encode({"type": kind, "message": message[:ROW_ERROR_MESSAGE_MAX]}).decode()


class HerdwickError(Exception):
    """Base of every error herdwick raises on purpose."""


class StorageUnavailable(HerdwickError):
    """Postgres or Redis could not be reached or dropped the connection.

    The operation's outcome is unknown to the caller only when the connection
    dropped during a commit; every write path is safe to retry (idempotency
    keys, ON CONFLICT guards).
    """


class PartitionAttached(StorageUnavailable):
    """A row was routed to the default executions partition while its day's own partition
    was being attached: the attach has committed by the time this is raised, so the same
    transaction run again puts the row where it belongs."""


class Rejected(HerdwickError):
    """Postgres refused what a statement carried (a value out of range, a check that
    failed): the same statement would fail again, so callers isolate the row, not retry."""


class NotFound(HerdwickError):
    """The thing does not exist, or belongs to another tenant (never 403)."""


class Conflict(HerdwickError):
    """The object's state forbids the transition (resume a canceled job)."""


class VersionMismatch(HerdwickError):
    """The object is no longer at the version the caller read (If-Match): 412."""

    def __init__(self, message: str, current_version: int) -> None:
        super().__init__(message)
        self.current_version = current_version


class QuotaExceeded(HerdwickError):
    """The tenant is over a limit; retry_after_s says when to try again."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class IdempotencyKeyReused(HerdwickError):
    """Same Idempotency-Key, different request body."""


class InvalidInput(HerdwickError):
    """A request that decoded but is not acceptable; names every bad field."""

    def __init__(self, errors: list[FieldError], status: int = 422) -> None:
        super().__init__("; ".join(f"{e.field}: {e.message}" for e in errors))
        self.errors = errors
        self.status = status


class SchemaOutOfDate(HerdwickError):
    """The database schema is behind this herdwick; run `herdwick migrate`."""
