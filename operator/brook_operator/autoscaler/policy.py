"""The autoscaling policy: ``decide(signals, current, policy, history, now) → Decision``.

Pure: no clock, no I/O. The operator's loop and the simulator call the same function.

The formula, in the order it is applied (``R`` = replicas the workload has now):

1. **Fresh metrics.** A replica's sample counts when the replica is ready and the sample is
   at most ``metricsStaleAfterSeconds`` old. With no fresh sample at all the size is held
   (``limited_by = Stale``, MetricsAvailable=False): missing data never scales in. It is only
   raised, to ``fallbackReplicas``, when that is set and higher. A ready replica without a
   fresh sample is taken to sit exactly at the targets, so it pushes neither way.
2. **Capacity.** ``C = max(R, ready)``: replicas that are starting (not ready yet and
   younger than ``startupGraceSeconds``, or without a pod yet within that grace after the
   fleet last grew) count as capacity on the way with no load, so the same load does not
   scale out twice.
3. **Saturation.** Per replica ``s_i = max(kv_i, running_i / maxNumSeqs)``: KV blocks and
   batch slots are the two things the scheduler admits against, and either one full makes
   new requests wait. ``u = Σ s_i / (C · targetKvCacheUsage)``.
   - Above the band (``u > 1 + tolerance``): ``ceil(Σ s_i / target)``, HPA's
     ``ceil(C · u)``.
   - Below it (``u < 1 - tolerance``): ``ceil(C · √u)``. Usage grows faster than the load
     per replica (a fuller batch steps slower, so each request holds its blocks and slot
     longer); a linear projection would scale in to a fleet that saturates at once and
     scale out again (measured: the simulator's flat trace reversed 6 times in an hour with
     it, 2 times with the square root).
   - Inside the band: ``R``.
4. **Overlap (efficiency).** When the mean overlap ratio of the ready replicas is below
   ``minOverlapRatio`` while ``u < 1`` the replicas are under-fed: too few sequences in
   flight to hide their communication, so every device does less work than it could. With
   complete data (every ready replica reported) and no backlog, the recommendation then
   packs the load to ``target · (1 + tolerance/2)``, ``ceil(Σ s_i / (target · (1 +
   tolerance/2)))``: fewer, fuller replicas whose pipelines hide more of their transfers,
   still inside the band. The loop applies this rule to pipelined replicas only
   (``parallel.pipeline > 1``, ``loop.policy_for``).
5. **Queue (backlog).** When ``Σ waiting_i / C`` is above ``targetWaitingRequests · (1 +
   tolerance)`` in this sample and in the previous one (a queue that persists), the waiting
   requests need batch slots: ``C + ceil(Σ waiting_i / (target · maxNumSeqs)) - starting``
   (each new replica offers ``target · maxNumSeqs`` slots; replicas already starting are
   slots on the way). While requests wait, nothing scales in. In the queue-only (KEDA-style)
   baseline the queue is the whole formula, both ways: ``ceil(Σ waiting_i / target)``.
6. **Recommendation** = the largest of the signals' recommendations.
7. **Startup grace.** While a replica is starting, no scale-in: new replicas are idle, not
   surplus.
8. **Stabilization** (Kubernetes HPA's rule): scaling up takes the lowest recommendation
   over ``scaleUpStabilizationSeconds``; scaling down takes the highest over
   ``scaleDownStabilizationSeconds``. A spike in one sample therefore cannot shrink the fleet
   until it has been gone for the whole window.
9. **Steps** of at most ``maxScaleUpStep`` up and ``maxScaleDownStep`` down per decision,
   then **bounds** ``[minReplicas, maxReplicas]``.

``Decision.limited_by`` names what clipped the recommendation: Stale, Startup, Cooldown
(a stabilization window), StepLimit, AtMax or AtMin.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

from brook_operator.api.autoscaling import AutoscalingSpec

#: Signals a policy may use; the simulator's ablations turn some off.
SIGNALS = frozenset({"kv", "queue", "overlap"})


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
    """Which signals drive decisions (all three in Brook's policy)."""

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

    def recommendation_at(self, now: float) -> Recommendation:
        return Recommendation(now, self.recommendation, self.queue_high, self.desired)


def _ceil(x: float) -> int:
    # Guard against 2.0000000001 becoming 3 through float noise.
    return math.ceil(round(x, 9))


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _last_raise(history: Sequence[Recommendation]) -> float | None:
    """When the decided count last grew (the oldest entry counts: after a restart the
    operator cannot know, and assumes the fleet may still be starting)."""
    last, previous = None, None
    for h in history:
        if h.desired is not None and (previous is None or h.desired > previous):
            last = h.time
        if h.desired is not None:
            previous = h.desired
    return last


def decide(
    signals: Sequence[ReplicaSignals],
    current: int,
    policy: Policy,
    history: Sequence[Recommendation],
    now: float,
) -> Decision:
    """The replica count to run now, why, and what limited it. See the module docstring."""
    grace = policy.startup_grace_seconds
    ready = [r for r in signals if r.ready]
    fresh = [
        r
        for r in ready
        if r.sample_age_seconds is not None
        and r.sample_age_seconds <= policy.metrics_stale_after_seconds
        and r.kv_cache_usage is not None
    ]
    capacity = max(current, len(ready))
    starting = sum(1 for r in signals if not r.ready and r.age_seconds < grace)
    # Replicas the workload wants that have no pod yet are starting too — for a grace
    # period after the fleet last grew (a quota that refuses pods must not block scale-in
    # forever).
    raised = _last_raise(history)
    if raised is None or now - raised < grace:
        starting += max(0, current - len(signals))
    mns = policy.max_num_seqs
    saturations = [r.saturation(mns) or 0.0 for r in fresh]
    reported = Aggregate(
        kv_cache_usage=_mean([r.kv_cache_usage for r in fresh if r.kv_cache_usage is not None]),
        overlap_ratio=_mean([r.overlap_ratio for r in fresh if r.overlap_ratio is not None]),
        waiting_requests=(
            sum(r.waiting_requests or 0.0 for r in fresh) / len(fresh) if fresh else None
        ),
        replicas_reporting=len(fresh),
        ready=len(ready),
        starting=starting,
    )
    low, high = policy.min_replicas, policy.max_replicas

    if not fresh:
        floor = max(current, policy.fallback_replicas or 0)
        desired = min(max(floor, low), high)
        why = (
            f"no replica ready yet ({starting} starting)"
            if not ready
            else f"no fresh metrics from {len(ready)} ready replica(s)"
        )
        return Decision(
            current=current,
            desired=desired,
            recommendation=current,
            reason=f"{why}: holding {desired} (missing metrics never scale in)",
            limited_by="Stale",
            metrics_available=False,
            aggregate=reported,
        )

    # Replicas that are ready but did not report sit at the targets: they push neither way.
    missing = len(ready) - len(fresh)
    target = policy.target_kv_cache_usage
    total = sum(saturations) + missing * target
    w_target = policy.target_waiting_requests
    total_waiting = sum(r.waiting_requests or 0.0 for r in fresh) + missing * w_target
    band = policy.tolerance
    what = "KV/slots" if mns else "KV"

    recs: dict[str, int] = {}
    notes: list[str] = []
    usage = total / (capacity * target)
    per_replica = total_waiting / capacity
    queue_high = per_replica > w_target * (1 + band)
    if "kv" in policy.signals:
        overlap = reported.overlap_ratio
        underfed = (
            "overlap" in policy.signals
            and overlap is not None
            and overlap < policy.min_overlap_ratio
            and usage < 1.0
            and missing == 0  # consolidation is a scale-in: only on complete data
            and not queue_high
        )
        if underfed:
            # Pack to the middle of the band's upper half: fuller pipelines, with headroom.
            packed = _ceil(total / (target * (1 + band / 2)))
            recs["kv"] = min(packed, current)  # under-feeding never adds replicas
            notes.append(
                f"under-fed: overlap {overlap:.2f} < floor {policy.min_overlap_ratio:.2f} at "
                f"{what} {total / capacity:.2f} < target {target:.2f}, consolidate to "
                f"{recs['kv']}"
            )
        elif abs(usage - 1.0) > band:
            if usage > 1.0:
                recs["kv"] = _ceil(total / target)
            else:
                # Usage grows faster than the load per replica (a fuller batch steps slower,
                # so each request holds its blocks and slot longer): project the survivors'
                # usage as growing with the square of their share of the load.
                recs["kv"] = min(current, _ceil(capacity * math.sqrt(usage)))
            notes.append(
                f"{what} {total / capacity:.2f} vs target {target:.2f}±{band:.0%} over "
                f"{capacity}: {recs['kv']}"
            )
        else:
            recs["kv"] = current
            notes.append(f"{what} {total / capacity:.2f} within {target:.2f}±{band:.0%}")

    if "queue" in policy.signals:
        if "kv" not in policy.signals:  # the queue-only baseline: HPA on one metric
            q_rec = (
                _ceil(total_waiting / w_target) if w_target > 0 else current + (total_waiting > 0)
            )
            outside = w_target == 0 or abs(per_replica / w_target - 1.0) > band
            recs["queue"] = q_rec if outside else current
            notes.append(f"queue {per_replica:.1f}/replica vs target {w_target:g}: {recs['queue']}")
        else:
            persistent = queue_high and bool(history) and history[-1].queue_high
            if persistent:
                # Waiting requests need batch slots: each new replica offers
                # target x maxNumSeqs of them (targetWaitingRequests without maxNumSeqs);
                # replicas already starting are that capacity on the way.
                absorb = target * mns if mns else max(w_target, 1.0)
                extra = max(0, _ceil(total_waiting / absorb) - starting)
                recs["queue"] = capacity + extra
                notes.append(
                    f"queue {per_replica:.1f}/replica > {w_target:g} persists: "
                    f"+{extra} ({starting} starting)"
                )
            elif queue_high:
                notes.append(f"queue {per_replica:.1f}/replica > {w_target:g} (first sample)")
    recommendation = max(recs.values())
    reason = "; ".join(notes)

    desired, limited_by = recommendation, None
    if desired < current and queue_high:
        desired, limited_by = current, "Cooldown"
        reason += "; requests are waiting: no scale-in"
    if desired < current and starting:
        desired, limited_by = current, "Startup"
        reason += f"; {starting} replica(s) starting: no scale-in during startup grace"

    if desired > current and policy.scale_up_stabilization_seconds > 0:
        window = [
            h.replicas for h in history if now - h.time < policy.scale_up_stabilization_seconds
        ]
        stabilized = max(current, min([desired, *window]))
        if stabilized < desired:
            desired, limited_by = stabilized, "Cooldown"
            reason += f"; scale-up window {policy.scale_up_stabilization_seconds:g}s: {desired}"
    elif desired < current and policy.scale_down_stabilization_seconds > 0:
        window = [
            h.replicas for h in history if now - h.time < policy.scale_down_stabilization_seconds
        ]
        stabilized = min(current, max([desired, *window]))
        if stabilized > desired:
            desired, limited_by = stabilized, "Cooldown"
            reason += (
                f"; scale-down window {policy.scale_down_stabilization_seconds:g}s holds {desired}"
            )

    if desired > current + policy.max_scale_up_step:
        desired, limited_by = current + policy.max_scale_up_step, "StepLimit"
        reason += f"; at most +{policy.max_scale_up_step} per decision"
    elif desired < current - policy.max_scale_down_step:
        desired, limited_by = current - policy.max_scale_down_step, "StepLimit"
        reason += f"; at most -{policy.max_scale_down_step} per decision"

    if (desired >= high and recommendation > high) or desired > high:
        desired, limited_by = high, "AtMax"
        reason += f"; maxReplicas {high}"
    elif (desired <= low and recommendation < low) or desired < low:
        desired, limited_by = low, "AtMin"
        reason += f"; minReplicas {low}"

    return Decision(
        current=current,
        desired=desired,
        recommendation=recommendation,
        reason=f"{current} → {desired}: {reason}" if desired != current else reason,
        limited_by=limited_by,
        metrics_available=True,
        aggregate=reported,
        queue_high=queue_high,
        signal_recommendations=recs,
    )
