"""Everything one ``LLMInference`` becomes, in the order it is applied."""

from __future__ import annotations

from typing import Any

from brook_operator.api import LLMInference
from brook_operator.api.router import HTTP_ROUTE_API, INFERENCE_POOL_API
from brook_operator.render.config_map import engine_config_map
from brook_operator.render.network_policy import network_policies
from brook_operator.render.router import router_children
from brook_operator.render.services import api_service, disruption_budget
from brook_operator.render.settings import OperatorSettings
from brook_operator.render.workload import LWS_API_VERSION, desired_replicas, workload

#: (apiVersion, kind) of the children a spec change can make unwanted: the workload kind
#: changes when a replica grows past one node (or shrinks back). The other children always
#: exist under fixed names, so they are only ever applied (a replica group's
#: NetworkPolicy outlives the group on purpose: see ``render.network_policy``).
PRUNABLE_KINDS: tuple[tuple[str, str], ...] = (
    ("apps/v1", "Deployment"),
    (LWS_API_VERSION, "LeaderWorkerSet"),
    (INFERENCE_POOL_API, "InferencePool"),  # spec.router removed, or its gateways
    (HTTP_ROUTE_API, "HTTPRoute"),
)
#: Kinds of optional APIs a child may need: (apiVersion, kind) → the CRD to install.
OPTIONAL_KINDS: dict[tuple[str, str], str] = {
    (INFERENCE_POOL_API, "InferencePool"): "inferencepools.inference.networking.k8s.io "
    "(the Gateway API Inference Extension)",
    (HTTP_ROUTE_API, "HTTPRoute"): "httproutes.gateway.networking.k8s.io (the Gateway API)",
}


def render_children(
    llmi: LLMInference, settings: OperatorSettings, autoscaled: int | None = None
) -> list[dict[str, Any]]:
    """The children of ``llmi`` (without owner references, which need its uid). The config
    and the network policies come first so that pods never start without them."""
    replicas = desired_replicas(llmi, autoscaled)
    return [
        engine_config_map(llmi, settings),
        *network_policies(llmi, replicas),
        api_service(llmi),
        workload(llmi, settings, replicas),
        disruption_budget(llmi),
        *router_children(llmi),
    ]


def with_owner(child: dict[str, Any], llmi: LLMInference) -> dict[str, Any]:
    """``child`` owned by ``llmi`` (garbage-collected with it)."""
    if llmi.metadata.uid is None:
        raise ValueError(f"{llmi.metadata.name}: metadata.uid is needed to own children")
    owner = {
        "apiVersion": llmi.api_version,
        "kind": llmi.kind,
        "name": llmi.metadata.name,
        "uid": llmi.metadata.uid,
        "controller": True,
        # No blockOwnerDeletion: it would need update on llminferences/finalizers where the
        # OwnerReferencesPermissionEnforcement admission plugin runs, and background
        # deletion does not wait for it.
    }
    return {**child, "metadata": {**child["metadata"], "ownerReferences": [owner]}}
