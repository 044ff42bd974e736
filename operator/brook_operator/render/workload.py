"""The replicas: a Deployment when a replica is one pod, a LeaderWorkerSet when it spans
several (the leader serves the API and hosts the rendezvous; workers join it)."""

from __future__ import annotations

from typing import Any

from brook_operator.api import LLMInference, topology
from brook_operator.render.labels import ROLE_LABEL, child_labels, selector_labels
from brook_operator.render.pod import pod_template
from brook_operator.render.settings import OperatorSettings

#: The LeaderWorkerSet API (https://lws.sigs.k8s.io), which multi-pod replicas need.
LWS_GROUP = "leaderworkerset.x-k8s.io"
LWS_VERSION = "v1"
LWS_API_VERSION = f"{LWS_GROUP}/{LWS_VERSION}"


def workload_name(llmi: LLMInference) -> str:
    return llmi.metadata.name


def desired_replicas(llmi: LLMInference, autoscaled: int | None = None) -> int:
    """spec.replicas, or the autoscaler's count (its minimum until it has decided), or 0
    while suspended."""
    spec = llmi.spec
    if spec.suspend:
        return 0
    if spec.autoscaling is not None:
        low, high = spec.autoscaling.min_replicas, spec.autoscaling.max_replicas
        return min(max(autoscaled if autoscaled is not None else low, low), high)
    return spec.replicas if spec.replicas is not None else 1


def _metadata(llmi: LLMInference) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": workload_name(llmi), "labels": child_labels(llmi)}
    if llmi.metadata.namespace:
        metadata["namespace"] = llmi.metadata.namespace
    return metadata


def deployment(llmi: LLMInference, settings: OperatorSettings, replicas: int) -> dict[str, Any]:
    rollout = llmi.spec.rollout
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(llmi),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector_labels(llmi)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {
                    "maxSurge": rollout.max_surge,
                    "maxUnavailable": rollout.max_unavailable,
                },
            },
            # A model load can take minutes; do not call a rollout stuck too early.
            "progressDeadlineSeconds": 3600,
            "template": pod_template(llmi, settings, "leader"),
        },
    }


def leader_worker_set(
    llmi: LLMInference, settings: OperatorSettings, replicas: int
) -> dict[str, Any]:
    rollout = llmi.spec.rollout
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": "LeaderWorkerSet",
        "metadata": _metadata(llmi),
        "spec": {
            "replicas": replicas,
            # Workers start with the leader, not after it is ready: the leader only becomes
            # ready once every worker has joined the rendezvous.
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": {
                "size": topology(llmi.spec).pods_per_replica,
                # A lost rank breaks the group's collectives: restart the whole group.
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": pod_template(llmi, settings, "leader"),
                "workerTemplate": pod_template(llmi, settings, "worker"),
            },
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {
                    "maxSurge": rollout.max_surge,
                    "maxUnavailable": rollout.max_unavailable,
                },
            },
            "networkConfig": {"subdomainPolicy": "UniquePerReplica"},
        },
    }


def workload(llmi: LLMInference, settings: OperatorSettings, replicas: int) -> dict[str, Any]:
    if topology(llmi.spec).workload == "Deployment":
        return deployment(llmi, settings, replicas)
    return leader_worker_set(llmi, settings, replicas)


def pod_templates(obj: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The pod templates of a workload as read back (a Deployment's one, a LeaderWorkerSet's
    leader and worker templates); empty for anything else or a missing part."""
    spec = (obj or {}).get("spec") or {}
    group = spec.get("leaderWorkerTemplate") or {}
    found = [spec.get("template"), group.get("leaderTemplate"), group.get("workerTemplate")]
    return [template for template in found if isinstance(template, dict)]


__all__ = ["ROLE_LABEL", "desired_replicas", "pod_templates", "workload", "workload_name"]
