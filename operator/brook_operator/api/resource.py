"""The ``LLMInference`` resource as a whole: identity, names, and the derived topology."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from brook_engine.config import Section
from brook_operator.api.spec import LLMInferenceSpec
from brook_operator.api.status import LLMInferenceStatus, Topology

GROUP = "brook.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "LLMInference"
PLURAL = "llminferences"
SINGULAR = "llminference"
SHORT_NAMES = ("llmi",)
CRD_NAME = f"{PLURAL}.{GROUP}"

#: Longest resource name: child names add suffixes and must stay valid DNS labels.
MAX_NAME_LENGTH = 50
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"


class ObjectMeta(BaseModel):
    """The metadata fields Brook reads; the rest is kept as is."""

    model_config = ConfigDict(extra="allow", frozen=True)

    name: str = Field(min_length=1, max_length=MAX_NAME_LENGTH, pattern=NAME_PATTERN)
    namespace: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    generation: int | None = None
    uid: str | None = None


class LLMInference(Section):
    """A model served on Kubernetes by replicas of the Brook engine."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    api_version: Literal["brook.dev/v1alpha1"] = Field(
        default="brook.dev/v1alpha1", alias="apiVersion"
    )
    kind: Literal["LLMInference"] = "LLMInference"
    metadata: ObjectMeta
    spec: LLMInferenceSpec
    status: LLMInferenceStatus | None = None

    @classmethod
    def from_object(cls, obj: dict[str, Any]) -> LLMInference:
        return cls.model_validate(obj)


def topology(spec: LLMInferenceSpec) -> Topology:
    """Devices per replica = tensor × pipeline; pods per replica = ceil(devices / devices per
    node); one pod runs as a Deployment, several as a LeaderWorkerSet."""
    devices = spec.parallel.world_size
    pods = math.ceil(devices / spec.accelerator.devices_per_node)
    return Topology(
        devices_per_replica=devices,
        pods_per_replica=pods,
        devices_per_pod=devices // pods,
        workload="Deployment" if pods == 1 else "LeaderWorkerSet",
    )
