"""The autoscaler's part of an ``LLMInference``'s status (pure): the signals it read with
the time of the oldest sample it used, its last 10 decisions, ``desiredReplicas``, and
three conditions — MetricsAvailable, ScalingActive and ScalingLimited (reason AtMax, AtMin,
Cooldown, Stale, StepLimit or Startup). All of the autoscaler's fields and nothing else: it
is applied server-side as the autoscaler's own (the reconciler's conditions are not here)."""

from __future__ import annotations

from typing import Any

from brook_operator.autoscaler.policy import Decision
from brook_operator.controller.conditions import conditions_by_type, make_condition

#: Decisions kept in status (the CRD's bound).
KEPT_DECISIONS = 10


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _same_kind(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two decisions that say the same thing (a hold repeated every interval is one)."""
    keys = ("fromReplicas", "toReplicas", "limitedBy")
    return all(a.get(k) == b.get(k) for k in keys)


def autoscaling_status(
    previous_status: dict[str, Any] | None,
    decision: Decision,
    current: int,
    now: str,
    generation: int | None,
    dry_run: bool,
    sample_time: str | None = None,
) -> dict[str, Any]:
    """The status fields the autoscaler owns after ``decision``, all of them."""
    previous_status = previous_status or {}
    previous = conditions_by_type(previous_status)
    aggregate = decision.aggregate
    signals = {
        "kvCacheUsage": _round(aggregate.kv_cache_usage),
        "overlapRatio": _round(aggregate.overlap_ratio),
        "waitingRequests": _round(aggregate.waiting_requests),
        "demandTokensPerSecond": _round(aggregate.demand_tokens_per_second),
        "replicaTokensPerSecond": _round(decision.capacity_tokens_per_second),
        "forecastTokensPerSecond": _round(decision.forecast_tokens_per_second),
        "replicasReporting": aggregate.replicas_reporting,
        "sampleTime": sample_time,
    }
    entry = {
        "time": now,
        "fromReplicas": current,
        "toReplicas": decision.desired,
        "reason": ("dry run: " if dry_run else "") + decision.reason[:1000],
        "limitedBy": decision.limited_by,
    }
    decisions = list((previous_status.get("autoscaling") or {}).get("lastDecisions") or [])
    if not decisions or not _same_kind(decisions[-1], entry):
        decisions.append(entry)
    decisions = decisions[-KEPT_DECISIONS:]

    def condition(kind: str, status: bool, reason: str, message: str) -> dict[str, Any]:
        return make_condition(previous, kind, status, reason, message, generation, now)

    if decision.metrics_available:
        metrics = condition(
            "MetricsAvailable",
            True,
            "MetricsRead",
            f"{aggregate.replicas_reporting} of {aggregate.ready} ready replica(s) reported",
        )
    else:
        metrics = condition("MetricsAvailable", False, "MetricsStale", decision.reason)
    if dry_run:
        active = condition(
            "ScalingActive", False, "DryRun", "autoscaling.mode is DryRun: decisions only"
        )
    elif not decision.metrics_available:
        active = condition("ScalingActive", False, "MetricsStale", "holding the current size")
    else:
        active = condition("ScalingActive", True, "Decided", decision.reason[:1000])
    if decision.limited_by:
        limited = condition("ScalingLimited", True, decision.limited_by, decision.reason[:1000])
    else:
        limited = condition("ScalingLimited", False, "WithinBounds", "no bound applied")
    status: dict[str, Any] = {
        "autoscaling": {"signals": signals, "lastDecisions": decisions},
        "conditions": [metrics, active, limited],
    }
    # DryRun changes nothing: the count wanted stays the one running.
    status["desiredReplicas"] = current if dry_run else decision.desired
    return status
