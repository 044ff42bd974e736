"""``decide()``: one table row per rule of the policy (see the module docstring of
``brook_operator.autoscaler.policy``)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from brook_operator.api.autoscaling import AutoscalingSpec
from brook_operator.autoscaler.policy import (
    Policy,
    Recommendation,
    ReplicaSignals,
    decide,
)

NOW = 10_000.0
BASE = Policy.from_spec(AutoscalingSpec(min_replicas=1, max_replicas=10))


def fleet(
    n: int,
    kv: float | None = 0.5,
    waiting: float = 0.0,
    overlap: float | None = 1.0,
    *,
    running: float | None = None,
    ready: bool = True,
    age: float = 3600.0,
    sample_age: float | None = 1.0,
    prefix: str = "r",
) -> list[ReplicaSignals]:
    return [
        ReplicaSignals(
            name=f"{prefix}{i}",
            ready=ready,
            age_seconds=age,
            kv_cache_usage=kv if ready else None,
            waiting_requests=waiting if ready else None,
            running_requests=running if ready else None,
            overlap_ratio=overlap if ready else None,
            sample_age_seconds=sample_age if ready else None,
        )
        for i in range(n)
    ]


def past(
    *pairs: tuple[float, int], queue_high: bool = False, desired: int | None = None
) -> list[Recommendation]:
    """Recommendations ``seconds_ago`` → replicas (each with ``desired`` as decided then)."""
    return [Recommendation(NOW - ago, n, queue_high, desired) for ago, n in pairs]


@dataclass
class Case:
    id: str
    signals: list[ReplicaSignals]
    current: int
    desired: int
    limited_by: str | None = None
    history: list[Recommendation] = field(default_factory=list)
    policy: dict[str, Any] = field(default_factory=dict)
    metrics_available: bool = True
    reason_has: str = ""


CASES = [
    # Tolerance band: 0.78 / 0.75 = 1.04 is inside ±10%.
    Case("inside band holds", fleet(2, kv=0.78), 2, 2, reason_has="within"),
    Case("just below band holds", fleet(2, kv=0.70), 2, 2),
    # Saturation: ceil(2 × 0.95 / 0.75) = 3.
    Case("KV above band scales out", fleet(2, kv=0.95), 2, 3, reason_has="KV 0.95"),
    Case(
        "scale-out step bound",
        fleet(4, kv=1.0),
        4,
        5,
        "StepLimit",
        policy={"max_scale_up_step": 1},
    ),
    Case("at max", fleet(10, kv=1.0), 10, 10, "AtMax"),
    Case("lowered max wins", fleet(12, kv=0.75), 12, 10, "AtMax"),
    # Scale-in projects usage growing with the square of the load share:
    # u = 4 × 0.1 / (4 × 0.75) = 0.133 → ceil(4 × √0.133) = 2; the window saw nothing higher.
    Case(
        "idle scales in after the window",
        fleet(4, kv=0.1),
        4,
        2,
        history=past((400, 4), (250, 2), (100, 2)),
        policy={"max_scale_down_step": 4},
    ),
    # u = 0.6 → ceil(4 × √0.6) = 4 where a linear projection (ceil(1.6 / 0.75) = 3) would
    # scale in, only to see the survivors' batches fill faster than their share of load.
    Case("scale-in projects convex usage", fleet(4, kv=0.45), 4, 4, history=past((400, 4))),
    Case(
        "scale-in step bound",
        fleet(4, kv=0.1),
        4,
        3,
        "StepLimit",
        history=past((250, 2)),
    ),
    Case(
        "scale-down window keeps the highest recommendation",
        fleet(4, kv=0.1),
        4,
        4,
        "Cooldown",
        history=past((100, 4), (50, 2)),
        policy={"max_scale_down_step": 4},
    ),
    Case(
        "scale-down window partly",
        fleet(4, kv=0.1),
        4,
        3,
        "Cooldown",
        history=past((100, 3), (50, 2)),
        policy={"max_scale_down_step": 4},
    ),
    Case(
        "scale-up window takes the lowest recommendation",
        fleet(2, kv=0.95),
        2,
        2,
        "Cooldown",
        history=past((30, 2)),
        policy={"scale_up_stabilization_seconds": 60},
    ),
    Case(
        "scale-up window passed",
        fleet(2, kv=0.95),
        2,
        3,
        history=past((90, 2)),
        policy={"scale_up_stabilization_seconds": 60},
    ),
    Case("at min", fleet(2, kv=0.05), 2, 2, "AtMin", policy={"min_replicas": 2}),
    Case("idle at min 1", fleet(1, kv=0.0), 1, 1, "AtMin", history=past((400, 1))),
    Case("raised min wins", fleet(1, kv=0.75), 1, 2, "AtMin", policy={"min_replicas": 2}),
    # Stale and missing metrics hold; never scale in.
    Case(
        "stale samples hold",
        fleet(4, kv=0.05, sample_age=61.0),
        4,
        4,
        "Stale",
        metrics_available=False,
        reason_has="never scale in",
    ),
    Case(
        "no samples at all hold",
        fleet(3, kv=None, sample_age=None),
        3,
        3,
        "Stale",
        metrics_available=False,
    ),
    Case(
        "stale raises to the fallback",
        fleet(2, kv=0.05, sample_age=600.0),
        2,
        3,
        "Stale",
        policy={"fallback_replicas": 3},
        metrics_available=False,
    ),
    Case(
        "stale never lowers to the fallback",
        fleet(5, kv=0.05, sample_age=600.0),
        5,
        5,
        "Stale",
        policy={"fallback_replicas": 3},
        metrics_available=False,
    ),
    Case(
        "nothing ready yet holds",
        fleet(2, ready=False, age=30.0),
        2,
        2,
        "Stale",
        metrics_available=False,
        reason_has="2 starting",
    ),
    # A ready replica that did not report sits at the target: 0.1 + 0.75 over 2 → 2 (hold),
    # where reading it as 0 would have scaled in.
    Case(
        "a missing replica is neutral",
        fleet(1, kv=0.1, prefix="a") + fleet(1, kv=None, sample_age=None, prefix="b"),
        2,
        2,
        history=past((400, 2)),
        policy={"scale_down_stabilization_seconds": 0},
    ),
    Case(
        "a missing replica does not hide a hot one",
        fleet(1, kv=0.95, prefix="a") + fleet(1, kv=None, sample_age=None, prefix="b"),
        2,
        3,
    ),
    # Startup grace: 2 ready at 0.95 and 2 starting → C = 4, u = 1.9 / 3 = 0.63: the same
    # load does not scale out again (4 stays 4).
    Case(
        "starting replicas are capacity on the way",
        fleet(2, kv=0.95, prefix="a") + fleet(2, ready=False, age=30.0, prefix="b"),
        4,
        4,
        policy={"scale_down_stabilization_seconds": 0},
    ),
    # ... and idle new replicas are not surplus: u = 0.6 / 3 → 3 < 4, held.
    Case(
        "no scale-in while replicas start",
        fleet(2, kv=0.3, prefix="a") + fleet(2, ready=False, age=30.0, prefix="b"),
        4,
        4,
        "Startup",
        policy={"scale_down_stabilization_seconds": 0},
    ),
    Case(
        "replicas without pods yet are starting",
        fleet(2, kv=0.3),
        4,
        4,
        "Startup",
        history=[Recommendation(NOW - 60, 4, False, 4)],
        policy={"scale_down_stabilization_seconds": 0},
    ),
    # A quota that refuses the pods must not block scale-in forever.
    Case(
        "pod-less replicas stop counting after the grace",
        fleet(2, kv=0.1),
        4,
        3,
        "StepLimit",
        history=[Recommendation(NOW - 700, 4, False, 4)],
        policy={"scale_down_stabilization_seconds": 0},
    ),
    Case(
        "more load still scales out past starting ones",
        fleet(2, kv=1.0, waiting=0) + fleet(1, ready=False, age=30.0, prefix="b"),
        3,
        3,
    ),
    Case(
        "a replica past its grace is not starting",
        fleet(2, kv=0.1, prefix="a") + fleet(1, ready=False, age=700.0, prefix="b"),
        3,
        2,
        "StepLimit",
        policy={"scale_down_stabilization_seconds": 0},
    ),
    # Queue: 40 waiting need ceil(40 / (0.75 × 32 slots)) = 2 more replicas, once the queue
    # has persisted over two samples; replicas already starting count against that.
    Case(
        "persistent queue scales out",
        fleet(2, kv=0.75, waiting=20),
        2,
        4,
        history=past((15, 2), queue_high=True),
        policy={"max_num_seqs": 32},
        reason_has="persists",
    ),
    Case(
        "a queue with replicas on the way",
        fleet(2, kv=0.75, waiting=20) + fleet(1, ready=False, age=30.0, prefix="b"),
        3,
        4,
        history=past((15, 3), queue_high=True),
        policy={"max_num_seqs": 32},
        reason_has="+1 (1 starting)",
    ),
    Case(
        "waiting requests block scale-in",
        fleet(4, kv=0.1, waiting=20),
        4,
        4,
        "Cooldown",
        history=past((400, 4)),
        reason_has="requests are waiting",
    ),
    # Full batch slots saturate a replica whose KV cache is far from full.
    Case(
        "batch slots saturate",
        fleet(2, kv=0.2, running=8),
        2,
        3,
        policy={"max_num_seqs": 8},
        reason_has="KV/slots 1.00",
    ),
    Case(
        "a first queue sample waits",
        fleet(2, kv=0.75, waiting=20),
        2,
        2,
        history=past((15, 2), queue_high=False),
        reason_has="first sample",
    ),
    Case(
        "queue inside band ignored",
        fleet(2, kv=0.75, waiting=8.5),
        2,
        2,
        history=past((15, 2), queue_high=True),
    ),
    Case(
        "queue-only scaler scales in on an empty queue",
        fleet(4, kv=0.9, waiting=0),
        4,
        3,
        "StepLimit",
        policy={"signals": frozenset({"queue"})},
    ),
    Case(
        "queue-only scaler ignores KV",
        fleet(2, kv=1.0, waiting=8),
        2,
        2,
        policy={"signals": frozenset({"queue"})},
    ),
    # Overlap: 4 replicas at KV 0.55 (u = 0.73, below the band): KV alone projects
    # ceil(4 × √0.73) = 4; under-fed replicas pack to 0.79: ceil(2.2 / 0.7875) = 3.
    Case(
        "under-fed replicas consolidate",
        fleet(4, kv=0.55, overlap=0.5),
        4,
        3,
        history=past((400, 4)),
        reason_has="under-fed",
    ),
    Case(
        "KV alone keeps them",
        fleet(4, kv=0.55, overlap=0.5),
        4,
        4,
        history=past((400, 4)),
        policy={"signals": frozenset({"kv", "queue"})},
    ),
    Case(
        "overlap above floor: no consolidation",
        fleet(4, kv=0.55, overlap=0.9),
        4,
        4,
        history=past((400, 4)),
    ),
    Case(
        "no consolidation on partial data",
        fleet(3, kv=0.55, overlap=0.5) + fleet(1, kv=None, sample_age=None, prefix="m"),
        4,
        4,
        history=past((400, 4)),
    ),
    Case(
        "low overlap at high KV is not under-feeding",
        fleet(2, kv=0.95, overlap=0.3),
        2,
        3,
    ),
    Case(
        "consolidation obeys the scale-down window",
        fleet(4, kv=0.55, overlap=0.5),
        4,
        4,
        "Cooldown",
        history=past((100, 4)),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_decide(case: Case) -> None:
    policy = replace(BASE, **case.policy)
    decision = decide(case.signals, case.current, policy, case.history, NOW)
    assert (decision.desired, decision.limited_by) == (case.desired, case.limited_by), (
        decision.reason
    )
    assert decision.metrics_available is case.metrics_available
    assert case.reason_has in decision.reason
    assert decision.current == case.current


def test_history_drives_a_whole_episode_without_reversal() -> None:
    """A fixed total load spread over the replicas rises, stays, falls: out at once, in only
    a whole window after the last hot sample, never back and forth."""
    policy = replace(BASE, max_scale_down_step=4)
    current = 2
    history = [Recommendation(0.0, current)]  # as the loop seeds it
    moves = []
    for step in range(100):
        now = step * 15.0
        total = 3.0 if 30 <= step < 50 else (1.4 if step < 30 else 0.6)
        decision = decide(
            fleet(current, kv=min(1.0, total / current)), current, policy, history, now
        )
        history.append(decision.recommendation_at(now))
        if decision.desired != current:
            moves.append((now, current, decision.desired))
            current = decision.desired
    ups = [m for m in moves if m[2] > m[1]]
    downs = [m for m in moves if m[2] < m[1]]
    # KV usage saturates at 1.0, so the hidden load shows one step at a time.
    assert ups == [(450.0, 2, 3), (465.0, 3, 4)], moves
    assert downs == [(1035.0, 4, 2)], moves  # ceil(4 × √(0.6 / 3)) = 2
    assert downs[0][0] >= 49 * 15.0 + policy.scale_down_stabilization_seconds, moves
    assert len(moves) == 3, moves


def test_policy_from_spec_and_bad_signals() -> None:
    spec = AutoscalingSpec.model_validate(
        {"minReplicas": 2, "maxReplicas": 7, "targetKvCacheUsage": 0.6, "tolerance": 0.05}
    )
    policy = Policy.from_spec(spec)
    assert (policy.min_replicas, policy.max_replicas) == (2, 7)
    assert (policy.target_kv_cache_usage, policy.tolerance) == (0.6, 0.05)
    with pytest.raises(ValueError, match="subset"):
        replace(BASE, signals=frozenset({"overlap"}))
    with pytest.raises(ValueError, match="subset"):
        replace(BASE, signals=frozenset({"kv", "latency"}))
