"""What the server serves: built-in resources and those registered from CRDs.

A :class:`ResourceSpec` is one served group/version/plural with what discovery, the tables,
the scale subresource, and the structural schema (defaulting, pruning) need. Objects are
stored once per group/plural under the storage version; other served versions of a CRD
show the same objects with only ``apiVersion`` rewritten (no conversion webhooks).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from . import errors

#: The verbs of an ordinary resource, as discovery lists them.
STANDARD_VERBS: tuple[str, ...] = (
    "create",
    "delete",
    "deletecollection",
    "get",
    "list",
    "patch",
    "update",
    "watch",
)
SUBRESOURCE_VERBS: tuple[str, ...] = ("get", "patch", "update")

GroupResource = tuple[str, str]


@dataclass(frozen=True)
class PrinterColumn:
    """One ``additionalPrinterColumns`` entry of a CRD version (or of a built-in table)."""

    name: str
    type: str
    json_path: str
    format: str = ""
    description: str = ""
    priority: int = 0


@dataclass(frozen=True)
class ScaleSpec:
    """Where a resource keeps the numbers its ``/scale`` subresource shows (JSON paths)."""

    spec_replicas_path: str
    status_replicas_path: str
    label_selector_path: str | None = None
    #: Built-in workloads report ``spec.selector`` (a LabelSelector) as the scale selector.
    selector_from_spec: bool = False


@dataclass(frozen=True, eq=False)
class ResourceSpec:
    """One served resource: ``group/version/plural``."""

    group: str
    version: str
    plural: str
    singular: str
    kind: str
    namespaced: bool
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    verbs: tuple[str, ...] = STANDARD_VERBS
    status: bool = False
    scale: ScaleSpec | None = None
    printer_columns: tuple[PrinterColumn, ...] = ()
    #: The structural schema (``openAPIV3Schema``) of a CRD version; None for built-ins.
    schema: Mapping[str, Any] | None = None
    #: The name of the CRD that registered this resource; None for built-ins.
    crd: str | None = None
    #: The version objects of this group/plural are stored under (the CRD's storage version).
    storage_version: str = ""
    list_kind: str = ""
    preferred: bool = True

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def storage_api_version(self) -> str:
        version = self.storage_version or self.version
        return f"{self.group}/{version}" if self.group else version

    @property
    def group_resource(self) -> GroupResource:
        return (self.group, self.plural)

    @property
    def is_custom(self) -> bool:
        return self.crd is not None

    def subresources(self) -> list[str]:
        return [*(["status"] if self.status else []), *(["scale"] if self.scale else [])]


def _builtin(
    group: str,
    version: str,
    plural: str,
    kind: str,
    *,
    namespaced: bool = True,
    short: tuple[str, ...] = (),
    categories: tuple[str, ...] = (),
    status: bool = False,
    scale: ScaleSpec | None = None,
    verbs: tuple[str, ...] = STANDARD_VERBS,
) -> ResourceSpec:
    return ResourceSpec(
        group=group,
        version=version,
        plural=plural,
        singular=kind.lower(),
        kind=kind,
        namespaced=namespaced,
        short_names=short,
        categories=categories,
        verbs=verbs,
        status=status,
        scale=scale,
        storage_version=version,
        list_kind=f"{kind}List",
    )


_WORKLOAD_SCALE = ScaleSpec(".spec.replicas", ".status.replicas", selector_from_spec=True)
_ALL = ("all",)

BUILTIN_RESOURCES: tuple[ResourceSpec, ...] = (
    _builtin(
        "",
        "v1",
        "namespaces",
        "Namespace",
        namespaced=False,
        short=("ns",),
        status=True,
        verbs=("create", "delete", "get", "list", "patch", "update", "watch"),
    ),
    _builtin("", "v1", "configmaps", "ConfigMap", short=("cm",)),
    _builtin("", "v1", "secrets", "Secret"),
    _builtin("", "v1", "serviceaccounts", "ServiceAccount", short=("sa",)),
    _builtin("", "v1", "services", "Service", short=("svc",), categories=_ALL, status=True),
    _builtin("", "v1", "pods", "Pod", short=("po",), categories=_ALL, status=True),
    _builtin("", "v1", "events", "Event", short=("ev",)),
    _builtin("", "v1", "persistentvolumeclaims", "PersistentVolumeClaim", short=("pvc",)),
    _builtin("", "v1", "nodes", "Node", namespaced=False, short=("no",), status=True),
    _builtin(
        "apps",
        "v1",
        "deployments",
        "Deployment",
        short=("deploy",),
        categories=_ALL,
        status=True,
        scale=_WORKLOAD_SCALE,
    ),
    _builtin(
        "apps",
        "v1",
        "statefulsets",
        "StatefulSet",
        short=("sts",),
        categories=_ALL,
        status=True,
        scale=_WORKLOAD_SCALE,
    ),
    _builtin(
        "apps",
        "v1",
        "replicasets",
        "ReplicaSet",
        short=("rs",),
        categories=_ALL,
        status=True,
        scale=_WORKLOAD_SCALE,
    ),
    _builtin(
        "policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", short=("pdb",), status=True
    ),
    _builtin("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy", short=("netpol",)),
    _builtin(
        "apiextensions.k8s.io",
        "v1",
        "customresourcedefinitions",
        "CustomResourceDefinition",
        namespaced=False,
        short=("crd", "crds"),
        categories=("api-extensions",),
        status=True,
    ),
    _builtin("events.k8s.io", "v1", "events", "Event", short=("ev",)),
    _builtin("coordination.k8s.io", "v1", "leases", "Lease"),
    _builtin(
        "autoscaling",
        "v2",
        "horizontalpodautoscalers",
        "HorizontalPodAutoscaler",
        short=("hpa",),
        categories=_ALL,
        status=True,
    ),
    _builtin("rbac.authorization.k8s.io", "v1", "roles", "Role"),
    _builtin("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding"),
    _builtin("rbac.authorization.k8s.io", "v1", "clusterroles", "ClusterRole", namespaced=False),
    _builtin(
        "rbac.authorization.k8s.io",
        "v1",
        "clusterrolebindings",
        "ClusterRoleBinding",
        namespaced=False,
    ),
)

CRD_GROUP_RESOURCE: GroupResource = ("apiextensions.k8s.io", "customresourcedefinitions")
NAMESPACES: GroupResource = ("", "namespaces")


def _version_key(version: str) -> tuple[int, int, int, str]:
    """Kubernetes version priority: GA > beta > alpha, then by number (v2 > v1beta3)."""
    import re

    match = re.fullmatch(r"v(\d+)(?:(alpha|beta)(\d+))?", version)
    if match is None:
        return (0, 0, 0, version)
    major, stage, minor = match.groups()
    rank = {"alpha": 1, "beta": 2}.get(stage or "", 3)
    return (rank, int(major), int(minor or 0), version)


def _scale_from(crd_scale: Mapping[str, Any]) -> ScaleSpec:
    return ScaleSpec(
        spec_replicas_path=str(crd_scale.get("specReplicasPath", ".spec.replicas")),
        status_replicas_path=str(crd_scale.get("statusReplicasPath", ".status.replicas")),
        label_selector_path=crd_scale.get("labelSelectorPath"),
    )


def _columns_from(raw: Iterable[Mapping[str, Any]]) -> tuple[PrinterColumn, ...]:
    return tuple(
        PrinterColumn(
            name=str(col["name"]),
            type=str(col.get("type", "string")),
            json_path=str(col.get("jsonPath", "")),
            format=str(col.get("format", "")),
            description=str(col.get("description", "")),
            priority=int(col.get("priority", 0)),
        )
        for col in raw
    )


def check_crd(crd: Mapping[str, Any]) -> None:
    """The few checks the real server makes that matter here (422 Invalid otherwise)."""
    name = str(crd.get("metadata", {}).get("name", ""))
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    group = spec.get("group")
    plural = names.get("plural")
    problems: list[str] = []
    if not group:
        problems.append("spec.group: Required value")
    if not plural:
        problems.append("spec.names.plural: Required value")
    if not names.get("kind"):
        problems.append("spec.names.kind: Required value")
    if spec.get("scope") not in ("Namespaced", "Cluster"):
        problems.append('spec.scope: Unsupported value: must be "Namespaced" or "Cluster"')
    versions = spec.get("versions") or []
    if not versions or sum(1 for v in versions if v.get("storage")) != 1:
        problems.append(
            "spec.versions: Invalid value: must have exactly one version marked as storage version"
        )
    if group and plural and name != f"{plural}.{group}":
        problems.append(
            f'metadata.name: Invalid value: "{name}": must be spec.names.plural+"."+spec.group'
        )
    if problems:
        raise errors.invalid(*CRD_GROUP_RESOURCE, name, ", ".join(problems))


def specs_from_crd(crd: Mapping[str, Any]) -> list[ResourceSpec]:
    """The resources a (valid) CustomResourceDefinition serves, preferred version first."""
    spec = crd["spec"]
    names = spec["names"]
    versions = [v for v in spec["versions"] if v.get("served", True)]
    storage = next(v["name"] for v in spec["versions"] if v.get("storage"))
    ordered = sorted(versions, key=lambda v: _version_key(str(v["name"])), reverse=True)
    result: list[ResourceSpec] = []
    for index, version in enumerate(ordered):
        subresources = version.get("subresources") or {}
        scale = subresources.get("scale")
        kind = str(names["kind"])
        result.append(
            ResourceSpec(
                group=str(spec["group"]),
                version=str(version["name"]),
                plural=str(names["plural"]),
                singular=str(names.get("singular") or kind.lower()),
                kind=kind,
                namespaced=spec.get("scope") == "Namespaced",
                short_names=tuple(names.get("shortNames") or ()),
                categories=tuple(names.get("categories") or ()),
                status="status" in subresources,
                scale=_scale_from(scale) if isinstance(scale, Mapping) else None,
                printer_columns=_columns_from(version.get("additionalPrinterColumns") or ()),
                schema=(version.get("schema") or {}).get("openAPIV3Schema"),
                crd=str(crd["metadata"]["name"]),
                storage_version=storage,
                list_kind=str(names.get("listKind") or f"{kind}List"),
                preferred=index == 0,
            )
        )
    return result


class Registry:
    """The served resources, looked up the ways URLs, kubectl and the helpers name them."""

    def __init__(self, specs: Iterable[ResourceSpec] = BUILTIN_RESOURCES) -> None:
        self._specs: dict[tuple[str, str, str], ResourceSpec] = {}
        for spec in specs:
            self.add(spec)

    def __iter__(self) -> Iterator[ResourceSpec]:
        return iter(list(self._specs.values()))

    def add(self, spec: ResourceSpec) -> None:
        self._specs[(spec.group, spec.version, spec.plural)] = spec

    def remove_crd(self, crd_name: str) -> list[ResourceSpec]:
        gone = [spec for spec in self._specs.values() if spec.crd == crd_name]
        for spec in gone:
            del self._specs[(spec.group, spec.version, spec.plural)]
        return gone

    def get(self, group: str, version: str, plural: str) -> ResourceSpec | None:
        return self._specs.get((group, version, plural))

    def storage_spec(self, group_resource: GroupResource) -> ResourceSpec | None:
        candidates = [s for s in self._specs.values() if s.group_resource == group_resource]
        for spec in candidates:
            if spec.version == spec.storage_version:
                return spec
        return candidates[0] if candidates else None

    def versions(self, group: str) -> list[str]:
        """The served versions of a group, preferred first."""
        found = {s.version for s in self._specs.values() if s.group == group}
        return sorted(found, key=_version_key, reverse=True)

    def groups(self) -> list[str]:
        """Named API groups (not the core group) in registration order."""
        seen: dict[str, None] = {}
        for spec in self._specs.values():
            if spec.group:
                seen.setdefault(spec.group, None)
        return list(seen)

    def in_group_version(self, group: str, version: str) -> list[ResourceSpec]:
        return [s for s in self._specs.values() if s.group == group and s.version == version]

    def resolve(self, name: str) -> ResourceSpec:
        """Find a resource the way kubectl does: plural, singular, short name or kind, with an
        optional ``.group`` or ``.version.group`` suffix, or ``group/version/plural``."""
        if "/" in name:
            *group_version, plural = name.split("/")
            gv = "/".join(group_version)
            group, _, version = gv.rpartition("/") if "/" in gv else ("", "", gv)
            spec = self.get(group, version, plural)
            if spec is None:
                raise KeyError(name)
            return spec
        head, _, suffix = name.partition(".")
        lowered = head.lower()
        matches = [
            spec
            for spec in self._specs.values()
            if lowered in (spec.plural, spec.singular, spec.kind.lower(), *spec.short_names)
            and (
                not suffix
                or spec.group == suffix
                or f"{spec.version}.{spec.group}".rstrip(".") == suffix
            )
        ]
        if not matches:
            raise KeyError(name)
        # Prefer the core group, then preferred versions, as kubectl's RESTMapper does.
        matches.sort(key=lambda s: (s.group != "", not s.preferred))
        return matches[0]
