"""Line charts as inline SVG text, for the HTML reports: no library, no script, nothing
fetched, so a report opens offline in any browser.

One chart is a few lines over a shared x axis. A None y breaks a line (a second with
nothing in it has no lag); a point standing alone is drawn as a dot, since a path of
one point draws nothing. The y axis starts at 0 (or below, for negative values) and
ends at a round number; labels are short (1.5k, 2M). Every name is HTML-escaped.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass

WIDTH_PX = 720
HEIGHT_PX = 240  # without the legend, whose rows are added below
MARGIN_LEFT_PX, MARGIN_RIGHT_PX, MARGIN_TOP_PX, MARGIN_BOTTOM_PX = 56, 16, 28, 44
LEGEND_ROW_PX = 16
CHAR_PX = 6.5  # about, at the legend's 11 px: for laying the legend out in rows
TICKS = 5
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b")


@dataclass(frozen=True)
class Line:
    name: str
    points: Sequence[tuple[float, float | None]]
    color: str = PALETTE[0]
    dashed: bool = False


def nice_step(span: float, ticks: int = TICKS) -> float:
    """A step of 1, 2 or 5 times a power of ten giving about `ticks` steps over `span`."""
    if not span > 0 or not math.isfinite(span):
        return 1.0
    raw = span / ticks
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw)


def short(value: float) -> str:
    """1234 -> 1.2k, 2_000_000 -> 2M, 0.25 -> 0.25."""
    size = abs(value)
    for limit, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if size >= limit:
            return f"{value / limit:.3g}{suffix}"
    return f"{value:.3g}"


def _finite(y: float | None) -> float | None:
    return y if y is not None and math.isfinite(y) else None


def _segments(points: Sequence[tuple[float, float | None]]) -> list[list[tuple[float, float]]]:
    segments: list[list[tuple[float, float]]] = [[]]
    for x, y in points:
        y = _finite(y)
        if y is None or not math.isfinite(x):
            if segments[-1]:
                segments.append([])
            continue
        segments[-1].append((x, y))
    return [s for s in segments if s]


class _Scale:
    """Data to pixels; a range of one value is widened so it has a middle."""

    def __init__(self, low: float, high: float, start_px: float, end_px: float) -> None:
        if high <= low:
            low, high = low - 1, high + 1
        self.low, self.high = low, high
        self._start, self._per = start_px, (end_px - start_px) / (high - low)

    def __call__(self, value: float) -> float:
        return round(self._start + (value - self.low) * self._per, 1)


def _y_range(ys: list[float]) -> tuple[float, float, float]:
    low, high = min(0.0, *ys), max(0.0, *ys)
    if high == low:
        high = low + 1
    step = nice_step(high - low)
    return math.floor(low / step) * step, math.ceil(high / step) * step, step


def _ticks(low: float, high: float, step: float) -> list[float]:
    count = round((high - low) / step)
    return [low + i * step for i in range(count + 1)]


def line_chart(lines: Sequence[Line], *, title: str, x_label: str, y_label: str,
               width_px: int = WIDTH_PX, height_px: int = HEIGHT_PX,
               x_step_min: float = 1.0) -> str:
    """An <svg> element: a <path class="series" data-series=NAME> per line with points, its
    d one `M`/`L` command per point. X ticks are at least `x_step_min` apart (whole
    seconds by default)."""
    esc = html.escape
    plot = [(line, _segments(line.points)) for line in lines]
    xs = [x for _, segs in plot for seg in segs for x, _ in seg]
    ys = [y for _, segs in plot for seg in segs for _, y in seg]
    left, right = MARGIN_LEFT_PX, width_px - MARGIN_RIGHT_PX
    top, bottom = MARGIN_TOP_PX, height_px - MARGIN_BOTTOM_PX
    legend = _legend(lines, left, right, height_px)
    full_px = height_px + LEGEND_ROW_PX * _legend_rows(lines, left, right)
    out = [f'<svg class="chart" viewBox="0 0 {width_px} {full_px}" width="{width_px}" '
           f'height="{full_px}" role="img" aria-label="{esc(title)}">',
           f"<title>{esc(title)}</title>",
           f'<text class="title" x="{left}" y="18">{esc(title)}</text>',
           f'<text class="axis-label" x="{(left + right) / 2}" y="{height_px - 12}" '
           f'text-anchor="middle">{esc(x_label)}</text>',
           f'<text class="axis-label" x="14" y="{(top + bottom) / 2}" text-anchor="middle" '
           f'transform="rotate(-90 14 {(top + bottom) / 2})">{esc(y_label)}</text>']
    if not xs:
        out += [f'<rect class="frame" x="{left}" y="{top}" width="{right - left}" '
                f'height="{bottom - top}"/>',
                f'<text class="empty" x="{(left + right) / 2}" y="{(top + bottom) / 2}" '
                'text-anchor="middle">no data</text>', "</svg>"]
        return "\n".join(out)
    x_scale = _Scale(min(xs), max(xs), left, right)
    y_low, y_high, y_step = _y_range(ys)
    y_scale = _Scale(y_low, y_high, bottom, top)
    out.append(f'<rect class="frame" x="{left}" y="{top}" width="{right - left}" '
               f'height="{bottom - top}"/>')
    for tick in _ticks(y_low, y_high, y_step):
        y = y_scale(tick)
        out += [f'<line class="grid" x1="{left}" y1="{y}" x2="{right}" y2="{y}"/>',
                f'<text class="tick" x="{left - 4}" y="{y + 4}" text-anchor="end">'
                f"{short(tick)}</text>"]
    x_step = max(x_step_min, nice_step(x_scale.high - x_scale.low))
    first = math.ceil(x_scale.low / x_step) * x_step
    for tick in _ticks(first, x_scale.high, x_step):
        if tick <= x_scale.high:
            x = x_scale(tick)
            out.append(f'<text class="tick" x="{x}" y="{bottom + 16}" text-anchor="middle">'
                       f"{short(tick)}</text>")
    for line, segments in plot:
        if not segments:
            continue
        d = " ".join(f"{'M' if i == 0 else 'L'}{x_scale(x)},{y_scale(y)}"
                     for seg in segments for i, (x, y) in enumerate(seg))
        dash = ' stroke-dasharray="5 3"' if line.dashed else ""
        out.append(f'<path class="series" data-series="{esc(line.name)}" d="{d}" fill="none" '
                   f'stroke="{esc(line.color)}" stroke-width="1.8"{dash}/>')
        out += [f'<circle cx="{x_scale(seg[0][0])}" cy="{y_scale(seg[0][1])}" r="2.5" '
                f'fill="{esc(line.color)}"/>' for seg in segments if len(seg) == 1]
    out += legend
    out.append("</svg>")
    return "\n".join(out)


def _legend_places(lines: Sequence[Line], left: float,
                   right: float) -> list[tuple[float, int]]:
    """(x, row) of each line's key: left to right, a new row when one is full."""
    places, x, row = [], left, 0
    for line in lines:
        width = 30 + CHAR_PX * len(line.name)
        if x > left and x + width > right:
            x, row = left, row + 1
        places.append((x, row))
        x += width
    return places


def _legend_rows(lines: Sequence[Line], left: float, right: float) -> int:
    return 1 + max((row for _, row in _legend_places(lines, left, right)), default=-1)


def _legend(lines: Sequence[Line], left: float, right: float, top_px: float) -> list[str]:
    out = []
    for line, (x, row) in zip(lines, _legend_places(lines, left, right), strict=True):
        y = top_px + row * LEGEND_ROW_PX + 4
        dash = ' stroke-dasharray="5 3"' if line.dashed else ""
        out += [f'<line x1="{x}" y1="{y - 4}" x2="{x + 18}" y2="{y - 4}" '
                f'stroke="{html.escape(line.color)}" stroke-width="2"{dash}/>',
                f'<text class="legend" x="{x + 22}" y="{y}">{html.escape(line.name)}</text>']
    return out
