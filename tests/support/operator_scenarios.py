"""The operator's scenarios, written once and run twice: against the emulated API server
(``tests/integration/operator``) and against a real cluster when ``KUBECONFIG`` points at one
(``tests/e2e``). A ``Cluster`` gives kubectl, reads, and — where no controllers run — plays
their part (a Deployment's ready replicas)."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import yaml

from .kube_api import KubeApi

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "crds" / "examples"
T = TypeVar("T")

#: Children of a single-pod resource, by kubectl resource name → object name suffix.
CHILDREN = {"configmap": "-engine", "service": "", "deployment": "", "poddisruptionbudget": ""}


class Cluster(Protocol):
    namespace: str
    timeout: float
    runs_controllers: bool
    """A real cluster: Deployments get status from their controller, garbage collection
    takes a moment."""

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]: ...

    def mark_workload_ready(self, kind: str, name: str, replicas: int) -> None:
        """Make the workload report ``replicas`` ready (a no-op where controllers run)."""
        ...


@dataclass
class EmulatedCluster:
    """A ``Cluster`` on the emulated kube-apiserver, which runs no controllers: the tests play
    their part."""

    api: KubeApi
    namespace: str
    timeout: float = 30.0
    runs_controllers: bool = False

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> Any:
        return self.api.kubectl(*args, input=input, check=check)

    def mark_workload_ready(self, kind: str, name: str, replicas: int) -> None:
        workload = self.api.get(kind + "s", name, self.namespace)
        assert workload is not None
        self.api.set_status(
            kind + "s",
            name,
            {
                "observedGeneration": workload["metadata"]["generation"],
                "replicas": replicas,
                "readyReplicas": replicas,
                "updatedReplicas": replicas,
                "availableReplicas": replicas,
            },
            self.namespace,
        )


def manifest(example: str, namespace: str, **spec: Any) -> dict[str, Any]:
    """An example manifest moved to ``namespace``, with top-level spec fields replaced."""
    obj: dict[str, Any] = yaml.safe_load((EXAMPLES / f"{example}.yaml").read_text())
    obj["metadata"]["namespace"] = namespace
    obj["spec"].update(spec)
    return obj


def get(cluster: Cluster, resource: str, name: str) -> dict[str, Any] | None:
    result = cluster.kubectl(
        "get", resource, name, "-n", cluster.namespace, "-o", "json", check=False
    )
    if result.returncode != 0:
        if "NotFound" in result.stderr or "not found" in result.stderr:
            return None
        raise AssertionError(f"kubectl get {resource} {name}: {result.stderr}")
    obj: dict[str, Any] = json.loads(result.stdout)
    return obj


def list_names(cluster: Cluster, resource: str, selector: str) -> list[str]:
    result = cluster.kubectl("get", resource, "-n", cluster.namespace, "-l", selector, "-o", "json")
    return sorted(item["metadata"]["name"] for item in json.loads(result.stdout)["items"])


def wait_for(cluster: Cluster, condition: Callable[[], T | None], message: str) -> T:
    deadline = time.monotonic() + cluster.timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {cluster.timeout:.0f}s waiting for {message}")
        time.sleep(0.1)


def condition(obj: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    for item in ((obj or {}).get("status") or {}).get("conditions") or []:
        if item.get("type") == kind:
            return dict(item)
    return {}


def apply(cluster: Cluster, obj: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(obj))


def wait_status(
    cluster: Cluster, name: str, check: Callable[[dict[str, Any]], bool], message: str
) -> dict[str, Any]:
    def read() -> dict[str, Any] | None:
        obj = get(cluster, "llminference", name)
        return obj if obj is not None and check(obj) else None

    return wait_for(cluster, read, f"{name}: {message}")


def wait_condition(cluster: Cluster, name: str, kind: str, status: str) -> dict[str, Any]:
    """The resource once its condition ``kind`` has ``status`` ("True" or "False")."""
    return wait_status(
        cluster, name, lambda o: condition(o, kind).get("status") == status, f"{kind}={status}"
    )


# -- scenarios -------------------------------------------------------------------------------


def create_converges(cluster: Cluster, name: str = "tiny-cpu") -> dict[str, Any]:
    """kubectl apply → every child appears, owned by the resource; status converges."""
    apply(cluster, manifest(name, cluster.namespace))
    llmi = wait_status(
        cluster,
        name,
        lambda o: (o.get("status") or {}).get("observedGeneration") == 1,
        "observedGeneration 1",
    )
    uid = llmi["metadata"]["uid"]
    for resource, suffix in CHILDREN.items():

        def child_exists(r: str = resource, s: str = suffix) -> dict[str, Any] | None:
            return get(cluster, r, name + s)

        child = wait_for(cluster, child_exists, resource)
        (owner,) = child["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"]) == ("LLMInference", name, uid)
        assert owner["controller"] is True
    status = llmi["status"]
    assert not llmi["metadata"].get("finalizers"), "deletion is left to garbage collection"
    assert condition(llmi, "SpecValid")["status"] == "True"
    assert status["endpoint"] == f"http://{name}.{cluster.namespace}.svc:8000/v1"
    assert status["topology"]["workload"] == "Deployment"
    cluster.mark_workload_ready("deployment", name, 1)
    if not cluster.runs_controllers:
        llmi = wait_status(
            cluster, name, lambda o: condition(o, "Ready").get("status") == "True", "Ready"
        )
        assert llmi["status"]["readyReplicas"] == 1
    return llmi


def printer_columns(cluster: Cluster, name: str = "tiny-cpu") -> None:
    out = cluster.kubectl("get", "llmi", "-n", cluster.namespace).stdout
    header, *rows = out.strip().splitlines()
    assert header.split() == ["NAME", "MODEL", "TP", "PP", "REPLICAS", "READY", "AGE"], out
    row = next(r.split() for r in rows if r.split()[0] == name)
    assert row[1:4] == ["file:///models/tiny-llama", "1", "1"], out


def update_image_and_scale(cluster: Cluster, name: str = "tiny-cpu") -> None:
    """A new image, ``kubectl scale`` and a new TP degree reach the children;
    observedGeneration follows."""
    cluster.kubectl(
        "patch", "llmi", name, "-n", cluster.namespace, "--type=merge",
        "-p", json.dumps({"spec": {"image": "registry.example/brook-engine:v2"}}),
    )  # fmt: skip

    def image() -> bool:
        deployment = get(cluster, "deployment", name) or {}
        containers = deployment["spec"]["template"]["spec"]["containers"]
        return bool(containers[0]["image"] == "registry.example/brook-engine:v2")

    wait_for(cluster, image, "the new image in the Deployment")
    wait_status(cluster, name, lambda o: o["status"].get("observedGeneration") == 2, "generation 2")
    cluster.kubectl("scale", f"llmi/{name}", "-n", cluster.namespace, "--replicas=3")
    wait_for(
        cluster,
        lambda: (get(cluster, "deployment", name) or {}).get("spec", {}).get("replicas") == 3,
        "3 replicas in the Deployment",
    )
    llmi = wait_status(
        cluster, name, lambda o: o["status"].get("desiredReplicas") == 3, "desiredReplicas 3"
    )
    assert llmi["status"]["observedGeneration"] == 3
    # Tensor parallel 2 on 2-device nodes: still one pod, now holding both devices.
    cluster.kubectl(
        "patch", "llmi", name, "-n", cluster.namespace, "--type=merge",
        "-p", json.dumps(
            {"spec": {"parallel": {"tensor": 2}, "accelerator": {"devicesPerNode": 2}}}
        ),
    )  # fmt: skip

    def world_size() -> bool:
        deployment = get(cluster, "deployment", name) or {}
        env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
        return {"name": "BROOK_WORLD_SIZE", "value": "2"} in env

    wait_for(cluster, world_size, "world size 2 in the Deployment")
    config_map = get(cluster, "configmap", f"{name}-engine") or {}
    assert "tensor: 2" in config_map["data"]["engine.yaml"]
    wait_status(cluster, name, lambda o: o["status"].get("observedGeneration") == 4, "generation 4")


def topology_change(cluster: Cluster, name: str = "tiny-cpu") -> None:
    """Pipeline 2 over 1-device nodes: two pods per replica, so the Deployment gives way to a
    LeaderWorkerSet of size 2; pipeline 1 brings the Deployment back."""
    cluster.kubectl(
        "patch", "llmi", name, "-n", cluster.namespace, "--type=merge",
        "-p", json.dumps({"spec": {"parallel": {"pipeline": 2}}}),
    )  # fmt: skip
    lws = wait_for(cluster, lambda: get(cluster, "leaderworkerset", name), "the LeaderWorkerSet")
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    wait_for(cluster, lambda: get(cluster, "deployment", name) is None, "the Deployment to go")
    llmi = wait_status(
        cluster,
        name,
        lambda o: o["status"].get("topology", {}).get("workload") == "LeaderWorkerSet",
        "LeaderWorkerSet topology",
    )
    assert llmi["status"]["topology"]["podsPerReplica"] == 2
    # And back: one pod per replica again, the LeaderWorkerSet gives way to a Deployment.
    cluster.kubectl(
        "patch", "llmi", name, "-n", cluster.namespace, "--type=merge",
        "-p", json.dumps({"spec": {"parallel": {"pipeline": 1}}}),
    )  # fmt: skip
    wait_for(cluster, lambda: get(cluster, "deployment", name), "the Deployment again")
    wait_for(
        cluster,
        lambda: get(cluster, "leaderworkerset", name) is None,
        "the LeaderWorkerSet to go",
    )


def delete_collects_children(cluster: Cluster, name: str = "tiny-cpu") -> None:
    cluster.kubectl("delete", "llmi", name, "-n", cluster.namespace, "--wait=true")
    selector = f"brook.dev/llminference={name}"

    def gone() -> bool:
        return all(
            not list_names(cluster, kind, selector)
            for kind in ("configmap", "service", "deployment", "poddisruptionbudget")
        )

    wait_for(cluster, gone, "garbage collection of the children")
