"""Invalid manifests are refused twice over, each time naming the field:

- by the committed CRD's own structural schema and CEL rules (evaluated by a CEL library on
  the defaulted object, as the API server does), so `kubectl apply` refuses them too;
- by `brook validate`, which adds the operator's pydantic models on top.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from brook_operator.cli import main
from brook_operator.crd.validate import (
    apply_defaults,
    cel_problems,
    schema_problems,
    validate_object,
)

ROOT = Path(__file__).parents[3]
BASE = yaml.safe_load((ROOT / "crds" / "examples" / "qwen-110b-npu-tp4-pp2.yaml").read_text())
DELETE = object()

# (id, edits as {dotted path: value or DELETE}, field path the problem must name)
CASES: list[tuple[str, dict[str, Any], str]] = [
    (
        "kv-dtype-enum",
        {"spec.kvCache.layerPolicies.0.dtype": "fp9"},
        "spec.kvCache.layerPolicies[0].dtype",
    ),
    ("quantization-enum", {"spec.quantization.weights": "int4"}, "spec.quantization.weights"),
    # Settings the engine cannot honour yet are refused at apply time, not in a crash loop.
    (
        "w8a16-with-one-row-copies",
        {"spec.quantization.weights": "w8a16", "spec.shapes.oneRowWeights": "bf16"},
        "spec.shapes.oneRowWeights",
    ),
    (
        "one-row-copies-on-an-accelerator",
        {"spec.quantization.weights": "none", "spec.shapes.oneRowWeights": "bf16"},
        "spec.shapes.oneRowWeights",
    ),
    (
        "group-size-without-w8a16",
        {"spec.quantization.weights": "none", "spec.quantization.groupSize": 32},
        "spec.quantization.groupSize",
    ),
    (
        "group-size-not-multiple-of-32",
        {"spec.quantization.groupSize": 48},
        "spec.quantization.groupSize",
    ),
    (
        "offload-without-budget",
        {"spec.offload": {"policy": "static"}},
        "spec.offload.deviceMemoryLimitGb",
    ),
    (
        "compile-settings-in-eager-mode",
        {"spec.shapes.patterns": [{"inputLen": 64, "outputLen": 64}]},
        "spec.shapes.patterns",
    ),
    ("cache-dir-in-eager-mode", {"spec.shapes.cacheDir": "/cache"}, "spec.shapes.cacheDir"),
    (
        "load-threshold-without-reroute",
        {"spec.moe.loadThreshold": 1.5},
        "spec.moe.loadThreshold",
    ),
    ("offload-policy-enum", {"spec.offload.policy": "sometimes"}, "spec.offload.policy"),
    ("tp-pp-does-not-fit", {"spec.parallel.tensor": 3}, "spec.parallel"),
    (
        "tp-wider-than-node",
        {"spec.parallel.tensor": 8, "spec.parallel.pipeline": 1},
        "spec.parallel",
    ),
    (
        "autoscaling-min-above-max",
        {"spec.replicas": DELETE, "spec.autoscaling": {"minReplicas": 5, "maxReplicas": 2}},
        "spec.autoscaling.minReplicas",
    ),
    (
        "history-lead-of-a-whole-period",
        {
            "spec.replicas": DELETE,
            "spec.autoscaling": {
                "maxReplicas": 4,
                "history": {"leadSeconds": 3600, "periodSeconds": 3600},
            },
        },
        "spec.autoscaling.history.leadSeconds",
    ),
    (
        "history-beyond-its-configmap",
        {
            "spec.replicas": DELETE,
            "spec.autoscaling": {
                "maxReplicas": 4,
                "history": {"periods": 28, "periodSeconds": 604800},
            },
        },
        "spec.autoscaling.history.periods",
    ),
    (
        "standby-without-a-capacity",
        {"spec.replicas": DELETE, "spec.autoscaling": {"maxReplicas": 4, "standbyReplicas": 1}},
        "spec.autoscaling.standbyReplicas",
    ),
    (
        "standby-at-the-maximum",
        {
            "spec.replicas": DELETE,
            "spec.autoscaling": {
                "maxReplicas": 4,
                "standbyReplicas": 4,
                "replicaTokensPerSecond": 500,
            },
        },
        "spec.autoscaling.standbyReplicas",
    ),
    (
        "autoscaling-with-a-metrics-key",
        {
            "spec.replicas": DELETE,
            "spec.autoscaling": {"maxReplicas": 4},
            "spec.server.metricsRequireApiKey": True,
            "spec.server.apiKeySecretRef": {"name": "api-key", "key": "token"},
        },
        "spec.server.metricsRequireApiKey",
    ),
    ("replicas-and-autoscaling", {"spec.autoscaling": {"maxReplicas": 4}}, "spec.replicas"),
    (
        "autoscaling-without-max",
        {"spec.replicas": DELETE, "spec.autoscaling": {}},
        "spec.autoscaling.maxReplicas",
    ),
    ("negative-replicas", {"spec.replicas": -1}, "spec.replicas"),
    ("negative-kv-blocks", {"spec.kvCache.numBlocks": -5}, "spec.kvCache.numBlocks"),
    (
        "negative-offload-budget",
        {"spec.offload.deviceMemoryLimitGb": -1},
        "spec.offload.deviceMemoryLimitGb",
    ),
    ("unknown-field", {"spec.parallel.tensr": 2}, "spec.parallel.tensr"),
    ("unknown-spec-field", {"spec.replica": 2}, "spec.replica"),
    ("bad-uri-scheme", {"spec.model.uri": "http://example.com/model"}, "spec.model.uri"),
    ("uri-without-scheme", {"spec.model.uri": "/models/qwen"}, "spec.model.uri"),
    ("missing-model", {"spec.model": DELETE}, "spec.model"),
    (
        "overlapping-kv-ranges",
        {
            "spec.kvCache.layerPolicies": [
                {"start": 0, "end": 0.6, "dtype": "fp8_e5m2"},
                {"start": 0.5, "end": 1, "dtype": "fp16"},
            ]
        },
        "spec.kvCache.layerPolicies",
    ),
    (
        "duplicate-kv-ranges",
        {
            "spec.kvCache.layerPolicies": [
                {"start": 0, "end": 1, "dtype": "fp16"},
                {"start": 0, "end": 1, "dtype": "fp16"},
            ]
        },
        "spec.kvCache.layerPolicies",
    ),
    (
        "empty-kv-range",
        {"spec.kvCache.layerPolicies": [{"start": 0.5, "end": 0.5, "dtype": "fp16"}]},
        "spec.kvCache.layerPolicies[0].start",
    ),
    (
        "prefix-not-block-multiple",
        {"spec.kvCache.prefixSharing.minPrefixLen": 100},
        "spec.kvCache.prefixSharing.minPrefixLen",
    ),
    (
        "fraction-and-blocks",
        {"spec.kvCache.memoryFraction": 0.8, "spec.kvCache.numBlocks": 100},
        "spec.kvCache.numBlocks",
    ),
    ("fraction-above-one", {"spec.kvCache.memoryFraction": 1.5}, "spec.kvCache.memoryFraction"),
    ("block-size-enum", {"spec.kvCache.blockSize": 24}, "spec.kvCache.blockSize"),
    (
        "offload-without-budget",
        {"spec.offload": {"policy": "adaptive", "cpuMemoryPoolGb": 128}},
        "spec.offload.deviceMemoryLimitGb",
    ),
    (
        "offload-priority-twice",
        {"spec.offload": {"priorityLayers": ["ffn", "ffn"]}},
        "spec.offload.priorityLayers",
    ),
    (
        "batch-budget-below-seqs",
        {"spec.scheduler.maxNumBatchedTokens": 32},
        "spec.scheduler.maxNumBatchedTokens",
    ),
    ("kv-longer-than-model", {"spec.kvCache.maxSeqLen": 65536}, "spec.kvCache.maxSeqLen"),
    (
        "no-chunked-prefill-short-budget",
        {"spec.scheduler.chunkedPrefill": False},
        "spec.scheduler.maxNumBatchedTokens",
    ),
    (
        "pattern-longer-than-model",
        {"spec.shapes.patterns": [{"inputLen": 32768, "outputLen": 1}]},
        "spec.shapes.patterns",
    ),
    ("rollout-both-zero", {"spec.rollout.maxUnavailable": 0}, "spec.rollout.maxSurge"),
    ("rollout-not-a-count", {"spec.rollout.maxSurge": "half"}, "spec.rollout.maxSurge"),
    (
        "accelerator-in-resources",
        {"spec.resources.limits.huawei.com/Ascend910": 4},
        "spec.resources",
    ),
    (
        "gang-on-other-scheduler",
        {"spec.scheduling.schedulerName": "default-scheduler"},
        "spec.scheduling.schedulerName",
    ),
    ("string-for-integer", {"spec.parallel.tensor": "four"}, "spec.parallel.tensor"),
    ("port-out-of-range", {"spec.server": {"port": 0}}, "spec.server.port"),
    # spec.pod adds to the pod; what the operator sets is protected, not overridden
    (
        "pod-env-the-operator-sets",
        {"spec.pod": {"env": [{"name": "MASTER_ADDR", "value": "10.0.0.1"}]}},
        "spec.pod.env",
    ),
    (
        "pod-env-brook-prefix",
        {"spec.pod": {"env": [{"name": "BROOK_WORLD_SIZE", "value": "4"}]}},
        "spec.pod.env",
    ),
    (
        "pod-volume-the-operator-names",
        {"spec.pod": {"volumes": [{"name": "config", "emptyDir": {}}]}},
        "spec.pod.volumes",
    ),
    (
        "pod-mount-of-no-volume",
        {"spec.pod": {"volumeMounts": [{"name": "cache", "mountPath": "/cache"}]}},
        "spec.pod.volumeMounts",
    ),
    (
        "pod-mount-over-the-models",
        {
            "spec.pod": {
                "volumes": [{"name": "cache", "emptyDir": {}}],
                "volumeMounts": [{"name": "cache", "mountPath": "/models/extra"}],
            }
        },
        "spec.pod.volumeMounts",
    ),
    (
        "pod-sidecar-named-engine",
        {"spec.pod": {"sidecars": [{"name": "engine", "image": "busybox"}]}},
        "spec.pod.sidecars",
    ),
    (
        "pod-sidecar-without-image",
        {"spec.pod": {"sidecars": [{"name": "proxy"}]}},
        "spec.pod.sidecars[0].image",
    ),
    (
        "pod-env-value-and-value-from",
        {
            "spec.pod": {
                "env": [{"name": "X", "value": "1", "valueFrom": {"fieldRef": {"fieldPath": "x"}}}]
            }
        },
        "spec.pod.env",
    ),
    (
        "pod-container-in-both-lists",
        {
            "spec.pod": {
                "initContainers": [{"name": "prep", "image": "busybox"}],
                "sidecars": [{"name": "prep", "image": "busybox"}],
            }
        },
        "spec.pod.sidecars",
    ),
    (
        "pod-label-of-the-operator",
        {"spec.pod": {"labels": {"brook.dev/llminference": "other"}}},
        "spec.pod.labels",
    ),
    (
        "pod-annotation-of-the-operator",
        {"spec.pod": {"annotations": {"prometheus.io/port": "9999"}}},
        "spec.pod.annotations",
    ),
    (
        "model-cache-of-a-claim",
        {"spec.model.cache": {"claimName": "shared"}},  # the base's model is pvc://
        "spec.model.cache",
    ),
    (
        "model-patterns-of-a-claim",
        {"spec.model.include": ["*.safetensors"]},
        "spec.model.include",
    ),
    (
        "router-hostnames-without-gateways",
        {"spec.router": {"endpointPicker": {"name": "epp"}, "hostnames": ["llm.example.com"]}},
        "spec.router.hostnames",
    ),
    ("name-too-long", {"metadata.name": "q" * 60}, "metadata.name"),
    ("name-not-dns", {"metadata.name": "Qwen_110B"}, "metadata.name"),
]


def _edited(edits: dict[str, Any]) -> dict[str, Any]:
    obj = copy.deepcopy(BASE)
    for dotted, value in edits.items():
        # "huawei.com/Ascend910" holds a dot: split off only the known parent path.
        if dotted.startswith("spec.resources.limits."):
            parts = ["spec", "resources", "limits", dotted.removeprefix("spec.resources.limits.")]
        else:
            parts = dotted.split(".")
        node: Any = obj
        for part in parts[:-1]:
            node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
        leaf = parts[-1]
        if value is DELETE:
            node.pop(leaf, None)
        elif isinstance(node, list):
            node[int(leaf)] = value
        else:
            node[leaf] = value
    return obj


@pytest.fixture(scope="module")
def crd_schema() -> dict[str, Any]:
    crd = yaml.safe_load((ROOT / "crds" / "llminference.yaml").read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]  # type: ignore[no-any-return]


def test_the_table_is_large_and_its_base_is_valid() -> None:
    assert len(CASES) >= 15
    assert validate_object(BASE) == []


@pytest.mark.parametrize(("edits", "field"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_the_crd_itself_refuses_it(
    edits: dict[str, Any], field: str, crd_schema: dict[str, Any]
) -> None:
    obj = _edited(edits)
    problems = schema_problems(obj, crd_schema)
    if not problems:
        problems = cel_problems(apply_defaults(obj, crd_schema), crd_schema)
    assert problems, "the CRD accepts it: the API server would too"
    assert any(p.path == field for p in problems), [str(p) for p in problems]


@pytest.mark.parametrize(("edits", "field"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_brook_validate_refuses_it(
    edits: dict[str, Any], field: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = tmp_path / "bad.yaml"
    manifest.write_text(yaml.safe_dump(_edited(edits)))
    assert main(["validate", "-f", str(manifest)]) == 1
    err = capsys.readouterr().err
    name = _edited(edits)["metadata"]["name"]
    assert f"{manifest}: LLMInference/{name}: {field}: " in err


def test_the_operator_models_refuse_what_the_crd_refuses() -> None:
    """An object that slipped past an older CRD still fails in the operator's own models."""
    from pydantic import ValidationError

    from brook_operator.api import LLMInference

    slipped = [c for c in CASES if c[0] not in {"name-too-long", "name-not-dns"}]
    for case_id, edits, _ in slipped:
        with pytest.raises(ValidationError):
            LLMInference.model_validate(_edited(edits))
            pytest.fail(case_id)


def test_other_kinds_and_garbage_are_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = tmp_path / "mixed.yaml"
    manifest.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n---\n[1, 2]\n")
    assert main(["validate", "-f", str(manifest)]) == 1
    err = capsys.readouterr().err
    assert "expected apiVersion brook.dev/v1alpha1 and kind LLMInference" in err
    assert "not a mapping" in err
    broken = tmp_path / "broken.yaml"
    broken.write_text("spec: [unclosed")
    assert main(["validate", "-f", str(broken)]) == 2
    assert "not valid YAML" in capsys.readouterr().err
    assert main(["validate", "-f", str(tmp_path / "missing.yaml")]) == 2
