"""deploy/kubernetes/examples/monitoring: the metrics Service and
ServiceMonitor reach the node plugins' metrics port, every alert and
dashboard query is PromQL (parsed by promql-parser, the Rust parser's Python
binding) and names only series the plugin exports, with labels they carry."""

from __future__ import annotations

import json
import re
from typing import Any

import kubernetes_validate
import promql_parser
import pytest
import yaml

from tests.deploy._deploy import K8S_DIR, REPO, container, kustomize_docs, one, pod_spec

MONITORING_DIR = K8S_DIR / "examples" / "monitoring"


def _docs() -> list[dict[str, Any]]:
    return kustomize_docs(MONITORING_DIR)


def _one(kind: str) -> dict[str, Any]:
    (doc,) = [d for d in _docs() if d["kind"] == kind]
    return doc


def _exported() -> dict[str, set[str]]:
    """Every series name the plugin's endpoint serves -> its label names: the
    registry of a plugin over a fake node (every family once), as rendered."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from csi_local.ops.metrics import FAMILIES, NAMESPACE, Metrics

    metrics = Metrics(node="n")
    metrics.observe_rpc("CreateVolume", "OK", 0.1)
    metrics.observe_command("lvs", 0.1, ok=False)
    metrics.observe_extend("data", 1, device_class="default")
    names: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    for name, (_, labels) in FAMILIES.items():  # the collector's, read at scrape time
        names[f"{NAMESPACE}_{name}"] = {*labels, "node"}
    return names


EXPORTED = _exported()
SCRAPE_LABELS = {"instance", "job", "namespace", "pod", "service", "endpoint", "container"}


def _selectors(expr: str) -> list[str]:
    return re.findall(r"\b((?:csi_local|process|python)_[a-z_]+)\b", expr)


def _check_expr(expr: str, where: str) -> None:
    promql_parser.parse(expr)  # ValueError on anything that is not PromQL
    names = _selectors(expr)
    assert names, f"{where}: no csi-local series"
    for name in names:
        assert name in EXPORTED, f"{where}: {name} is not exported"
    for labels in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", expr):
        for label in filter(None, (x.strip() for x in labels.split(","))):
            assert label == "le" or any(label in EXPORTED[n] for n in names), (where, label)


def test_parser_refuses_what_is_not_promql() -> None:
    with pytest.raises(ValueError):
        promql_parser.parse("sum by (node) (rate(csi_local_rpc_requests_total[5m])")
    with pytest.raises(AssertionError, match="not exported"):
        _check_expr("csi_local_thin_pool_fill > 1", "typo")


def _rules() -> list[dict[str, Any]]:
    return [r for g in _one("PrometheusRule")["spec"]["groups"] for r in g["rules"]]


@pytest.mark.parametrize("rule", _rules(), ids=lambda r: r["alert"])
def test_alert_rules_are_promql_over_exported_series(rule: dict[str, Any]) -> None:
    _check_expr(rule["expr"], rule["alert"])
    assert re.fullmatch(r"\d+[smh]", rule["for"])
    assert rule["labels"]["severity"] in ("warning", "critical")
    # the labels the annotations use are on the alert's series
    names = _selectors(rule["expr"])
    for label in re.findall(r"\$labels\.(\w+)", json.dumps(rule["annotations"])):
        assert any(label in EXPORTED[n] for n in names) or label in SCRAPE_LABELS, label


def test_the_alerts_the_issue_asks_for() -> None:
    """Pool data and metadata fill, autoextend failing, VG down, RPC errors;
    the README's alert is the rule's own."""
    rules = {r["alert"]: r for r in _rules()}
    uses = {name: set(_selectors(r["expr"])) for name, r in rules.items()}
    assert "csi_local_thin_pool_data_used_ratio" in uses["CsiLocalThinPoolFilling"]
    assert "csi_local_thin_pool_metadata_used_ratio" in uses["CsiLocalThinPoolMetadataFilling"]
    assert "csi_local_thin_pool_autoextend_threshold_ratio" in uses[
        "CsiLocalThinPoolAutoextendFailing"]
    assert "csi_local_volume_group_up" in uses["CsiLocalVolumeGroupDown"]
    assert "csi_local_rpc_requests_total" in uses["CsiLocalRpcErrors"]
    readme = (REPO / "README.md").read_text()
    block = readme.split("### Metrics", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    (documented,) = yaml.safe_load(block)["groups"][0]["rules"]
    assert documented == rules[documented["alert"]]


def test_fills_are_compared_as_ratios() -> None:
    """Every fill is a 0-1 `_ratio`: an alert that compares one with a
    percentage (`> 80`) would never fire, a panel in `percent` would show
    0.9 %. No expression names a `_percent` series."""
    rules = [r["expr"] for r in _rules()]
    for expr in rules:
        assert "_percent" not in expr, expr
        for number in re.findall(r"_ratio(?:\{[^}]*\})?\s*[<>]=?\s*([0-9.]+)", expr):
            assert float(number) <= 1, expr
    assert any("_ratio" in expr for expr in rules)
    dashboard = json.loads((MONITORING_DIR / "dashboard.json").read_text())
    for panel in dashboard["panels"]:
        exprs = [t["expr"] for t in panel["targets"]]
        assert not any("_percent" in e for e in exprs), exprs
        if any("_ratio" in e for e in exprs):
            assert panel["fieldConfig"]["defaults"]["unit"] == "percentunit", panel["title"]


def test_dashboard_queries() -> None:
    dashboard = json.loads((MONITORING_DIR / "dashboard.json").read_text())
    targets = [t for p in dashboard["panels"] for t in p["targets"]]
    assert len(targets) >= 8
    for t in targets:
        # Grafana's variables, as Prometheus would see them once substituted
        expr = t["expr"].replace("$__rate_interval", "1m").replace('"$node"', '".*"')
        _check_expr(expr, t["expr"])
    cm = _one("ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["dashboard.json"]) == dashboard


def test_service_monitor_reaches_the_plugins_metrics_port() -> None:
    svc, sm = _one("Service"), _one("ServiceMonitor")
    kubernetes_validate.validate(svc, "1.31.0", strict=True)
    assert svc["spec"]["clusterIP"] == "None"
    ds = one("DaemonSet", "csi-local-node")
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    plugin = container(ds, "csi-local")
    (port,) = svc["spec"]["ports"]
    declared = {p["name"]: p["containerPort"] for p in plugin["ports"]}
    assert declared[port["targetPort"]] == port["port"]
    assert f"--metrics-address=:{port['port']}" in plugin["args"]
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["port"] == port["name"] and endpoint["path"] == "/metrics"
    ns = ds["metadata"]["namespace"]
    assert {d["metadata"]["namespace"] for d in _docs()} == {ns}
    assert pod_spec(ds)  # the DaemonSet the Service selects exists
