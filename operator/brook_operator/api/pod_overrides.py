"""``spec.pod``: what a cluster adds to every engine pod — environment, volumes and their
mounts, a service account, image pull secrets, a runtime class, labels and annotations,
sidecars and init containers — merged into the pod the operator renders.

The operator's own parts are protected rather than overridden: the rendezvous and device
environment, its volumes and mount points, its containers, its labels and the metrics
annotations. Naming one is a validation error that says which field of the spec sets it, so
no precedence rule can silently break a replica. The Kubernetes objects passed through
(env sources, volumes, containers, spread constraints) are checked here only for what Brook
relies on — their names — and in full by the API server when the workload is applied.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import ConfigDict, Field

from brook_engine.config import Section
from brook_operator.api.kube import DNS_LABEL, DNS_SUBDOMAIN, LABEL_VALUE

#: A Kubernetes object of a kind the API server validates when the workload is applied.
KubeObject = dict[str, Any]
EnvFromSource = Annotated[KubeObject, Field(description="A Kubernetes EnvFromSource.")]
SpreadConstraint = Annotated[
    KubeObject, Field(description="A Kubernetes TopologySpreadConstraint.")
]
HostAlias = Annotated[KubeObject, Field(description="A Kubernetes HostAlias.")]
#: Lists the API server keeps unique by name (as it does a pod's own).
_BY_NAME: dict[str, Any] = {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]}


class _PassedThrough(Section):
    """A Kubernetes object passed through as written, but for the fields declared here:
    those the operator checks (and the API server's CEL rules can read)."""

    model_config = ConfigDict(extra="allow")


class Volume(_PassedThrough):
    """A Kubernetes Volume (any source: hostPath, persistentVolumeClaim, secret, ...)."""

    name: str = Field(min_length=1, max_length=63, pattern=DNS_LABEL)
    """The volume's name, unique in the pod."""


class Container(_PassedThrough):
    """A Kubernetes Container."""

    name: str = Field(min_length=1, max_length=63, pattern=DNS_LABEL)
    """The container's name, unique in the pod."""

    image: str = Field(min_length=1, max_length=1024)
    """Its image."""


#: Environment the operator sets on the engine container (and every BROOK_* name).
OPERATOR_ENV = (
    "POD_NAME",
    "POD_NAMESPACE",
    "POD_IP",
    "MASTER_ADDR",
    "MASTER_PORT",
    "LWS_LEADER_ADDRESS",
    "HCCL_IF_IP",
    "HCCL_SOCKET_IFNAME",
    "HCCL_CONNECT_TIMEOUT",
    "HCCL_BUFFSIZE",
    "HOME",
)
OPERATOR_ENV_PREFIX = "BROOK_"
#: The operator's volumes and where it mounts them.
OPERATOR_VOLUMES = (
    "config",
    "tmp",
    "shm",
    "model",
    "model-credentials",
    "fetch-tmp",
    "compile-cache",
    "api-key",
)
OPERATOR_MOUNT_PATHS = ("/etc/brook", "/tmp", "/dev/shm", "/models", "/var/run/secrets/brook")
#: The operator's containers.
OPERATOR_CONTAINERS = ("engine", "fetch-model")
#: Label and annotation prefixes the operator owns (selectors, metrics discovery).
OPERATOR_LABEL_PREFIXES = ("brook.dev/", "app.kubernetes.io/", "leaderworkerset.sigs.k8s.io/")
OPERATOR_ANNOTATION_PREFIXES = ("prometheus.io/", "brook.dev/")


class EnvVar(Section):
    """An environment variable of the engine container."""

    name: str = Field(min_length=1, max_length=256, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
    """Variable name."""

    value: str | None = Field(default=None, max_length=32768)
    """Its value (``$(OTHER)`` expands another variable, as in any pod)."""

    value_from: KubeObject | None = None
    """A Kubernetes EnvVarSource (secretKeyRef, configMapKeyRef, fieldRef, ...)."""


class VolumeMount(Section):
    """Where the engine container mounts one of ``pod.volumes``."""

    name: str = Field(min_length=1, max_length=63, pattern=DNS_LABEL)
    """The volume's name."""

    mount_path: str = Field(min_length=1, max_length=4096, pattern=r"^/")
    """Absolute path in the container."""

    read_only: bool = False
    """Mount read-only."""

    sub_path: str | None = Field(default=None, max_length=4096)
    """A path within the volume to mount instead of its root."""


class LocalObjectReference(Section):
    """A Secret in the resource's namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)
    """Secret name."""


class PodOverrides(Section):
    """Added to every engine pod of every replica (leaders and workers)."""

    labels: dict[str, Annotated[str, LABEL_VALUE]] = Field(default_factory=dict, max_length=32)
    """Pod labels (a mesh's injection label, a cost centre); the operator's own prefixes
    (brook.dev/, app.kubernetes.io/, leaderworkerset.sigs.k8s.io/) are refused."""

    annotations: dict[str, str] = Field(default_factory=dict, max_length=32)
    """Pod annotations; prometheus.io/ and brook.dev/ are the operator's."""

    service_account_name: str | None = Field(default=None, max_length=253, pattern=DNS_SUBDOMAIN)
    """Service account of the pods (cloud credentials for s3:// models by workload
    identity, say); default: the namespace's default account."""

    automount_service_account_token: bool = False
    """Mount the service account's token (off: the engine calls no Kubernetes API; turn on
    only for a sidecar or a workload identity that needs it)."""

    image_pull_secrets: list[LocalObjectReference] = Field(default_factory=list, max_length=16)
    """Secrets for pulling the engine (and sidecar) images from a private registry."""

    runtime_class_name: str | None = Field(default=None, max_length=253, pattern=DNS_SUBDOMAIN)
    """RuntimeClass of the pods (a device runtime, a sandbox)."""

    env: list[EnvVar] = Field(default_factory=list, max_length=64, json_schema_extra=_BY_NAME)
    """Added to the engine container's environment (driver paths, a model mirror,
    ASCEND_* or NCCL_* settings); the operator's names and BROOK_* are refused."""

    env_from: list[EnvFromSource] = Field(default_factory=list, max_length=16)
    """Kubernetes EnvFromSources (a Secret or ConfigMap's keys) of the engine container."""

    volumes: list[Volume] = Field(default_factory=list, max_length=32, json_schema_extra=_BY_NAME)
    """Kubernetes Volumes added to the pods (driver host paths, a shared model cache, a
    credentials Secret); each needs a name the operator's volumes do not use."""

    volume_mounts: list[VolumeMount] = Field(default_factory=list, max_length=32)
    """Mounts of ``volumes`` in the engine container, away from the operator's paths."""

    init_containers: list[Container] = Field(
        default_factory=list, max_length=8, json_schema_extra=_BY_NAME
    )
    """Kubernetes Containers run before the engine, after the operator's model download."""

    sidecars: list[Container] = Field(
        default_factory=list, max_length=8, json_schema_extra=_BY_NAME
    )
    """Kubernetes Containers run beside the engine in every pod (the pods run as non-root
    with the restricted profile's pod security context: a sidecar must too)."""

    topology_spread_constraints: list[SpreadConstraint] = Field(default_factory=list, max_length=8)
    """Kubernetes TopologySpreadConstraints of the pods."""

    host_aliases: list[HostAlias] = Field(default_factory=list, max_length=16)
    """Kubernetes HostAliases (/etc/hosts entries) of the pods."""


def _named(
    items: list[Volume] | list[Container], where: str, forbidden: tuple[str, ...]
) -> list[str]:
    problems = []
    seen: set[str] = set()
    for item in items:
        if item.name in forbidden:
            problems.append(
                f"pod.{where}: {item.name!r} is the operator's; choose another name "
                f"(the operator's: {', '.join(forbidden)})"
            )
        elif item.name in seen:
            problems.append(f"pod.{where}: {item.name!r} is named twice")
        seen.add(item.name)
    return problems


def pod_problems(pod: PodOverrides) -> list[str]:
    """What ``pod`` may not do, each naming the field (the CRD's CEL rules say the same)."""
    problems: list[str] = []
    for var in pod.env:
        if var.name in OPERATOR_ENV or var.name.startswith(OPERATOR_ENV_PREFIX):
            problems.append(
                f"pod.env: {var.name} is set by the operator (the rendezvous, the devices, "
                "accelerator.hccl); change the spec field that sets it instead"
            )
        if var.value is not None and var.value_from is not None:
            problems.append(f"pod.env: {var.name}: set value or valueFrom, not both")
    problems += _named(pod.volumes, "volumes", OPERATOR_VOLUMES)
    problems += _named(pod.init_containers, "initContainers", OPERATOR_CONTAINERS)
    problems += _named(pod.sidecars, "sidecars", OPERATOR_CONTAINERS)
    both = {c.name for c in pod.init_containers} & {c.name for c in pod.sidecars}
    if both:
        problems.append(
            f"pod.sidecars: {', '.join(sorted(both))} also named in pod.initContainers; "
            "a pod's containers need distinct names"
        )
    names = {v.name for v in pod.volumes}
    for mount in pod.volume_mounts:
        if mount.name not in names:
            problems.append(
                f"pod.volumeMounts: {mount.name!r} is none of pod.volumes; add it there"
            )
        path = mount.mount_path.rstrip("/") or "/"
        taken = [p for p in OPERATOR_MOUNT_PATHS if path == p or path.startswith(p + "/")]
        if taken or path == "/":
            problems.append(
                f"pod.volumeMounts: {mount.mount_path} is where the operator mounts its own "
                f"volumes ({', '.join(OPERATOR_MOUNT_PATHS)}); mount elsewhere"
            )
    for key in pod.labels:
        if key.startswith(OPERATOR_LABEL_PREFIXES):
            problems.append(
                f"pod.labels: {key} is the operator's (its selectors); use a key outside "
                f"{', '.join(OPERATOR_LABEL_PREFIXES)}"
            )
    for key in pod.annotations:
        if key.startswith(OPERATOR_ANNOTATION_PREFIXES):
            problems.append(
                f"pod.annotations: {key} is the operator's; use a key outside "
                f"{', '.join(OPERATOR_ANNOTATION_PREFIXES)}"
            )
    return problems
