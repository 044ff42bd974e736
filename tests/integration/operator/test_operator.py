"""The real operator (``brook operator`` as a child process, kopf inside) against the
emulated kube-apiserver, driven with kubectl.

The emulator runs no controllers: the tests set a Deployment's status themselves where the
Deployment controller would, and its garbage collector acts within the deleting request
(a real one acts a moment later). It validates nothing, which lets a test store a spec the
real CRD would refuse — the case of an older CRD. What it does not emulate is listed in
``tests/support/kube_api/__init__.py``; ``tests/e2e`` runs the same scenarios on a real
cluster.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import kmock
import pytest

from brook_operator.api import LLMInference
from brook_operator.memory_plan import fitting_plan, memory_request
from brook_operator.rbac import CLUSTER_RULES, NAMESPACED_RULES
from support import hub
from support import operator_scenarios as scenarios
from support.kube_api import KubeApi, leaderworkerset_crd, minimal_crd
from support.operator_process import OperatorProcess
from support.operator_scenarios import EmulatedCluster
from support.ports import free_port
from support.rbac_usage import USED, record_rbac

NAMESPACE = "ai"


@pytest.fixture
def cluster(kube_api: KubeApi, brook_crd: dict[str, Any]) -> EmulatedCluster:
    kube_api.create_namespace(NAMESPACE)
    kube_api.create(leaderworkerset_crd())
    # spec.router's APIs (the autoscaled example routes through a Gateway)
    kube_api.create(
        minimal_crd("inference.networking.k8s.io", "v1", "inferencepools", "InferencePool")
    )
    kube_api.create(minimal_crd("gateway.networking.k8s.io", "v1", "httproutes", "HTTPRoute"))
    return EmulatedCluster(kube_api, NAMESPACE)


@contextmanager
def _resyncing_operator(kube_api: KubeApi, tmp_path: Path) -> Iterator[OperatorProcess]:
    """The operator resyncing every half second (status refreshes, Degraded reconciled
    again); stopped cleanly, its requests recorded for the RBAC check."""
    process = OperatorProcess.start(
        kube_api.kubeconfig,
        tmp_path / "operator.log",
        namespaces=[NAMESPACE],
        extra_args=("--resync-seconds=0.5",),
    )
    try:
        yield process
    finally:
        assert process.stop() == 0
        record_rbac(kube_api)


@pytest.fixture
def operator(cluster: EmulatedCluster, tmp_path: Path) -> Iterator[OperatorProcess]:
    process = OperatorProcess.start(
        cluster.api.kubeconfig, tmp_path / "operator.log", namespaces=[NAMESPACE]
    )
    yield process
    code = process.stop()
    log = process.log()
    record_rbac(cluster.api)
    assert code == 0, log
    assert "Traceback" not in log, log


def test_create_update_scale_change_topology_delete(
    cluster: EmulatedCluster, operator: OperatorProcess
) -> None:
    scenarios.create_converges(cluster)
    scenarios.printer_columns(cluster)
    scenarios.update_image_and_scale(cluster)
    scenarios.topology_change(cluster)
    scenarios.delete_collects_children(cluster)
    metrics = operator.metrics()
    assert 'brook_operator_reconciles_total{result="applied"}' in metrics


def test_every_example_reconciles(cluster: EmulatedCluster, operator: OperatorProcess) -> None:
    for path in sorted(scenarios.EXAMPLES.glob("*.yaml")):
        scenarios.apply(cluster, scenarios.manifest(path.stem, NAMESPACE))
    for path in sorted(scenarios.EXAMPLES.glob("*.yaml")):
        obj = scenarios.manifest(path.stem, NAMESPACE)
        name = obj["metadata"]["name"]
        llmi = scenarios.wait_status(
            cluster,
            name,
            lambda o: (
                scenarios.condition(o, "SpecValid").get("status") == "True"
                and o["status"].get("observedGeneration") == 1
            ),
            "reconciled",
        )
        kind = llmi["status"]["topology"]["workload"].lower()
        assert scenarios.get(cluster, kind, name) is not None
        assert scenarios.condition(llmi, "Degraded")["status"] == "False"


def test_invalid_spec_gets_spec_valid_false_and_no_children(
    cluster: EmulatedCluster, operator: OperatorProcess
) -> None:
    # Stored past the CRD's rules (the emulator validates nothing, as an older CRD would).
    bad = scenarios.manifest("tiny-cpu", NAMESPACE, parallel={"tensor": 0})
    bad["metadata"]["name"] = "broken"
    cluster.api.create(bad)
    llmi = scenarios.wait_condition(cluster, "broken", "SpecValid", "False")
    valid = scenarios.condition(llmi, "SpecValid")
    assert valid["reason"] == "InvalidSpec"
    assert "spec.parallel.tensor" in valid["message"]
    # The operator stays healthy and serves the next resource; the broken one has nothing.
    scenarios.create_converges(cluster)
    assert operator.healthy()
    for kind in ("configmap", "service", "deployment", "poddisruptionbudget"):
        assert scenarios.list_names(cluster, kind, "brook.dev/llminference=broken") == []
    events = json.loads(
        cluster.kubectl(
            "get", "events", "-n", NAMESPACE,
            "--field-selector", "involvedObject.name=broken", "-o", "json",
        ).stdout
    )["items"]  # fmt: skip
    warnings = [e for e in events if e["message"].startswith("SpecValid=False")]
    assert warnings and warnings[0]["type"] == "Warning"
    assert "spec.parallel.tensor" in warnings[0]["message"]


def test_a_memory_plan_that_cannot_fit_is_refused_before_any_pod(
    cluster: EmulatedCluster, tmp_path: Path
) -> None:
    """The operator reads an hf:// model's config.json from the Hub (a loopback stand-in):
    a budget that cannot hold the weights is SpecValid=False with the plan's numbers and
    nothing is applied; once it fits, the pods get the plan's memory request."""
    repo = "HuggingFaceTB/SmolLM2-135M-Instruct"
    folder = tmp_path / "repo"
    folder.mkdir()
    shutil.copy(
        scenarios.ROOT / "tests/data/model_configs/SmolLM2-135M-Instruct.json",
        folder / "config.json",
    )
    manifest = scenarios.manifest(
        "tiny-cpu",
        NAMESPACE,
        offload={"policy": "static", "deviceMemoryLimitGb": 0.01},
        resources={"requests": {"cpu": "2"}},
    )
    manifest["spec"]["model"]["uri"] = f"hf://{repo}"
    with hub.serving(folder, repo) as served:
        process = OperatorProcess.start(
            cluster.api.kubeconfig,
            tmp_path / "operator.log",
            namespaces=[NAMESPACE],
            hub_endpoint=served.url,
        )
        try:
            scenarios.apply(cluster, manifest)
            llmi = scenarios.wait_condition(cluster, "tiny-cpu", "SpecValid", "False")
            spec_valid = scenarios.condition(llmi, "SpecValid")
            assert spec_valid["reason"] == "PlanDoesNotFit"
            assert "spec.offload.deviceMemoryLimitGb" in spec_valid["message"]
            assert "raise it to" in spec_valid["message"]
            for kind in scenarios.CHILDREN:
                assert scenarios.get(cluster, kind, "tiny-cpu" + scenarios.CHILDREN[kind]) is None

            manifest["spec"]["offload"]["deviceMemoryLimitGb"] = 4
            scenarios.apply(cluster, manifest)
            deployment = scenarios.wait_for(
                cluster, lambda: scenarios.get(cluster, "deployment", "tiny-cpu"), "the Deployment"
            )
            (engine,) = [
                c
                for c in deployment["spec"]["template"]["spec"]["containers"]
                if c["name"] == "engine"
            ]
            config = json.loads((folder / "config.json").read_text())
            fitting = LLMInference.model_validate(manifest)
            expected = memory_request(fitting, fitting_plan(fitting, config))
            assert engine["resources"]["requests"]["memory"] == expected
            assert 1024 < int(expected.removesuffix("Mi")) < 4096  # SmolLM2 float32 + 1 GiB
            llmi = scenarios.wait_condition(cluster, "tiny-cpu", "SpecValid", "True")
            # one read of the config for both rounds
            assert served.paths.count(f"GET /{repo}/resolve/main/config.json") == 1
        finally:
            assert process.stop() == 0
            record_rbac(cluster.api)
        assert "Traceback" not in process.log(), process.log()


def test_missing_leader_worker_set_is_degraded(
    kube_api: KubeApi, brook_crd: Any, tmp_path: Path
) -> None:
    kube_api.create_namespace(NAMESPACE)
    cluster = EmulatedCluster(kube_api, NAMESPACE)  # no LeaderWorkerSet CRD here
    with _resyncing_operator(kube_api, tmp_path) as process:
        scenarios.apply(cluster, scenarios.manifest("qwen-110b-npu-tp4-pp2", NAMESPACE))
        llmi = scenarios.wait_condition(cluster, "qwen-110b", "Degraded", "True")
        assert scenarios.condition(llmi, "Degraded")["reason"] == "LeaderWorkerSetMissing"
        # What does not need LeaderWorkerSet is still there.
        assert scenarios.get(cluster, "configmap", "qwen-110b-engine") is not None
        assert scenarios.get(cluster, "service", "qwen-110b") is not None
        assert process.healthy()
        # Installing LeaderWorkerSet heals it at the next resync, with no change to the spec.
        kube_api.create(leaderworkerset_crd())
        scenarios.wait_for(
            cluster, lambda: scenarios.get(cluster, "leaderworkerset", "qwen-110b"), "the LWS"
        )
        scenarios.wait_condition(cluster, "qwen-110b", "Degraded", "False")


def test_killed_mid_reconcile_resumes_without_duplicates(
    cluster: EmulatedCluster, tmp_path: Path
) -> None:
    api = cluster.api
    # Deployments cannot be written: the first operator applies the ConfigMap and Service,
    # then fails on the Deployment and retries — and is killed while it does.
    api.handler[kmock.method.PATCH, kmock.resource("apps", "v1", "deployments")] << 500
    first = OperatorProcess.start(api.kubeconfig, tmp_path / "first.log", namespaces=[NAMESPACE])
    scenarios.apply(cluster, scenarios.manifest("tiny-cpu", NAMESPACE))
    scenarios.wait_for(
        cluster,
        lambda: (
            scenarios.condition(scenarios.get(cluster, "llmi", "tiny-cpu"), "Degraded").get(
                "reason"
            )
            == "ApplyFailed"
        ),
        "the failed apply to show",
    )
    assert scenarios.get(cluster, "configmap", "tiny-cpu-engine") is not None
    assert scenarios.get(cluster, "deployment", "tiny-cpu") is None
    first.kill()
    record_rbac(api)
    api.clear_reactions()
    second = OperatorProcess.start(api.kubeconfig, tmp_path / "second.log", namespaces=[NAMESPACE])
    try:
        scenarios.wait_for(
            cluster, lambda: scenarios.get(cluster, "deployment", "tiny-cpu"), "the Deployment"
        )
        cluster.mark_workload_ready("deployment", "tiny-cpu", 1)
        scenarios.wait_status(
            cluster,
            "tiny-cpu",
            lambda o: (
                scenarios.condition(o, "Ready").get("status") == "True"
                and scenarios.condition(o, "Degraded").get("status") == "False"
            ),
            "Ready after the restart",
        )
        selector = "brook.dev/llminference=tiny-cpu"
        for kind in ("configmap", "service", "deployment", "poddisruptionbudget"):
            assert len(scenarios.list_names(cluster, kind, selector)) == 1, kind
    finally:
        assert second.stop() == 0
        record_rbac(api)


def _engine_pod(
    api: KubeApi, name: str, status: dict[str, Any], init: list[dict[str, Any]] | None = None
) -> None:
    """An engine pod of tiny-cpu as the kubelet or the scheduler reports it."""
    api.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": NAMESPACE,
                "labels": {
                    "app.kubernetes.io/name": "brook-engine",
                    "brook.dev/llminference": "tiny-cpu",
                    "brook.dev/role": "leader",
                },
            },
            "spec": {
                "containers": [{"name": "engine", "image": "brook-engine:test"}],
                "initContainers": init or [],
            },
        }
    )
    api.set_status("pods", name, status, NAMESPACE)


def test_status_says_why_replicas_are_not_ready(
    kube_api: KubeApi, brook_crd: Any, tmp_path: Path
) -> None:
    """A crash loop (with the engine's last error line), an image that cannot be pulled and a
    pod no node can take, each in the Ready condition with its reason; kstatus's Stalled
    says a person is needed, and clears when the pods recover."""
    kube_api.create_namespace(NAMESPACE)
    cluster = EmulatedCluster(kube_api, NAMESPACE)
    with _resyncing_operator(kube_api, tmp_path):
        scenarios.apply(cluster, scenarios.manifest("tiny-cpu", NAMESPACE, replicas=3))
        scenarios.wait_status(
            cluster, "tiny-cpu", lambda o: bool(scenarios.condition(o, "Ready")), "Ready"
        )
        crash = {
            "name": "engine",
            "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 20s"}},
            "lastState": {
                "terminated": {
                    "exitCode": 2,
                    "reason": "Error",
                    "message": "INFO loading\n"
                    "error: model.uri: /models/tiny-llama has no config.json",
                }
            },
        }
        _engine_pod(kube_api, "tiny-cpu-a", {"phase": "Running", "containerStatuses": [crash]})
        pull = {
            "name": "engine",
            "state": {
                "waiting": {
                    "reason": "ImagePullBackOff",
                    "message": 'Back-off pulling image "brook-engine:test"',
                }
            },
        }
        _engine_pod(kube_api, "tiny-cpu-b", {"phase": "Pending", "containerStatuses": [pull]})
        unschedulable = {
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": "0/3 nodes are available: 3 Insufficient cpu.",
        }
        _engine_pod(kube_api, "tiny-cpu-c", {"phase": "Pending", "conditions": [unschedulable]})

        def says_all(obj: dict[str, Any] | None) -> bool:
            message = str(scenarios.condition(obj, "Ready").get("message", ""))
            return all(r in message for r in ("CrashLoopBackOff", "ImagePull", "Unschedulable"))

        llmi = scenarios.wait_status(cluster, "tiny-cpu", says_all, "the pods' reasons")
        ready = scenarios.condition(llmi, "Ready")
        assert ready["status"] == "False" and ready["reason"] == "CrashLoopBackOff"
        assert (
            "exit code 2: error: model.uri: /models/tiny-llama has no config.json"
            in (ready["message"])
        )
        assert 'Back-off pulling image "brook-engine:test"' in ready["message"]
        assert "3 Insufficient cpu" in ready["message"]
        stalled = scenarios.condition(llmi, "Stalled")
        assert stalled["status"] == "True" and stalled["reason"] == "CrashLoopBackOff"
        # the pods recover (new image, fixed model, a node added): the reasons go
        for name in ("tiny-cpu-a", "tiny-cpu-b", "tiny-cpu-c"):
            kube_api.delete("pods", name, NAMESPACE)
        llmi = scenarios.wait_condition(cluster, "tiny-cpu", "Stalled", "False")
        assert scenarios.condition(llmi, "Ready")["reason"] == "ReplicasNotReady"
        assert scenarios.condition(llmi, "Reconciling")["status"] == "True"


def test_status_shows_the_model_download_a_pod_serves(
    kube_api: KubeApi,
    brook_crd: Any,
    tmp_path: Path,
    make_tiny_model: Callable[..., Path],
) -> None:
    """A real ``brook-engine fetch`` (as the pod's init container runs it, serving its
    progress on the pod's API port) downloads from the Hub stand-in; the operator reads it
    by the pod's IP into status.modelDownload and Ready's ModelDownloading; when the fetch
    container has ended, the field goes."""
    served = tmp_path / "served"
    shutil.copytree(make_tiny_model("llama"), served)
    # a shard the Hub client writes in 10 MiB pieces: progress at 10 and 20 MiB
    (served / "model-00002-of-00002.safetensors").write_bytes(b"\0" * (30 << 20))
    total = sum(p.stat().st_size for p in served.iterdir())
    kube_api.create_namespace(NAMESPACE)
    cluster = EmulatedCluster(kube_api, NAMESPACE)
    manifest = scenarios.manifest("tiny-cpu", NAMESPACE, replicas=1)
    port = free_port()
    manifest["spec"]["server"] = {**manifest["spec"].get("server", {}), "port": port}
    with (
        hub.serving(served, "brook-test/tiny", rate=total / 12) as stand_in,
        _resyncing_operator(kube_api, tmp_path),
    ):
        scenarios.apply(cluster, manifest)
        scenarios.wait_status(
            cluster, "tiny-cpu", lambda o: bool(scenarios.condition(o, "Ready")), "Ready"
        )
        fetch = hub.fetch(
            stand_in.url, "brook-test/tiny", tmp_path / "model", f"--progress-port={port}"
        )
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        fetcher = {"name": "fetch-model", "state": {"running": {"startedAt": started}}}
        _engine_pod(
            kube_api,
            "tiny-cpu-a",
            {"phase": "Pending", "podIP": "127.0.0.1", "initContainerStatuses": [fetcher]},
            init=[
                {
                    "name": "fetch-model",
                    "image": "brook-engine:test",
                    "command": ["brook-engine", "fetch", f"--progress-port={port}"],
                }
            ],
        )

        def midway(obj: dict[str, Any]) -> bool:
            download = (obj.get("status") or {}).get("modelDownload") or {}
            return 10 << 20 <= download.get("bytesDone", 0) < download.get("bytesTotal", 0)

        llmi = scenarios.wait_status(cluster, "tiny-cpu", midway, "download progress")
        download = llmi["status"]["modelDownload"]
        assert download["bytesTotal"] == total
        assert download["pods"] == download["podsReporting"] == 1
        ready = scenarios.condition(llmi, "Ready")
        assert ready["reason"] == "ModelDownloading", ready
        assert "downloading the model in 1 pod for " in ready["message"], ready
        assert f"({download['bytesDone'] / total:.0%})" in ready["message"], ready
        _, err = fetch.communicate(timeout=120)
        assert fetch.returncode == 0, err
        fetcher["state"] = {"terminated": {"exitCode": 0, "reason": "Completed"}}
        kube_api.set_status(
            "pods",
            "tiny-cpu-a",
            {"phase": "Pending", "podIP": "127.0.0.1", "initContainerStatuses": [fetcher]},
            NAMESPACE,
        )
        llmi = scenarios.wait_status(
            cluster,
            "tiny-cpu",
            lambda o: "modelDownload" not in (o.get("status") or {}),
            "the download gone from status",
        )
        assert scenarios.condition(llmi, "Ready")["reason"] == "ReplicasNotReady"


def test_router_renders_the_inference_pool_and_route_once_their_apis_exist(
    kube_api: KubeApi, brook_crd: Any, tmp_path: Path
) -> None:
    """spec.router without the Inference Extension's CRDs: Degraded naming what to install,
    everything else applied; once installed, the next resync creates the InferencePool and
    the HTTPRoute (owned by the resource); dropping the gateways, then the router, prunes
    them. The CRDs here are stand-ins with an open schema (``minimal_crd``)."""
    kube_api.create_namespace(NAMESPACE)
    cluster = EmulatedCluster(kube_api, NAMESPACE)
    router = {
        "endpointPicker": {"name": "tiny-epp"},
        "gateways": [{"name": "inference-gateway", "namespace": "gateway-system"}],
    }
    with _resyncing_operator(kube_api, tmp_path):
        scenarios.apply(cluster, scenarios.manifest("tiny-cpu", NAMESPACE, router=router))
        llmi = scenarios.wait_status(
            cluster,
            "tiny-cpu",
            lambda o: scenarios.condition(o, "Degraded").get("reason") == "RouterAPIMissing",
            "RouterAPIMissing",
        )
        message = scenarios.condition(llmi, "Degraded")["message"]
        assert "inferencepools.inference.networking.k8s.io" in message
        assert "httproutes.gateway.networking.k8s.io" in message
        assert scenarios.get(cluster, "deployment", "tiny-cpu") is not None
        kube_api.create(
            minimal_crd("inference.networking.k8s.io", "v1", "inferencepools", "InferencePool")
        )
        kube_api.create(minimal_crd("gateway.networking.k8s.io", "v1", "httproutes", "HTTPRoute"))
        pool = scenarios.wait_for(
            cluster, lambda: kube_api.get("inferencepools", "tiny-cpu", NAMESPACE), "the pool"
        )
        assert pool["spec"]["endpointPickerRef"]["name"] == "tiny-epp"
        assert pool["spec"]["selector"]["matchLabels"]["brook.dev/role"] == "leader"
        assert pool["metadata"]["ownerReferences"][0]["kind"] == "LLMInference"
        route = scenarios.wait_for(
            cluster, lambda: kube_api.get("httproutes", "tiny-cpu", NAMESPACE), "the route"
        )
        assert route["spec"]["rules"][0]["backendRefs"][0]["kind"] == "InferencePool"
        scenarios.wait_condition(cluster, "tiny-cpu", "Degraded", "False")
        without_route = {"endpointPicker": {"name": "tiny-epp"}}
        scenarios.apply(cluster, scenarios.manifest("tiny-cpu", NAMESPACE, router=without_route))
        scenarios.wait_for(
            cluster,
            lambda: kube_api.get("httproutes", "tiny-cpu", NAMESPACE) is None,
            "the route pruned",
        )
        assert kube_api.get("inferencepools", "tiny-cpu", NAMESPACE) is not None
        scenarios.apply(cluster, scenarios.manifest("tiny-cpu", NAMESPACE))
        scenarios.wait_for(
            cluster,
            lambda: kube_api.get("inferencepools", "tiny-cpu", NAMESPACE) is None,
            "the pool pruned",
        )


def test_throttling_and_server_errors_are_retried(
    cluster: EmulatedCluster, operator: OperatorProcess
) -> None:
    """429 and 5xx answers are tried again: by the client (3 tries), then by kopf with
    backoff. A 409 is not (a conflict with another field manager is reported instead:
    test_faults.py and test_ownership.py)."""
    api = cluster.api
    deployments = kmock.resource("apps", "v1", "deployments")
    api.handler[kmock.method.PATCH, deployments][:4] << 429
    api.handler[kmock.method.GET, deployments][:1] << 503
    scenarios.create_converges(cluster)  # ends Ready, so the retries went through
    llmi = scenarios.get(cluster, "llmi", "tiny-cpu")
    assert scenarios.condition(llmi, "Degraded")["status"] == "False"
    metrics = operator.metrics()
    assert 'brook_operator_reconcile_errors_total{code="429"}' in metrics
    assert 'brook_operator_reconciles_total{result="error"}' in metrics


def test_zz_rbac_rules_are_exactly_what_the_operator_used() -> None:
    """Runs last (modules run in name order; the autoscaler's come first): every permission
    in rbac.py was used by some operator test, and every request the operator made is
    covered by one."""
    if not USED:
        pytest.skip("run with the rest of the module")
    granted = {
        (verb, rule.api_group, resource)
        for rule in NAMESPACED_RULES + CLUSTER_RULES
        for resource in rule.resources
        for verb in rule.verbs
    }
    assert USED - granted == set(), "requests the RBAC rules do not allow"
    assert granted - USED == set(), "permissions the operator never used"
