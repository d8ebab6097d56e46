"""Log lines: one event a line, as text (`event=name key=value ...`) or as JSON objects.

Every herdwick module logs through `get(name)`, naming the event and its
fields: `log.info("shard_claimed", shard=3, revision=7)`. The text format
renders that as `event=shard_claimed shard=3 revision=7` (values with spaces
or quotes are JSON-quoted); the json format as one object a line,
`{"ts": ..., "level": "info", "logger": "herdwick.shard", "event":
"shard_claimed", "shard": 3, "revision": 7}`. Ids go by the names
`tenant_id`, `job_id` and `execution_id` wherever they apply, so a log
search for one id finds every line about it. Lines of other libraries
(aiohttp, asyncio) carry their message as `message`.

HERDWICK_LOG_LEVEL (debug, info, warning, error; default info) and
HERDWICK_LOG_FORMAT (text, json; default text) choose, or `--log-level`
and `--log-format` on any command.
"""

from __future__ import annotations

import logging
import sys
from datetime import UTC, datetime
from typing import Any, TextIO

import msgspec

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
DEFAULT_LEVEL = "info"
DEFAULT_FORMAT = "text"
LEVEL_ENV = "HERDWICK_LOG_LEVEL"
FORMAT_ENV = "HERDWICK_LOG_FORMAT"
# The LogRecord attributes that carry an event's name and fields.
_EVENT = "hw_event"
_FIELDS = "hw_fields"


class EventLogger:
    """A logging.Logger that takes an event name and keyword fields."""

    __slots__ = ("_log",)

    def __init__(self, name: str) -> None:
        self._log = logging.getLogger(name)

    def debug(self, event: str, **fields: Any) -> None:
        self._emit(logging.DEBUG, event, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._emit(logging.INFO, event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._emit(logging.WARNING, event, fields)

    def error(self, event: str, **fields: Any) -> None:
        self._emit(logging.ERROR, event, fields)

    def exception(self, event: str, **fields: Any) -> None:
        """An error with the traceback of the exception being handled."""
        self._emit(logging.ERROR, event, fields, exc_info=True)

    def is_enabled(self, level: int) -> bool:
        return self._log.isEnabledFor(level)

    def _emit(self, level: int, event: str, fields: dict[str, Any],
              exc_info: bool = False) -> None:
        if self._log.isEnabledFor(level):
            # The message is the text form, so any handler (an SDK user's own logging set-up,
            # pytest's caplog) shows the fields; the JSON formatter reads them from the record.
            # stacklevel 3: the record names the caller of info(), not this module.
            self._log.log(level, "%s", text_line(event, fields),
                          extra={_EVENT: event, _FIELDS: fields}, exc_info=exc_info,
                          stacklevel=3)


def get(name: str) -> EventLogger:
    return EventLogger(name)


def _timestamp(record: logging.LogRecord) -> str:
    when = datetime.fromtimestamp(record.created, UTC)
    return when.strftime("%Y-%m-%dT%H:%M:%S.") + f"{when.microsecond // 1000:03d}Z"


def _text_value(value: Any) -> str:
    text = value if isinstance(value, str) else str(value)
    if not text or any(c in text for c in ' "=\n\t') or not text.isprintable():
        return msgspec.json.encode(text).decode()
    return text


def text_line(event: str, fields: dict[str, Any]) -> str:
    """`event=<name> key=value ...`: the message of every herdwick log record."""
    return " ".join([f"event={event}", *(f"{k}={_text_value(v)}" for k, v in fields.items())])


class TextFormatter(logging.Formatter):
    """`<time> <LEVEL> <logger> <message>`, a traceback on the lines after."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"{_timestamp(record)} {record.levelname} {record.name} {record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def _json_default(value: Any) -> Any:
    return str(value)


_json = msgspec.json.Encoder(enc_hook=_json_default)


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ts, level, logger, event and its fields (or message), exc."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {"ts": _timestamp(record), "level": record.levelname.lower(),
                                "logger": record.name}
        event = getattr(record, _EVENT, None)
        if event is None:
            line["message"] = record.getMessage()
        else:
            line["event"] = event
            for key, value in getattr(record, _FIELDS).items():
                line.setdefault(key, value)
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        try:
            return _json.encode(line).decode()
        except (TypeError, ValueError, OverflowError):  # a field msgspec cannot take
            return _json.encode({k: str(v) for k, v in line.items()}).decode()


class RetriedByTheLibrary(logging.Filter):
    """A library's warning about a failure it retries by itself, as one event line with the
    error, not a traceback a retry: asyncpg's pool refilling its floor while Postgres is
    away logs one at each retry, and a failover would bury every other line in them."""

    def __init__(self, event: str) -> None:
        super().__init__()
        self._event = event

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None:
            return True
        fields = {"error": f"{type(exc).__name__}: {exc}", "message": record.getMessage()}
        record.msg, record.args = "%s", (text_line(self._event, fields),)
        record.exc_info = record.exc_text = None
        setattr(record, _EVENT, self._event)
        setattr(record, _FIELDS, fields)
        return True


# logger -> the event its retried failures become (RetriedByTheLibrary)
_RETRIED = {"asyncpg.pool": "postgres_pool_refill_failed"}


def check(level: str, fmt: str) -> None:
    """Raise ValueError naming the variable for a level or format we do not know."""
    if level not in LEVELS:
        raise ValueError(f"{LEVEL_ENV} must be one of {', '.join(LEVELS)}, not {level!r}")
    if fmt not in FORMATS:
        raise ValueError(f"{FORMAT_ENV} must be one of {', '.join(FORMATS)}, not {fmt!r}")


def configure(level: str = DEFAULT_LEVEL, fmt: str = DEFAULT_FORMAT,
              stream: TextIO | None = None) -> None:
    """Route every logger (herdwick's and the libraries') to one handler on stderr."""
    check(level, fmt)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name, event in _RETRIED.items():
        library = logging.getLogger(name)
        if not any(isinstance(f, RetriedByTheLibrary) for f in library.filters):
            library.addFilter(RetriedByTheLibrary(event))
