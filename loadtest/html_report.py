"""`--report FILE.html`: a load test's run as one page for people, self-contained.

The page holds the command line and its settings, the headline figures, throughput
and lag second by second (loadtest/plot.py's inline SVG), the text report exactly as
the command printed it, and every figure of the JSON report as tables. Inline CSS,
no script, no link or image from anywhere: it opens offline, mailed or archived.
Everything that comes from the run or its flags is HTML-escaped.
"""

from __future__ import annotations

import argparse
import html
import os
import shlex
import sys
import tempfile
import urllib.parse
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import msgspec

from herdwick.config import ConfigError
from herdwick.loadtest.plot import PALETTE, Line, line_chart
from herdwick.loadtest.timeline import Series, Timeline

# Plotted, so left out of the figure tables.
PLOTTED_FIELDS = frozenset({"timeline", "per_second"})
# Flags that are the command's plumbing, not the run's settings.
NOT_SETTINGS = frozenset({"command", "loadtest_command"})
# Flags whose value is a secret (loadtest submit --api-key): shown as *** when set.
SECRET_FLAGS = frozenset({"api_key"})

_CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #222;
       margin: 2em auto; max-width: 1100px; padding: 0 1em; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; } h2 { font-size: 1.15em; margin-top: 1.8em;
     border-bottom: 1px solid #ddd; } .when { color: #666; margin-top: 0; }
pre { background: #f6f6f6; padding: 0.8em; overflow-x: auto; font-size: 12.5px; }
pre.command { white-space: pre-wrap; }
table { border-collapse: collapse; margin: 0.2em 0; } td, th { border: 1px solid #ddd;
        padding: 2px 6px; text-align: left; vertical-align: top; font-size: 13px; }
th { background: #f3f3f3; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
dl.headline { display: grid; grid-template-columns: max-content auto; gap: 2px 1.2em; }
dl.headline dt { color: #555; } dl.headline dd { margin: 0; font-weight: 600; }
svg.chart { display: block; margin: 0.6em 0; max-width: 100%; height: auto; }
svg .frame { fill: none; stroke: #bbb; } svg .grid { stroke: #eee; }
svg text { font-size: 11px; fill: #444; } svg .title { font-size: 13px; font-weight: 600; }
svg .empty { font-size: 14px; fill: #999; }
"""


def check_path(path: str | None) -> None:
    """Before a long run: the report's folder must be there."""
    if path is not None and not Path(path).resolve().parent.is_dir():
        raise ConfigError(f"--report {path}: no such folder")


def masked(value: str) -> str:
    """A URL with its password replaced by ***; anything else as it is."""
    try:
        parts = urllib.parse.urlsplit(value)
    except ValueError:
        return value
    if not parts.scheme or parts.password is None:
        return value
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    """The flags as parsed, defaults included; passwords in URLs masked."""
    found = {}
    for key, value in sorted(vars(args).items()):
        if key in NOT_SETTINGS or not (value is None or isinstance(value, str | int | float)):
            continue
        if key in SECRET_FLAGS and value is not None:
            value = "***"
        found[key] = masked(value) if isinstance(value, str) else value
    return found


def command_line(argv: Sequence[str] | None = None) -> str:
    """How the command was run, e.g. `herdwick loadtest e2e --jobs 300`; URL passwords
    and secret flags' values masked."""
    shown, secret_next = [], False
    for arg in sys.argv[1:] if argv is None else argv:
        flag = arg.split("=", 1)[0].lstrip("-").replace("-", "_")
        if secret_next:
            shown.append("***")
        elif arg.startswith("--") and flag in SECRET_FLAGS and "=" in arg:
            shown.append(arg.split("=", 1)[0] + "=***")
        else:
            shown.append(masked(arg))
        secret_next = arg.startswith("--") and flag in SECRET_FLAGS and "=" not in arg
    return shlex.join(["herdwick", *shown])


# --- the page -------------------------------------------------------------------------------


def _cell(value: Any) -> str:
    if isinstance(value, dict):
        return _table(value)
    if isinstance(value, list):
        if value and all(isinstance(v, dict) for v in value):
            return _rows(value)
        return html.escape(", ".join(_scalar(v) for v in value)) or "&ndash;"
    return html.escape(_scalar(value))


def _scalar(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _td(value: Any) -> str:
    kind = ' class="num"' if isinstance(value, int | float) and not isinstance(value, bool) else ""
    return f"<td{kind}>{_cell(value)}</td>"


def _table(values: dict[str, Any]) -> str:
    rows = [f"<tr><th>{html.escape(str(k))}</th>{_td(v)}</tr>"
            for k, v in values.items() if k not in PLOTTED_FIELDS]
    return "<table>" + "".join(rows) + "</table>"


def _rows(items: list[dict[str, Any]]) -> str:
    columns = list(dict.fromkeys(k for item in items for k in item if k not in PLOTTED_FIELDS))
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(_td(item.get(c)) for c in columns) + "</tr>"
                   for item in items)
    return f"<table><tr>{head}</tr>{body}</table>"


def charts(timeline: Timeline | None) -> str:
    """Throughput and lag over time, one line per series (lag: p99 solid, p50 dashed)."""
    if timeline is None:
        return "<p>This run recorded no per-second figures.</p>"
    colors = {s.name: PALETTE[i % len(PALETTE)] for i, s in enumerate(timeline.series)}
    throughput = [Line(s.name, [(x.t_s, x.count) for x in s.seconds], colors[s.name])
                  for s in timeline.series]
    lag = [line for s in timeline.series for line in _lag_lines(s, colors[s.name])]
    return "\n".join([
        line_chart(throughput, title=f"Throughput: {timeline.count_label}",
                   x_label=timeline.x_label, y_label="per second"),
        line_chart(lag, title=f"Lag: {timeline.lag_label} (p99 solid, p50 dashed)",
                   x_label=timeline.x_label, y_label="ms")])


def _lag_lines(series: Series, color: str) -> list[Line]:
    return [Line(f"{series.name} p99", [(x.t_s, x.p99_ms) for x in series.seconds], color),
            Line(f"{series.name} p50", [(x.t_s, x.p50_ms) for x in series.seconds], color,
                 dashed=True)]


def render(*, command: str, command_line: str, settings: dict[str, Any], started_at: datetime,
           headline: Sequence[tuple[str, str]], text: str, figures: msgspec.Struct,
           timeline: Timeline | None, extra_charts: Sequence[str] = ()) -> str:
    """The page; `extra_charts` (line_chart SVGs) follow the throughput and lag plots."""
    esc = html.escape
    title = f"herdwick {command}"
    heads = "".join(f"<dt>{esc(k)}</dt><dd>{esc(v)}</dd>" for k, v in headline)
    return "\n".join([
        "<!doctype html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{esc(title)}, {started_at:%Y-%m-%d %H:%M:%S} UTC</title>",
        f"<style>{_CSS}</style>", "</head>", "<body>",
        f"<h1>{esc(title)}</h1>",
        f'<p class="when">run at {started_at:%Y-%m-%d %H:%M:%S} UTC</p>',
        "<h2>Command</h2>", f'<pre class="command">{esc(command_line)}</pre>', _table(settings),
        "<h2>Headline</h2>", f'<dl class="headline">{heads}</dl>',
        "<h2>Over time</h2>", charts(timeline), *extra_charts,
        "<h2>As printed</h2>", f"<pre>{esc(text)}</pre>",
        "<h2>Every figure</h2>", _cell(msgspec.to_builtins(figures)),
        "</body>", "</html>", ""])


def write(path: str, page: str) -> None:
    """All or nothing: written beside the target, then renamed over it."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.resolve().parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(page)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_report(args: argparse.Namespace, command: str, report: msgspec.Struct, text: str,
                 headline: Sequence[tuple[str, str]], timeline: Timeline | None,
                 started_at: datetime, extra_charts: Sequence[str] = ()) -> None:
    """--report's page for a finished run, if the flag was given."""
    path = getattr(args, "report", None)
    if path is None:
        return
    write(path, render(command=command, command_line=command_line(),
                       settings=settings_of(args),
                       started_at=started_at, headline=headline,
                       text=text, figures=report, timeline=timeline,
                       extra_charts=extra_charts))
