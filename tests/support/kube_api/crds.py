"""Stand-in CustomResourceDefinitions for third-party kinds a test may install (or omit),
and a builder for more. Their schemas preserve unknown fields (nothing is pruned)."""

from __future__ import annotations

from typing import Any


def minimal_crd(
    group: str,
    version: str,
    plural: str,
    kind: str,
    *,
    namespaced: bool = True,
    short_names: tuple[str, ...] = (),
    categories: tuple[str, ...] = (),
    status: bool = True,
    scale: dict[str, str] | None = None,
    printer_columns: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A CRD with an open schema. ``scale`` holds ``specReplicasPath``,
    ``statusReplicasPath`` and optionally ``labelSelectorPath``."""
    subresources: dict[str, Any] = {}
    if status:
        subresources["status"] = {}
    if scale is not None:
        subresources["scale"] = dict(scale)
    names: dict[str, Any] = {
        "plural": plural,
        "singular": kind.lower(),
        "kind": kind,
        "listKind": f"{kind}List",
    }
    if short_names:
        names["shortNames"] = list(short_names)
    if categories:
        names["categories"] = list(categories)
    served: dict[str, Any] = {
        "name": version,
        "served": True,
        "storage": True,
        "schema": {
            "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        },
        "subresources": subresources,
    }
    if printer_columns:
        served["additionalPrinterColumns"] = printer_columns
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced" if namespaced else "Cluster",
            "names": names,
            "versions": [served],
        },
    }


def leaderworkerset_crd() -> dict[str, Any]:
    """LeaderWorkerSet (``leaderworkersets.leaderworkerset.x-k8s.io``, v1): its names,
    status and scale subresources as upstream declares them; an open schema."""
    return minimal_crd(
        "leaderworkerset.x-k8s.io",
        "v1",
        "leaderworkersets",
        "LeaderWorkerSet",
        short_names=("lws",),
        scale={
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.hpaPodSelector",
        },
    )


def volcano_podgroup_crd() -> dict[str, Any]:
    """Volcano PodGroup (``podgroups.scheduling.volcano.sh``, v1beta1); an open schema."""
    return minimal_crd(
        "scheduling.volcano.sh",
        "v1beta1",
        "podgroups",
        "PodGroup",
        short_names=("pg", "podgroup-v1beta1"),
    )
