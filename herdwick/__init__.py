"""herdwick: a distributed, multi-tenant job scheduler.

The worker SDK is importable from here (`herdwick.Worker`, `herdwick.Permanent`,
`herdwick.Context`, `herdwick.LeaseLost`), loaded on first use so that
`import herdwick.<module>` stays free of the Redis client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from herdwick.worker import Context, LeaseLost, Permanent, Worker

__all__ = ["Context", "LeaseLost", "Permanent", "Worker"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from herdwick import worker

        return getattr(worker, name)
    raise AttributeError(f"module 'herdwick' has no attribute {name!r}")
