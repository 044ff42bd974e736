"""What the autoscaling policy reads and returns: each replica's signals, the policy's numbers
(``Policy``, from ``spec.autoscaling``), the recommendations kept for its windows, and the
``Decision`` with the aggregate the status shows. ``policy.decide`` is the function over them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from brook_operator.api.autoscaling import AutoscalingSpec

#: Signals a policy may use; the simulator's ablations turn some off.
SIGNALS = frozenset({"kv", "queue", "overlap", "arrival"})


@dataclass(frozen=True)
class ReplicaSignals:
    """What one replica (one replica group, read at its leader) reported."""

    name: str
    ready: bool
    age_seconds: float
    """Time since the replica was created."""

    kv_cache_usage: float | None = None
    """Fraction of KV blocks held by live requests; None when not read."""

    waiting_requests: float | None = None
    running_requests: float | None = None
    """Sequences in the running batch (for batch-slot usage)."""

    overlap_ratio: float | None = None
    sample_age_seconds: float | None = None
    """Time since the sample was read; None when there is none."""

    demand_tokens_per_second: float | None = None
    """Tokens arriving per second (prompt tokens accepted or refused, plus tokens generated)
    between this sample and the replica's previous one (``rates.demand_rate``); None
    without two readings."""

    def saturation(self, max_num_seqs: int | None) -> float | None:
        """The scarcer of the two resources the scheduler admits against: KV blocks and
        batch slots (``scheduler.maxNumSeqs``). Either one full means new requests wait."""
        if self.kv_cache_usage is None:
            return None
        if max_num_seqs and self.running_requests is not None:
            return max(self.kv_cache_usage, min(1.0, self.running_requests / max_num_seqs))
        return self.kv_cache_usage


@dataclass(frozen=True)
class Policy:
    """The numbers ``decide`` works with (seconds and ratios): the fields of the same names
    of an ``AutoscalingSpec`` (``from_spec``; the spec holds the defaults)."""

    min_replicas: int
    max_replicas: int
    target_kv_cache_usage: float
    target_waiting_requests: float
    min_overlap_ratio: float
    tolerance: float
    scale_up_stabilization_seconds: float
    scale_down_stabilization_seconds: float
    max_scale_up_step: int
    max_scale_down_step: int
    startup_grace_seconds: float
    metrics_stale_after_seconds: float
    fallback_replicas: int | None
    max_num_seqs: int | None = None
    """Batch slots per replica (``scheduler.maxNumSeqs``); None: KV usage alone."""

    signals: frozenset[str] = SIGNALS
    """Which signals drive decisions (all four in Brook's policy)."""

    replica_tokens_per_second: float | None = None
    """Tokens per second one replica serves at the target usage; None: learned
    (``capacity.CapacityEstimate``)."""

    standby_replicas: int = 0
    """Replicas kept on top of what the arriving tokens need (``standbyReplicas``)."""

    def __post_init__(self) -> None:
        unknown = self.signals - SIGNALS
        if unknown or not self.signals & {"kv", "queue"}:
            raise ValueError(
                f"signals {sorted(self.signals)}: use a non-empty subset of {sorted(SIGNALS)} "
                "with kv or queue in it"
            )

    @classmethod
    def from_spec(
        cls,
        spec: AutoscalingSpec,
        signals: frozenset[str] = SIGNALS,
        max_num_seqs: int | None = None,
    ) -> Policy:
        spec_fields = {f.name for f in fields(cls)} - {"max_num_seqs", "signals"}
        return cls(
            **{name: getattr(spec, name) for name in spec_fields},
            max_num_seqs=max_num_seqs,
            signals=signals,
        )

    @property
    def longest_window(self) -> float:
        """How long the history must reach back."""
        return max(
            self.scale_up_stabilization_seconds,
            self.scale_down_stabilization_seconds,
            self.startup_grace_seconds,
        )


@dataclass(frozen=True)
class Recommendation:
    """One past recommendation, kept for the stabilization windows."""

    time: float
    replicas: int
    queue_high: bool = False
    """The queue was above its band (for the persistence rule)."""

    desired: int | None = None
    """The count decided then (when the fleet last grew, for the startup grace)."""


@dataclass(frozen=True)
class Aggregate:
    """The signals as the status shows them (means over the replicas that reported)."""

    kv_cache_usage: float | None
    overlap_ratio: float | None
    waiting_requests: float | None
    """Mean over the replicas that reported."""

    replicas_reporting: int
    ready: int
    starting: int
    demand_tokens_per_second: float | None = None
    """Sum over the replicas that reported a rate."""


@dataclass(frozen=True)
class Decision:
    current: int
    """Replicas when it was made."""

    desired: int
    recommendation: int
    """Before startup grace, windows, steps and bounds; what the history keeps."""

    reason: str
    limited_by: str | None
    metrics_available: bool
    aggregate: Aggregate
    queue_high: bool = False
    signal_recommendations: dict[str, int] = field(default_factory=dict)
    capacity_tokens_per_second: float | None = None
    """Per-replica capacity the arrival signal sized against (None: not known yet)."""

    forecast_tokens_per_second: float | None = None
    """The demand earlier days saw within the lead ahead (None: no predictive term)."""

    def recommendation_at(self, now: float) -> Recommendation:
        return Recommendation(now, self.recommendation, self.queue_high, self.desired)
