"""Sparklines: a series drawn as one SVG path, server-side, for the dashboard's pages."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

WIDTH = 120
HEIGHT = 24
_PAD = 1.5  # so the stroke at the top and bottom is not clipped


class Sparkline(NamedTuple):
    path: str  # an SVG path's d: one M...L run per stretch of values, a gap for each None
    peak: float  # the largest value, which touches the top (0 when there is none)
    width: int
    height: int


def sparkline(values: Sequence[float | None], width: int = WIDTH,
              height: int = HEIGHT) -> Sparkline:
    """Oldest value on the left; the scale runs from 0 to the series' peak."""
    known = [v for v in values if v is not None]
    peak = max(known, default=0.0)
    step = width / max(len(values) - 1, 1)
    span = height - 2 * _PAD
    parts: list[str] = []
    pen_down = False
    for i, value in enumerate(values):
        if value is None:
            pen_down = False
            continue
        y = height - _PAD - (value / peak * span if peak > 0 else 0)
        parts.append(f"{'L' if pen_down else 'M'}{i * step:.1f} {y:.1f}")
        pen_down = True
    return Sparkline(" ".join(parts), float(peak), width, height)
