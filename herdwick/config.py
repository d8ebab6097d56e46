"""Configuration (CONTRACT.md): environment variables, each also a CLI flag."""

from __future__ import annotations

import ipaddress
import os
import re
import urllib.parse
from collections.abc import Mapping
from typing import Annotated

import msgspec
from msgspec import Meta

from herdwick import redis_url
from herdwick.redaction import redacted

DEFAULT_KEY_PREFIX = "hw"
DEFAULT_API_HOST = "127.0.0.1"
DEFAULT_API_PORT = 8080
DISPATCH_ORDERS = ("fair", "fifo")
DEFAULT_DISPATCH_ORDER = "fair"
DEFAULT_READY_MAX = "auto"
MIN_READY_MAX = 1
MAX_READY_MAX = 100_000_000
DEFAULT_HERD_WARN_JOBS = 1000
DEFAULT_RETENTION_DAYS = 30
MAX_RETENTION_DAYS = 36_500
# Relative to the scheduler's working directory: fine for one node; with several, each
# archives where it runs, so production sets a shared directory or an s3:// bucket.
DEFAULT_ARCHIVE_URL = "./archive"
# A replica whose replay is further behind the primary than this serves no read: the
# gateway reads from the primary instead. At most MAX_READ_LAG_S: the tenants' write marks
# in Redis live that long (storage/write_marks.py), and a replica may be trusted only over
# a span the marks cover.
DEFAULT_READ_MAX_LAG_S = 5.0
MAX_READ_LAG_S = 60.0
# HERDWICK_DB_POOL_MAX's floor: the scheduler's dispatch actors, event folder and shard
# loads each hold a connection at once, and fewer would make them take turns.
MIN_DB_POOL_MAX = 4
MAX_DB_POOL_MAX = 1000
# A read URL starts where a postgres scheme follows a comma: a comma elsewhere belongs to
# the URL (a multi-host DSN, which a read URL may not be, is then refused by name).
_READ_URL_SPLIT = re.compile(r",\s*(?=postgres(?:ql)?://)")
_KEY_PREFIX = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")

Port = Annotated[int, Meta(ge=0, le=65535)]


class ConfigError(ValueError):
    """A setting is missing or malformed; the message names the variable."""


class Settings(msgspec.Struct, kw_only=True, frozen=True):
    """Every setting of every process. Build with `from_env`; validates itself."""

    database_url: str | None = None
    # Read replicas for the gateway's history reads: one or more postgres:// URLs, comma-
    # separated, each naming one server (gateway/reads.py). None: every read on the primary.
    read_database_url: str | None = None
    read_max_lag_s: float = DEFAULT_READ_MAX_LAG_S
    redis_url: str | None = None
    key_prefix: str = DEFAULT_KEY_PREFIX
    admin_token: str | None = None
    http_allow: tuple[str, ...] = ()
    api_host: str = DEFAULT_API_HOST
    api_port: Port = DEFAULT_API_PORT
    dispatch_order: str = DEFAULT_DISPATCH_ORDER
    ready_max: str = DEFAULT_READY_MAX
    herd_warn_jobs: int = DEFAULT_HERD_WARN_JOBS  # a tenant's jobs due in one second that warn
    retention_days: int = DEFAULT_RETENTION_DAYS  # executions older than this leave by whole days
    archive_url: str = DEFAULT_ARCHIVE_URL  # where they are archived first: a directory or s3://
    archive_s3_endpoint: str | None = None  # an S3-compatible server; None: AWS or AWS_ENDPOINT_URL
    db_pool_max: int | None = None  # a process's Postgres connections; None: its kind's default

    def __post_init__(self) -> None:
        if self.herd_warn_jobs < 1:
            raise ConfigError(f"HERDWICK_HERD_WARN_JOBS must be at least 1, "
                              f"not {self.herd_warn_jobs}")
        if self.db_pool_max is not None and not \
                MIN_DB_POOL_MAX <= self.db_pool_max <= MAX_DB_POOL_MAX:
            raise ConfigError(f"HERDWICK_DB_POOL_MAX must be {MIN_DB_POOL_MAX} to "
                              f"{MAX_DB_POOL_MAX}, not {self.db_pool_max}")
        if self.dispatch_order not in DISPATCH_ORDERS:
            raise ConfigError(f"HERDWICK_DISPATCH_ORDER must be one of "
                              f"{', '.join(DISPATCH_ORDERS)}, not {self.dispatch_order!r}")
        self.ready_caps  # noqa: B018 - validates HERDWICK_READY_MAX
        if not _KEY_PREFIX.match(self.key_prefix):
            raise ConfigError(
                "HERDWICK_KEY_PREFIX must be 1-64 characters of letters, digits and _ . : - "
                "(no braces: they are the Redis Cluster hash tag)")
        for cidr in self.http_allow:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError:
                raise ConfigError(f"HERDWICK_HTTP_ALLOW: {cidr!r} is not a CIDR") from None
        if self.admin_token is not None and len(self.admin_token) < 16:
            raise ConfigError("HERDWICK_ADMIN_TOKEN must be at least 16 characters")
        if not 1 <= self.retention_days <= MAX_RETENTION_DAYS:
            raise ConfigError(f"HERDWICK_RETENTION_DAYS must be 1 to {MAX_RETENTION_DAYS}, "
                              f"not {self.retention_days}")
        _check_archive_url(self.archive_url)
        if self.redis_url and redis_url.is_cluster_url(self.redis_url):
            try:
                redis_url.cluster_seeds(self.redis_url)
            except redis_url.BadRedisUrl as exc:
                raise ConfigError(f"HERDWICK_REDIS_URL: {exc}") from None
        self.read_database_urls  # noqa: B018 - validates HERDWICK_READ_DATABASE_URL
        if not 0 < self.read_max_lag_s <= MAX_READ_LAG_S:
            raise ConfigError(f"HERDWICK_READ_MAX_LAG_S must be above 0 and at most "
                              f"{MAX_READ_LAG_S:g} seconds, not {self.read_max_lag_s:g}")
        if self.archive_s3_endpoint is not None and urllib.parse.urlsplit(
                self.archive_s3_endpoint).scheme not in ("http", "https"):
            raise ConfigError("HERDWICK_ARCHIVE_S3_ENDPOINT must be an http:// or https:// URL")

    def require_database(self) -> None:
        if not self.database_url:
            raise ConfigError("HERDWICK_DATABASE_URL is not set (a Postgres DSN)")

    def require_redis(self) -> None:
        if not self.redis_url:
            raise ConfigError("HERDWICK_REDIS_URL is not set (a Redis URL)")

    def require_services(self) -> None:
        """Production processes refuse to start without both URLs."""
        self.require_database()
        self.require_redis()

    @property
    def ready_caps(self) -> tuple[int, dict[str, int]]:
        """(every pool's bound, per-pool bounds) of HERDWICK_READY_MAX; 0 is the default bound,
        from the workers' lease rate."""
        default, pools = 0, {}
        for part in (p.strip() for p in self.ready_max.split(",") if p.strip()):
            pool, _, value = part.rpartition("=")
            try:
                cap = 0 if value == "auto" else int(value)
            except ValueError:
                cap = -1
            if cap < 0 or (cap and not MIN_READY_MAX <= cap <= MAX_READY_MAX):
                raise ConfigError(
                    f"HERDWICK_READY_MAX: {part!r}: a bound is auto or {MIN_READY_MAX}.."
                    f"{MAX_READY_MAX}, for every pool or as pool=bound")
            if pool:
                pools[pool] = cap
            else:
                default = cap
        return default, pools

    @property
    def read_database_urls(self) -> tuple[str, ...]:
        """HERDWICK_READ_DATABASE_URL as its URLs; () when unset."""
        if not self.read_database_url or not self.read_database_url.strip():
            return ()
        urls = tuple(u.strip() for u in _READ_URL_SPLIT.split(self.read_database_url.strip()))
        for url in urls:
            parts = urllib.parse.urlsplit(url)
            if parts.scheme not in ("postgres", "postgresql"):
                raise ConfigError(f"HERDWICK_READ_DATABASE_URL: {url[:80]!r} is not a "
                                  "postgresql:// URL")
            hosts = parts.netloc.rpartition("@")[2]
            if "," in hosts or "host=" in parts.query:
                # The gateway samples each replica's replay position over one connection and
                # reads through others: they must reach the same server.
                raise ConfigError(f"HERDWICK_READ_DATABASE_URL: {redacted(url)!r} does "
                                  "not name one host; give each replica a URL of its own")
        return urls

    @property
    def http_allow_networks(self) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
        return tuple(ipaddress.ip_network(c, strict=False) for c in self.http_allow)


# setting name -> environment variable
ENV = {
    "database_url": "HERDWICK_DATABASE_URL",
    "read_database_url": "HERDWICK_READ_DATABASE_URL",
    "read_max_lag_s": "HERDWICK_READ_MAX_LAG_S",
    "redis_url": "HERDWICK_REDIS_URL",
    "key_prefix": "HERDWICK_KEY_PREFIX",
    "admin_token": "HERDWICK_ADMIN_TOKEN",
    "http_allow": "HERDWICK_HTTP_ALLOW",
    "api_host": "HERDWICK_API_HOST",
    "api_port": "HERDWICK_API_PORT",
    "dispatch_order": "HERDWICK_DISPATCH_ORDER",
    "ready_max": "HERDWICK_READY_MAX",
    "herd_warn_jobs": "HERDWICK_HERD_WARN_JOBS",
    "retention_days": "HERDWICK_RETENTION_DAYS",
    "archive_url": "HERDWICK_ARCHIVE_URL",
    "archive_s3_endpoint": "HERDWICK_ARCHIVE_S3_ENDPOINT",
    "db_pool_max": "HERDWICK_DB_POOL_MAX",
}


def _check_archive_url(url: str) -> None:
    """A directory path, a file:// URL or s3://bucket[/prefix]: what storage/archive.py opens."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "s3":
        if not parts.netloc:
            raise ConfigError(f"HERDWICK_ARCHIVE_URL: {url!r} names no bucket (s3://bucket/prefix)")
    elif parts.scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path:
            raise ConfigError(f"HERDWICK_ARCHIVE_URL: {url!r} is not a local file:// path")
    elif len(parts.scheme) > 1 or not url:  # one letter: a Windows drive, a path
        raise ConfigError(f"HERDWICK_ARCHIVE_URL: {url!r} is not a directory, file:// or "
                          "s3:// URL")


def from_env(env: Mapping[str, str] | None = None, **overrides: object) -> Settings:
    """Settings from the environment, then from overrides (CLI flags) that are not None."""
    env = os.environ if env is None else env
    raw: dict[str, object] = {}
    for field, var in ENV.items():
        value = env.get(var)
        if value is None or value == "":
            continue
        raw[field] = _parse(field, var, value)
    raw.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return msgspec.convert(raw, Settings)
    except msgspec.ValidationError as exc:
        match = re.search(r"at `\$\.(\w+)`", str(exc))
        where = ENV.get(match.group(1), match.group(1)) if match else "configuration"
        raise ConfigError(f"{where}: {str(exc).split(' - at ')[0]}") from None


def _parse(field: str, var: str, value: str) -> object:
    if field == "http_allow":
        return tuple(part.strip() for part in value.split(",") if part.strip())
    if field == "api_port":
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"{var} must be a port number, got {value!r}") from None
    if field == "herd_warn_jobs":
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"{var} must be a whole number of jobs, got {value!r}") from None
    if field == "db_pool_max":
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"{var} must be a whole number of connections, "
                              f"got {value!r}") from None
    if field == "read_max_lag_s":
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"{var} must be a number of seconds, got {value!r}") from None
    if field == "retention_days":
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"{var} must be a whole number of days, got {value!r}") from None
    return value
