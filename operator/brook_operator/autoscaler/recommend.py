"""Steps 1 to 7 of ``policy.decide``: from the replicas' signals to the recommendation, one
pure function each, numbered as in the docstring of ``brook_operator.autoscaler.policy``
(which explains the formula). ``limits`` holds steps 8 to 10."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from brook_operator.autoscaler.policy_types import (
    Aggregate,
    Decision,
    Policy,
    Recommendation,
    ReplicaSignals,
)


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


@dataclass(frozen=True)
class Load:
    """The fleet's load as the signals see it (steps 2 and 3). Ready replicas without a fresh
    sample (``missing``) count as sitting at the targets: they push neither way."""

    capacity: int
    starting: int
    missing: int
    saturation: float
    """``Σ s_i`` over the fresh samples, plus the target for each missing one."""

    waiting: float
    """``Σ waiting_i`` likewise."""

    usage: float
    """``u``: the saturation over the capacity's target."""

    per_replica_waiting: float
    queue_high: bool
    """The queue is above its band in this sample."""


class Vote(NamedTuple):
    """One signal's recommendation (None: it has none) and what it says about it."""

    replicas: int | None
    note: str | None


# 1. Fresh metrics


def _finite(replica: ReplicaSignals) -> bool:
    """Every signal a number (NaN or ±Inf is no sample: it would poison the sums)."""
    values = (
        replica.kv_cache_usage,
        replica.waiting_requests,
        replica.running_requests,
        replica.overlap_ratio,
        replica.sample_age_seconds,
        replica.demand_tokens_per_second,
    )
    return all(v is None or math.isfinite(v) for v in values)


def fresh_samples(signals: Sequence[ReplicaSignals], policy: Policy) -> list[ReplicaSignals]:
    """Ready replicas whose KV sample is at most ``metricsStaleAfterSeconds`` old, with
    finite signals (a non-finite one makes the sample stale)."""
    return [
        r
        for r in signals
        if r.ready
        and r.sample_age_seconds is not None
        and r.sample_age_seconds <= policy.metrics_stale_after_seconds
        and r.kv_cache_usage is not None
        and _finite(r)
    ]


def hold_without_metrics(current: int, policy: Policy, reported: Aggregate) -> Decision:
    """No fresh sample: hold the size (raised to ``fallbackReplicas`` only), never scale in."""
    floor = max(current, policy.fallback_replicas or 0)
    desired = min(max(floor, policy.min_replicas), policy.max_replicas)
    why = (
        f"no replica ready yet ({reported.starting} starting)"
        if not reported.ready
        else f"no fresh metrics from {reported.ready} ready replica(s)"
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


# 2. Capacity


def starting_replicas(
    signals: Sequence[ReplicaSignals],
    current: int,
    policy: Policy,
    history: Sequence[Recommendation],
    now: float,
) -> int:
    """Replicas on the way: not ready and younger than the startup grace, and those the
    workload wants that have no pod yet, for a grace after the fleet last grew (a quota that
    refuses pods must not block scale-in forever)."""
    grace = policy.startup_grace_seconds
    starting = sum(1 for r in signals if not r.ready and r.age_seconds < grace)
    raised = _last_raise(history)
    if raised is None or now - raised < grace:
        starting += max(0, current - len(signals))
    return starting


def aggregate(fresh: Sequence[ReplicaSignals], ready: int, starting: int) -> Aggregate:
    """The signals as the status shows them."""
    return Aggregate(
        kv_cache_usage=_mean([r.kv_cache_usage for r in fresh if r.kv_cache_usage is not None]),
        overlap_ratio=_mean([r.overlap_ratio for r in fresh if r.overlap_ratio is not None]),
        waiting_requests=(
            sum(r.waiting_requests or 0.0 for r in fresh) / len(fresh) if fresh else None
        ),
        replicas_reporting=len(fresh),
        ready=ready,
        starting=starting,
        demand_tokens_per_second=(sum(rates) if (rates := _rates(fresh)) else None),
    )


def _rates(fresh: Sequence[ReplicaSignals]) -> list[float]:
    return [r.demand_tokens_per_second for r in fresh if r.demand_tokens_per_second is not None]


def _fleet_demand(fresh: Sequence[ReplicaSignals], load: Load, capacity: float) -> float:
    """``Σ d_i``, a replica without a rate (or a ready one without a fresh sample) counted
    as serving exactly ``capacity``: it pushes neither way."""
    known = _rates(fresh)
    return sum(known) + (len(fresh) - len(known) + load.missing) * capacity


def complete_readings(
    signals: Sequence[ReplicaSignals], policy: Policy
) -> list[ReplicaSignals] | None:
    """The fresh samples when every ready replica has one with a demand rate; None
    otherwise (a partial fleet's sum or ratio is biased by whichever replicas answered)."""
    fresh = fresh_samples(signals, policy)
    ready = sum(1 for r in signals if r.ready)
    if not fresh or len(fresh) < ready or any(r.demand_tokens_per_second is None for r in fresh):
        return None
    return fresh


# 3. Saturation (and the queue's sums, for step 5)


def measure_load(
    fresh: Sequence[ReplicaSignals], ready: int, current: int, starting: int, policy: Policy
) -> Load:
    """``C = max(R, ready)``, ``Σ s_i``, ``u`` and the waiting requests per replica."""
    capacity = max(current, ready)
    missing = ready - len(fresh)
    target = policy.target_kv_cache_usage
    w_target = policy.target_waiting_requests
    saturation = sum(r.saturation(policy.max_num_seqs) or 0.0 for r in fresh) + missing * target
    waiting = sum(r.waiting_requests or 0.0 for r in fresh) + missing * w_target
    per_replica = waiting / capacity
    return Load(
        capacity=capacity,
        starting=starting,
        missing=missing,
        saturation=saturation,
        waiting=waiting,
        usage=saturation / (capacity * target),
        per_replica_waiting=per_replica,
        queue_high=per_replica > w_target * (1 + policy.tolerance),
    )


def _what(policy: Policy) -> str:
    return "KV/slots" if policy.max_num_seqs else "KV"


def saturation_vote(load: Load, current: int, policy: Policy) -> Vote:
    """Above the band ``ceil(Σ s_i / target)``, below it ``ceil(C · √u)``, inside it ``R``."""
    target, band = policy.target_kv_cache_usage, policy.tolerance
    per_replica = load.saturation / load.capacity
    if abs(load.usage - 1.0) <= band:
        return Vote(current, f"{_what(policy)} {per_replica:.2f} within {target:.2f}±{band:.0%}")
    if load.usage > 1.0:
        replicas = _ceil(load.saturation / target)
    else:
        # Usage grows faster than the load per replica (a fuller batch steps slower, so each
        # request holds its blocks and slot longer): project the survivors' usage as growing
        # with the square of their share of the load.
        replicas = min(current, _ceil(load.capacity * math.sqrt(load.usage)))
    return Vote(
        replicas,
        f"{_what(policy)} {per_replica:.2f} vs target {target:.2f}±{band:.0%} over "
        f"{load.capacity}: {replicas}",
    )


# 4. Overlap (efficiency)


def overlap_vote(load: Load, current: int, policy: Policy, overlap: float | None) -> Vote | None:
    """Under-fed replicas (overlap below the floor while ``u < 1``, on complete data and
    without a backlog) pack the load to ``target · (1 + tolerance/2)``; None otherwise."""
    underfed = (
        "overlap" in policy.signals
        and overlap is not None
        and overlap < policy.min_overlap_ratio
        and load.usage < 1.0
        and load.missing == 0  # consolidation is a scale-in: only on complete data
        and not load.queue_high
    )
    if not underfed or overlap is None:
        return None
    target = policy.target_kv_cache_usage
    # Pack to the middle of the band's upper half: fuller pipelines, with headroom.
    packed = _ceil(load.saturation / (target * (1 + policy.tolerance / 2)))
    replicas = min(packed, current)  # under-feeding never adds replicas
    return Vote(
        replicas,
        f"under-fed: overlap {overlap:.2f} < floor {policy.min_overlap_ratio:.2f} at "
        f"{_what(policy)} {load.saturation / load.capacity:.2f} < target {target:.2f}, "
        f"consolidate to {replicas}",
    )


# 5. Queue (backlog)


def queue_vote(load: Load, current: int, policy: Policy, history: Sequence[Recommendation]) -> Vote:
    """A queue that persists adds the replicas its requests need; in the queue-only baseline
    the queue is the whole formula, both ways."""
    w_target = policy.target_waiting_requests
    per_replica = load.per_replica_waiting
    if "kv" not in policy.signals:  # the queue-only baseline: HPA on one metric
        q_rec = _ceil(load.waiting / w_target) if w_target > 0 else current + (load.waiting > 0)
        outside = w_target == 0 or abs(per_replica / w_target - 1.0) > policy.tolerance
        replicas = q_rec if outside else current
        return Vote(replicas, f"queue {per_replica:.1f}/replica vs target {w_target:g}: {replicas}")
    if load.queue_high and bool(history) and history[-1].queue_high:
        # Waiting requests need batch slots: each new replica offers target x maxNumSeqs of
        # them (targetWaitingRequests without maxNumSeqs); replicas already starting are that
        # capacity on the way.
        mns = policy.max_num_seqs
        absorb = policy.target_kv_cache_usage * mns if mns else max(w_target, 1.0)
        extra = max(0, _ceil(load.waiting / absorb) - load.starting)
        return Vote(
            load.capacity + extra,
            f"queue {per_replica:.1f}/replica > {w_target:g} persists: "
            f"+{extra} ({load.starting} starting)",
        )
    if load.queue_high:
        return Vote(None, f"queue {per_replica:.1f}/replica > {w_target:g} (first sample)")
    return Vote(None, None)


# 6. Arrivals (a surge)

#: How far above the fleet's capacity the arriving demand must be to vote: well outside the
#: noise of one interval's arrivals, so only a surge speaks; below it the saturation and
#: queue signals size the fleet.
SURGE = 1.5


def arrival_vote(
    fresh: Sequence[ReplicaSignals],
    load: Load,
    current: int,
    policy: Policy,
    capacity: float | None,
    history: Sequence[Recommendation] = (),
) -> Vote | None:
    """A surge, seen at the first reading after it starts: when the tokens arriving per
    second exceed ``SURGE`` times what the fleet serves at its target, the replicas that
    demand needs, ``ceil(Σ demand_i / capacity)``. A climb the step limit cut short (the
    last recommendation is above the current size) goes on while the demand stays above
    the band: the replicas just added count in the fleet's capacity, and must not end the
    surge halfway. Otherwise a floor for scale-in. A replica without a rate yet counts as
    serving exactly its capacity. None when the signal is off or the capacity unknown."""
    if "arrival" not in policy.signals or capacity is None or capacity <= 0:
        return None
    demand = _fleet_demand(fresh, load, capacity)
    usage = demand / (load.capacity * capacity)
    climbing = bool(history) and history[-1].replicas > current
    if usage > SURGE or (climbing and usage > 1 + policy.tolerance):
        replicas = _ceil(demand / capacity)
        return Vote(
            replicas,
            f"arrivals {demand:.0f} tok/s = {usage:.1f}x the capacity of {load.capacity} "
            f"({capacity:.0f} tok/s each): {replicas}",
        )
    # Otherwise a floor for scale-in: no fewer replicas than the arriving tokens fill to
    # the top of the band.
    floor = min(current, _ceil(demand / (capacity * (1 + policy.tolerance))))
    return Vote(floor, None)


def forecast_vote(forecast: float | None, capacity: float | None) -> Vote | None:
    """The predictive term (``spec.autoscaling.history``): the replicas the demand expected
    within the lead needs, ``ceil(forecast / capacity)``; None without a forecast or a
    capacity."""
    if forecast is None or capacity is None or capacity <= 0:
        return None
    replicas = max(1, _ceil(forecast / capacity))
    return Vote(replicas, f"earlier days: {forecast:.0f} tok/s ahead: {replicas}")


def standby_vote(
    fresh: Sequence[ReplicaSignals], load: Load, policy: Policy, capacity: float | None
) -> Vote | None:
    """``standbyReplicas`` on top of what the arriving tokens need: ``ceil(Σ d_i / c) + S``.
    The arrivals, not saturation, size the need: they are linear in the load, so a fleet
    kept above its need reads the same need (saturation falls faster than the load per
    replica and would read less). None without standby or a capacity."""
    spare = policy.standby_replicas
    if not spare or capacity is None or capacity <= 0:
        return None
    demand = _fleet_demand(fresh, load, capacity)
    # The need as the scale-in floor reads it (to the top of the band), so one interval's
    # noise in the arrivals does not move the standby.
    need = max(1, _ceil(demand / (capacity * (1 + policy.tolerance))))
    return Vote(need + spare, f"{need} for the arrivals + {spare} standby")


# 7. Recommendation: every signal's vote (``decide`` takes the largest)


def signal_votes(
    load: Load,
    current: int,
    policy: Policy,
    history: Sequence[Recommendation],
    overlap: float | None,
    fresh: Sequence[ReplicaSignals] = (),
    capacity: float | None = None,
    forecast: float | None = None,
) -> dict[str, Vote]:
    """Each signal the policy uses, with its vote (the overlap rule speaks for ``kv``)."""
    votes: dict[str, Vote] = {}
    if "kv" in policy.signals:
        votes["kv"] = overlap_vote(load, current, policy, overlap) or saturation_vote(
            load, current, policy
        )
    if "queue" in policy.signals:
        votes["queue"] = queue_vote(load, current, policy, history)
    arrival = arrival_vote(fresh, load, current, policy, capacity, history)
    if arrival is not None:
        votes["arrival"] = arrival
    ahead = forecast_vote(forecast, capacity)
    if ahead is not None:
        votes["history"] = ahead
    spare = standby_vote(fresh, load, policy, capacity)
    if spare is not None:
        votes["standby"] = spare
    return votes
