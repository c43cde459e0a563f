"""Grafana dashboards: every panel's PromQL parses (checked by `promtool`, through a throwaway
recording-rule file, after Grafana's own variable substitution) and names only metrics
prewarm exports; the dashboards the issue asks for exist; provisioning points at them."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from prewarm.core.metrics import EXPORTED
from tests.test_prometheus_rules import exported_base, metric_names

GRAFANA = Path(__file__).resolve().parents[1] / "deploy" / "grafana"
DASHBOARDS = sorted((GRAFANA / "dashboards").glob("*.json"))
PROMTOOL = shutil.which("promtool")
#: What Grafana substitutes for its built-in variables before sending a query.
GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h"}


def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for item in items:
        yield item
        yield from panels(item.get("panels", []))  # panels collapsed into rows


def substitute(expr: str, dashboard: dict[str, Any]) -> str:
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    for var in dashboard.get("templating", {}).get("list", []):
        expr = re.sub(r"\$\{?" + re.escape(var["name"]) + r"\}?", ".*", expr)
    assert "$" not in expr, f"unknown Grafana variable left in {expr!r}"
    return expr


def all_exprs() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title, expression) for every query target."""
    out = []
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        for panel in panels(dashboard["panels"]):
            for target in panel.get("targets", []):
                out.append((path.name, panel["title"], substitute(target["expr"], dashboard)))
    return out


def test_dashboards_are_there_with_the_panels_asked_for() -> None:
    titles = " | ".join(
        panel["title"].lower() for path in DASHBOARDS for panel in panels(json.loads(path.read_text())["panels"])
    )
    for wanted in ("cold starts by hour and node", "warmup benefit", "fragmentation trend", "forecast vs actual",
                   "replicas by state"):
        assert wanted in titles, f"no panel titled like {wanted!r}"
    heatmap = next(
        panel for path in DASHBOARDS for panel in panels(json.loads(path.read_text())["panels"])
        if panel["title"] == "Cold starts by hour and node"
    )
    assert heatmap["type"] == "heatmap" and "by (node)" in heatmap["targets"][0]["expr"]
    assert "[1h]" in heatmap["targets"][0]["expr"]


def test_dashboards_are_well_formed() -> None:
    uids = set()
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        assert dashboard["uid"] not in uids
        uids.add(dashboard["uid"])
        ids = [p["id"] for p in panels(dashboard["panels"])]
        assert len(ids) == len(set(ids)), f"{path.name}: duplicate panel ids"
        for panel in panels(dashboard["panels"]):
            if panel.get("type") == "row":
                continue
            assert panel["targets"], f"{path.name}: panel {panel['title']!r} has no query"
            assert panel["datasource"]["uid"] == "prometheus"
            refs = [t["refId"] for t in panel["targets"]]
            assert len(refs) == len(set(refs))


@pytest.mark.skipif(PROMTOOL is None, reason="promtool (Debian package prometheus) is not installed")
def test_every_panel_query_parses(tmp_path: Path) -> None:
    assert PROMTOOL is not None
    exprs = all_exprs()
    assert len(exprs) >= 10
    rules = {"groups": [{"name": "dashboards", "rules": [
        {"record": f"dashboard:query_{i}", "expr": expr} for i, (_, _, expr) in enumerate(exprs)
    ]}]}
    path = tmp_path / "dashboard_queries.yml"
    path.write_text(yaml.safe_dump(rules))
    out = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    # and a broken query is caught the same way (the check can fail)
    path.write_text(yaml.safe_dump({"groups": [{"name": "x", "rules": [{"record": "x:y", "expr": "sum(rate(foo[5m])"}]}]}))
    assert subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, timeout=60).returncode != 0


def test_panels_name_only_exported_metrics() -> None:
    for name, title, expr in all_exprs():
        names = {exported_base(n) for n in metric_names(expr)}
        assert names, f"{name}: {title}: no metric in {expr!r}"
        unknown = names - set(EXPORTED)
        assert not unknown, f"{name}: panel {title!r} names metrics prewarm does not export: {sorted(unknown)}"


def test_variables_query_exported_metrics() -> None:
    for path in DASHBOARDS:
        for var in json.loads(path.read_text())["templating"]["list"]:
            metric = re.fullmatch(r"label_values\((\w+), *(\w+)\)", var["definition"])
            assert metric and metric.group(1) in EXPORTED, f"{path.name}: variable {var['name']}"


def test_provisioning_points_at_the_dashboards_and_datasource() -> None:
    source = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert [d["uid"] for d in source["datasources"]] == ["prometheus"]
    assert source["datasources"][0]["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "prewarm.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
