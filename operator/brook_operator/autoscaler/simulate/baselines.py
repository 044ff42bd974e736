"""The policies a trace is replayed against.

- ``brook``: Brook's policy, every signal (KV cache, queue, overlap, arrivals), with the
  predictive term when the spec sets ``history``.
- ``brook-history``: the same with the predictive term on (the spec's ``history``, or its
  defaults): it looks at the same time of earlier days, so on a one-hour trace it is
  ``brook``.
- ``no-overlap``, ``no-arrival``: the ablations without the overlap signal, and without the
  arrival signal (Brook's policy before it had one).
- ``kv-only``: the ablation with the saturation signal alone.
- ``queue-only``: the KEDA-style baseline: the waiting queue alone, both ways, polled every
  30 s, with the HPA's default behaviour (no scale-up window, a 300 s scale-down window, at
  most 4 replicas up and any number down per decision, no startup grace).
- ``static-peak``: the fewest fixed replicas that meet the SLO for 99% of the requests of
  this very trace, found by bisection: the strongest static baseline (it knows the future).
- ``static-mean``: fixed at ``ceil(static-peak × mean demand / peak demand)``, demand being
  input + output tokens per second over 5-minute windows: sized for the average.
- ``oracle-reactive`` / ``oracle-clairvoyant``: bounds, not policies (``oracle``): the fleet
  sized from the trace's true demand of the last minute, or also of the minute one cold start
  ahead, with no step limit or startup grace and a one-minute hold before scaling in.

Every autoscaled fleet starts warm at the size the static-peak fleet scaled to the first
window's demand, as if the autoscaler had been following the load before the trace began.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from brook_operator.api.autoscaling import AutoscalingSpec, HistorySpec
from brook_operator.autoscaler.policy import SIGNALS, Policy
from brook_operator.autoscaler.simulate.oracle import ORACLES
from brook_operator.autoscaler.simulate.profile import Profile
from brook_operator.autoscaler.simulate.run import Autoscaled, RunResult, simulate
from brook_operator.autoscaler.simulate.trace import Request

POLICIES = (
    "brook",
    "brook-history",
    "no-overlap",
    "no-arrival",
    "kv-only",
    "queue-only",
    "static-peak",
    "static-mean",
    *ORACLES,
)
SLO_QUANTILE = 0.99
DEMAND_WINDOW_SECONDS = 300.0
QUEUE_ONLY_INTERVAL_SECONDS = 30


def autoscaled(name: str, spec: AutoscalingSpec, max_num_seqs: int | None = None) -> Autoscaled:
    """The policy ``name`` (one of the autoscaled ones) from the user's ``spec``; the
    replica's batch slots (``max_num_seqs``) as the operator reads them from the spec."""
    if name in ("brook", "brook-history"):
        history = spec.history or (HistorySpec() if name == "brook-history" else None)
        policy = Policy.from_spec(spec, max_num_seqs=max_num_seqs)
        return Autoscaled(policy, spec.interval_seconds, history=history)
    if name in ("no-overlap", "no-arrival"):  # the ablations that isolate one signal
        without = SIGNALS - {name.removeprefix("no-")}
        policy = Policy.from_spec(spec, without, max_num_seqs=max_num_seqs)
        return Autoscaled(policy, spec.interval_seconds)
    if name == "kv-only":
        policy = Policy.from_spec(spec, frozenset({"kv"}), max_num_seqs=max_num_seqs)
        return Autoscaled(policy, spec.interval_seconds)
    if name == "queue-only":
        hpa = AutoscalingSpec(
            min_replicas=spec.min_replicas,
            max_replicas=spec.max_replicas,
            target_waiting_requests=spec.target_waiting_requests,
            interval_seconds=QUEUE_ONLY_INTERVAL_SECONDS,
            max_scale_up_step=4,
            max_scale_down_step=spec.max_replicas,
            startup_grace_seconds=0,
        )
        return Autoscaled(Policy.from_spec(hpa, frozenset({"queue"})), hpa.interval_seconds)
    raise ValueError(f"policy {name!r} is not autoscaled")


def demand_windows(requests: Sequence[Request]) -> list[float]:
    """Input + output tokens per second of arrivals in each 5-minute window."""
    count = int(requests[-1].arrival_s // DEMAND_WINDOW_SECONDS) + 1
    tokens = [0.0] * count
    for r in requests:
        tokens[int(r.arrival_s // DEMAND_WINDOW_SECONDS)] += r.input_tokens + r.output_tokens
    return [t / DEMAND_WINDOW_SECONDS for t in tokens]


def scaled_to_demand(replicas: int, demand: float, peak: float) -> int:
    return max(1, math.ceil(round(replicas * demand / peak, 9))) if peak > 0 else 1


def attainment(result: RunResult, slo_seconds: float) -> float:
    met = sum(1 for t in result.ttft if t <= slo_seconds)  # NaN (never served) never meets
    return met / len(result.ttft)


@dataclass
class StaticPeak:
    replicas: int
    meets_slo: bool
    result: RunResult
    tried: dict[int, bool]
    """Fleet size → met the SLO (the bisection's steps)."""


def static_peak(
    requests: Sequence[Request],
    profile: Profile,
    slo_seconds: float,
    most: int,
    run: Callable[..., RunResult] = simulate,
) -> StaticPeak:
    """The fewest fixed replicas in ``[1, most]`` meeting the SLO for 99% of requests
    (bisection: more replicas never serve a trace worse here)."""
    allowed = math.floor(len(requests) * (1 - SLO_QUANTILE) + 1e-9)
    tried: dict[int, bool] = {}
    results: dict[int, RunResult] = {}

    def meets(n: int, full: bool = False) -> bool:
        result = run(requests, profile, n, None, slo_seconds, None if full else allowed)
        tried[n] = not result.aborted and attainment(result, slo_seconds) >= SLO_QUANTILE
        results[n] = result
        return tried[n]

    if not meets(most):
        return StaticPeak(most, False, results[most], tried)
    low, high = 0, most  # low fails (or is 0), high meets
    while high - low > 1:
        mid = (low + high) // 2
        if meets(mid):
            high = mid
        else:
            low = mid
    return StaticPeak(high, True, results[high], tried)
