"""The pieces of a load test's report for people: the SVG plots, the per-second series they
plot, the HTML page around them and the progress bar on stderr."""

from __future__ import annotations

import argparse
import io
import re
import time
from datetime import UTC, datetime

import msgspec
import pytest

from herdwick.config import ConfigError
from herdwick.loadtest import html_report
from herdwick.loadtest.plot import Line, line_chart, nice_step, short
from herdwick.loadtest.report import (
    DUE_TICK_LATE_S,
    PROGRESS_EVERY_S,
    Progress,
    add_report_flags,
)
from herdwick.loadtest.timeline import Second, Series, Timeline, per_second
from tests.integration.report_checks import (
    assert_plots_match,
    assert_self_contained,
    paths,
    text_of,
)

NUMBER = r"-?\d+(?:\.\d+)?"


def coordinates(svg: str) -> list[tuple[float, float]]:
    return [(float(x), float(y)) for d in re.findall(r' d="([^"]*)"', svg)
            for x, y in re.findall(rf"[ML]({NUMBER}),({NUMBER})", d)]


# --- the plot -------------------------------------------------------------------------------


def test_an_empty_chart_says_so_and_draws_no_line() -> None:
    svg = line_chart([Line("herd", [])], title="t", x_label="s", y_label="ms")
    assert svg.startswith("<svg") and svg.endswith("</svg>")
    assert "no data" in svg and "<path" not in svg
    assert line_chart([], title="t", x_label="s", y_label="ms").count("no data") == 1


def test_a_single_point_is_a_dot_inside_the_frame() -> None:
    svg = line_chart([Line("herd", [(3, 120.0)])], title="t", x_label="s", y_label="ms")
    assert paths(svg) == {"herd": 1}
    [(x, y)] = coordinates(svg)
    assert 56 < x < 704 and 28 <= y <= 196  # a range of one value is widened around it
    assert f'<circle cx="{x}" cy="{y}"' in svg  # a path of one point draws nothing


def test_large_values_stay_in_the_frame_with_short_labels() -> None:
    points = [(t, 10.0 ** (t + 3)) for t in range(10)]  # 1k .. 1T
    svg = line_chart([Line("big", points)], title="t", x_label="s", y_label="n")
    xy = coordinates(svg)
    assert len(xy) == 10
    assert all(56 <= x <= 704 and 28 <= y <= 196 for x, y in xy)
    assert ">1T<" in svg or ">1.2T<" in svg or ">1.4T<" in svg
    assert "e+" not in svg  # no 1e+12 labels


def test_a_gap_breaks_the_line_and_names_are_escaped() -> None:
    svg = line_chart([Line("<herd> & co", [(0, 1.0), (1, None), (2, 3.0), (3, float("nan"))],
                           dashed=True)], title="<b>lag</b>", x_label="s", y_label="ms")
    [d] = re.findall(r' d="([^"]*)"', svg)
    assert d.count("M") == 2 and d.count("L") == 0  # two single points
    assert "<herd>" not in svg and "&lt;herd&gt; &amp; co" in svg
    assert "<b>" not in svg and "stroke-dasharray" in svg


def test_negative_values_put_zero_inside_the_axis() -> None:
    svg = line_chart([Line("lag", [(0, -1.0), (1, 4.0)])], title="t", x_label="s",
                     y_label="ms")
    assert ">0<" in svg and ">-" in svg


def test_steps_and_labels_are_round() -> None:
    assert nice_step(10) == 2 and nice_step(1000) == 200 and nice_step(0.3) == 0.1
    assert nice_step(0) == 1 and nice_step(float("inf")) == 1
    assert [short(v) for v in (0, 0.25, 999, 1500, 2_000_000, 3e12)] == [
        "0", "0.25", "999", "1.5k", "2M", "3T"]


# --- the series -----------------------------------------------------------------------------


def test_points_are_bucketed_by_second_with_the_empty_seconds_between() -> None:
    series = per_second("herd", [(0.1, 5.0, 1), (0.9, 15.0, 1), (3.5, 40.0, 20),
                                 (float("nan"), 1.0, 1)])
    assert series.seconds == [Second(0, 2, 5.0, 15.0, 15.0), Second(1, 0, None, None, None),
                              Second(2, 0, None, None, None), Second(3, 20, 40.0, 40.0, 40.0)]
    assert per_second("none", []).seconds == []
    assert per_second("early", [(-1.5, 1.0, 1)]).seconds[0].t_s == -2  # floor, not truncation


def test_a_second_row_is_compact_in_the_json() -> None:
    assert msgspec.json.encode(Second(1, 2, 3.0, 4.0, None)) == b"[1,2,3.0,4.0,null]"


# --- the page -------------------------------------------------------------------------------


class Figures(msgspec.Struct):
    jobs_per_s: float
    note: str
    tenants: list[dict]
    timeline: Timeline | None = None


def timeline() -> Timeline:
    return Timeline(origin=datetime(2026, 12, 4, tzinfo=UTC), x_label="s after due",
                    count_label="leased per second", lag_label="due -> lease, ms",
                    series=[per_second("herd", [(0.2, 10.0, 1), (2.5, 30.0, 1)]),
                            Series(name="<steady>", seconds=[Second(1, 5, 2.0, 3.0, 4.0)])])


def page_of(figures: Figures, text: str = "as printed") -> str:
    return html_report.render(
        command="loadtest e2e", command_line="herdwick loadtest e2e --jobs 3",
        settings={"jobs": 3, "database_url": "postgresql://u:***@127.0.0.1/x"},
        started_at=datetime(2026, 12, 4, 10, 0, tzinfo=UTC),
        headline=[("jobs/s", "6,489")], text=text, figures=figures,
        timeline=figures.timeline)


def test_the_page_is_self_contained_and_escapes_what_it_is_given() -> None:
    figures = Figures(jobs_per_s=6489.5, note='<script src="https://x.example/a.js"></script>',
                      tenants=[{"name": "t1", "p99_ms": 12.5}, {"name": "t2", "p99_ms": 9.0}],
                      timeline=timeline())
    page = page_of(figures, text="herd: 3 jobs <all> succeeded")
    assert_self_contained(page)
    assert "&lt;script src=&quot;https://x.example/a.js&quot;&gt;" in page
    assert text_of(page) == "herd: 3 jobs <all> succeeded"
    assert ">6489.5<" in page and ">12.5<" in page and ">t2<" in page  # every figure
    assert "6,489" in page and "--jobs 3" in page
    assert_plots_match(page, figures.timeline)
    assert paths(page)["<steady>"] == 1
    assert "[1,5," not in page  # the series are plotted, not tabled


def test_a_run_without_series_still_makes_a_page() -> None:
    page = page_of(Figures(jobs_per_s=1.0, note="", tenants=[]))
    assert_self_contained(page)
    assert "no per-second figures" in page


def test_passwords_and_keys_are_masked() -> None:
    args = argparse.Namespace(database_url="postgresql://u:secret@127.0.0.1/x",
                              api_key="hw_live_123", jobs=5, keep=False, func=print,
                              command="loadtest")
    settings = html_report.settings_of(args)
    assert settings == {"api_key": "***", "database_url": "postgresql://u:***@127.0.0.1/x",
                        "jobs": 5, "keep": False}
    line = html_report.command_line(["loadtest", "submit", "--api-key", "hw_live_123",
                                     "--url=http://127.0.0.1:1", "--api-key=k2",
                                     "--database-url", "postgresql://u:pw@127.0.0.1/x"])
    assert "hw_live_123" not in line and "k2" not in line and ":pw@" not in line
    assert line.startswith("herdwick loadtest submit --api-key '***'")


def test_a_report_into_a_missing_folder_fails_before_the_run(tmp_path) -> None:
    with pytest.raises(ConfigError, match="no such folder"):
        html_report.check_path(str(tmp_path / "nowhere" / "r.html"))
    html_report.check_path(str(tmp_path / "r.html"))
    html_report.check_path(None)


def test_the_page_is_written_whole(tmp_path) -> None:
    target = tmp_path / "run.html"
    html_report.write(str(target), "<!doctype html>x")
    assert target.read_text() == "<!doctype html>x"
    assert [p.name for p in tmp_path.iterdir()] == ["run.html"]


# --- the progress bar -----------------------------------------------------------------------


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def parse_flags(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_report_flags(parser)
    return parser.parse_args(list(flags))


def test_the_bar_shows_the_phase_and_counts_and_says_lines_above_it() -> None:
    out = io.StringIO()  # not a terminal: the bar only when forced
    progress = Progress(out, "e2e", bar=True)
    done = [0]
    progress.set("draining", lambda: "herd 40/100", done=lambda: done[0], total=100)
    done[0] = 40
    progress.tick()
    progress.say("kept database hw_e2e_1")
    progress.close()
    text = out.getvalue()
    assert "e2e draining" in text and "40/100" in text and "herd 40/100" in text
    assert "kept database hw_e2e_1\n" in text


def test_the_bar_says_when_it_waits_for_due() -> None:
    out = io.StringIO()
    progress = Progress(out, "herd", bar=True)
    progress.set("on the streams", done=lambda: 0, total=10,
                 due_at=datetime.now(UTC).timestamp() + 60)
    assert "herd waiting for due" in out.getvalue()


def test_without_a_terminal_there_is_no_bar_only_lines() -> None:
    out = io.StringIO()
    progress = Progress(out, "e2e")
    progress.set("draining", lambda: "x", done=lambda: 5, total=10)
    progress.tick()
    progress.say("api: 1 process(es)")
    assert out.getvalue() == "api: 1 process(es)\n"
    assert Progress(Terminal(), "e2e").bar_on
    assert not Progress(Terminal(), "e2e", bar=False).bar_on
    assert not Progress(None, "e2e", bar=True).bar_on


def test_the_flags_force_the_bar_on_or_off() -> None:
    assert parse_flags().progress is None and parse_flags().report is None
    assert parse_flags("--progress").progress is True
    assert parse_flags("--no-progress").progress is False
    assert parse_flags("--report", "r.html").report == "r.html"


def test_the_bar_is_drawn_as_the_due_time_passes_not_only_every_half_second() -> None:
    """A herd can drain within one tick of its due time: the tick then comes at the due
    time, so the bar shows the phase (`draining`) and not only `waiting for due`."""
    progress = Progress(io.StringIO(), "e2e", bar=True)
    assert progress.next_tick_in() == PROGRESS_EVERY_S  # nothing due
    progress.set("draining", due_at=time.time() + 0.2)
    assert 0.15 < progress.next_tick_in() <= 0.2 + DUE_TICK_LATE_S
    progress.set("draining", due_at=time.time() + 5)  # far off: the usual tick
    assert progress.next_tick_in() == PROGRESS_EVERY_S
    progress.set("draining", due_at=time.time() - 1)  # passed: the usual tick
    assert progress.next_tick_in() == PROGRESS_EVERY_S
    progress.close()
