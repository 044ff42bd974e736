"""The Helm chart charts/brook, rendered offline by Helm's own Go SDK (helm-python-sdk): valid
objects, exactly the operator's RBAC rules, a restricted pod, the generated CRD unchanged,
values that are checked, commented and documented, and a clean `helm lint`."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import pytest
import yaml

from brook_engine import __version__
from brook_operator.api import CRD_NAME
from brook_operator.cli import build_parser
from brook_operator.model_configs import DEFAULT_ENDPOINT as DEFAULT_HUB_ENDPOINT
from brook_operator.rbac import (
    CLUSTER_RULES,
    NAMESPACED_RULES,
    PEERING_CLUSTER_RULES,
    PEERING_NAMESPACED_RULES,
    Rule,
    policy_rules,
)

ROOT = Path(__file__).parents[3]
CHART = ROOT / "charts" / "brook"
CRD_FILE = ROOT / "crds" / "llminference.yaml"
DOCS = ROOT / "docs" / "helm.md"

RELEASE = "brook"
NAMESPACE = "brook-system"
KEEP = "helm.sh/resource-policy"
WATCHED = ["team-a", "team-b"]

#: Every optional part switched on or away from its default.
NON_DEFAULT: dict[str, Any] = {
    "rbac": {"scope": "namespace", "watchNamespaces": WATCHED},
    "serviceMonitor": {"enabled": True, "interval": "15s", "labels": {"release": "kps"}},
    # The observability pack (test_observability_pack.py checks what it holds).
    "podMonitor": {"enabled": True, "labels": {"release": "kps"}},
    "prometheusRule": {"enabled": True, "labels": {"release": "kps"}},
    "grafanaDashboard": {"enabled": True},
    "networkPolicy": {
        "enabled": True,
        "ingressFrom": [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}],
        "apiServer": {"cidrs": ["10.0.0.1/32"]},
    },
    "crds": {"enabled": False},
    "image": {"repository": "registry.example/brook-operator", "tag": "dev"},
    "engine": {
        "image": "registry.example/brook-engine:dev",
        "images": {"npu": "registry.example/cann:dev"},
    },
    "podLabels": {"team": "ml", "app.kubernetes.io/name": "not-the-selector"},
}


# -- rendering ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def _render(chart: helm.Chart, values: dict[str, Any] | None = None) -> dict[str, str]:
    return chart.render(values or {}, name=RELEASE, namespace=NAMESPACE)


def _objects(rendered: dict[str, str]) -> list[dict[str, Any]]:
    objects: list[dict[str, Any]] = []
    for path, text in rendered.items():
        if path.endswith(".txt"):
            continue
        objects.extend(doc for doc in yaml.safe_load_all(text) if doc is not None)
    return objects


@pytest.fixture(scope="module")
def default(chart: helm.Chart) -> list[dict[str, Any]]:
    return _objects(_render(chart))


@pytest.fixture(scope="module")
def custom(chart: helm.Chart) -> list[dict[str, Any]]:
    return _objects(_render(chart, NON_DEFAULT))


def _all(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [obj for obj in objects if obj["kind"] == kind]


def _one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = _all(objects, kind)
    return found


def _container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = _one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    return container  # type: ignore[no-any-return]


# -- the chart and its objects -----------------------------------------------------------


def test_chart_metadata(chart: helm.Chart) -> None:
    meta = chart.metadata
    assert meta["apiVersion"] == "v2"
    assert (meta["name"], meta["type"], meta["version"]) == ("brook", "application", "0.1.0")
    assert meta["appVersion"] == __version__, "appVersion must follow brook_engine.__version__"
    assert meta["kubeVersion"].startswith(">=1.27")
    assert meta["home"] == "https://github.com/brook-dev/brook"
    assert meta["sources"] == ["https://github.com/brook-dev/brook"]
    assert meta["description"]


@pytest.mark.parametrize("which", ["default", "custom"])
def test_every_document_is_a_named_kubernetes_object(
    which: str, request: pytest.FixtureRequest
) -> None:
    objects: list[dict[str, Any]] = request.getfixturevalue(which)
    keys = set()
    for obj in objects:
        assert isinstance(obj.get("apiVersion"), str) and obj["apiVersion"], obj
        assert isinstance(obj.get("kind"), str) and obj["kind"], obj
        assert isinstance(obj.get("metadata", {}).get("name"), str), obj
        key = (obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"])
        assert key not in keys, f"{key} rendered twice"
        keys.add(key)


def test_defaults_render_the_operator_alone(default: list[dict[str, Any]]) -> None:
    kinds = sorted(obj["kind"] for obj in default)
    assert kinds == sorted(
        [
            "ClusterRole",
            "ClusterRoleBinding",
            "CustomResourceDefinition",
            "Deployment",
            "Service",
            "ServiceAccount",
        ]
    )
    assert _one(default, "Deployment")["spec"]["replicas"] == 1
    # One replica: a PodDisruptionBudget would only block node drains.
    assert not _all(default, "PodDisruptionBudget")


# -- RBAC: exactly rbac.py ---------------------------------------------------------------


def _normalized(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def _expected(rules: tuple[Rule, ...]) -> set[tuple[str, str, str]]:
    return _normalized(policy_rules(rules))


def _no_wildcards(rules: list[dict[str, Any]]) -> None:
    for rule in rules:
        assert set(rule) == {"apiGroups", "resources", "verbs"}, rule
        assert "*" not in {*rule["apiGroups"], *rule["resources"], *rule["verbs"]}, rule


def _subject(binding: dict[str, Any]) -> dict[str, Any]:
    (subject,) = binding["subjects"]
    return subject  # type: ignore[no-any-return]


def test_cluster_scope_rules_are_exactly_rbac_py(default: list[dict[str, Any]]) -> None:
    role = _one(default, "ClusterRole")
    _no_wildcards(role["rules"])
    assert _normalized(role["rules"]) == _expected(NAMESPACED_RULES + CLUSTER_RULES)
    assert not _all(default, "Role") and not _all(default, "RoleBinding")

    binding = _one(default, "ClusterRoleBinding")
    account = _one(default, "ServiceAccount")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    assert _subject(binding) == {
        "kind": "ServiceAccount",
        "name": account["metadata"]["name"],
        "namespace": NAMESPACE,
    }
    pod = _one(default, "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account["metadata"]["name"]


def test_namespace_scope_has_one_role_per_namespace(custom: list[dict[str, Any]]) -> None:
    cluster_role = _one(custom, "ClusterRole")
    _no_wildcards(cluster_role["rules"])
    assert _normalized(cluster_role["rules"]) == _expected(CLUSTER_RULES)

    roles = _all(custom, "Role")
    assert sorted(role["metadata"]["namespace"] for role in roles) == WATCHED
    for role in roles:
        _no_wildcards(role["rules"])
        assert _normalized(role["rules"]) == _expected(NAMESPACED_RULES)

    bindings = _all(custom, "RoleBinding")
    assert sorted(binding["metadata"]["namespace"] for binding in bindings) == WATCHED
    for binding in bindings:
        assert binding["roleRef"]["kind"] == "Role"
        assert binding["roleRef"]["name"] == roles[0]["metadata"]["name"]
        assert _subject(binding)["namespace"] == NAMESPACE

    args = _container(custom)["args"]
    assert "--all-namespaces" not in args
    assert [arg for arg in args if arg.startswith("--namespace")] == [
        f"--namespace={namespace}" for namespace in WATCHED
    ]


@pytest.mark.parametrize("scope", ["cluster", "namespace"])
def test_several_replicas_elect_a_leader_through_kopf_peering(
    chart: helm.Chart, scope: str
) -> None:
    values: dict[str, Any] = {"replicas": 2, "rbac": {"scope": scope}}
    if scope == "namespace":
        values["rbac"]["watchNamespaces"] = WATCHED
    objects = _objects(_render(chart, values))
    args = build_parser().parse_args(_container(objects)["args"])
    assert args.peering == RELEASE
    definitions = [o["metadata"]["name"] for o in _all(objects, "CustomResourceDefinition")]
    if scope == "cluster":
        assert "clusterkopfpeerings.kopf.dev" in definitions
        (peering,) = _all(objects, "ClusterKopfPeering")
        assert peering["metadata"]["name"] == RELEASE
        role = _one(objects, "ClusterRole")
        assert _normalized(role["rules"]) == _expected(
            NAMESPACED_RULES + PEERING_CLUSTER_RULES + CLUSTER_RULES
        )
    else:
        assert "kopfpeerings.kopf.dev" in definitions
        peerings = _all(objects, "KopfPeering")
        assert sorted(p["metadata"]["namespace"] for p in peerings) == WATCHED
        for role in _all(objects, "Role"):
            assert _normalized(role["rules"]) == _expected(
                NAMESPACED_RULES + PEERING_NAMESPACED_RULES
            )


def test_one_replica_runs_standalone(default: list[dict[str, Any]]) -> None:
    assert build_parser().parse_args(_container(default)["args"]).peering is None
    assert not _all(default, "ClusterKopfPeering") and not _all(default, "KopfPeering")
    assert all("kopf.dev" not in o["metadata"]["name"] for o in default)


def test_namespace_scope_defaults_to_the_release_namespace(chart: helm.Chart) -> None:
    objects = _objects(_render(chart, {"rbac": {"scope": "namespace"}}))
    assert [role["metadata"]["namespace"] for role in _all(objects, "Role")] == [NAMESPACE]
    assert f"--namespace={NAMESPACE}" in _container(objects)["args"]


def test_watch_namespaces_need_namespace_scope(chart: helm.Chart) -> None:
    with pytest.raises(helm.HelmValuesError, match="/rbac/watchNamespaces"):
        _render(chart, {"rbac": {"watchNamespaces": ["team-a"]}})


# -- the operator Deployment -------------------------------------------------------------


def test_operator_command_line(default: list[dict[str, Any]]) -> None:
    container = _container(default)
    assert container["image"] == f"ghcr.io/brook-dev/brook-operator:{__version__}"
    assert container["args"] == [
        "operator",
        "--all-namespaces",
        "--metrics-port=9090",
        "--health-port=8080",
    ]
    env = {var["name"]: var["valueFrom"]["fieldRef"]["fieldPath"] for var in container["env"]}
    # POD_ID: kopf's identity, else getpass.getuser(), which fails for a uid without a
    # passwd entry.
    assert env == {"POD_NAMESPACE": "metadata.namespace", "POD_ID": "metadata.name"}
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"metrics": 9090, "health": 8080}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}, probe
    assert container["resources"] == {
        "requests": {"cpu": "100m", "memory": "256Mi"},
        "limits": {"memory": "512Mi"},
    }


@pytest.mark.parametrize("which", ["default", "custom"])
def test_operator_arguments_parse_with_brook_cli(
    which: str, request: pytest.FixtureRequest
) -> None:
    """The chart and `brook operator` agree on the flags."""
    objects: list[dict[str, Any]] = request.getfixturevalue(which)
    args = build_parser().parse_args(_container(objects)["args"])
    assert args.command == "operator"
    assert args.all_namespaces is (which == "default")
    assert args.namespace == (None if which == "default" else WATCHED)
    assert (args.metrics_port, args.health_port) == (9090, 8080)
    assert args.engine_image == (None if which == "default" else NON_DEFAULT["engine"]["image"])
    assert args.engine_image_for == (
        None if which == "default" else ["npu=registry.example/cann:dev"]
    )


def test_custom_images(custom: list[dict[str, Any]], chart: helm.Chart) -> None:
    container = _container(custom)
    assert container["image"] == "registry.example/brook-operator:dev"
    assert "--engine-image=registry.example/brook-engine:dev" in container["args"]

    digest = "sha256:" + "a" * 64
    pinned = _objects(_render(chart, {"image": {"digest": digest}}))
    assert _container(pinned)["image"] == f"ghcr.io/brook-dev/brook-operator@{digest}"


def test_pod_labels_never_replace_the_selector_labels(custom: list[dict[str, Any]]) -> None:
    deployment = _one(custom, "Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert labels["team"] == "ml"
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()


_RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}


@pytest.mark.parametrize("which", ["default", "custom"])
def test_pod_is_restricted(which: str, request: pytest.FixtureRequest) -> None:
    """Each control of the Pod Security Standards' "restricted" profile (and "baseline",
    which it includes), plus the read-only root and the fixed non-root ids."""
    objects: list[dict[str, Any]] = request.getfixturevalue(which)
    pod = _one(objects, "Deployment")["spec"]["template"]["spec"]
    pod_security = pod["securityContext"]
    # Baseline: no host namespaces, host paths or host ports, nothing privileged.
    for host in ("hostNetwork", "hostPID", "hostIPC", "hostUsers"):
        assert host not in pod, host
    for volume in pod["volumes"]:
        assert set(volume) - {"name"} <= _RESTRICTED_VOLUMES, volume
    assert "sysctls" not in pod_security
    # Restricted, pod level.
    assert pod_security["runAsNonRoot"] is True
    assert pod_security["runAsUser"] == 65532
    assert pod_security["runAsGroup"] == 65532
    assert pod_security["fsGroup"] == 65532
    assert pod_security["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is True
    for container in pod["containers"] + pod.get("initContainers", []):
        security = container["securityContext"]
        assert security["allowPrivilegeEscalation"] is False
        assert security.get("privileged", False) is False
        assert security["capabilities"] == {"drop": ["ALL"]}
        assert security["readOnlyRootFilesystem"] is True
        assert security.get("runAsNonRoot", True) is True
        assert security.get("runAsUser", 65532) != 0
        assert security.get("seccompProfile", {"type": "RuntimeDefault"}) == {
            "type": "RuntimeDefault"
        }
        for key in ("procMount", "appArmorProfile", "seLinuxOptions", "windowsOptions"):
            assert key not in security, key
        assert all("hostPort" not in port for port in container["ports"])
        # The only writable place: /tmp, an emptyDir.
        (mount,) = container["volumeMounts"]
        volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        assert (mount["mountPath"], "emptyDir" in volume) == ("/tmp", True)


# -- the CRD -----------------------------------------------------------------------------


def _keep(text: str) -> str:
    return text.replace("\nmetadata:\n", f"\nmetadata:\n  annotations:\n    {KEEP}: keep\n", 1)


def _crd_text(chart: helm.Chart, values: dict[str, Any] | None = None) -> str:
    return _render(chart, values)["brook/templates/llminference-crd.yaml"]


def test_the_chart_copy_of_the_crd_is_the_generated_file() -> None:
    copy = CHART / "files" / "llminference.yaml"
    assert copy.read_bytes() == CRD_FILE.read_bytes(), f"{copy} drifted: run `make crd`"


def test_crd_is_the_generated_file_plus_the_keep_annotation(
    chart: helm.Chart, default: list[dict[str, Any]]
) -> None:
    generated = CRD_FILE.read_text()
    assert _crd_text(chart) == _keep(generated)

    crd = _one(default, "CustomResourceDefinition")
    metadata = dict(crd["metadata"])
    assert metadata["name"] == CRD_NAME
    assert metadata.pop("annotations") == {KEEP: "keep"}
    assert {**crd, "metadata": metadata} == yaml.safe_load(generated)


def test_crd_keep_follows_the_value(chart: helm.Chart) -> None:
    text = _crd_text(chart, {"crds": {"keep": False}})
    assert text == CRD_FILE.read_text()
    assert "annotations" not in yaml.safe_load(text)["metadata"]


def test_crd_is_absent_when_disabled(custom: list[dict[str, Any]]) -> None:
    assert not _all(custom, "CustomResourceDefinition")


# -- metrics and network -----------------------------------------------------------------


def test_metrics_service_and_service_monitor(custom: list[dict[str, Any]]) -> None:
    service = _one(custom, "Service")
    deployment = _one(custom, "Deployment")
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"}
    ]

    monitor = _one(custom, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kps"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= (
        service["metadata"]["labels"].items()
    )
    (endpoint,) = monitor["spec"]["endpoints"]
    assert (endpoint["port"], endpoint["path"], endpoint["interval"]) == (
        "metrics",
        "/metrics",
        "15s",
    )


def _ports(rule: dict[str, Any]) -> set[tuple[Any, str]]:
    return {(port["port"], port["protocol"]) for port in rule["ports"]}


def test_network_policy(custom: list[dict[str, Any]]) -> None:
    policy = _one(custom, "NetworkPolicy")["spec"]
    pod_labels = _one(custom, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert sorted(policy["policyTypes"]) == ["Egress", "Ingress"]

    metrics, health = policy["ingress"]
    assert _ports(metrics) == {("metrics", "TCP")}
    assert metrics["from"] == NON_DEFAULT["networkPolicy"]["ingressFrom"]
    assert _ports(health) == {("health", "TCP")}

    api, dns, hub, engine = policy["egress"]
    assert _ports(api) == {(443, "TCP"), (6443, "TCP")}
    assert api["to"] == [{"ipBlock": {"cidr": "10.0.0.1/32"}}]
    assert _ports(dns) == {(53, "UDP"), (53, "TCP")}
    assert _ports(hub) == {(443, "TCP")} and "to" not in hub  # the Hub's addresses vary
    assert _ports(engine) == {(8000, "TCP")}
    (peer,) = engine["to"]
    assert peer["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "brook-engine"}}
    (expression,) = peer["namespaceSelector"]["matchExpressions"]
    assert expression["values"] == WATCHED


def test_network_policy_reaches_engines_everywhere_in_cluster_scope(chart: helm.Chart) -> None:
    objects = _objects(_render(chart, {"networkPolicy": {"enabled": True}}))
    api, _, _, engine = _one(objects, "NetworkPolicy")["spec"]["egress"]
    assert "to" not in api
    assert engine["to"][0]["namespaceSelector"] == {}


def test_hub_endpoint_reaches_the_operator_and_its_policy(
    chart: helm.Chart, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HF_ENDPOINT", raising=False)  # the operator's own default
    default = _objects(_render(chart, {"networkPolicy": {"enabled": True}}))
    assert build_parser().parse_args(_container(default)["args"]).hub_endpoint == (
        DEFAULT_HUB_ENDPOINT
    )
    mirror = _objects(_render(chart, {"hub": {"endpoint": "https://hf-mirror.example"}}))
    args = build_parser().parse_args(_container(mirror)["args"])
    assert args.hub_endpoint == "https://hf-mirror.example"
    off = _objects(_render(chart, {"hub": {"endpoint": "off"}, "networkPolicy": {"enabled": True}}))
    assert build_parser().parse_args(_container(off)["args"]).hub_endpoint == "off"
    rules = _one(off, "NetworkPolicy")["spec"]["egress"]
    assert [_ports(rule) for rule in rules][2] == {(8000, "TCP")}  # api, dns, engines: no Hub
    with pytest.raises(helm.HelmValuesError, match="/hub/endpoint"):
        _render(chart, {"hub": {"endpoint": "hf-mirror.example"}})


# -- values: schema, comments, docs ------------------------------------------------------


@cache
def _schema() -> dict[str, Any]:
    return json.loads((CHART / "values.schema.json").read_text())  # type: ignore[no-any-return]


def _resolve(node: dict[str, Any]) -> dict[str, Any]:
    ref = node.get("$ref")
    if ref is None:
        return node
    return _schema()["definitions"][ref.removeprefix("#/definitions/")]  # type: ignore[no-any-return]


def test_schema_is_draft_07_and_accepts_the_defaults(chart: helm.Chart) -> None:
    schema = _schema()
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.Draft7Validator(schema).validate(chart.values)
    jsonschema.Draft7Validator(schema).validate(chart.merge_values(NON_DEFAULT))


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"rbac": {"scope": "bogus"}}, "/rbac/scope"),
        ({"replicas": -1}, "/replicas"),
        ({"replicas": 6}, "/replicas"),
        ({"bogus": True}, "'bogus'"),
        ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
        ({"image": {"tagg": "dev"}}, "'tagg'"),
        ({"metrics": {"port": 70000}}, "/metrics/port"),
        ({"serviceMonitor": {"interval": "soon"}}, "/serviceMonitor/interval"),
        ({"rbac": {"scope": "namespace", "watchNamespaces": ["Team_A"]}}, "/watchNamespaces/0"),
        ({"podMonitor": {"interval": "often"}}, "/podMonitor/interval"),
        ({"prometheusRule": {"ttftSLOBurn": {"thresholdSeconds": 3}}}, "/thresholdSeconds"),
        ({"prometheusRule": {"ttftSLOBurn": {"objective": 1}}}, "/objective"),
        ({"prometheusRule": {"kvCacheSaturated": {"threshold": 1.5}}}, "/threshold"),
        ({"prometheusRule": {"queuePersistent": {"severity": "page"}}}, "/severity"),
        ({"prometheusRule": {"replicasNotReady": {"fr": "5m"}}}, "'fr'"),
        ({"grafanaDashboard": {"label": "not a label"}}, "/grafanaDashboard/label"),
    ],
)
def test_schema_rejects_bad_values(chart: helm.Chart, values: dict[str, Any], named: str) -> None:
    with pytest.raises(helm.HelmValuesError, match=re.escape(named)):
        _render(chart, values)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(chart.merge_values(values), _schema(), jsonschema.Draft7Validator)


def test_template_checks_what_the_schema_cannot(chart: helm.Chart) -> None:
    with pytest.raises(helm.HelmRenderError, match=r"metrics\.port and health\.port"):
        _render(chart, {"metrics": {"port": 8080}})


@pytest.mark.parametrize("values", [{}, NON_DEFAULT], ids=["default", "custom"])
def test_helm_lint(values: dict[str, Any]) -> None:
    report = helm.lint(CHART, values, strict=True, namespace=NAMESPACE, kube_version="v1.27.0")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


_KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z0-9_./-]+):(?: |$)")


def _values_keys() -> list[tuple[tuple[str, ...], bool]]:
    """Every mapping key of values.yaml as (path, whether a comment line is right above)."""
    keys = []
    stack: list[tuple[int, str]] = []
    commented = False
    for line in (CHART / "values.yaml").read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            commented = True
            continue
        match = _KEY.match(line)
        if match:
            indent = len(match["indent"])
            while stack and stack[-1][0] >= indent:
                stack.pop()
            stack.append((indent, match["key"]))
            keys.append((tuple(key for _, key in stack), commented))
        assert not stripped.startswith("- "), f"write lists in flow style: {line!r}"
        commented = False
    return keys


def _described(path: tuple[str, ...]) -> dict[str, Any] | None:
    """The schema node of a value the chart defines; None for a key inside an open map (a
    label, a resource quantity), which is data rather than a setting."""
    node: dict[str, Any] = _schema()
    for key in path:
        properties = _resolve(node).get("properties", {})
        if key not in properties:
            assert _resolve(node).get("additionalProperties") is not False, (
                f"values.yaml key {'.'.join(path)} is not in values.schema.json"
            )
            return None
        node = properties[key]
    return node


def _schema_paths(node: dict[str, Any], path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    for key, child in _resolve(node).get("properties", {}).items():
        yield (*path, key)
        yield from _schema_paths(child, (*path, key))


def test_every_value_is_commented_and_described() -> None:
    keys = _values_keys()
    assert len(keys) > 30
    for path, commented in keys:
        node = _described(path)
        if node is None:
            continue
        dotted = ".".join(path)
        assert commented, f"values.yaml: {dotted} has no comment line right above it"
        assert node.get("description"), f"values.schema.json: {dotted} has no description"


def test_every_schema_property_has_a_default_and_a_row_in_the_docs() -> None:
    defaults = {path for path, _ in _values_keys()}
    docs = DOCS.read_text()
    for path in _schema_paths(_schema()):
        dotted = ".".join(path)
        assert path in defaults, f"values.schema.json: {dotted} has no default in values.yaml"
        if "properties" not in _resolve(_described(path) or {}):
            assert f"| `{dotted}` |" in docs, f"docs/helm.md: no row for {dotted}"
