"""The autoscaling section of the spec: bounds, targets and damping."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from brook_engine.config import Section

#: The most history kept: 60 days of 5-minute slots are about 430 KB of the ConfigMap's 1 MiB.
MAX_HISTORY_SECONDS = 60 * 86_400


class HistorySpec(Section):
    """The predictive term: the fleet's demand at the same time of earlier days, so a surge
    that recurs is met before it starts. The operator keeps the demand per 5-minute slot in
    a ConfigMap named after the resource (``<name>-demand-history``)."""

    lead_seconds: int = Field(default=600, ge=60, le=7200)
    """How far ahead to look: the fleet is sized, this long before, for the highest demand
    the same stretch of earlier days saw. Longer than a replica takes to start."""

    periods: int = Field(default=7, ge=1, le=28)
    """Earlier periods kept; the forecast is their lower median, so one odd day of three or
    more moves it neither way."""

    period_seconds: int = Field(default=86_400, ge=3600, le=604_800)
    """The length of the pattern: a day, or 604800 for a weekly one."""

    @model_validator(mode="after")
    def _fits(self) -> HistorySpec:
        if self.lead_seconds >= self.period_seconds:
            raise ValueError(
                f"leadSeconds ({self.lead_seconds}) must be shorter than periodSeconds "
                f"({self.period_seconds}): a lead of a whole period looks at today"
            )
        if self.periods * self.period_seconds > MAX_HISTORY_SECONDS:
            raise ValueError(
                f"periods × periodSeconds ({self.periods} × {self.period_seconds} s) exceeds "
                f"{MAX_HISTORY_SECONDS // 86_400} days, more than its ConfigMap holds; keep "
                "fewer periods"
            )
        return self


class AutoscalingSpec(Section):
    """Replica count from the engines' KV-cache usage, queue and communication overlap.
    When set, spec.replicas must be unset: the count belongs to the autoscaler."""

    min_replicas: int = Field(default=1, ge=1, le=1000)
    """Fewest replicas."""

    max_replicas: int = Field(ge=1, le=1000)
    """Most replicas."""

    target_kv_cache_usage: float = Field(default=0.75, gt=0, le=1)
    """KV-cache usage (fraction of blocks held by live requests) to keep replicas at; above
    it (beyond the tolerance) the autoscaler scales out."""

    target_waiting_requests: float = Field(default=8, ge=0, le=100_000)
    """Waiting requests per replica to keep at; a persistent queue above it scales out."""

    min_overlap_ratio: float = Field(default=0.7, ge=0, le=1)
    """Communication/compute overlap floor: replicas below it while their KV usage is under
    target are under-fed, and are consolidated (packed up to the top of the tolerance band
    instead of to the target)."""

    tolerance: float = Field(default=0.1, ge=0, lt=1)
    """Relative band around each target within which nothing changes."""

    scale_up_stabilization_seconds: int = Field(default=0, ge=0, le=3600)
    """Window over which scale-up takes the lowest recommendation."""

    scale_down_stabilization_seconds: int = Field(default=300, ge=0, le=3600)
    """Window over which scale-down takes the highest recommendation."""

    max_scale_up_step: int = Field(default=4, ge=1, le=1000)
    """Most replicas added in one decision."""

    max_scale_down_step: int = Field(default=1, ge=1, le=1000)
    """Most replicas removed in one decision."""

    startup_grace_seconds: int = Field(default=600, ge=0, le=7200)
    """Time a new replica has to become ready; it counts as capacity on the way and is not
    scaled in for being idle."""

    metrics_stale_after_seconds: int = Field(default=60, ge=5, le=3600)
    """Metrics older than this are stale; stale or missing metrics hold the current size."""

    fallback_replicas: int | None = Field(default=None, ge=1, le=1000)
    """While metrics are stale, run at least this many replicas (never fewer than now)."""

    replica_tokens_per_second: float | None = Field(default=None, gt=0, le=1e9)
    """Tokens per second (prompt plus generated) one replica serves at targetKvCacheUsage,
    for the arrival signal: a surge to more than 1.5 times what the fleet serves scales out
    at the first reading, to the replicas the arriving tokens need. Unset: learned from the
    replicas' own metrics while they run near the target."""

    standby_replicas: int = Field(default=0, ge=0, le=999)
    """Replicas kept started on top of what the arriving tokens need, serving with the
    others: the first minutes of a surge that outruns a replica's start land on them, and
    they are refilled as the fleet grows. They cost their replica-hours all day and count
    within maxReplicas. Needs replicaTokensPerSecond: a fleet kept above its need never runs
    near its target, where what a replica serves is learned."""

    history: HistorySpec | None = None
    """Size ahead for the demand of earlier days at the same time (unset: react only)."""

    interval_seconds: int = Field(default=15, ge=5, le=600)
    """Time between decisions."""

    mode: Literal["Active", "DryRun"] = "Active"
    """Active applies decisions; DryRun only records them in status."""

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"minReplicas ({self.min_replicas}) exceeds maxReplicas ({self.max_replicas})"
            )
        if self.standby_replicas >= self.max_replicas:
            raise ValueError(
                f"standbyReplicas ({self.standby_replicas}) must be below maxReplicas "
                f"({self.max_replicas}): at least one replica is sized by the signals"
            )
        if self.standby_replicas and self.replica_tokens_per_second is None:
            raise ValueError(
                "standbyReplicas needs replicaTokensPerSecond (what one replica serves at "
                "targetKvCacheUsage, from `brook-engine bench`): a fleet kept above its need "
                "never runs near its target, where it would be learned"
            )
        fallback = self.fallback_replicas
        if fallback is not None and not self.min_replicas <= fallback <= self.max_replicas:
            raise ValueError(
                f"fallbackReplicas ({fallback}) must lie between minReplicas "
                f"({self.min_replicas}) and maxReplicas ({self.max_replicas})"
            )
        return self
