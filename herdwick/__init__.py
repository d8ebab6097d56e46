"""herdwick: a distributed, multi-tenant job scheduler.

The worker SDK is importable from here (`herdwick.Worker`, `herdwick.Permanent`,
`herdwick.RetryAfter`, `herdwick.Defer`, `herdwick.Context`, `herdwick.LeaseLost`), and
so is what an http target's receiver needs to check a delivery
(`herdwick.verify_signature`, `herdwick.SignatureError`).
Each is loaded on first use, so that `import herdwick.<module>` stays free of the
Redis client.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from herdwick.signing import SignatureError, verify_signature
    from herdwick.worker import Context, Defer, LeaseLost, Permanent, RetryAfter, Worker

# Each name exported here, and the module that defines it.
_EXPORTS = {
    "Context": "herdwick.worker",
    "LeaseLost": "herdwick.worker",
    "Permanent": "herdwick.worker",
    "Worker": "herdwick.worker",
    "RetryAfter": "herdwick.worker",
    "Defer": "herdwick.worker",
    "SignatureError": "herdwick.signing",
    "verify_signature": "herdwick.signing",
}
__all__ = ["Context", "Defer", "LeaseLost", "Permanent", "RetryAfter", "SignatureError", "Worker",
           "verify_signature"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'herdwick' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
