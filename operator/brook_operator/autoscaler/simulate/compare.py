"""A trace replayed against several policies: static-peak first (the others are measured
against its replica-hours and start from its size scaled to the opening load), then each
requested policy, scored by ``report.summary``."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from brook_operator.api.autoscaling import AutoscalingSpec
from brook_operator.autoscaler.simulate import baselines
from brook_operator.autoscaler.simulate.oracle import ORACLES, oracle
from brook_operator.autoscaler.simulate.profile import Profile
from brook_operator.autoscaler.simulate.report import summary
from brook_operator.autoscaler.simulate.router import DEFAULT_ROUTER
from brook_operator.autoscaler.simulate.run import Autoscaled, RunResult, simulate
from brook_operator.autoscaler.simulate.simulation_error import SimulationError
from brook_operator.autoscaler.simulate.trace import Request


@dataclass
class Comparison:
    slo_seconds: float
    static_peak: baselines.StaticPeak
    initial_replicas: int
    """Where the autoscaled fleets start."""

    results: dict[str, RunResult] = field(default_factory=dict)
    rows: dict[str, dict[str, Any]] = field(default_factory=dict)


def default_spec(profile: Profile) -> AutoscalingSpec:
    """``spec.autoscaling`` with every default and the profile's replica limit."""
    return AutoscalingSpec(max_replicas=profile.max_replicas)


def load_spec(path: Path, profile: Profile) -> AutoscalingSpec:
    """``spec.autoscaling`` fields from a YAML or JSON file (camelCase, as in a manifest);
    ``maxReplicas`` defaults to the profile's."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise SimulationError(f"{path}: unreadable policy: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SimulationError(f"{path}: a policy is a mapping of spec.autoscaling fields")
    data.setdefault("maxReplicas", profile.max_replicas)
    try:
        return AutoscalingSpec.model_validate(data)
    except ValidationError as exc:
        problems = [
            f"{'.'.join(str(p) for p in e['loc']) or 'autoscaling'}: {e['msg']}"
            for e in exc.errors()
        ]
        raise SimulationError(f"{path}: " + "; ".join(problems)) from None


def compare(
    requests: Sequence[Request],
    profile: Profile,
    spec: AutoscalingSpec,
    names: Sequence[str] = baselines.POLICIES,
    slo_seconds: float | None = None,
    oracle_headroom: float = 1.0,
    router: str = DEFAULT_ROUTER,
    reads_gateway_queue: bool = False,
    window: tuple[float, float] | None = None,
) -> Comparison:
    """Every policy in ``names`` on the same trace and profile, each fleet behind ``router``
    (``simulate.router``); with ``reads_gateway_queue`` (flow control only) the autoscaled
    policies also count the requests held at the gateway; with ``window`` (seconds after
    midnight, start and end) each row also scores the requests arriving in it, each day."""
    unknown = [n for n in names if n not in baselines.POLICIES]
    if unknown:
        raise SimulationError(
            f"unknown policies {', '.join(unknown)}; choose from {', '.join(baselines.POLICIES)}"
        )
    slo = profile.ttft_slo_seconds if slo_seconds is None else slo_seconds
    if reads_gateway_queue and router != "flow-control":
        raise SimulationError(
            f"--read-gateway-queue applies with --router flow-control (the router that holds "
            f"requests at the gateway); --router {router} sends every request on at once"
        )
    run = functools.partial(simulate, router=router)
    peak = baselines.static_peak(requests, profile, slo, spec.max_replicas, run)
    demand = baselines.demand_windows(requests)
    top = max(demand)
    initial = min(
        spec.max_replicas,
        max(spec.min_replicas, baselines.scaled_to_demand(peak.replicas, demand[0], top)),
    )
    out = Comparison(slo, peak, initial)

    def run_oracle(name: str, headroom: float) -> RunResult:
        bound = oracle(
            name,
            requests,
            tokens_per_replica=top / peak.replicas,
            cold_start_seconds=profile.cold_start_seconds,
            headroom=headroom,
            min_replicas=spec.min_replicas,
            max_replicas=spec.max_replicas,
        )
        return run(requests, profile, initial, Autoscaled(None, spec.interval_seconds, bound), slo)

    peak_hours = peak.result.replica_seconds / 3600
    reversal_window = spec.scale_down_stabilization_seconds
    for name in names:
        if name == "static-peak":
            result = peak.result
            extra: dict[str, Any] = {"replicas": peak.replicas, "meets_slo": peak.meets_slo}
        elif name == "static-mean":
            mean = baselines.scaled_to_demand(peak.replicas, sum(demand) / len(demand), top)
            result = run(requests, profile, mean, None, slo)
            extra = {"replicas": mean}
        elif name in ORACLES:
            result = run_oracle(name, oracle_headroom)
            extra = {"initial_replicas": initial, "headroom": oracle_headroom}
        else:
            result = run(
                requests,
                profile,
                initial,
                dataclasses.replace(
                    baselines.autoscaled(name, spec, profile.max_num_seqs),
                    reads_gateway_queue=reads_gateway_queue,
                ),
                slo,
            )
            extra = {"initial_replicas": initial}
        out.results[name] = result
        out.rows[name] = {**summary(result, slo, peak_hours, reversal_window, window), **extra}
    # Every policy against the clairvoyant bound at headroom 1 (run for it when not asked
    # for, or asked for at another headroom).
    clairvoyant = out.results.get("oracle-clairvoyant")
    if clairvoyant is None or oracle_headroom != 1.0:
        clairvoyant = run_oracle("oracle-clairvoyant", 1.0)
    for row in out.rows.values():
        row["replica_hours_vs_clairvoyant"] = round(
            row["replica_hours"] / (clairvoyant.replica_seconds / 3600), 3
        )
    return out
