"""Who goes next on a pool's ready stream: deficit round robin across tenants, by weight.

Pure: no I/O and no clock. The fair-queue actor (actors/fairqueue.py) owns one
policy per pool, feeds it due work as it falls due, and asks it for `budget`
items whenever the pool's stream has room.

Deficit round robin (Shreedhar and Varghese, 1995), with items as the unit:
the tenants with work wait in a ring; each visit adds `quantum x weight` to
the tenant's deficit and takes that many of its items (the earliest due
first), and an emptied tenant leaves the ring with its deficit forgotten. So
under contention tenants with weights 1:2:4 get 1:2:4 of the items, a tenant
with nothing waiting takes nothing and its share goes to the others in the
same pass, and a tenant that starts waiting joins the ring's end, served
within one pass. The quantum is the round's budget spread over the ring's
weight, so one pass fills about one round, and what a round leaves of a pass
the next one continues (the ring and the deficits persist). It costs O(1)
an item and hands out runs of one tenant's items, which keeps each dispatch
batch dense; virtual finish times would order item by item at O(log n)
each, for no fairer a share at these batch sizes.

Items are ints whose high bits are the due time, so a tenant's heap gives its
work in due order. Shards hand work over shortly before it falls due; `take`
and `due` count only items below a bound (those due by now), and a tenant
whose earliest item is not due yet sits the round out, as if it had none.
FifoPolicy is the contrast: one heap, every tenant's work in due order, no
shares (`HERDWICK_DISPATCH_ORDER=fifo`).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable

DEFAULT_WEIGHT = 1
NO_BOUND = float("inf")  # every item counts as due


def count_below(heap: list, bound, limit: int) -> int:
    """How many of a min-heap's items are below `bound`, up to `limit`: O(that many),
    walking only the subtrees whose roots are below it."""
    found, size, stack = 0, len(heap), [0]
    while stack and found < limit:
        i = stack.pop()
        if i < size and heap[i] < bound:
            found += 1
            stack += (2 * i + 1, 2 * i + 2)
    return found


class DrrPolicy:
    """Per-tenant heaps of items served by deficit round robin. Owned by one actor."""

    def __init__(self, weight_of: Callable[[str], int] | None = None) -> None:
        self._weight_of = weight_of or (lambda tenant: DEFAULT_WEIGHT)
        self._heaps: dict[str, list[int]] = {}
        # Each heap's largest item added, an upper bound however items leave: once it is
        # below the bound the whole heap is due, counted in O(1) (a herd's every round).
        self._top: dict[str, int] = {}
        self._ring: deque[str] = deque()  # tenants with work, in visiting order
        self._deficit: dict[str, float] = {}
        self._resuming = False  # the ring's head is mid-turn: no new quantum at its next visit
        self.backlog = 0

    def add(self, tenant: str, item: int) -> None:
        heap = self._heaps.get(tenant)
        if heap is None:
            heap = self._heaps[tenant] = []
            self._ring.append(tenant)  # a newcomer is visited within one pass
            self._deficit[tenant] = 0.0
            self._top[tenant] = item
        elif item > self._top[tenant]:
            self._top[tenant] = item
        heapq.heappush(heap, item)
        self.backlog += 1

    def put_back(self, tenant: str, items: Iterable[int]) -> None:
        """Items taken and not dispatched after all (no tokens): queued again, same place."""
        for item in items:
            self.add(tenant, item)

    def waiting(self, tenant: str) -> int:
        return len(self._heaps.get(tenant, ()))

    def tenants(self) -> list[str]:
        return list(self._ring)

    def due(self, bound=NO_BOUND, limit: int = 1 << 62) -> int:
        """How many items are below `bound` (due), up to `limit`."""
        found, top = 0, self._top
        for tenant, heap in self._heaps.items():
            if top[tenant] < bound:
                found += len(heap)
            elif heap[0] < bound:
                found += count_below(heap, bound, limit - found)
            if found >= limit:
                return limit
        return found

    def earliest(self) -> int | None:
        return min((heap[0] for heap in self._heaps.values()), default=None)

    def take(self, budget: int, eligible: Callable[[str], bool] | None = None,
             bound=NO_BOUND) -> list[tuple[str, int]]:
        """Up to `budget` items below `bound`, as (tenant, item), by weight among eligible
        tenants."""
        taken: list[tuple[str, int]] = []
        heaps = self._heaps
        ring = [t for t in self._ring
                if heaps[t][0] < bound and (eligible is None or eligible(t))]
        if budget <= 0 or not ring:
            return taken
        quantum = max(1.0, budget / sum(self._weight(t) for t in ring))
        skipped = 0  # ineligible visits in a row: a whole ring of them ends the round
        while budget > 0 and self._ring and skipped < len(self._ring):
            tenant = self._ring[0]
            heap = heaps[tenant]
            if heap[0] >= bound or (eligible is not None and not eligible(tenant)):
                self._next()
                skipped += 1
                continue
            skipped = 0
            if not self._resuming:  # a turn the last round cut short goes on as it was
                self._deficit[tenant] += quantum * self._weight(tenant)
            self._resuming = False
            count = min(int(self._deficit[tenant]), budget)
            pop, took = heapq.heappop, 0
            while took < count and heap and heap[0] < bound:
                taken.append((tenant, pop(heap)))
                took += 1
            self._deficit[tenant] -= took
            budget -= took
            self.backlog -= took
            if not heap:
                self._forget(tenant)
            elif heap[0] >= bound:  # nothing more due: as if emptied, it keeps no credit
                self._deficit[tenant] = 0.0
                self._next()
            elif budget == 0 and self._deficit[tenant] >= 1:
                self._resuming = True  # the round ran out mid-turn
            else:
                self._next()
        return taken

    def _next(self) -> None:
        self._ring.rotate(-1)
        self._resuming = False

    def drop(self, keep: Callable[[int], bool]) -> list[int]:
        """Forget the items `keep` refuses (their shard moved to another node); -> them."""
        dropped: list[int] = []
        for tenant in list(self._ring):
            heap = self._heaps[tenant]
            kept = [work for work in heap if keep(work)]
            if len(kept) != len(heap):
                dropped += [work for work in heap if not keep(work)]
                heapq.heapify(kept)
                self._heaps[tenant] = kept
                if not kept:
                    self._forget(tenant)
        self.backlog -= len(dropped)
        return dropped

    def _forget(self, tenant: str) -> None:
        if self._ring and self._ring[0] == tenant:
            self._resuming = False
        self._ring.remove(tenant)
        del self._heaps[tenant]
        del self._top[tenant]
        del self._deficit[tenant]  # DRR: an emptied queue keeps no credit

    def _weight(self, tenant: str) -> int:
        return max(1, self._weight_of(tenant))


class FifoPolicy:
    """Every tenant's items in one heap, by due time: first in, first out."""

    def __init__(self, weight_of: Callable[[str], int] | None = None) -> None:
        self._heap: list[tuple[int, str]] = []
        self._count: dict[str, int] = {}
        self.backlog = 0

    def add(self, tenant: str, item: int) -> None:
        heapq.heappush(self._heap, (item, tenant))
        self._count[tenant] = self._count.get(tenant, 0) + 1
        self.backlog += 1

    def put_back(self, tenant: str, items: Iterable[int]) -> None:
        for item in items:
            self.add(tenant, item)

    def waiting(self, tenant: str) -> int:
        return self._count.get(tenant, 0)

    def tenants(self) -> list[str]:
        return [t for t, n in self._count.items() if n]

    def due(self, bound=NO_BOUND, limit: int = 1 << 62) -> int:
        # (item, tenant) pairs: below (bound,) exactly when the item is below bound
        return count_below(self._heap, (bound,), limit)

    def earliest(self) -> int | None:
        return self._heap[0][0] if self._heap else None

    def take(self, budget: int, eligible: Callable[[str], bool] | None = None,
             bound=NO_BOUND) -> list[tuple[str, int]]:
        taken: list[tuple[str, int]] = []
        held: list[tuple[int, str]] = []
        while budget > 0 and self._heap and self._heap[0][0] < bound:
            item, tenant = heapq.heappop(self._heap)
            if eligible is not None and not eligible(tenant):
                held.append((item, tenant))
                continue
            taken.append((tenant, item))
            self._count[tenant] -= 1
            budget -= 1
        for pair in held:
            heapq.heappush(self._heap, pair)
        self.backlog -= len(taken)
        return taken

    def drop(self, keep: Callable[[int], bool]) -> list[int]:
        dropped = [work for work, _ in self._heap if not keep(work)]
        for work, tenant in self._heap:
            if not keep(work):
                self._count[tenant] -= 1
        self._heap = [(work, t) for work, t in self._heap if keep(work)]
        heapq.heapify(self._heap)
        self.backlog -= len(dropped)
        return dropped
