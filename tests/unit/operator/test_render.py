"""Rendering of every example into its children, against golden files, and the properties a
pod must have whatever the example: devices, rendezvous env per rank, probes, grace period,
restricted security context, model volumes.

Regenerate the golden files after an intended change with
``BROOK_UPDATE_GOLDEN=1 pytest tests/unit/operator/test_render.py`` and review the diff.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from brook_engine.config import load_engine_config
from brook_operator.api import LLMInference
from brook_operator.render import (
    ENGINE_CONFIG_FILE,
    OperatorSettings,
    render_children,
    with_owner,
)
from brook_operator.render.pod import LWS_WORKER_INDEX_LABEL, termination_grace_seconds
from support.examples import example_manifest

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((ROOT / "crds" / "examples").glob("*.yaml"))
GOLDEN = Path(__file__).parent / "golden"
SETTINGS = OperatorSettings(engine_image="registry.example/brook-engine:test")


def _llmi(name: str, **changes: Any) -> LLMInference:
    return LLMInference.model_validate(example_manifest(name, **changes))


def _by_kind(children: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {c["kind"]: c for c in children}


def _pod_templates(workload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    if workload["kind"] == "Deployment":
        return {"leader": workload["spec"]["template"]}
    template = workload["spec"]["leaderWorkerTemplate"]
    return {"leader": template["leaderTemplate"], "worker": template["workerTemplate"]}


def resolve_env(
    container: dict[str, Any], pod: dict[str, Any], injected: dict[str, str]
) -> dict[str, str]:
    """The environment the kubelet gives ``container``: ``injected`` first (what
    LeaderWorkerSet prepends), downward-API fields from ``pod``, then $(VAR) expansion of
    variables defined earlier."""
    env = dict(injected)
    for item in container["env"]:
        if "value" in item:
            env[item["name"]] = re.sub(
                r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                lambda m: env.get(m.group(1), m.group(0)),
                item["value"],
            )
            continue
        path = item["valueFrom"]["fieldRef"]["fieldPath"]
        label = re.fullmatch(r"metadata\.labels\['(.+)'\]", path)
        if label:
            env[item["name"]] = pod["metadata"]["labels"][label.group(1)]
        else:
            node: Any = pod
            for part in path.split("."):
                node = node[part]
            env[item["name"]] = str(node)
    return env


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_children_match_golden_files(path: Path) -> None:
    children = [
        with_owner(c, _llmi(path.stem)) for c in render_children(_llmi(path.stem), SETTINGS)
    ]
    rendered = yaml.safe_dump_all(children, sort_keys=False)
    golden = GOLDEN / path.name
    if os.environ.get("BROOK_UPDATE_GOLDEN"):
        golden.write_text(rendered)
    assert golden.exists(), f"run with BROOK_UPDATE_GOLDEN=1 to create {golden}"
    assert rendered == golden.read_text()


def test_single_pod_replica_is_a_deployment_with_all_devices() -> None:
    children = _by_kind(render_children(_llmi("llama-70b-npu-tp8"), SETTINGS))
    assert set(children) == {
        "ConfigMap",
        "NetworkPolicy",
        "Service",
        "Deployment",
        "PodDisruptionBudget",
    }
    pod = children["Deployment"]["spec"]["template"]
    engine = pod["spec"]["containers"][0]
    assert engine["resources"]["limits"]["huawei.com/Ascend910"] == 8
    assert engine["resources"]["requests"]["huawei.com/Ascend910"] == 8
    running = {
        "metadata": {**pod["metadata"], "name": "llama-70b-5d9f7-x2x7q", "namespace": "ai"},
        "status": {"podIP": "10.0.0.7"},
    }
    env = resolve_env(engine, running, {})
    assert env["BROOK_WORLD_SIZE"] == "8" and env["BROOK_NUM_PODS"] == "1"
    assert env["BROOK_POD_RANK"] == "0" and env["MASTER_ADDR"] == "127.0.0.1"
    assert env["HCCL_IF_IP"] == "10.0.0.7"


def test_tp4_pp2_spans_two_pods_and_each_rank_gets_its_env() -> None:
    llmi = _llmi("qwen-110b-npu-tp4-pp2")
    children = _by_kind(render_children(llmi, SETTINGS))
    lws = children["LeaderWorkerSet"]
    assert "Deployment" not in children
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert lws["spec"]["startupPolicy"] == "LeaderCreated"
    leader_address = "qwen-110b-0.qwen-110b-0.inference"
    envs = {}
    for rank, role in enumerate(("leader", "worker")):
        template = _pod_templates(lws)[role]
        pod = {
            "metadata": {
                "name": f"qwen-110b-0-{rank}" if rank else "qwen-110b-0",
                "namespace": "inference",
                "labels": {**template["metadata"]["labels"], LWS_WORKER_INDEX_LABEL: str(rank)},
            },
            "status": {"podIP": f"10.1.0.{10 + rank}"},
        }
        engine = template["spec"]["containers"][0]
        assert engine["resources"]["limits"]["huawei.com/Ascend910"] == 4
        envs[rank] = resolve_env(engine, pod, {"LWS_LEADER_ADDRESS": leader_address})
    for rank in (0, 1):
        env = envs[rank]
        assert env["BROOK_POD_RANK"] == str(rank)
        assert env["BROOK_WORLD_SIZE"] == "8"
        assert env["BROOK_DEVICES_PER_POD"] == "4" and env["BROOK_NUM_PODS"] == "2"
        assert env["MASTER_ADDR"] == leader_address and env["MASTER_PORT"] == "29500"
        assert env["HCCL_IF_IP"] == f"10.1.0.{10 + rank}"
        assert env["HCCL_SOCKET_IFNAME"] == "eth0"
        assert env["HCCL_BUFFSIZE"] == "400" and env["HCCL_CONNECT_TIMEOUT"] == "120"
    # Only the leader serves the API: probes and the Service select it alone.
    leader, worker = _pod_templates(lws)["leader"], _pod_templates(lws)["worker"]
    assert "readinessProbe" in leader["spec"]["containers"][0]
    assert "readinessProbe" not in worker["spec"]["containers"][0]
    assert children["Service"]["spec"]["selector"]["brook.dev/role"] == "leader"
    assert children["PodDisruptionBudget"]["spec"]["maxUnavailable"] == 1
    # Gang scheduling: the pods go to Volcano.
    assert leader["spec"]["schedulerName"] == "volcano"


def test_autoscaled_replicas_start_at_the_minimum_and_follow_the_decision() -> None:
    llmi = _llmi("qwen-7b-autoscaled")
    workload = _by_kind(render_children(llmi, SETTINGS))["Deployment"]
    assert workload["spec"]["replicas"] == 2  # autoscaling.minReplicas
    decided = _by_kind(render_children(llmi, SETTINGS, autoscaled=5))["Deployment"]
    assert decided["spec"]["replicas"] == 5
    clipped = _by_kind(render_children(llmi, SETTINGS, autoscaled=99))["Deployment"]
    assert clipped["spec"]["replicas"] == 16  # maxReplicas
    suspended = _llmi("qwen-7b-autoscaled", suspend=True)
    assert _by_kind(render_children(suspended, SETTINGS))["Deployment"]["spec"]["replicas"] == 0


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_pod_is_restricted_probed_and_drains(path: Path) -> None:
    llmi = _llmi(path.stem)
    children = _by_kind(render_children(llmi, SETTINGS))
    workload = children.get("Deployment") or children["LeaderWorkerSet"]
    for role, template in _pod_templates(workload).items():
        spec = template["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] != 0
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert spec["automountServiceAccountToken"] is False
        assert spec["terminationGracePeriodSeconds"] > llmi.spec.server.drain_timeout_seconds
        assert spec["terminationGracePeriodSeconds"] == termination_grace_seconds(
            llmi.spec.server.drain_timeout_seconds
        )
        for container in spec["containers"] + spec.get("initContainers", []):
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False
            assert context["capabilities"] == {"drop": ["ALL"]}
            assert context["readOnlyRootFilesystem"] is True
            assert "privileged" not in context
        mounts = {m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
        assert {"/tmp", "/dev/shm", "/etc/brook"} <= mounts
        engine = spec["containers"][0]
        assert engine["command"] == [
            "brook-engine",
            "serve",
            "--config",
            f"/etc/brook/{ENGINE_CONFIG_FILE}",
        ]
        if role == "leader":
            assert engine["readinessProbe"]["httpGet"]["path"] == "/ready"
            assert engine["livenessProbe"]["httpGet"]["path"] == "/health"
            assert engine["startupProbe"]["httpGet"]["path"] == "/health"
            assert template["metadata"]["annotations"]["prometheus.io/scrape"] == "true"


def test_model_sources_mount_or_fetch_and_the_engine_reads_the_local_folder(
    tmp_path: Path,
) -> None:
    cases = {
        "pvc://models/Qwen/Qwen2.5-7B": ("/models/Qwen/Qwen2.5-7B", None),
        "hf://Qwen/Qwen2.5-7B-Instruct": ("/models/Qwen/Qwen2.5-7B-Instruct", "brook-engine"),
        "s3://bucket/llama/70b": ("/models/bucket/llama/70b", "aws"),
        "oci://registry.example/models/llama:70b": (
            "/models/registry.example/models/llama/70b",
            "oras",
        ),
        "file:///models/tiny-llama": ("/models/tiny-llama", None),
    }
    for uri, (local, tool) in cases.items():
        llmi = _llmi("tiny-cpu", **{"model.uri": uri, "model.credentialsSecretRef": None})
        children = _by_kind(render_children(llmi, SETTINGS))
        config_file = tmp_path / "engine.yaml"
        config_file.write_text(children["ConfigMap"]["data"][ENGINE_CONFIG_FILE])
        assert load_engine_config(config_file).model.uri == f"file://{local}", uri
        spec = children["Deployment"]["spec"]["template"]["spec"]
        init = spec.get("initContainers", [])
        if tool is None:
            assert init == [], uri
        else:
            assert len(init) == 1 and init[0]["command"][0] == tool, uri
            assert local in init[0]["command"], uri
        if uri.startswith("pvc://"):
            volume = next(v for v in spec["volumes"] if v["name"] == "model")
            assert volume["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}


def test_downloads_take_what_the_engine_reads_and_a_shared_cache_is_filled_once() -> None:
    from brook_engine.config import MODEL_FILES
    from brook_operator.render.model_source import cache_folder

    llmi = _llmi("qwen-7b-autoscaled")  # hf://Qwen/Qwen2.5-7B-Instruct
    spec = _by_kind(render_children(llmi, SETTINGS))["Deployment"]["spec"]["template"]["spec"]
    (fetch,) = spec["initContainers"]
    assert fetch["command"][:3] == ["brook-engine", "fetch", "hf://Qwen/Qwen2.5-7B-Instruct"]
    assert [a for a in fetch["command"] if a.startswith("--include=")] == [
        f"--include={p}" for p in MODEL_FILES
    ]
    # the shared cache: one folder per model and revision on the claim, read-only to the
    # engine, written by the fetch (which locks it for the other replicas)
    cached = _llmi(
        "qwen-7b-autoscaled",
        **{
            "model.cache": {"claimName": "model-cache"},
            "model.revision": "v1.2",
            "model.exclude": ["*onnx*"],
        },
    )
    children = _by_kind(render_children(cached, SETTINGS))
    spec = children["Deployment"]["spec"]["template"]["spec"]
    (fetch,) = spec["initContainers"]
    folder = "/models/" + cache_folder("Qwen/Qwen2.5-7B-Instruct", "v1.2", None, ["*onnx*"])
    assert folder.startswith("/models/Qwen--Qwen2.5-7B-Instruct@v1.2-")  # + the patterns' key
    assert fetch["command"][3:5] == ["--output", folder]
    # one folder per model, revision and file set: none shared by two that differ
    assert cache_folder("org/m", "main") == "org--m@main"
    assert cache_folder("org/m", "refs/pr/1") != cache_folder("org/m", "refs-pr-1")
    assert cache_folder("org/m", "main", ["*.json"]) != cache_folder("org/m", "main")
    assert "--revision" in fetch["command"] and "--exclude=*onnx*" in fetch["command"]
    model = next(v for v in spec["volumes"] if v["name"] == "model")
    assert model == {"name": "model", "persistentVolumeClaim": {"claimName": "model-cache"}}
    (engine,) = spec["containers"]
    mount = next(m for m in engine["volumeMounts"] if m["name"] == "model")
    assert mount["readOnly"] is True
    writable = next(m for m in fetch["volumeMounts"] if m["name"] == "model")
    assert not writable.get("readOnly")
    assert (
        "model.uri: file:///models/Qwen--Qwen2.5-7B-Instruct@v1.2"
        in (children["ConfigMap"]["data"][ENGINE_CONFIG_FILE].replace('"', "").replace("'", ""))
        or folder in children["ConfigMap"]["data"][ENGINE_CONFIG_FILE]
    )
    # s3:// filters with aws s3 sync's own filters: nothing, the patterns, the exclusions
    s3 = _llmi("tiny-cpu", **{"model.uri": "s3://bucket/qwen", "model.exclude": ["*.bin"]})
    spec = _by_kind(render_children(s3, SETTINGS))["Deployment"]["spec"]["template"]["spec"]
    command = spec["initContainers"][0]["command"]
    assert command[command.index("--exclude") + 1] == "*"
    assert command[-4:-2] == ["--exclude", "*.bin"]


def test_credentials_reach_only_the_fetching_container() -> None:
    llmi = _llmi("qwen-7b-autoscaled")  # hf:// with credentialsSecretRef hf-token/token
    spec = _by_kind(render_children(llmi, SETTINGS))["Deployment"]["spec"]["template"]["spec"]
    (fetch,) = spec["initContainers"]
    token = next(e for e in fetch["env"] if e["name"] == "HF_TOKEN")
    assert token["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
    assert "hf-token" not in yaml.safe_dump(spec["containers"])


def test_owner_reference_needs_the_uid() -> None:
    llmi = _llmi("tiny-cpu").model_copy(
        update={"metadata": _llmi("tiny-cpu").metadata.model_copy(update={"uid": None})}
    )
    with pytest.raises(ValueError, match=r"metadata\.uid"):
        with_owner(render_children(llmi, SETTINGS)[0], llmi)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_what_spec_pod_may_not_name_covers_all_the_operator_renders(path: Path) -> None:
    """The protected names of spec.pod (refused by the CRD and the models) are every env
    name, volume, mount point, container and label the operator itself renders."""
    from brook_operator.api import pod_overrides as protected

    llmi = _llmi(path.stem)
    workload = _by_kind(render_children(llmi, SETTINGS))
    workload = workload.get("Deployment") or workload["LeaderWorkerSet"]
    own = {v.name for v in (llmi.spec.pod.volumes if llmi.spec.pod else [])}
    own_mounts = {m.mount_path for m in (llmi.spec.pod.volume_mounts if llmi.spec.pod else [])}
    for template in _pod_templates(workload).values():
        spec = template["spec"]
        containers = [*spec.get("initContainers", []), *spec["containers"]]
        assert {c["name"] for c in containers} <= set(protected.OPERATOR_CONTAINERS)
        for container in containers:
            for var in container.get("env", []) if container["name"] == "engine" else []:
                name = var["name"]  # spec.pod.env reaches the engine container only
                assert name in protected.OPERATOR_ENV or name.startswith("BROOK_"), name
            for mount in container.get("volumeMounts", []):
                path_ = mount["mountPath"]
                allowed = (path_ == llmi.spec.shapes.cache_dir) or any(
                    path_ == p or path_.startswith(p + "/") for p in protected.OPERATOR_MOUNT_PATHS
                )
                assert allowed or path_ in own_mounts, path_
        assert {v["name"] for v in spec["volumes"]} - own <= set(protected.OPERATOR_VOLUMES)
        for key in template["metadata"]["labels"]:
            theirs = llmi.spec.pod is not None and key in llmi.spec.pod.labels
            assert theirs or key.startswith(protected.OPERATOR_LABEL_PREFIXES), key


def test_spec_pod_reaches_every_pod_of_a_multi_pod_replica() -> None:
    pod = {
        "env": [{"name": "ASCEND_GLOBAL_LOG_LEVEL", "value": "3"}],
        "envFrom": [{"secretRef": {"name": "s3-credentials"}}],
        "volumes": [{"name": "driver", "hostPath": {"path": "/usr/local/Ascend/driver"}}],
        "volumeMounts": [{"name": "driver", "mountPath": "/usr/local/Ascend/driver"}],
        "serviceAccountName": "model-reader",
        "runtimeClassName": "ascend",
        "sidecars": [{"name": "log-shipper", "image": "fluent-bit:3"}],
        "initContainers": [{"name": "warm-cache", "image": "busybox:1.36"}],
        "annotations": {"sidecar.istio.io/inject": "false"},
    }
    llmi = _llmi("qwen-110b-npu-tp4-pp2", pod=pod)
    lws = _by_kind(render_children(llmi, SETTINGS))["LeaderWorkerSet"]
    for role, template in _pod_templates(lws).items():
        spec = template["spec"]
        engine = next(c for c in spec["containers"] if c["name"] == "engine")
        assert {"name": "ASCEND_GLOBAL_LOG_LEVEL", "value": "3"} in engine["env"], role
        assert engine["envFrom"] == [{"secretRef": {"name": "s3-credentials"}}]
        assert engine["volumeMounts"][-1] == {
            "name": "driver",
            "mountPath": "/usr/local/Ascend/driver",
        }
        assert spec["serviceAccountName"] == "model-reader"
        assert spec["automountServiceAccountToken"] is False
        assert spec["runtimeClassName"] == "ascend"
        assert [c["name"] for c in spec["containers"]] == ["engine", "log-shipper"]
        assert spec["initContainers"][-1]["name"] == "warm-cache"  # after the model fetch
        assert template["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false"
        # the operator's parts are untouched: the rendezvous env, the probes, the context
        names = [v["name"] for v in engine["env"]]
        assert names.count("MASTER_ADDR") == 1
        assert engine["securityContext"]["allowPrivilegeEscalation"] is False


def test_spec_pod_env_reaches_the_model_download() -> None:
    mirror = {"name": "HF_ENDPOINT", "value": "https://hub-mirror.example"}
    llmi = _llmi("qwen-7b-autoscaled", pod={"env": [mirror]})  # hf://: a fetch-model container
    spec = _by_kind(render_children(llmi, SETTINGS))["Deployment"]["spec"]["template"]["spec"]
    (fetch,) = spec["initContainers"]
    assert mirror in fetch["env"] and mirror in spec["containers"][0]["env"]


def test_router_without_gateways_is_the_pool_alone() -> None:
    router: dict[str, Any] = {"endpointPicker": {"name": "epp", "failureMode": "FailOpen"}}
    children = render_children(_llmi("tiny-cpu", router=router), SETTINGS)
    kinds = [c["kind"] for c in children]
    assert "InferencePool" in kinds and "HTTPRoute" not in kinds
    pool = next(c for c in children if c["kind"] == "InferencePool")
    assert pool["spec"]["endpointPickerRef"] == {
        "name": "epp",
        "port": {"number": 9002},
        "failureMode": "FailOpen",
    }
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    with_gateway = {**router, "gateways": [{"name": "gw", "sectionName": "https"}]}
    with_gateway["hostnames"] = ["a.b"]
    route = render_children(_llmi("tiny-cpu", router=with_gateway), SETTINGS)[-1]
    assert route["kind"] == "HTTPRoute"
    assert route["spec"]["parentRefs"] == [{"name": "gw", "sectionName": "https"}]
    assert route["spec"]["hostnames"] == ["a.b"]


def test_the_engine_image_is_the_accelerators_variant() -> None:
    from brook_operator import __version__
    from brook_operator.cli import main

    def images(name: str, settings: OperatorSettings) -> set[str]:
        workload = _by_kind(render_children(_llmi(name), settings))
        workload = workload.get("Deployment") or workload["LeaderWorkerSet"]
        return {
            c["image"]
            for t in _pod_templates(workload).values()
            for c in [*t["spec"].get("initContainers", []), *t["spec"]["containers"]]
        }

    published = OperatorSettings()
    repo = "ghcr.io/brook-dev/brook-engine"
    assert images("qwen-7b-autoscaled", published) == {f"{repo}:{__version__}-cann"}  # + fetch
    assert images("tiny-cpu", published) == {f"{repo}:{__version__}"}
    mirrored = OperatorSettings(engine_images={**published.engine_images, "npu": "mirror/cann:1"})
    assert images("llama-70b-npu-tp8", mirrored) == {"mirror/cann:1"}
    assert images("llama-70b-npu-tp8", OperatorSettings(engine_image="one:1")) == {"one:1"}
    assert main(["render", "-f", str(ROOT / "crds/examples/tiny-cpu.yaml"),
                 "--engine-image-for", "gpu=x"]) == 2  # fmt: skip
