"""Two oracles that bound what any autoscaler could do on a trace.

Both size the fleet every ``intervalSeconds`` from the trace's true demand (input + output
tokens per second of the requests that arrive), at the rate one replica serves within the
SLO: the static-peak fleet's, ``peak window demand / static-peak replicas``. They have no
step limit and no startup grace; they scale in once the size has been lower for
``ORACLE_WINDOW_SECONDS`` (with no damping at all, a fleet sized to the minute flaps around
an integer boundary and pays a cold start each time it comes back). Replicas still take
``cold_start_seconds`` to serve.

- ``oracle-reactive`` reads the demand of the last ``ORACLE_WINDOW_SECONDS``: a scaler that
  measures the present perfectly but cannot see ahead. What it misses, no reactive policy
  at that headroom can serve: the misses are the cold start's.
- ``oracle-clairvoyant`` also knows the demand of the window that starts one cold start
  from now, and sizes for the larger of the two: what foresight buys.

``headroom`` multiplies both sizes (1: exactly the static-peak fleet's per-replica rate).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from brook_operator.autoscaler.simulate.trace import Request

ORACLE_WINDOW_SECONDS = 60.0
ORACLE_STEP_SECONDS = 5.0
ORACLES = ("oracle-reactive", "oracle-clairvoyant")


@dataclass(frozen=True)
class Oracle:
    name: str
    arrivals: Sequence[float]
    cumulative_tokens: Sequence[float]
    """Input + output tokens of the first i requests, i = 0..len."""

    tokens_per_replica: float
    """Tokens per second one replica serves within the SLO."""

    lookahead_seconds: float | None
    """None: reactive; otherwise the cold start, for the window it also sizes for."""

    headroom: float
    min_replicas: int
    max_replicas: int

    def demand(self, start: float, end: float) -> float:
        """Tokens per second of the requests arriving in ``[start, end)``."""
        if end <= start:
            return 0.0
        i = bisect.bisect_left(self.arrivals, start)
        j = bisect.bisect_left(self.arrivals, end)
        return (self.cumulative_tokens[j] - self.cumulative_tokens[i]) / (end - start)

    def size(self, now: float) -> tuple[int, str]:
        """Replicas to run now (the most sized over the last window), and why."""
        step, steps = ORACLE_STEP_SECONDS, int(ORACLE_WINDOW_SECONDS // ORACLE_STEP_SECONDS)
        now_sized = self._sized(now)
        earlier = [self._sized(now - k * step) for k in range(1, steps + 1) if now - k * step >= 0]
        held = max(earlier, key=lambda s: s[0], default=now_sized)
        if held[0] > now_sized[0]:
            return held[0], f"{now_sized[1]}; holding the last {ORACLE_WINDOW_SECONDS:g}s' most"
        return now_sized

    def _sized(self, now: float) -> tuple[int, str]:
        w = ORACLE_WINDOW_SECONDS
        # Before the first full window, the opening window stands for the past.
        past = self.demand(now - w, now) if now >= w else self.demand(0.0, w)
        demand, why = past, f"demand {past:.0f} tok/s over the last {w:g}s"
        if self.lookahead_seconds is not None:
            ahead = self.demand(now + self.lookahead_seconds, now + self.lookahead_seconds + w)
            if ahead > past:
                demand = ahead
                why = f"demand {ahead:.0f} tok/s in {self.lookahead_seconds:g}s"
        n = math.ceil(round(self.headroom * demand / self.tokens_per_replica, 9))
        return min(self.max_replicas, max(self.min_replicas, n, 1)), why


def oracle(
    name: str,
    requests: Sequence[Request],
    tokens_per_replica: float,
    cold_start_seconds: float,
    headroom: float,
    min_replicas: int,
    max_replicas: int,
) -> Oracle:
    if name not in ORACLES:
        raise ValueError(f"{name!r} is not an oracle; choose from {', '.join(ORACLES)}")
    if tokens_per_replica <= 0 or headroom <= 0:
        raise ValueError("an oracle needs a positive per-replica rate and headroom")
    tokens = [float(r.input_tokens + r.output_tokens) for r in requests]
    return Oracle(
        name=name,
        arrivals=[r.arrival_s for r in requests],
        cumulative_tokens=[0.0, *itertools.accumulate(tokens)],
        tokens_per_replica=tokens_per_replica,
        lookahead_seconds=cold_start_seconds if name == "oracle-clairvoyant" else None,
        headroom=headroom,
        min_replicas=min_replicas,
        max_replicas=max_replicas,
    )
