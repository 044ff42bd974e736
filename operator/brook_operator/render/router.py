"""``spec.router``'s children: the InferencePool of the replicas' leader pods, and the
HTTPRoute from the given Gateways to it (both named after the resource)."""

from __future__ import annotations

from typing import Any

from brook_operator.api import LLMInference
from brook_operator.api.router import HTTP_ROUTE_API, INFERENCE_GROUP, INFERENCE_POOL_API
from brook_operator.render.labels import ROLE_LABEL, child_labels, selector_labels


def _metadata(llmi: LLMInference) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": llmi.metadata.name, "labels": child_labels(llmi)}
    if llmi.metadata.namespace:
        metadata["namespace"] = llmi.metadata.namespace
    return metadata


def router_children(llmi: LLMInference) -> list[dict[str, Any]]:
    router = llmi.spec.router
    if router is None:
        return []
    picker = router.endpoint_picker
    pool = {
        "apiVersion": INFERENCE_POOL_API,
        "kind": "InferencePool",
        "metadata": _metadata(llmi),
        "spec": {
            # the leaders serve the API; a multi-pod replica is one endpoint
            "selector": {"matchLabels": {**selector_labels(llmi), ROLE_LABEL: "leader"}},
            "targetPorts": [{"number": llmi.spec.server.port}],
            "endpointPickerRef": {
                "name": picker.name,
                "port": {"number": picker.port},
                "failureMode": picker.failure_mode,
            },
        },
    }
    if not router.gateways:
        return [pool]
    parents = []
    for gateway in router.gateways:
        parent: dict[str, Any] = {"name": gateway.name}
        if gateway.namespace:
            parent["namespace"] = gateway.namespace
        if gateway.section_name:
            parent["sectionName"] = gateway.section_name
        parents.append(parent)
    route_spec: dict[str, Any] = {"parentRefs": parents}
    if router.hostnames:
        route_spec["hostnames"] = list(router.hostnames)
    route_spec["rules"] = [
        {
            "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
            "backendRefs": [
                {"group": INFERENCE_GROUP, "kind": "InferencePool", "name": llmi.metadata.name}
            ],
        }
    ]
    route = {
        "apiVersion": HTTP_ROUTE_API,
        "kind": "HTTPRoute",
        "metadata": _metadata(llmi),
        "spec": route_spec,
    }
    return [pool, route]
