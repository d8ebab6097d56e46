"""Small in-process metrics: log-bucketed histograms (the metrics issue exposes them)."""

from __future__ import annotations

import bisect
import math

# 1 ms .. ~2.3 h in steps of ~10 %: quantiles within 10 % at any scale.
_BOUNDS_S = tuple(0.001 * 1.1 ** i for i in range(160))


class Histogram:
    """Counts observations (seconds) into fixed log buckets; cheap to observe, mergeable."""

    def __init__(self) -> None:
        self.counts = [0] * (len(_BOUNDS_S) + 1)
        self.total = 0
        self.max_s = 0.0
        self.sum_s = 0.0

    def observe(self, value_s: float) -> None:
        value_s = max(value_s, 0.0)
        self.counts[bisect.bisect_left(_BOUNDS_S, value_s)] += 1
        self.total += 1
        self.sum_s += value_s
        self.max_s = max(self.max_s, value_s)

    def quantile(self, q: float) -> float:
        """The upper bound of the bucket holding the q-quantile (0 when empty)."""
        if self.total == 0:
            return 0.0
        rank = max(1, math.ceil(q * self.total))
        seen = 0
        for i, count in enumerate(self.counts):
            seen += count
            if seen >= rank:
                return min(_BOUNDS_S[i] if i < len(_BOUNDS_S) else self.max_s, self.max_s)
        return self.max_s

    def merge(self, other: Histogram) -> None:
        for i, count in enumerate(other.counts):
            self.counts[i] += count
        self.total += other.total
        self.sum_s += other.sum_s
        self.max_s = max(self.max_s, other.max_s)
