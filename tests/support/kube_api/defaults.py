"""Values the real server fills in that clients read back: a few built-in defaults
(workload replicas, Service type, clusterIP and ports, Namespace and Pod initial status)
and the status the apiextensions controllers give a CRD."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from . import objects
from .resources import NAMESPACES, ResourceSpec
from .store import JsonObject

_WORKLOADS = frozenset({("apps", "deployments"), ("apps", "statefulsets"), ("apps", "replicasets")})


def builtin_defaults(
    spec: ResourceSpec, obj: JsonObject, old: JsonObject | None, allocate_ip: Callable[[], str]
) -> None:
    """The few defaults of built-in kinds that clients commonly read back, on every
    write as the real defaulting is (allocations and initial status on create only)."""
    group_resource = spec.group_resource
    body_spec = obj.get("spec")
    if group_resource in _WORKLOADS:
        if not isinstance(body_spec, dict):
            body_spec = obj["spec"] = {}
        body_spec.setdefault("replicas", 1)
    elif group_resource == ("", "services"):
        if not isinstance(body_spec, dict):
            body_spec = obj["spec"] = {}
        body_spec.setdefault("type", "ClusterIP")
        body_spec.setdefault("sessionAffinity", "None")
        old_spec = (old or {}).get("spec") or {}
        for key in ("clusterIP", "clusterIPs"):  # immutable once allocated
            if key in old_spec and not body_spec.get(key):
                body_spec[key] = old_spec[key]
        if not body_spec.get("clusterIP"):
            body_spec["clusterIP"] = allocate_ip()
        if body_spec["clusterIP"] != "None":
            body_spec.setdefault("clusterIPs", [body_spec["clusterIP"]])
        for port in body_spec.get("ports") or ():
            if isinstance(port, dict):
                port.setdefault("protocol", "TCP")
                port.setdefault("targetPort", port.get("port"))
    elif group_resource == NAMESPACES and old is None:
        meta = obj["metadata"]
        meta.setdefault("labels", {})["kubernetes.io/metadata.name"] = meta["name"]
        obj["spec"] = {"finalizers": ["kubernetes"]}
        obj["status"] = {"phase": "Active"}
    elif group_resource == ("", "pods") and old is None:
        obj["status"] = {"phase": "Pending", "qosClass": "BestEffort"}


def crd_status(crd: JsonObject, previous: Any = None) -> JsonObject:
    """What the apiextensions controllers report: the accepted names and the
    NamesAccepted/Established conditions (kept as they were while the names stay)."""
    names = dict(crd["spec"]["names"])
    names.setdefault("singular", str(names["kind"]).lower())
    names.setdefault("listKind", f"{names['kind']}List")
    storage = [v["name"] for v in crd["spec"]["versions"] if v.get("storage")]
    if isinstance(previous, Mapping) and previous.get("acceptedNames") == names:
        stored = list(previous.get("storedVersions") or [])
        return {
            **previous,
            "storedVersions": stored + [v for v in storage if v not in stored],
        }
    now = objects.timestamp()
    return {
        "acceptedNames": names,
        "conditions": [
            {
                "type": "NamesAccepted",
                "status": "True",
                "reason": "NoConflicts",
                "message": "no conflicts found",
                "lastTransitionTime": now,
            },
            {
                "type": "Established",
                "status": "True",
                "reason": "InitialNamesAccepted",
                "message": "the initial names have been accepted",
                "lastTransitionTime": now,
            },
        ],
        "storedVersions": storage,
    }
