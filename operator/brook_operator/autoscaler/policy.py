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
6. **Arrivals (a surge).** Each replica's demand ``d_i`` is the tokens arriving per second
   between its last two readings: prompt tokens accepted or refused (a full queue's 429s
   are demand too) plus tokens generated (``rates``). It is sized against ``c``, the tokens
   per second one replica serves at the target: ``replicaTokensPerSecond``, or learned from
   readings where the fleet ran near its target with no backlog (``capacity``). A replica
   without a rate yet counts as ``c``.
   - A surge (``Σ d_i > 1.5 · C · c``) votes ``ceil(Σ d_i / c)`` at the first reading that
     shows it. KV and slot usage climb over the requests' lifetime (about two minutes to a
     fourfold step); the arriving tokens show the step at once. The 1.5 keeps one
     interval's noise out: on the flat trace (30 requests per 15 s, heavy-tailed prompt
     lengths) the tokens of one interval vary by 22% (standard deviation) and reach 1.66
     times their mean once in the hour. A climb the step limit cut short (the last
     recommendation is above ``R``) goes on while ``Σ d_i > C · c · (1 + tolerance)``.
   - Otherwise it is a floor for scale-in: ``min(R, ceil(Σ d_i / (c · (1 + tolerance))))``.
     Saturation falls steeply when a fleet has room, so the square-root projection can
     still name a fleet the arriving tokens would overfill (measured: the flat trace went
     5 → 4 → 5 three times an hour without this floor, once with it).
   - **Ahead** (with ``spec.autoscaling.history``): ``ceil(forecast / c)``, the forecast
     being the highest demand the same stretch of earlier days saw within ``leadSeconds``
     ahead (their lower median; ``history``). A surge that recurs daily is met a lead
     before it starts, and the fleet is not scaled in just before it.
7. **Recommendation** = the largest of the signals' recommendations.
8. **Startup grace.** While a replica is starting, no scale-in: new replicas are idle, not
   surplus.
9. **Stabilization** (Kubernetes HPA's rule): scaling up takes the lowest recommendation
   over ``scaleUpStabilizationSeconds``; scaling down takes the highest over
   ``scaleDownStabilizationSeconds``. A spike in one sample therefore cannot shrink the fleet
   until it has been gone for the whole window.
10. **Steps** of at most ``maxScaleUpStep`` up and ``maxScaleDownStep`` down per decision,
    then **bounds** ``[minReplicas, maxReplicas]``.

``Decision.limited_by`` names what clipped the recommendation: Stale, Startup, Cooldown
(a stabilization window), StepLimit, AtMax or AtMin.
"""

from __future__ import annotations

from collections.abc import Sequence

from brook_operator.autoscaler.limits import (
    Outcome,
    apply_bounds,
    hold_scale_in,
    limit_step,
    stabilize,
)
from brook_operator.autoscaler.policy_types import (
    SIGNALS,
    Aggregate,
    Decision,
    Policy,
    Recommendation,
    ReplicaSignals,
)
from brook_operator.autoscaler.recommend import (
    aggregate,
    fresh_samples,
    hold_without_metrics,
    measure_load,
    signal_votes,
    starting_replicas,
)

__all__ = [
    "SIGNALS",
    "Aggregate",
    "Decision",
    "Policy",
    "Recommendation",
    "ReplicaSignals",
    "decide",
]


def decide(
    signals: Sequence[ReplicaSignals],
    current: int,
    policy: Policy,
    history: Sequence[Recommendation],
    now: float,
    capacity: float | None = None,
    forecast: float | None = None,
) -> Decision:
    """The replica count to run now, why, and what limited it. See the module docstring;
    each step is a function of ``recommend`` (1 to 7) or ``limits`` (8 to 10).
    ``capacity``: the tokens/s one replica serves at the target, as the caller learned it
    (``capacity.CapacityEstimate``); ``policy.replica_tokens_per_second`` wins over it.
    ``forecast``: the tokens/s earlier days saw within the lead ahead (``history``), for
    the predictive term; None without it."""
    ready = sum(1 for r in signals if r.ready)
    fresh = fresh_samples(signals, policy)  # 1
    starting = starting_replicas(signals, current, policy, history, now)  # 2
    reported = aggregate(fresh, ready, starting)
    if not fresh:
        return hold_without_metrics(current, policy, reported)

    load = measure_load(fresh, ready, current, starting, policy)  # 2, 3
    capacity = policy.replica_tokens_per_second or capacity
    votes = signal_votes(
        load, current, policy, history, reported.overlap_ratio, fresh, capacity, forecast
    )  # 3 to 6
    recs = {name: vote.replicas for name, vote in votes.items() if vote.replicas is not None}
    recommendation = max(recs.values())  # 7
    outcome = Outcome(recommendation, None, "; ".join(v.note for v in votes.values() if v.note))
    outcome = hold_scale_in(outcome, current, load)  # 8
    outcome = stabilize(outcome, current, policy, history, now)  # 9
    outcome = limit_step(outcome, current, policy)  # 10
    outcome = apply_bounds(outcome, recommendation, policy)
    desired = outcome.desired
    return Decision(
        current=current,
        desired=desired,
        recommendation=recommendation,
        reason=f"{current} → {desired}: {outcome.reason}" if desired != current else outcome.reason,
        limited_by=outcome.limited_by,
        metrics_available=True,
        aggregate=reported,
        queue_high=load.queue_high,
        signal_recommendations=recs,
        capacity_tokens_per_second=capacity,
        forecast_tokens_per_second=forecast,
    )
