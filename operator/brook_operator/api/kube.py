"""Small Kubernetes types the spec refers to (secret references, tolerations, resources),
modelled with only the fields Brook passes through."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from brook_engine.config import Section

#: A Kubernetes quantity (``4``, ``16Gi``, ``500m``).
IntOrString = int | str
#: A count or a percentage (``1``, ``25%``), as Deployment rollouts take.
IntOrPercent = Annotated[int, Field(ge=0)] | Annotated[str, Field(pattern=r"^[0-9]{1,3}%$")]

DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
#: A label value (empty, or up to 63 of letters, digits, '-', '_', '.', alphanumeric at the ends).
LABEL_VALUE = Field(max_length=63, pattern=r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


class SecretKeyRef(Section):
    """A key of a Secret in the resource's namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)
    """Name of the Secret."""

    key: str = Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")
    """Key within the Secret."""


class Toleration(Section):
    """A toleration copied to the engine pods."""

    key: str | None = Field(default=None, max_length=316)
    """Taint key the toleration applies to; empty with operator Exists matches every key."""

    operator: Literal["Exists", "Equal"] = "Equal"
    """Exists or Equal."""

    value: str | None = Field(default=None, max_length=63)
    """Taint value for operator Equal."""

    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """Taint effect to match; all effects when unset."""

    toleration_seconds: int | None = Field(default=None, ge=0)
    """For NoExecute: how long the pod stays bound after the taint appears."""


class ResourcesSpec(Section):
    """CPU and memory of the engine container. The accelerator resource is added from
    spec.accelerator and must not be listed here."""

    requests: dict[str, IntOrString] = Field(default_factory=dict, max_length=16)
    """Resources requested, as Kubernetes quantities (cpu: 8, memory: 64Gi)."""

    limits: dict[str, IntOrString] = Field(default_factory=dict, max_length=16)
    """Resource limits, as Kubernetes quantities."""


class GangScheduling(Section):
    """Schedule all pods of a replica together or none (Volcano PodGroup)."""

    provider: Literal["volcano"] = "volcano"
    """Gang scheduler; Volcano is supported."""

    queue: str | None = Field(default=None, max_length=253)
    """Volcano queue of the PodGroup."""


class SchedulingSpec(Section):
    """Where the engine pods may run."""

    node_selector: dict[str, str] = Field(default_factory=dict, max_length=32)
    """Node labels the pods require."""

    tolerations: list[Toleration] = Field(default_factory=list, max_length=32)
    """Taints the pods tolerate (accelerator nodes are often tainted)."""

    affinity: dict[str, Any] | None = None
    """A Kubernetes affinity object, copied to the pods as is."""

    priority_class_name: str | None = Field(default=None, max_length=253, pattern=DNS_SUBDOMAIN)
    """PriorityClass of the pods."""

    scheduler_name: str | None = Field(default=None, max_length=253)
    """Scheduler of the pods; default-scheduler when unset (volcano with gang scheduling)."""

    gang: GangScheduling | None = None
    """Gang scheduling of multi-pod replicas."""


class RolloutSpec(Section):
    """How a change of spec replaces running replicas."""

    max_surge: IntOrPercent = 1
    """Replicas created above the desired count during a rollout (a count or a percentage).
    Set 0 when no spare accelerators exist."""

    max_unavailable: IntOrPercent = 0
    """Replicas that may be unavailable during a rollout (a count or a percentage)."""
