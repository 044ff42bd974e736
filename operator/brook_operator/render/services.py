"""The API Service (leader pods only: in a multi-pod replica only the leader serves) and the
PodDisruptionBudget."""

from __future__ import annotations

from typing import Any

from brook_operator.api import LLMInference
from brook_operator.render.labels import ROLE_LABEL, child_labels, selector_labels
from brook_operator.render.pod import HTTP_PORT


def _metadata(llmi: LLMInference, name: str) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "labels": child_labels(llmi)}
    if llmi.metadata.namespace:
        metadata["namespace"] = llmi.metadata.namespace
    return metadata


def api_service(llmi: LLMInference) -> dict[str, Any]:
    """``<name>``: the OpenAI-compatible API of every ready replica, and their /metrics."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(llmi, llmi.metadata.name),
        "spec": {
            "type": "ClusterIP",
            "selector": {**selector_labels(llmi), ROLE_LABEL: "leader"},
            "ports": [
                {"name": HTTP_PORT, "port": llmi.spec.server.port, "targetPort": HTTP_PORT},
            ],
        },
    }


def endpoint(llmi: LLMInference) -> str:
    namespace = llmi.metadata.namespace or "default"
    return f"http://{llmi.metadata.name}.{namespace}.svc:{llmi.spec.server.port}/v1"


def disruption_budget(llmi: LLMInference) -> dict[str, Any]:
    """At most one pod down at a time through voluntary disruptions (drains, upgrades):
    evicting any pod of a multi-pod replica restarts that whole group, so one pod is one
    replica."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(llmi, llmi.metadata.name),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(llmi)},
        },
    }
