"""Pod objects standing in for engine pods where no controller or kubelet runs: created
the way a ReplicaSet or StatefulSet would, then marked Running and Ready at an address
where a real (or fixed-exposition) /metrics endpoint listens."""

from __future__ import annotations

from typing import Any

from .kube_api import KubeApi


def replica_owner(kind: str, name: str, uid: str) -> dict[str, Any]:
    """A controller ownerReference (``kind`` ReplicaSet or StatefulSet)."""
    return {"apiVersion": "apps/v1", "kind": kind, "name": name, "uid": uid, "controller": True}


def add_ready_pod(
    api: KubeApi,
    namespace: str,
    name: str,
    template: dict[str, Any],
    address: str,
    port: int,
    *,
    owner: dict[str, Any] | None,
    host_network: bool = False,
) -> None:
    """A pod from a workload's pod ``template`` (its labels and engine image), owned by
    ``owner`` (None: a look-alike nobody made), Ready at ``address``, engine API on ``port``."""
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "labels": template["metadata"]["labels"],
    }
    if owner is not None:
        metadata["ownerReferences"] = [owner]
    engine = {
        "name": "engine",
        "image": template["spec"]["containers"][0]["image"],
        "ports": [{"name": "http", "containerPort": port}],
    }
    api.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": metadata,
            "spec": {"hostNetwork": host_network, "containers": [engine]},
        }
    )
    status = {
        "phase": "Running",
        "podIP": address,
        "conditions": [{"type": "Ready", "status": "True"}],
    }
    api.set_status("pods", name, status, namespace)
