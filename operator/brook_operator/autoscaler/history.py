"""The demand of earlier days at the same time, for the predictive term
(``spec.autoscaling.history``): a daily surge is met before it starts.

The fleet's demand (tokens arriving per second over the replicas, ``Σ d_i``) is kept as a
mean per slot of ``SLOT_SECONDS`` for the last ``periods`` periods (days by default). The
forecast at ``now`` is, for each earlier period ``k``, the highest slot mean in
``[now - k·period, now - k·period + lead]``; the forecast is the lower median of those over
the periods that have data. One odd day (an outage, a one-off launch) therefore moves it
neither way when three or more days are kept.

Slots are indexed by absolute time (``floor(t / SLOT_SECONDS)``), so a period of 86,400 s
lines up with the UTC day and the history survives an operator restart in a ConfigMap
(``to_data`` / ``from_data``)."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from brook_operator.autoscaler.policy_types import Policy, ReplicaSignals
from brook_operator.autoscaler.recommend import complete_readings

SLOT_SECONDS = 300
#: The ConfigMap key the history is kept under.
DATA_KEY = "demand.json"


def observed_demand(signals: Sequence[ReplicaSignals], policy: Policy) -> float | None:
    """The fleet's demand at one reading, ``Σ d_i``, when every ready replica has a fresh
    sample with a rate (a partial sum would record a dip that never was); None otherwise."""
    complete = complete_readings(signals, policy)
    if complete is None:
        return None
    return sum(r.demand_tokens_per_second or 0.0 for r in complete)


class HistoryError(ValueError):
    """A stored history that cannot be read (it is then started afresh)."""


@dataclass
class DemandHistory:
    period_seconds: float = 86_400.0
    periods: int = 7
    slots: dict[int, tuple[float, int]] = field(default_factory=dict)
    """Slot index → (mean demand in tokens/s, readings)."""

    def record(self, now: float, demand: float) -> None:
        """Add one reading of the fleet's demand (finite, ≥ 0; anything else is ignored:
        no history is better than a poisoned one)."""
        if not math.isfinite(demand) or demand < 0:
            return
        index = int(now // SLOT_SECONDS)
        mean, count = self.slots.get(index, (0.0, 0))
        self.slots[index] = (mean + (demand - mean) / (count + 1), count + 1)
        oldest = index - math.ceil(self.periods * self.period_seconds / SLOT_SECONDS) - 1
        for stale in [i for i in self.slots if i < oldest]:
            del self.slots[stale]

    def forecast(self, now: float, lead_seconds: float) -> float | None:
        """Tokens/s the fleet should expect within ``lead_seconds``, from the same time of
        the earlier periods; None without any."""
        per_period = []
        for k in range(1, self.periods + 1):
            start = now - k * self.period_seconds
            first, last = int(start // SLOT_SECONDS), int((start + lead_seconds) // SLOT_SECONDS)
            seen = [self.slots[i][0] for i in range(first, last + 1) if i in self.slots]
            if seen:
                per_period.append(max(seen))
        return statistics.median_low(per_period) if per_period else None

    def to_data(self) -> dict[str, str]:
        """The ConfigMap's data."""
        body = {
            "slotSeconds": SLOT_SECONDS,
            "periodSeconds": self.period_seconds,
            "slots": {str(i): [round(m, 3), n] for i, (m, n) in sorted(self.slots.items())},
        }
        return {DATA_KEY: json.dumps(body, separators=(",", ":"))}

    @classmethod
    def from_data(
        cls, data: dict[str, Any] | None, period_seconds: float, periods: int
    ) -> DemandHistory:
        """The history a ConfigMap's data holds (empty without one); ``HistoryError`` when
        it is unreadable or kept with another slot or period."""
        history = cls(period_seconds, periods)
        if not data or DATA_KEY not in data:
            return history
        try:
            body = json.loads(data[DATA_KEY])
            if not isinstance(body, dict) or not isinstance(body.get("slots"), dict):
                raise HistoryError("not a mapping with a mapping of slots")
            kept = (body.get("slotSeconds"), body.get("periodSeconds"))
            if kept != (SLOT_SECONDS, period_seconds):
                raise HistoryError(
                    f"kept with slots of {kept[0]} s and a period of {kept[1]} s, not "
                    f"{SLOT_SECONDS} s and {period_seconds} s"
                )
            for key, (mean, count) in body["slots"].items():
                if not (math.isfinite(mean) and mean >= 0 and count >= 1):
                    raise HistoryError(f"slot {key}: {mean!r} over {count!r} readings")
                history.slots[int(key)] = (float(mean), int(count))
        except HistoryError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise HistoryError(f"unreadable: {exc}") from None
        return history
