"""The metrics' names as Prometheus reads them, and the Grafana dashboard built on them."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import REGISTRY

from herdwick import telemetry

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "herdwick.json"
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}


def exposed() -> set[str]:
    """Every herdwick sample name a scrape can show."""
    names = set()
    for family in REGISTRY.collect():
        if family.name.startswith("herdwick_"):
            names |= {family.name + suffix for suffix in _SUFFIXES[family.type]}
    return names


def queried() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    return {name for e in exprs for name in re.findall(r"\bherdwick_[a-z_]+", e)}


def test_the_dashboard_queries_only_metrics_that_exist() -> None:
    assert queried() - exposed() == set()


def test_every_metric_has_a_place_on_the_dashboard() -> None:
    families = {re.sub(r"_(bucket|count|sum|total)$", "", n) for n in exposed()}
    shown = {re.sub(r"_(bucket|count|sum|total)$", "", n) for n in queried()}
    assert families - shown == set()


def test_every_gauge_is_exposed_with_its_help() -> None:
    families = {f.name: f for f in REGISTRY.collect() if f.name in telemetry.GAUGES}
    assert set(families) == set(telemetry.GAUGES)
    assert all(families[n].documentation == telemetry.GAUGES[n] for n in families)


class _Source:
    def __init__(self, value: float) -> None:
        self.value = value

    def gauges(self):
        yield "herdwick_ready_depth", {"pool": "p"}, self.value


def _ready_depth() -> float:
    for family in REGISTRY.collect():
        if family.name == "herdwick_ready_depth":
            return sum(s.value for s in family.samples if s.labels == {"pool": "p"})
    return 0.0


def test_gauges_of_live_sources_add_up_and_leave_with_them() -> None:
    one, two = _Source(2), _Source(3)
    telemetry.watch(one)
    telemetry.watch(two)
    assert _ready_depth() == 5
    telemetry.unwatch(one)
    assert _ready_depth() == 3
    del two  # held weakly: a source that is gone is no longer read
    assert _ready_depth() == 0
