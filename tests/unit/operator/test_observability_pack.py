"""The chart's observability pack: a PodMonitor for the engine leaders, a PrometheusRule with
Brook's five alerts, and a Grafana dashboard in a sidecar ConfigMap. Rendered and linted by
Helm's Go SDK as in test_chart.py; every metric a query names is one the engine or the
operator exports; the dashboard is checked against Grafana's own JSON schemas (vendored in
tests/data/grafana from grafana/grafana-foundation-sdk)."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import pytest
import yaml
from prometheus_client import CollectorRegistry

from brook_engine.metrics.prometheus import _LATENCY_BUCKETS, EngineMetrics
from brook_operator.api import LLMInference
from brook_operator.operator_metrics import OperatorMetrics
from brook_operator.render.labels import INSTANCE_LABEL, ROLE_LABEL
from brook_operator.render.pod import HTTP_PORT, pod_template
from brook_operator.render.settings import OperatorSettings
from support.examples import example_manifest

ROOT = Path(__file__).parents[3]
CHART = ROOT / "charts" / "brook"
DASHBOARD_FILE = CHART / "files" / "grafana-dashboard.json"
GRAFANA = ROOT / "tests" / "data" / "grafana"
DOCS = ROOT / "docs" / "observability.md"

RELEASE = "brook"
NAMESPACE = "brook-system"
WATCHED = ["team-a", "team-b"]
ENGINE_JOB = 'job="brook-engine"'

PACK: dict[str, Any] = {
    "podMonitor": {"enabled": True},
    "prometheusRule": {"enabled": True},
    "grafanaDashboard": {"enabled": True},
}
KINDS = {"podMonitor": "PodMonitor", "prometheusRule": "PrometheusRule"}
ALERTS = {
    "BrookKVCacheSaturated",
    "BrookQueuePersistent",
    "BrookTTFTSLOBurn",
    "BrookAutoscalerMetricsStale",
    "BrookReplicasNotReady",
}
#: A metric name in PromQL (digits too: e2e); `\b` skips label names such as
#: label_brook_dev_llminference.
METRIC = re.compile(r"\bbrook_[a-z0-9_]+")


# -- rendering ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def _objects(chart: helm.Chart, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    rendered = chart.render(values or {}, name=RELEASE, namespace=NAMESPACE)
    return [
        doc
        for path, text in rendered.items()
        if not path.endswith(".txt")
        for doc in yaml.safe_load_all(text)
        if doc is not None
    ]


def _one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [obj for obj in objects if obj["kind"] == kind]
    return found


def _dashboard_configmap(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (found,) = [o for o in objects if o["kind"] == "ConfigMap" and "brook.json" in o["data"]]
    return found


def _rules(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    (group,) = _one(objects, "PrometheusRule")["spec"]["groups"]
    return {rule["alert"]: rule for rule in group["rules"]}


def _monitoring_kinds(objects: list[dict[str, Any]]) -> list[str]:
    kinds = [o["kind"] for o in objects if o["kind"] in KINDS.values()]
    if any(o["kind"] == "ConfigMap" for o in objects):
        kinds.append("ConfigMap")
    return sorted(kinds)


# -- what Brook exports ------------------------------------------------------------------


@cache
def _exported() -> frozenset[str]:
    """Every series name the engine's and the operator's registries expose: counters with
    _total, histograms with _bucket, _count and _sum (as Prometheus stores them)."""
    registry = CollectorRegistry()
    EngineMetrics(registry, {"model": "m"})
    OperatorMetrics(registry)
    names: set[str] = set()
    for family in registry.collect():
        if family.type == "counter":
            names.add(f"{family.name}_total")
        elif family.type == "histogram":
            names.update(f"{family.name}{suffix}" for suffix in ("_bucket", "_count", "_sum"))
        else:
            names.add(family.name)
    return frozenset(names)


def _unknown_metrics(expr: str) -> set[str]:
    return set(METRIC.findall(expr)) - _exported()


def test_the_metric_check_knows_both_registries() -> None:
    exported = _exported()
    assert "brook_engine_time_to_first_token_seconds_bucket" in exported
    assert "brook_engine_generation_tokens_total" in exported
    assert "brook_operator_autoscaler_decisions_total" in exported
    assert _unknown_metrics('rate(brook_engine_kv_cache_usage{job="x"}[5m])') == {
        "brook_engine_kv_cache_usage"
    }
    assert _unknown_metrics('kube_pod_labels{label_brook_dev_llminference="x"}') == set()


def _balanced(expr: str) -> bool:
    """Brackets pair up outside strings: a cheap stand-in for promtool's parser."""
    pairs = {")": "(", "]": "[", "}": "{"}
    stack: list[str] = []
    for char in re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr):
        if char in "([{":
            stack.append(char)
        elif char in pairs and (not stack or stack.pop() != pairs[char]):
            return False
    return not stack


# -- on, off, lint -----------------------------------------------------------------------


def test_defaults_render_none_of_the_pack(chart: helm.Chart) -> None:
    assert _monitoring_kinds(_objects(chart)) == []


@pytest.mark.parametrize("option", sorted(PACK))
def test_each_option_renders_its_object_alone(chart: helm.Chart, option: str) -> None:
    objects = _objects(chart, {option: PACK[option]})
    assert _monitoring_kinds(objects) == [KINDS.get(option, "ConfigMap")]
    objects = _objects(chart, {**PACK, option: {"enabled": False}})
    assert KINDS.get(option, "ConfigMap") not in _monitoring_kinds(objects)


@pytest.mark.parametrize("scope", ["cluster", "namespace"])
def test_helm_lint_with_the_pack(scope: str) -> None:
    values: dict[str, Any] = {**PACK, "serviceMonitor": {"enabled": True}}
    if scope == "namespace":
        values["rbac"] = {"scope": "namespace", "watchNamespaces": WATCHED}
    report = helm.lint(CHART, values, strict=True, namespace=NAMESPACE, kube_version="v1.27.0")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


# -- the PodMonitor ----------------------------------------------------------------------


def _pods(role: str) -> dict[str, Any]:
    llmi = LLMInference.model_validate(example_manifest("qwen-110b-npu-tp4-pp2"))
    return pod_template(llmi, OperatorSettings(), role)  # type: ignore[arg-type]


def test_pod_monitor_scrapes_the_leaders_http_port(chart: helm.Chart) -> None:
    monitor = _one(
        _objects(chart, {"podMonitor": {"enabled": True, "interval": "15s"}}), "PodMonitor"
    )
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    spec = monitor["spec"]
    selector = spec["selector"]["matchLabels"]
    # The labels the operator gives a leader pod, and not a worker.
    leader, worker = _pods("leader"), _pods("worker")
    assert selector.items() <= leader["metadata"]["labels"].items()
    assert not selector.items() <= worker["metadata"]["labels"].items()
    assert selector[ROLE_LABEL] == "leader"

    (endpoint,) = spec["podMetricsEndpoints"]
    (container,) = leader["spec"]["containers"]
    assert endpoint["port"] == HTTP_PORT == "http"
    assert HTTP_PORT in {port["name"] for port in container["ports"]}
    assert endpoint["path"] == leader["metadata"]["annotations"]["prometheus.io/path"]
    assert (endpoint["interval"], endpoint["scrapeTimeout"]) == ("15s", "10s")

    # job="brook-engine" (the alerts' and the dashboard's matcher) comes from the pod label.
    assert f'job="{leader["metadata"]["labels"][spec["jobLabel"]]}"' == ENGINE_JOB
    relabeled = {r["targetLabel"]: r["sourceLabels"] for r in endpoint["relabelings"]}
    sanitized = re.sub(r"[^A-Za-z0-9_]", "_", INSTANCE_LABEL)
    assert relabeled == {
        "llminference": [f"__meta_kubernetes_pod_label_{sanitized}"],
        "namespace": ["__meta_kubernetes_namespace"],
        "pod": ["__meta_kubernetes_pod_name"],
    }


def test_pod_monitor_follows_the_watched_namespaces(chart: helm.Chart) -> None:
    everywhere = _one(_objects(chart, {"podMonitor": {"enabled": True}}), "PodMonitor")
    assert everywhere["spec"]["namespaceSelector"] == {"any": True}

    scoped = _objects(
        chart,
        {
            "podMonitor": {"enabled": True, "labels": {"release": "kps"}},
            "rbac": {"scope": "namespace", "watchNamespaces": WATCHED},
        },
    )
    monitor = _one(scoped, "PodMonitor")
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": WATCHED}
    assert monitor["metadata"]["namespace"] == NAMESPACE
    assert monitor["metadata"]["labels"]["release"] == "kps"
    # The same namespaces the operator is told to watch.
    args = _one(scoped, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [a.removeprefix("--namespace=") for a in args if a.startswith("--namespace=")] == WATCHED


# -- the PrometheusRule ------------------------------------------------------------------


def test_rule_has_the_five_alerts_on_exported_metrics(chart: helm.Chart) -> None:
    rules = _rules(_objects(chart, {"prometheusRule": {"enabled": True}}))
    assert set(rules) == ALERTS
    for name, rule in rules.items():
        expr = rule["expr"]
        assert METRIC.search(expr), name
        assert _unknown_metrics(expr) == set(), name
        assert _balanced(expr), name
        assert rule["labels"]["severity"] in {"critical", "warning"}
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        anchor = rule["annotations"]["runbook_url"].rsplit("#", 1)[1]
        assert anchor == name.lower()
        assert re.search(rf"^##+ {name}$", DOCS.read_text(), re.M), f"{DOCS.name}: no {name}"
        # Prometheus's templates pass through Helm as text.
        assert "{{ $labels.namespace }}" in rule["annotations"]["description"]
        if "brook_engine" in expr:
            assert ENGINE_JOB in expr, name
            assert "{{ $labels.llminference }}" in rule["annotations"]["description"]
            assert "by (namespace, llminference)" in expr, name
        else:
            assert f'namespace="{NAMESPACE}"' in expr, name


def test_rule_defaults(chart: helm.Chart) -> None:
    rules = _rules(_objects(chart, {"prometheusRule": {"enabled": True}}))
    assert "brook_engine_kv_cache_usage_ratio" in rules["BrookKVCacheSaturated"]["expr"]
    assert rules["BrookKVCacheSaturated"]["expr"].endswith(") > 0.9")
    assert rules["BrookQueuePersistent"]["expr"].endswith(") > 8")
    assert "brook_engine_num_requests_waiting" in rules["BrookQueuePersistent"]["expr"]
    assert rules["BrookReplicasNotReady"]["for"] == "30m"
    stale = rules["BrookAutoscalerMetricsStale"]["expr"]
    assert 'outcome="stale"' in stale and "[15m]" in stale

    burn = rules["BrookTTFTSLOBurn"]
    assert burn["labels"]["severity"] == "critical"
    assert burn["for"] == "2m"
    expr = burn["expr"]
    # Two windows, each the share of requests over the bucket, against the same budget.
    assert expr.count('le=~"1|1.0"') == 2
    assert expr.count("> 14.4 * (1 - 0.99)") == 2
    assert "[1h]" in expr and "[5m]" in expr and "\nand\n" in expr


def test_rule_values(chart: helm.Chart) -> None:
    values = {
        "prometheusRule": {
            "enabled": True,
            "labels": {"release": "kps"},
            "alertLabels": {"team": "ml", "severity": "ignored"},
            "kvCacheSaturated": {"threshold": 0.8, "for": "5m", "severity": "critical"},
            "queuePersistent": {"enabled": False},
            "ttftSLOBurn": {
                "thresholdSeconds": 2.5,
                "objective": 0.995,
                "burnRate": 6,
                "longWindow": "6h",
                "shortWindow": "30m",
            },
        },
        "rbac": {"scope": "namespace", "watchNamespaces": WATCHED},
    }
    objects = _objects(chart, values)
    assert _one(objects, "PrometheusRule")["metadata"]["labels"]["release"] == "kps"
    rules = _rules(objects)
    assert set(rules) == ALERTS - {"BrookQueuePersistent"}
    kv = rules["BrookKVCacheSaturated"]
    assert kv["expr"].endswith(") > 0.8") and kv["for"] == "5m"
    # The alert's own severity wins over alertLabels.
    assert kv["labels"] == {"severity": "critical", "team": "ml"}
    burn = rules["BrookTTFTSLOBurn"]["expr"]
    assert burn.count('le="2.5"') == 2 and "[6h]" in burn and "[30m]" in burn
    assert burn.count("> 6 * (1 - 0.995)") == 2
    # Scoped like the operator: these rules never see another release's engines.
    for name, rule in rules.items():
        if "brook_engine" in rule["expr"]:
            assert 'namespace=~"team-a|team-b"' in rule["expr"], name


def test_ttft_threshold_is_a_bucket_bound(chart: helm.Chart) -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    burn = schema["properties"]["prometheusRule"]["properties"]["ttftSLOBurn"]
    assert burn["properties"]["thresholdSeconds"]["enum"] == list(_LATENCY_BUCKETS)
    with pytest.raises(helm.HelmValuesError, match="thresholdSeconds"):
        _objects(chart, {"prometheusRule": {"ttftSLOBurn": {"thresholdSeconds": 3}}})
    # Every bound renders a matcher for the le label as the engine writes it (1.0) and as
    # Prometheus 3 stores it (1).
    for bound in _LATENCY_BUCKETS:
        values = {"prometheusRule": {"enabled": True, "ttftSLOBurn": {"thresholdSeconds": bound}}}
        expr = _rules(_objects(chart, values))["BrookTTFTSLOBurn"]["expr"]
        matcher = re.search(r'le(=~?)"([^"]+)"', expr)
        assert matcher is not None
        pattern = matcher[2] if matcher[1] == "=~" else re.escape(matcher[2])
        written = str(float(bound))  # prometheus_client's floatToGoString
        assert re.fullmatch(pattern, written), (bound, pattern)
        assert re.fullmatch(pattern, f"{bound:g}"), (bound, pattern)


def test_a_burn_rate_that_can_never_fire_is_refused(chart: helm.Chart) -> None:
    with pytest.raises(helm.HelmRenderError, match="could never fire"):
        _objects(chart, {"prometheusRule": {"enabled": True, "ttftSLOBurn": {"burnRate": 100}}})


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_checks_the_rules(chart: helm.Chart, tmp_path: Path) -> None:
    spec = _one(_objects(chart, {"prometheusRule": {"enabled": True}}), "PrometheusRule")["spec"]
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(spec))
    done = subprocess.run(
        ["promtool", "check", "rules", str(rules)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


# -- the dashboard ConfigMap -------------------------------------------------------------


def test_dashboard_configmap_carries_the_sidecar_label_and_the_file(chart: helm.Chart) -> None:
    configmap = _dashboard_configmap(_objects(chart, {"grafanaDashboard": {"enabled": True}}))
    assert configmap["metadata"]["namespace"] == NAMESPACE
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert "annotations" not in configmap["metadata"]
    (text,) = configmap["data"].values()
    assert text == DASHBOARD_FILE.read_text().rstrip("\n")
    assert json.loads(text) == _dashboard()


def test_dashboard_configmap_values(chart: helm.Chart) -> None:
    values = {
        "grafanaDashboard": {
            "enabled": True,
            "namespace": "monitoring",
            "label": "grafana.example/dashboard",
            "labelValue": "brook",
            "annotations": {"grafana_folder": "Brook"},
        }
    }
    metadata = _dashboard_configmap(_objects(chart, values))["metadata"]
    assert metadata["namespace"] == "monitoring"
    assert metadata["labels"]["grafana.example/dashboard"] == "brook"
    assert "grafana_dashboard" not in metadata["labels"]
    assert metadata["annotations"] == {"grafana_folder": "Brook"}


# -- the dashboard against Grafana's schemas ---------------------------------------------

#: The vendored files and their git blob ids, as tests/data/grafana/README.md records them.
_BLOB = re.compile(r"^\| `(?P<file>[a-z]+\.jsonschema\.json)` \| `(?P<blob>[0-9a-f]{40})` \|", re.M)


@cache
def _grafana_schema(name: str) -> dict[str, Any]:
    return json.loads((GRAFANA / f"{name}.jsonschema.json").read_text())  # type: ignore[no-any-return]


@cache
def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD_FILE.read_text())  # type: ignore[no-any-return]


def _validator(name: str, definition: str | None = None) -> jsonschema.Draft7Validator:
    schema = _grafana_schema(name)
    if definition is not None:
        schema = {**schema, "$ref": f"#/definitions/{definition}"}
    return jsonschema.Draft7Validator(schema)


def _errors(validator: jsonschema.Draft7Validator, instance: Any) -> list[str]:
    """Every error, with those under an anyOf (a panel is a Panel or a RowPanel) spelled out."""

    def leaves(error: jsonschema.ValidationError) -> Iterator[jsonschema.ValidationError]:
        yield error
        for child in error.context or ():
            yield from leaves(child)

    return [
        f"{'/'.join(map(str, leaf.absolute_path))}: {leaf.message}"
        for error in validator.iter_errors(instance)
        for leaf in leaves(error)
    ]


def _panels() -> list[dict[str, Any]]:
    return [panel for panel in _dashboard()["panels"] if panel["type"] != "row"]


def test_vendored_schemas_are_the_recorded_files_and_complete() -> None:
    recorded = {m["file"]: m["blob"] for m in _BLOB.finditer((GRAFANA / "README.md").read_text())}
    assert set(recorded) == {path.name for path in GRAFANA.glob("*.jsonschema.json")}
    assert "dashboard.jsonschema.json" in recorded
    for file, blob in recorded.items():
        data = (GRAFANA / file).read_bytes()
        # git's blob id: the file is byte for byte the one at the recorded commit.
        assert hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == blob, file
        schema = json.loads(data)
        assert schema["$schema"] == "http://json-schema.org/draft-07/schema#", file
        jsonschema.Draft7Validator.check_schema(schema)
        # Complete: every reference resolves inside the file.
        refs = re.findall(r'"\$ref": "([^"]+)"', data.decode())
        for ref in refs:
            assert ref.startswith("#/definitions/"), (file, ref)
            assert ref.removeprefix("#/definitions/") in schema["definitions"], (file, ref)
    assert _grafana_schema("dashboard")["$ref"] == "#/definitions/Dashboard"


def test_dashboard_matches_grafanas_schema() -> None:
    assert _errors(_validator("dashboard"), _dashboard()) == []


def test_panels_match_their_plugins_schemas() -> None:
    """The dashboard schema leaves a panel's targets and options open; the Prometheus and
    panel-plugin schemas of the same SDK close them."""
    query = _validator("prometheus", "Dataquery")
    for panel in _panels():
        title = panel["title"]
        for target in panel["targets"]:
            assert _errors(query, target) == [], title
        options = _validator(panel["type"], "Options")
        assert _errors(options, panel["options"]) == [], title
        if panel["type"] == "timeseries":
            custom = _validator("timeseries", "FieldConfig")
            assert _errors(custom, panel["fieldConfig"]["defaults"]["custom"]) == [], title


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d["panels"][1].update(titel="typo"), "Additional properties"),
        (lambda d: d["panels"][1]["gridPos"].update(w=25), "25 is greater than the maximum"),
        (lambda d: d.pop("templating"), "'templating' is a required property"),
        (lambda d: d["templating"]["list"][0].update(type="dropdown"), "'dropdown' is not one of"),
    ],
)
def test_the_schema_catches_mistakes(change: Any, message: str) -> None:
    broken = json.loads(DASHBOARD_FILE.read_text())
    change(broken)
    assert any(message in error for error in _errors(_validator("dashboard"), broken))


def test_panel_schemas_catch_mistakes() -> None:
    stat = next(p for p in _panels() if p["type"] == "stat")
    options = {k: v for k, v in stat["options"].items() if k != "reduceOptions"}
    assert _errors(_validator("stat", "Options"), options)
    target = {**stat["targets"][0], "legend": "{{pod}}"}
    assert _errors(_validator("prometheus", "Dataquery"), target)


# -- the dashboard's own rules -----------------------------------------------------------


def test_every_panel_is_titled_typed_and_queries_exported_metrics() -> None:
    ids = [panel["id"] for panel in _dashboard()["panels"]]
    assert len(ids) == len(set(ids))
    for panel in _panels():
        title = panel.get("title")
        assert title, panel
        assert panel["type"] in {"timeseries", "stat", "gauge", "table"}, title
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, title
        assert panel["targets"], title
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"]), title
        for target in panel["targets"]:
            expr = target["expr"]
            assert target["datasource"] == panel["datasource"], title
            # Brook's metrics, or the engine scrape's own up series.
            assert METRIC.search(expr) or f"up{{{ENGINE_JOB}" in expr, (title, expr)
            assert _unknown_metrics(expr) == set(), title
            assert _balanced(expr), title
            if "brook_engine" in expr or ENGINE_JOB in expr:
                # The PodMonitor's job and labels, filtered by the dashboard's variables.
                assert expr.count(ENGINE_JOB) == expr.count('llminference=~"$llminference"')
                assert ENGINE_JOB in expr, title


def test_panels_tile_the_grid_without_overlap() -> None:
    taken: set[tuple[int, int]] = set()
    for panel in _dashboard()["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        cells = {(pos["x"] + i, pos["y"] + j) for i in range(pos["w"]) for j in range(pos["h"])}
        assert not cells & taken, panel["title"]
        taken |= cells


def test_dashboard_variables() -> None:
    variables = {v["name"]: v for v in _dashboard()["templating"]["list"]}
    assert (variables["datasource"]["type"], variables["datasource"]["query"]) == (
        "datasource",
        "prometheus",
    )
    for name in ("namespace", "llminference"):
        assert variables[name]["type"] == "query"
        assert re.fullmatch(
            rf"label_values\(up\{{{ENGINE_JOB}.*\}}, {name}\)", variables[name]["query"]
        )
        # "All" matches every engine of the PodMonitor, not series without the label.
        assert variables[name]["allValue"] == ".+"
    bounds = variables["ttft_slo"]["query"].split(",")
    assert {float(b) for b in bounds} <= set(_LATENCY_BUCKETS)


@pytest.mark.parametrize(
    "metric",
    [
        "brook_engine_generation_tokens_total",
        "brook_engine_prompt_tokens_total",
        "brook_engine_time_to_first_token_seconds_bucket",
        "brook_engine_time_per_output_token_seconds_bucket",
        "brook_engine_kv_cache_usage_ratio",
        "brook_engine_prefix_cache_hits_total",
        "brook_engine_num_requests_waiting",
        "brook_engine_num_requests_running",
        "brook_engine_comm_compute_overlap_ratio",
        "brook_engine_pipeline_bubble_ratio",
        "brook_engine_offload_weight_bytes",
        "brook_engine_offload_transfer_exposed_seconds_total",
        "brook_engine_compile_cache_hits_total",
        "brook_engine_moe_load_cv",
        "brook_operator_autoscaler_decisions_total",
        "brook_operator_reconcile_errors_total",
    ],
)
def test_dashboard_covers(metric: str) -> None:
    exprs = [target["expr"] for panel in _panels() for target in panel["targets"]]
    assert any(metric in METRIC.findall(expr) for expr in exprs)
