"""One simulated run: a trace replayed against a fleet of replicas that a policy resizes (or
a fixed fleet), in ticks of ``TICK_SECONDS``.

At each tick boundary: decide (every ``interval_seconds``), route the requests that arrived
since the last boundary (conservative: none is routed before the boundary at or after its
arrival), then advance every replica to the next boundary. The run goes on past the last
arrival until every request has finished.

Routing (``router``): by default a new request goes to the serving replica (ready, not
draining) with the fewest requests waiting or in prefill, ties to the one holding the least
KV; ``service`` picks at random, ``flow-control`` holds requests at the gateway until a
replica has room (``simulate.router``). With no serving replica a request waits at the
gateway. Scale-up adds replicas that serve after ``cold_start_seconds``.
Scale-in removes replicas that are still starting first (as a ReplicaSet does), then drains
the ready replicas holding the least KV: a draining replica takes no new requests, finishes
what it has and then disappears.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from brook_operator.api.autoscaling import HistorySpec
from brook_operator.autoscaler.capacity import CapacityEstimate
from brook_operator.autoscaler.history import DemandHistory, observed_demand
from brook_operator.autoscaler.policy import Policy, Recommendation, ReplicaSignals, decide
from brook_operator.autoscaler.rates import DemandCounters, demand_rate
from brook_operator.autoscaler.simulate.oracle import Oracle
from brook_operator.autoscaler.simulate.profile import Profile
from brook_operator.autoscaler.simulate.replica import Job, Outcome, Replica
from brook_operator.autoscaler.simulate.router import DEFAULT_ROUTER, Router
from brook_operator.autoscaler.simulate.simulation_error import SimulationError
from brook_operator.autoscaler.simulate.trace import Request

TICK_SECONDS = 0.25
#: A run still busy this long after the last arrival is a bug or a hopeless fleet.
MAX_TAIL_SECONDS = 6 * 3600.0


@dataclass(frozen=True)
class Autoscaled:
    """A fleet ``policy`` (or, for the bounds, an ``oracle``) resizes every
    ``interval_seconds``."""

    policy: Policy | None
    interval_seconds: float
    oracle: Oracle | None = None
    reads_gateway_queue: bool = False
    """The policy also counts requests held at the gateway as waiting (what reading the
    endpoint picker's flow-control queue would give; Brook's loop reads only the engines)."""

    history: HistorySpec | None = None
    """The predictive term's settings (``spec.autoscaling.history``); None: reactive."""

    def __post_init__(self) -> None:
        if (self.policy is None) == (self.oracle is None):
            raise ValueError("an autoscaled fleet needs exactly one of a policy and an oracle")


@dataclass
class RunResult:
    arrivals: list[float]
    ttft: list[float]
    """Seconds from arrival to the first token, per request (NaN: aborted before)."""

    finished: list[float]
    duration_s: float
    replica_seconds: float
    preemptions: int
    completed: int
    aborted: bool = False
    """Stopped early once the SLO was out of reach (``max_misses``)."""

    scale_events: list[tuple[float, int, int]] = field(default_factory=list)
    """(time, replicas before, replicas after) of each decision that changed the size."""

    timeline: list[tuple[float, int]] = field(default_factory=list)
    """(time, replicas that exist) at the start and at each change."""

    decisions: list[tuple[float, int, int, str | None, str]] = field(default_factory=list)
    """(time, current, desired, limited_by, reason) of every decision."""


class _Fleet:
    def __init__(self, profile: Profile, outcome: Outcome) -> None:
        self.profile = profile
        self.outcome = outcome
        self.replicas: list[Replica] = []
        self.gone: list[Replica] = []
        self._count = 0

    def add(self, now: float, ready_at: float | None = None) -> None:
        created = now if ready_at is None else ready_at - self.profile.cold_start_seconds
        ready = now + self.profile.cold_start_seconds if ready_at is None else ready_at
        self.replicas.append(Replica(f"r{self._count}", self.profile, created, ready, self.outcome))
        self._count += 1

    def active(self) -> list[Replica]:
        return [r for r in self.replicas if not r.draining]

    def drain(self, count: int, now: float) -> None:
        """Starting replicas first (youngest first), then the ready ones holding least KV."""
        active = self.active()
        starting = sorted((r for r in active if not r.is_ready(now)), key=lambda r: -r.created)
        ready = sorted((r for r in active if r.is_ready(now)), key=lambda r: r.kv_held)
        for replica in (starting + ready)[:count]:
            replica.draining = True

    def remove_drained(self, now: float) -> bool:
        done = [r for r in self.replicas if r.draining and r.is_empty()]
        for replica in done:
            replica.removed = now
            self.replicas.remove(replica)
            self.gone.append(replica)
        return bool(done)

    def replica_seconds(self, end: float) -> float:
        return sum(
            (end if r.removed is None else r.removed) - max(r.created, 0.0)
            for r in self.replicas + self.gone
        )


@dataclass
class _Readings:
    """What the autoscaler remembers between decisions, as the operator's loop does: each
    replica's last counters (for its demand rate) and the learned capacity."""

    counters: dict[str, tuple[DemandCounters, float]] = field(default_factory=dict)
    capacity: CapacityEstimate = field(default_factory=CapacityEstimate)
    demand: DemandHistory | None = None
    """The fleet's demand over earlier periods, for the predictive term."""

    def rates(self, replicas: Sequence[Replica], now: float) -> dict[str, float | None]:
        out: dict[str, float | None] = {}
        seen = {}
        for r in replicas:
            if not r.is_ready(now):
                continue
            reading = (DemandCounters(r.prompt_tokens_received, r.tokens_generated), now)
            out[r.name] = demand_rate(self.counters.get(r.name), reading)
            seen[r.name] = reading
        self.counters = seen
        return out


def signals_of(
    replicas: Sequence[Replica],
    now: float,
    held: int = 0,
    rates: dict[str, float | None] | None = None,
) -> list[ReplicaSignals]:
    """What each non-draining replica's /metrics would say now; ``held`` requests waiting
    at the gateway are counted as waiting, shared evenly by the ready replicas (the queue
    the autoscaler reads from the endpoint picker under flow control); ``rates``: each
    replica's demand since the previous decision."""
    rates = rates or {}
    out = []
    num_ready = sum(1 for r in replicas if r.is_ready(now))
    extra = held / num_ready if num_ready else 0.0
    for r in replicas:
        ready = r.is_ready(now)
        out.append(
            ReplicaSignals(
                name=r.name,
                ready=ready,
                age_seconds=now - r.created,
                kv_cache_usage=min(1.0, r.kv_held / r.profile.kv_cache_tokens) if ready else None,
                waiting_requests=float(len(r.waiting)) + extra if ready else None,
                running_requests=float(r.num_running) if ready else None,
                overlap_ratio=r.profile.overlap_ratio(r.num_decoding) if ready else None,
                sample_age_seconds=0.0 if ready else None,
                demand_tokens_per_second=rates.get(r.name),
            )
        )
    return out


def check_fits(requests: Sequence[Request], profile: Profile) -> None:
    for line, r in enumerate(requests, start=2):
        if r.input_tokens + r.output_tokens > profile.kv_cache_tokens:
            raise SimulationError(
                f"trace line {line}: {r.input_tokens} + {r.output_tokens} tokens exceed the KV "
                f"cache of profile {profile.name} ({profile.kv_cache_tokens} tokens); such a "
                "request could never run"
            )


def simulate(
    requests: Sequence[Request],
    profile: Profile,
    replicas: int,
    autoscaled: Autoscaled | None = None,
    slo_seconds: float | None = None,
    max_misses: int | None = None,
    router: str = DEFAULT_ROUTER,
) -> RunResult:
    """Replay ``requests`` on ``replicas`` warm replicas, resized by ``autoscaled`` if given.

    The autoscaler starts as if it had been running at ``replicas``: its history holds that
    recommendation at time 0. With ``max_misses``, the run stops once more requests than
    that have missed the SLO (bisection only needs to know that it failed).
    """
    if not requests:
        raise SimulationError("the trace has no requests")
    check_fits(requests, profile)
    routing = Router(router)
    slo = profile.ttft_slo_seconds if slo_seconds is None else slo_seconds
    outcome = Outcome(len(requests), slo)
    jobs = [Job(i, r.arrival_s, r.input_tokens, r.output_tokens) for i, r in enumerate(requests)]
    fleet = _Fleet(profile, outcome)
    for _ in range(replicas):
        fleet.add(0.0, ready_at=0.0)
    history: list[Recommendation] = [Recommendation(0.0, replicas)] if autoscaled else []
    result = RunResult(
        arrivals=[r.arrival_s for r in requests],
        ttft=outcome.ttft,
        finished=outcome.finished,
        duration_s=0.0,
        replica_seconds=0.0,
        preemptions=0,
        completed=0,
        timeline=[(0.0, replicas)],
    )
    gateway: deque[Job] = deque()
    ahead = autoscaled.history if autoscaled else None
    readings = _Readings(
        demand=DemandHistory(ahead.period_seconds, ahead.periods) if ahead else None
    )
    last_arrival = requests[-1].arrival_s
    next_job, tick = 0, 0
    next_decision = autoscaled.interval_seconds if autoscaled else float("inf")
    while True:
        now = tick * TICK_SECONDS
        if autoscaled and now >= next_decision - 1e-9:
            next_decision += autoscaled.interval_seconds
            seen = len(gateway) if autoscaled.reads_gateway_queue else 0
            _scale(fleet, autoscaled, history, now, result, seen, readings)
        while next_job < len(jobs) and jobs[next_job].arrival <= now:
            gateway.append(jobs[next_job])
            next_job += 1
        if gateway:
            routing.route(
                gateway, [r for r in fleet.replicas if not r.draining and r.is_ready(now)]
            )
        for replica in fleet.replicas:
            replica.advance(now, TICK_SECONDS)
        tick += 1
        now = tick * TICK_SECONDS
        if fleet.remove_drained(now):
            result.timeline.append((now, len(fleet.replicas)))
        if max_misses is not None and outcome.misses > max_misses:
            result.aborted = True
            break
        if next_job == len(jobs) and not gateway and outcome.completed == len(jobs):
            break
        if now > last_arrival + MAX_TAIL_SECONDS:
            raise SimulationError(
                f"requests still unfinished {MAX_TAIL_SECONDS:.0f} s after the last arrival "
                f"({outcome.completed} of {len(jobs)} done)"
            )
    result.duration_s = now
    result.replica_seconds = fleet.replica_seconds(now)
    result.preemptions = outcome.preemptions
    result.completed = outcome.completed
    return result


def _scale(
    fleet: _Fleet,
    autoscaled: Autoscaled,
    history: list[Recommendation],
    now: float,
    result: RunResult,
    held: int,
    readings: _Readings,
) -> None:
    active = fleet.active()
    if autoscaled.oracle is not None:
        desired, why = autoscaled.oracle.size(now)
        result.decisions.append(
            (now, len(active), desired, None, f"{autoscaled.oracle.name}: {why}")
        )
    else:
        policy = autoscaled.policy
        assert policy is not None  # Autoscaled holds one of the two
        signals = signals_of(active, now, held, readings.rates(active, now))
        ahead = autoscaled.history
        forecast = (
            readings.demand.forecast(now, ahead.lead_seconds)
            if ahead is not None and readings.demand is not None
            else None
        )
        decision = decide(
            signals, len(active), policy, history, now, readings.capacity.value, forecast
        )
        readings.capacity.observe(signals, policy)
        demand = observed_demand(signals, policy)
        if readings.demand is not None and demand is not None:
            readings.demand.record(now, demand)
        result.decisions.append(
            (now, decision.current, decision.desired, decision.limited_by, decision.reason)
        )
        history.append(decision.recommendation_at(now))
        while history and now - history[0].time > policy.longest_window:
            history.pop(0)
        desired = decision.desired
    change = desired - len(active)
    if not change:
        return
    if change > 0:
        for _ in range(change):
            fleet.add(now)
    else:
        fleet.drain(-change, now)
    result.scale_events.append((now, len(active), desired))
    fleet.remove_drained(now)
    result.timeline.append((now, len(fleet.replicas)))
