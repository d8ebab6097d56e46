"""What every `--report FILE.html` must be: one page that opens offline, its plots a path a
series with a point a second. Shared by the load tests' report tests."""

from __future__ import annotations

import html
import re
from datetime import UTC, datetime

import msgspec

from herdwick.loadtest import html_report
from herdwick.loadtest.timeline import Timeline

_PATH = re.compile(r'<path class="series" data-series="([^"]*)" d="([^"]*)"')
_POINT = re.compile(r"[ML]-?[\d.]+,-?[\d.]+")


def assert_self_contained(page: str) -> None:
    """Nothing the page loads comes from elsewhere, and it runs no script."""
    assert page.startswith("<!doctype html>")
    assert "<script" not in page.lower()
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.IGNORECASE)
    assert not re.search(r"@import|url\(", page, re.IGNORECASE)
    assert "<style>" in page


def paths(page: str) -> dict[str, int]:
    """Each plotted line by name: how many points its path has (the throughput chart's
    come first, so a name plotted twice keeps its first)."""
    found: dict[str, int] = {}
    for name, d in _PATH.findall(page):
        found.setdefault(html.unescape(name), len(_POINT.findall(d)))
    return found


def assert_plots_match(page: str, timeline: Timeline) -> None:
    """A throughput path per series with a point per second observed; lag paths with a
    point per second that had something in it."""
    assert page.count("<svg") >= 2
    plotted = paths(page)
    assert timeline.series
    for series in timeline.series:
        seconds = series.seconds
        assert [s.t_s for s in seconds] == list(range(seconds[0].t_s, seconds[-1].t_s + 1))
        assert plotted[series.name] == len(seconds)
        busy = sum(1 for s in seconds if s.count > 0)
        assert plotted[f"{series.name} p99"] == plotted[f"{series.name} p50"] == busy


def text_of(page: str) -> str:
    """The page's "As printed" section, unescaped: what the command printed."""
    found = re.search(r"<h2>As printed</h2>\n<pre>(.*?)</pre>", page, re.DOTALL)
    assert found is not None
    return html.unescape(found.group(1))


def page_of(report: msgspec.Struct, text: str, timeline: Timeline | None) -> str:
    """The page `--report` writes for a run a test made by calling the scenario's run()."""
    return html_report.render(command="loadtest", command_line="herdwick loadtest",
                              settings={}, started_at=datetime.now(UTC), headline=[],
                              text=text, figures=report, timeline=timeline)
