"""deploy/monitoring: dashboard and alert rules parse, and every query names a series the agent exports."""

import json
import re
from pathlib import Path

import prometheus_client
import pytest
import yaml

from plugvisor.common import monitoring
from plugvisor.deviceplugin import metrics as plugin_metrics
from plugvisor.supervisor.metrics import SupervisorCollector

DEPLOY = Path(__file__).parents[2] / "deploy" / "monitoring"
METRIC = re.compile(r"\bplugvisor_[a-z0-9_]+")


def agent_series() -> set[str]:
    """Every sample name the agent's /metrics can carry: supervisor, per-device and plugin families."""
    child = {
        "resource": "example.com/x",
        "pid": 1,
        "state": "RUNNING",
        "registered": True,
        "registrations": 1,
        "devices": {"healthy": 1, "total": 1},
        "restarts_by_cause": {},
        "crash_looping": False,
        "backoff_delay": None,
    }
    snapshot = {"children": [child], "supervisor": {"kubelet_restarts": 0, "ready": True}}
    names = {s.name for m in SupervisorCollector(lambda: snapshot).collect() for s in m.samples}
    names |= monitoring.exported_metric_names()
    for name in plugin_metrics.METRICS:
        value = getattr(plugin_metrics, name)
        assert isinstance(value, prometheus_client.metrics.MetricWrapperBase)
        for m in value.describe():
            names |= {m.name, f"{m.name}_total", f"{m.name}_bucket", f"{m.name}_count", f"{m.name}_sum"}
    return names


def dashboard_queries() -> list[str]:
    document = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    queries = [t["expr"] for panel in document["panels"] for t in panel["targets"]]
    variables = document["templating"]["list"]
    queries += [v["query"]["query"] for v in variables if isinstance(v.get("query"), dict)]
    return queries


def rules() -> list[dict]:
    document = yaml.safe_load((DEPLOY / "prometheusrule.yaml").read_text())
    assert document["apiVersion"] == "monitoring.coreos.com/v1"
    assert document["kind"] == "PrometheusRule"
    return [rule for group in document["spec"]["groups"] for rule in group["rules"]]


@pytest.mark.parametrize("source", ["dashboard", "rules"])
def test_every_query_names_an_exported_series(source):
    queries = dashboard_queries() if source == "dashboard" else [r["expr"] for r in rules()]
    assert queries
    exported = agent_series()
    for query in queries:
        named = set(METRIC.findall(query))
        assert named, f"query names no plugvisor series: {query}"
        unknown = sorted(named - exported)
        assert not unknown, f"{query!r} names {unknown}, which the agent does not export"


def test_the_dashboard_is_per_node_and_shows_what_operators_ask_for():
    document = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    assert "node" in {v["name"] for v in document["templating"]["list"]}
    titles = " ".join(p["title"].lower() for p in document["panels"])
    for topic in ("health", "namespace", "temperature", "degraded", "holds"):
        assert topic in titles
    assert all('instance=~"$node"' in q for q in dashboard_queries() if "plugvisor_ready" not in q)
    assert len({p["id"] for p in document["panels"]}) == len(document["panels"])


def test_the_rules_alert_on_unhealthy_devices_degraded_links_and_unregistered_resources():
    by_name = {r["alert"]: r for r in rules()}
    wanted = {"PlugvisorDeviceUnhealthy", "PlugvisorPcieLinkDegraded", "PlugvisorResourceUnregistered"}
    assert wanted <= set(by_name)
    assert by_name["PlugvisorResourceUnregistered"]["for"] == "1m"
    for rule in by_name.values():
        assert rule["labels"]["severity"] in {"warning", "critical"}
        assert rule["annotations"]["summary"]


def test_the_gpu_panels_and_alerts_use_nvmls_series():
    queries = " ".join(dashboard_queries())
    for series in (
        "plugvisor_gpu_utilization_ratio",
        "plugvisor_gpu_memory_used_bytes",
        "plugvisor_gpu_last_xid",
    ):
        assert series in queries
    by_name = {r["alert"]: r for r in rules()}
    assert {"PlugvisorGpuXid", "PlugvisorGpuLost", "PlugvisorGpuDoubleBitEcc"} <= set(by_name)
    assert by_name["PlugvisorGpuXid"]["labels"]["severity"] == "critical"
