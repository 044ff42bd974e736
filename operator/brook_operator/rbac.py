"""Every Kubernetes permission the operator uses, and nothing else.

The Helm chart's (Cluster)Role is rendered from the same list (a test compares them), and
the integration tests record the operator's requests against the API and check that each
one is covered here.
"""

from __future__ import annotations

from dataclasses import dataclass

from brook_operator.api import GROUP, PLURAL
from brook_operator.api.router import GATEWAY_GROUP, INFERENCE_GROUP
from brook_operator.render.workload import LWS_GROUP

#: A child is read first (Brook writes only objects it owns), then server-side applied:
#: create when it is new, patch after.
APPLY_VERBS = ("get", "create", "patch")
#: The workload also has its status read, its events followed (kopf lists and watches it)
#: and is deleted when the topology changes kind (Deployment ↔ LeaderWorkerSet).
WORKLOAD_VERBS = ("get", "list", "watch", "create", "patch", "delete")
ROUTER_VERBS = ("get", "list", "create", "patch", "delete")


@dataclass(frozen=True)
class Rule:
    """One PolicyRule: API group, resources, verbs."""

    api_group: str
    resources: tuple[str, ...]
    verbs: tuple[str, ...]

    def as_policy_rule(self) -> dict[str, list[str]]:
        return {
            "apiGroups": [self.api_group],
            "resources": list(self.resources),
            "verbs": list(self.verbs),
        }


#: Rules in the namespaces the operator watches (a Role per namespace, or a ClusterRole).
NAMESPACED_RULES: tuple[Rule, ...] = (
    # The resource: kopf lists and watches it and patches its annotations (handler progress);
    # a child's event reads its owner; status is written through the subresource.
    Rule(GROUP, (PLURAL,), ("get", "list", "watch", "patch")),
    Rule(GROUP, (f"{PLURAL}/status",), ("patch",)),
    # The children.
    Rule("", ("configmaps", "services"), APPLY_VERBS),
    Rule("policy", ("poddisruptionbudgets",), APPLY_VERBS),
    Rule("networking.k8s.io", ("networkpolicies",), APPLY_VERBS),
    Rule("apps", ("deployments",), WORKLOAD_VERBS),
    Rule(LWS_GROUP, ("leaderworkersets",), WORKLOAD_VERBS),
    # spec.router's children, pruned (listed, deleted) when the router goes.
    Rule(INFERENCE_GROUP, ("inferencepools",), ROUTER_VERBS),
    Rule(GATEWAY_GROUP, ("httproutes",), ROUTER_VERBS),
    # The autoscaler lists the leader pods to scrape their /metrics, and before a scale-in
    # sets each one's pod-deletion-cost so the least-loaded one goes.
    Rule("", ("pods",), ("list", "patch")),
    # Kubernetes Events on the resource (kopf posts core/v1 Events).
    Rule("", ("events",), ("create",)),
)

#: Cluster-scoped rules: kopf discovers custom resources through their definitions (the
#: operator also learns from them whether LeaderWorkerSet is installed), and in
#: namespace-scoped mode kopf follows the namespaces it was given.
CLUSTER_RULES: tuple[Rule, ...] = (
    Rule("apiextensions.k8s.io", ("customresourcedefinitions",), ("list", "watch")),
    Rule("", ("namespaces",), ("list", "watch")),
)


def policy_rules(rules: tuple[Rule, ...]) -> list[dict[str, list[str]]]:
    return [rule.as_policy_rule() for rule in rules]


#: With more than one operator replica (the chart's ``replicas``), kopf's peering elects the
#: one that handles events: it reads and patches a peering object, a ClusterKopfPeering in
#: cluster scope (cluster-scoped rules) or a KopfPeering in each watched namespace.
PEERING_CLUSTER_RULES: tuple[Rule, ...] = (
    Rule("kopf.dev", ("clusterkopfpeerings",), ("get", "list", "watch", "patch")),
)
PEERING_NAMESPACED_RULES: tuple[Rule, ...] = (
    Rule("kopf.dev", ("kopfpeerings",), ("get", "list", "watch", "patch")),
)
