"""How many tokens per second one replica serves at the target usage, learned from the
replicas' own readings when ``spec.autoscaling.replicaTokensPerSecond`` does not say.

At a reading where the fleet runs near its target (saturation within twice the tolerance of
it) with no backlog, the fleet's demand over its saturation, scaled to the target, is one
estimate: ``Σ demand_i / Σ s_i × target``. Far from the target the ratio is not a capacity
(saturation grows faster than the load, see ``policy``), and under a backlog the demand is
not what the replicas served. The estimate is the median of the last ``WINDOW`` such
readings: a surge's first readings, where demand has jumped and saturation has not caught up
yet, are outvoted."""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from brook_operator.autoscaler.policy_types import Policy, ReplicaSignals
from brook_operator.autoscaler.recommend import complete_readings

#: Readings the median is taken over (five minutes at the default 15 s interval).
WINDOW = 20
#: Readings needed before the estimate is used.
MIN_READINGS = 4


@dataclass
class CapacityEstimate:
    """Per-replica capacity (tokens/s at the target usage), learned one reading at a time."""

    readings: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))

    @property
    def value(self) -> float | None:
        if len(self.readings) < MIN_READINGS:
            return None
        return statistics.median(self.readings)

    def observe(self, signals: Sequence[ReplicaSignals], policy: Policy) -> bool:
        """Learn from one reading of the fleet (what ``decide`` was given); True when the
        reading counted. Every ready replica must have a fresh sample with a demand rate: a
        partial fleet's ratio is biased by whichever replicas answered."""
        fresh = complete_readings(signals, policy)
        if fresh is None:
            return False
        demand = [r.demand_tokens_per_second for r in fresh]
        saturation = [r.saturation(policy.max_num_seqs) for r in fresh]
        waiting = [r.waiting_requests or 0.0 for r in fresh]
        if any(s is None for s in saturation):
            return False
        total_s = sum(s or 0.0 for s in saturation)
        target, band = policy.target_kv_cache_usage, policy.tolerance
        usage = total_s / (len(fresh) * target)
        if abs(usage - 1.0) > 2 * band:
            return False
        if sum(waiting) / len(fresh) > policy.target_waiting_requests:
            return False
        total_d = sum(d or 0.0 for d in demand)
        if total_d <= 0:
            return False
        self.readings.append(total_d / total_s * target)
        return True
