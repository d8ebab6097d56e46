"""Submit-time lookups of http targets' names: a name that resolves to a refused address is a 422.

A submit looks up the distinct names of its http targets at once, for at most
LOOKUP_TIMEOUT_S in all, and checks every address each resolves to with
herdwick.ssrf. A name that does not resolve in that time, or at all, is
accepted: delivery resolves it again through ssrf.GuardedResolver, and that
check, not this one, decides where a request may go (DNS answers change).
This one tells a tenant early that a target can never be delivered.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from datetime import datetime, timedelta

import yarl

from herdwick import logs, ssrf
from herdwick.clock import Clock

log = logs.get("herdwick.gateway")

LOOKUP_TIMEOUT_S = 2.0  # for all of one submit's names together
CACHE_TTL_S = 30.0
CACHE_MAX_NAMES = 1024
MAX_LOOKUPS = 32  # in flight across the gateway; a name past it is left to delivery


def target_name(ref: str) -> str | None:
    """The name an http target's URL resolves, as aiohttp will ask for it (yarl's IDNA
    form); None for a literal address or a URL that does not parse."""
    try:
        host = yarl.URL(ref).raw_host
    except (ValueError, TypeError):
        return None
    if not host or ssrf.parse_host(host) is not None:
        return None
    return host


class TargetDns:
    """Looks names up for the submit handlers, remembering each answer CACHE_TTL_S.

    Only the event loop's tasks touch it, so it needs no lock. A lookup outlives
    the submit that started it when that submit stops waiting (getaddrinfo's
    thread cannot be stopped): its answer still lands in the cache, and the next
    submit naming it joins it instead of starting another. close() cancels them.
    """

    def __init__(self, allow: Iterable[ssrf.Network], clock: Clock, *,
                 resolve: ssrf.Resolve | None = None, timeout_s: float = LOOKUP_TIMEOUT_S,
                 ttl_s: float = CACHE_TTL_S, max_names: int = CACHE_MAX_NAMES,
                 max_lookups: int = MAX_LOOKUPS) -> None:
        self._allow = tuple(allow)
        self._clock = clock
        self._resolve = resolve
        self._timeout_s = timeout_s
        self._ttl = timedelta(seconds=ttl_s)
        self._max_names = max_names
        self._max_lookups = max_lookups
        # name -> (when the answer expires, why it is refused or None), oldest first
        self._answers: dict[str, tuple[datetime, ssrf.TargetRefused | None]] = {}
        self._lookups: dict[str, asyncio.Task[ssrf.TargetRefused | None]] = {}

    async def refusals(self, names: Iterable[str]) -> dict[str, ssrf.TargetRefused]:
        """The names that resolve to a refused address, each with why; a name that does
        not resolve within the timeout, or at all, is not among them."""
        now = self._clock.now()
        refused: dict[str, ssrf.TargetRefused] = {}
        waiting: dict[asyncio.Task[ssrf.TargetRefused | None], str] = {}
        for name in set(names):
            answer = self._answers.get(name)
            if answer is not None and answer[0] > now:
                if answer[1] is not None:
                    refused[name] = answer[1]
                continue
            task = self._lookups.get(name) or self._start(name)
            if task is not None:
                waiting[task] = name
        if waiting:
            await asyncio.wait(waiting, timeout=self._timeout_s)
        for task, name in waiting.items():
            if task.done() and not task.cancelled() and task.result() is not None:
                refused[name] = task.result()
        return refused

    def _start(self, name: str) -> asyncio.Task[ssrf.TargetRefused | None] | None:
        if len(self._lookups) >= self._max_lookups:
            log.debug("target_lookup_skipped", host=name, in_flight=len(self._lookups))
            return None
        task = asyncio.create_task(self._look_up(name))
        self._lookups[name] = task
        task.add_done_callback(lambda _: self._lookups.pop(name, None))
        return task

    async def _look_up(self, name: str) -> ssrf.TargetRefused | None:
        try:
            await ssrf.check_host(name, 0, self._allow, resolve=self._resolve)
        except ssrf.TargetRefused as exc:
            outcome: ssrf.TargetRefused | None = exc
        except (OSError, ValueError) as exc:  # NXDOMAIN, timeout, a label IDNA refuses
            log.debug("target_lookup_failed", host=name, error=str(exc))
            return None  # not remembered: the next submit asks again
        except Exception as exc:  # a resolver's own bug must not make a submit a 500
            log.warning("target_lookup_error", host=name, error=repr(exc))
            return None  # checked again at delivery
        else:
            outcome = None
        self._remember(name, outcome)
        return outcome

    def _remember(self, name: str, outcome: ssrf.TargetRefused | None) -> None:
        self._answers.pop(name, None)
        while len(self._answers) >= self._max_names:
            del self._answers[next(iter(self._answers))]
        self._answers[name] = (self._clock.now() + self._ttl, outcome)

    async def close(self) -> None:
        tasks = list(self._lookups.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
