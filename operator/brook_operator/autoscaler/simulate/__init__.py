"""The autoscaler simulator: replay a request trace against replicas modelled from a
calibrated profile, resized by Brook's policy (the very ``decide`` the operator runs), by
its ablations and by baselines, and score each on TTFT SLO attainment and replica-hours.

``brook autoscale simulate`` is its command line; docs/autoscaler-simulator.md explains the
model and its limits.
"""

from brook_operator.autoscaler.simulate.baselines import POLICIES, StaticPeak, static_peak
from brook_operator.autoscaler.simulate.compare import Comparison, compare, default_spec, load_spec
from brook_operator.autoscaler.simulate.profile import Profile, load_profile, shipped_profiles
from brook_operator.autoscaler.simulate.run import Autoscaled, RunResult, simulate
from brook_operator.autoscaler.simulate.simulation_error import SimulationError
from brook_operator.autoscaler.simulate.trace import (
    Request,
    read_trace,
    resolve_trace,
    scale_rate,
    shipped_traces,
    write_trace,
)

__all__ = [
    "POLICIES",
    "Autoscaled",
    "Comparison",
    "Profile",
    "Request",
    "RunResult",
    "SimulationError",
    "StaticPeak",
    "compare",
    "default_spec",
    "load_profile",
    "load_spec",
    "read_trace",
    "resolve_trace",
    "scale_rate",
    "shipped_profiles",
    "shipped_traces",
    "simulate",
    "static_peak",
    "write_trace",
]
