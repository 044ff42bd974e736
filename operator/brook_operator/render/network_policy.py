"""The NetworkPolicies of the engine pods: the API port is open to the clients
``spec.server.allowedClients`` selects (to anyone when unset), and the rest of a pod — the
torch.distributed rendezvous, gloo's and HCCL's listeners — only to the pods of its own
replica.

- ``<name>-engine`` selects every engine pod of the resource, so each one refuses all
  ingress but what a policy admits; it admits TCP to ``server.port`` (the API, /metrics,
  the probes) from the allowed clients. That is all a single-pod replica needs: its ranks
  meet on loopback.
- ``<name>-group-<i>``, for a multi-pod replica, selects the pods of LeaderWorkerSet group
  ``i`` and admits every TCP port from those pods: the rendezvous has a fixed port, but
  gloo and HCCL listen on ephemeral ones. A NetworkPolicy cannot say "from the pods of my
  own group", so there is one per group index: the replicas and those a rolling update
  surges to.

Group policies are never pruned. One only ever opens group ``i``'s pods to one another, so a
policy left from a larger replica count admits nothing new, is ready when the group comes
back, and keeps a group that drains after a scale-in connected until its pods are gone; all
of them go with the resource (owner references). Traffic from a pod's own node (the kubelet's
probes) is always admitted by NetworkPolicy.
"""

from __future__ import annotations

import math
from typing import Any

from brook_operator.api import LLMInference, topology
from brook_operator.render.labels import child_labels, selector_labels

#: LeaderWorkerSet's label holding a pod's group (replica) index.
LWS_GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"


def engine_policy_name(llmi: LLMInference) -> str:
    return f"{llmi.metadata.name}-engine"


def group_policy_name(llmi: LLMInference, group: int) -> str:
    return f"{llmi.metadata.name}-group-{group}"


def network_policies(llmi: LLMInference, replicas: int) -> list[dict[str, Any]]:
    """The engine pods' policy, then one per replica group of a multi-pod replica."""
    policies = [_policy(llmi, engine_policy_name(llmi), selector_labels(llmi), [_api_rule(llmi)])]
    if topology(llmi.spec).pods_per_replica > 1:
        for group in range(replicas + _surge(llmi, replicas)):
            pods = {**selector_labels(llmi), LWS_GROUP_INDEX_LABEL: str(group)}
            own_pods = {"from": [{"podSelector": {"matchLabels": pods}}]}
            rule = {**own_pods, "ports": [{"protocol": "TCP"}]}
            policies.append(_policy(llmi, group_policy_name(llmi, group), pods, [rule]))
    return policies


def _api_rule(llmi: LLMInference) -> dict[str, Any]:
    server = llmi.spec.server
    rule: dict[str, Any] = {"ports": [{"port": server.port, "protocol": "TCP"}]}
    if server.allowed_clients is not None:  # else from anywhere
        rule["from"] = [
            peer.model_dump(by_alias=True, exclude_none=True) for peer in server.allowed_clients
        ]
    return rule


def _surge(llmi: LLMInference, replicas: int) -> int:
    """Groups a rolling update adds above ``replicas`` (maxSurge, a percentage rounded up)."""
    surge = llmi.spec.rollout.max_surge
    if isinstance(surge, str):
        return math.ceil(replicas * int(surge.rstrip("%")) / 100)
    return surge


def _policy(
    llmi: LLMInference, name: str, pods: dict[str, str], ingress: list[dict[str, Any]]
) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name}
    if llmi.metadata.namespace:
        metadata["namespace"] = llmi.metadata.namespace
    metadata["labels"] = child_labels(llmi)
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata,
        "spec": {
            "podSelector": {"matchLabels": pods},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }
