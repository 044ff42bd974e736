"""``LLMInference.status``: what the operator observed and decided."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import Field

from brook_engine.config import Section

#: Condition types the operator sets.
CONDITION_TYPES = (
    "Ready",
    "Progressing",
    "SpecValid",
    "ScalingActive",
    "ScalingLimited",
    "MetricsAvailable",
    "Degraded",
)


class Condition(Section):
    """A condition in the Kubernetes convention."""

    type: str = Field(min_length=1, max_length=316)
    """Ready, Progressing, SpecValid, Degraded, Reconciling, Stalled (kstatus), ScalingActive,
    ScalingLimited or MetricsAvailable."""

    status: Literal["True", "False", "Unknown"]
    """True, False or Unknown."""

    reason: str = Field(default="", max_length=1024)
    """One CamelCase word for machines (e.g. LeaderWorkerSetMissing, AtMax, Stale)."""

    message: str = Field(default="", max_length=32768)
    """A sentence for people."""

    last_transition_time: datetime | None = None
    """When status last changed."""

    observed_generation: int | None = Field(default=None, ge=0)
    """The spec generation the condition was computed from."""


class Topology(Section):
    """How one replica maps onto devices and pods."""

    devices_per_replica: int = Field(ge=1)
    """tensor × pipeline."""

    pods_per_replica: int = Field(ge=1)
    """ceil(devicesPerReplica / accelerator.devicesPerNode)."""

    devices_per_pod: int = Field(ge=1)
    """Accelerator devices each pod requests."""

    workload: Literal["Deployment", "LeaderWorkerSet"]
    """Deployment for single-pod replicas, LeaderWorkerSet for multi-pod ones."""


class ScalingSignals(Section):
    """The autoscaler's inputs, aggregated over ready replicas."""

    kv_cache_usage: float | None = None
    """Mean fraction of KV blocks held by live requests."""

    overlap_ratio: float | None = None
    """Mean communication/compute overlap (1 without communication)."""

    waiting_requests: float | None = None
    """Waiting requests per replica."""

    demand_tokens_per_second: float | None = None
    """Tokens arriving per second over the replicas that reported a rate (prompt tokens
    accepted or refused, plus tokens generated)."""

    replica_tokens_per_second: float | None = None
    """Tokens per second one replica serves at the target KV usage, as the arrival signal
    sizes against it (spec.autoscaling.replicaTokensPerSecond, or learned)."""

    forecast_tokens_per_second: float | None = None
    """With autoscaling.history: the demand earlier days saw within the lead ahead."""

    replicas_reporting: int = Field(default=0, ge=0)
    """Replicas whose metrics were read."""

    sample_time: datetime | None = None
    """When the metrics were read."""


class ScalingDecision(Section):
    """One autoscaler decision."""

    time: datetime
    """When it was made."""

    from_replicas: int = Field(ge=0)
    """Replicas before."""

    to_replicas: int = Field(ge=0)
    """Replicas decided."""

    reason: str = Field(max_length=1024)
    """Why, with the numbers."""

    limited_by: str | None = Field(default=None, max_length=64)
    """What clipped it (AtMax, AtMin, Cooldown, Stale, StepLimit, Startup), if any."""


class AutoscalingStatus(Section):
    """What the autoscaler last saw and decided."""

    signals: ScalingSignals | None = None
    """Latest aggregated signals."""

    last_decisions: list[ScalingDecision] = Field(default_factory=list, max_length=10)
    """The last 10 decisions, newest last."""


class ModelDownloadStatus(Section):
    """The model download engine pods wait for (present only while one runs): read from
    what ``brook-engine fetch`` serves on each pod's API port."""

    pods: int = Field(ge=0)
    """Pods whose fetch-model init container runs."""

    pods_reporting: int = Field(ge=0)
    """Of them, those whose progress was read (an s3:// or oci:// fetcher serves none)."""

    bytes_done: int | None = Field(default=None, ge=0)
    """Bytes on disk of the pod furthest behind."""

    bytes_total: int | None = Field(default=None, ge=0)
    """What its download takes in all (the repository's files the patterns select)."""

    bytes_per_second: int | None = Field(default=None, ge=0)
    """Its rate over the last 30 s."""

    started_at: datetime | None = None
    """When the first of the fetch containers started."""

    message: str = Field(default="", max_length=1024)
    """The same in a sentence, as Ready's message gives it."""


class LLMInferenceStatus(Section):
    """Observed state of an LLMInference."""

    observed_generation: int | None = Field(default=None, ge=0)
    """The spec generation last reconciled."""

    replicas: int | None = Field(default=None, ge=0)
    """Replicas that exist."""

    ready_replicas: int | None = Field(default=None, ge=0)
    """Replicas ready to serve."""

    desired_replicas: int | None = Field(default=None, ge=0)
    """Replicas wanted now (spec.replicas or the autoscaler's decision)."""

    selector: str | None = None
    """Label selector of the engine pods (for the scale subresource)."""

    topology: Topology | None = None
    """How a replica maps onto devices and pods."""

    endpoint: str | None = None
    """In-cluster URL of the OpenAI-compatible API."""

    autoscaling: AutoscalingStatus | None = None
    """Autoscaler state."""

    model_download: ModelDownloadStatus | None = None
    """The model download engine pods wait for, while one runs."""

    conditions: list[Condition] = Field(default_factory=list, max_length=16)
    """Ready (its reason and message name the pods' own when replicas are not ready),
    Progressing, SpecValid, Degraded, Reconciling and Stalled (kstatus: what Argo CD, Flux and
    ``kubectl wait`` read), ScalingActive, ScalingLimited, MetricsAvailable."""
