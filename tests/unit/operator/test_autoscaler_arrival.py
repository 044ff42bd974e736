"""The arrival signal: rates from two readings of the engines' counters (restarts
included), the capacity learned from the fleet's own readings, and the vote in ``decide``
that sees a surge at the first reading after it starts."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from brook_operator.api.autoscaling import AutoscalingSpec
from brook_operator.autoscaler.capacity import MIN_READINGS, WINDOW, CapacityEstimate
from brook_operator.autoscaler.policy import Policy, ReplicaSignals, decide
from brook_operator.autoscaler.rates import DemandCounters, demand_rate
from brook_operator.autoscaler.scrape import parse_metrics
from brook_operator.pod_http import PodReadError

from .test_autoscaler_parts import _exposition
from .test_autoscaler_policy import BASE, NOW, fleet, past


def _with_demand(signals: list[ReplicaSignals], demand: float | None) -> list[ReplicaSignals]:
    return [replace(r, demand_tokens_per_second=demand) for r in signals]


# -- rates ---------------------------------------------------------------------------------


def test_counters_that_drop_restarted_from_zero_all_together() -> None:
    before = (DemandCounters(1_000, 500), 100.0)
    # The engine restarted: the prompt counter dropped; the generation counter has already
    # passed its old value, but it too counted from zero.
    after = (DemandCounters(300, 700), 110.0)
    assert demand_rate(before, after) == pytest.approx((300 + 700) / 10)


def test_refused_tokens_count_up_to_the_tokens_accepted() -> None:
    """A refused request that retries is refused again: its prompt must not read as a
    surge many times the demand."""
    before = (DemandCounters(1_000, 0, 0), 0.0)
    storm = (DemandCounters(1_100, 0, 5_000), 10.0)
    assert demand_rate(before, storm) == pytest.approx((100 + 100) / 10)
    some = (DemandCounters(1_100, 0, 40), 10.0)
    assert demand_rate(before, some) == pytest.approx((100 + 40) / 10)


def test_demand_rate_over_two_readings() -> None:
    before = (DemandCounters(1_000, 500, 0), 100.0)
    after = (DemandCounters(1_600, 800, 100), 110.0)
    assert demand_rate(before, after) == pytest.approx((600 + 300 + 100) / 10)
    # The engine restarted between the readings: its counters start again from zero.
    restarted = (DemandCounters(90, 10, 0), 115.0)
    assert demand_rate(after, restarted) == pytest.approx(100 / 5)


@pytest.mark.parametrize(
    ("before", "after"),
    [
        (None, (DemandCounters(1, 1), 10.0)),  # no earlier reading
        ((DemandCounters(1, 1), 10.0), (DemandCounters(5, 5), 10.0)),  # time stood still
        ((DemandCounters(1, 1), 10.0), (DemandCounters(math.nan, 5), 20.0)),
        ((DemandCounters(1, 1), 10.0), (DemandCounters(math.inf, 5), 20.0)),
        ((DemandCounters(1, 1), 10.0), (DemandCounters(-3, 5), 20.0)),
    ],
)
def test_no_rate_rather_than_a_wrong_one(
    before: tuple[DemandCounters, float] | None, after: tuple[DemandCounters, float]
) -> None:
    assert demand_rate(before, after) is None


def test_the_engine_exports_its_demand_counters() -> None:
    sample = parse_metrics(_exposition(0.5, 2, 1.0))
    assert sample.demand == DemandCounters(10.0, 20.0, 0.0)
    bare = "brook_engine_kv_cache_usage_ratio 0.5\nbrook_engine_num_requests_waiting 2\n"
    assert parse_metrics(bare).demand is None  # an older engine: no arrival signal
    negative = (
        bare + "brook_engine_prompt_tokens_total -4\nbrook_engine_generation_tokens_total 1\n"
    )
    with pytest.raises(PodReadError, match="prompt_tokens=-4"):
        parse_metrics(negative)


# -- the capacity learned ------------------------------------------------------------------


def test_capacity_is_learned_near_the_target_only() -> None:
    estimate = CapacityEstimate()
    # Two replicas at the target (0.75) taking 300 tok/s between them: 150 tok/s each.
    at_target = _with_demand(fleet(2, kv=0.75), 150.0)
    for _ in range(MIN_READINGS - 1):
        assert estimate.observe(at_target, BASE)
    assert estimate.value is None  # too few readings yet
    assert estimate.observe(at_target, BASE)
    assert estimate.value == pytest.approx(150.0)
    # Far from the target, behind a queue, with a replica unread, or without rates: no
    # reading counts.
    assert not estimate.observe(_with_demand(fleet(2, kv=0.2), 20.0), BASE)
    assert not estimate.observe(_with_demand(fleet(2, kv=0.75, waiting=30), 400.0), BASE)
    partial = at_target[:1] + fleet(1, kv=0.75, sample_age=None, prefix="x")
    assert not estimate.observe(partial, BASE)
    assert not estimate.observe(fleet(2, kv=0.75), BASE)
    assert estimate.value == pytest.approx(150.0)


def test_a_surges_first_readings_do_not_move_the_capacity() -> None:
    estimate = CapacityEstimate()
    for _ in range(WINDOW):
        estimate.observe(_with_demand(fleet(2, kv=0.75), 150.0), BASE)
    # Demand jumps fourfold while KV usage has not caught up yet: a few such readings are
    # outvoted by the median.
    for _ in range(WINDOW // 2 - 1):
        estimate.observe(_with_demand(fleet(2, kv=0.8), 600.0), BASE)
    assert estimate.value == pytest.approx(150.0)


# -- the vote ------------------------------------------------------------------------------


def test_a_surge_scales_out_at_the_first_reading() -> None:
    """KV usage still at the target, the queue empty: only the arrivals show the step."""
    before = decide(_with_demand(fleet(2, kv=0.75), 150.0), 2, BASE, past((15, 2)), NOW, 150.0)
    assert before.desired == 2  # each replica takes the 150 tok/s it serves at the target
    surge = _with_demand(fleet(2, kv=0.75), 4 * 150.0)
    decision = decide(surge, 2, BASE, past((15, 2)), NOW, capacity=150.0)
    assert decision.desired == 6  # +4 per decision (maxScaleUpStep) of the 8 needed
    assert decision.signal_recommendations["arrival"] == 8
    assert decision.limited_by == "StepLimit"
    assert "arrivals 1200 tok/s" in decision.reason
    assert decision.aggregate.demand_tokens_per_second == pytest.approx(1200.0)
    assert decision.capacity_tokens_per_second == 150.0
    # The same readings without the arrival signal, or before the capacity is known, wait.
    without = replace(BASE, signals=BASE.signals - {"arrival"})
    assert decide(surge, 2, without, past((15, 2)), NOW, 150.0).desired == 2
    assert decide(surge, 2, BASE, past((15, 2)), NOW, capacity=None).desired == 2


def test_a_climb_the_step_limit_cut_short_goes_on() -> None:
    """2 replicas, 1200 tok/s at 150 each: 8 needed, +4 a decision. At 6 the arriving
    tokens are 1.33 times the fleet's capacity, below the surge threshold but above the
    band: the climb goes on to 8 instead of waiting for KV usage to catch up."""
    surge = _with_demand(fleet(2, kv=0.75), 600.0)
    first = decide(surge, 2, BASE, past((15, 2)), NOW, capacity=150.0)
    assert (first.desired, first.recommendation) == (6, 8)
    spread = _with_demand(fleet(6, kv=0.4), 200.0)
    history = [*past((30, 2)), first.recommendation_at(NOW - 15)]
    second = decide(spread, 6, BASE, history, NOW, capacity=150.0)
    assert (second.signal_recommendations["arrival"], second.desired) == (8, 8), second.reason
    # Without a climb in progress the same reading is inside the surge threshold: a floor.
    settled = decide(spread, 6, BASE, past((15, 6)), NOW, capacity=150.0)
    assert settled.signal_recommendations["arrival"] == 6


def test_a_configured_capacity_wins_over_the_learned_one() -> None:
    policy = Policy.from_spec(AutoscalingSpec(max_replicas=10, replica_tokens_per_second=100))
    surge = _with_demand(fleet(2, kv=0.75), 300.0)
    decision = decide(surge, 2, policy, past((15, 2)), NOW, capacity=1_000.0)
    assert decision.signal_recommendations["arrival"] == 6
    assert decision.capacity_tokens_per_second == 100.0


def test_small_swings_leave_the_fleet_to_the_other_signals() -> None:
    # 1.4x the capacity is noise-sized for one interval: no vote above the current size.
    signals = _with_demand(fleet(2, kv=0.75), 1.4 * 150.0)
    decision = decide(signals, 2, BASE, past((15, 2)), NOW, capacity=150.0)
    assert decision.signal_recommendations["arrival"] == 2
    assert decision.desired == 2


def test_arrivals_hold_a_scale_in_the_demand_does_not_support() -> None:
    """Saturation falls steeply below capacity (a fleet with room drains its batches fast),
    so KV usage alone would scale in to a fleet the arriving tokens then overfill."""
    quiet = fleet(5, kv=0.25)
    window = past((400, 5))
    assert decide(quiet, 5, BASE, window, NOW).desired == 4  # KV: ceil(5 √(1/3)) = 3, -1 step
    held = decide(_with_demand(quiet, 140.0), 5, BASE, window, NOW, capacity=150.0)
    # 700 tok/s need ceil(700 / (150 × 1.1)) = 5 replicas at the top of the band.
    assert held.signal_recommendations["arrival"] == 5
    assert held.desired == 5
    # With demand that does fit in four, the scale-in goes ahead.
    fits = decide(_with_demand(quiet, 100.0), 5, BASE, window, NOW, capacity=150.0)
    assert fits.desired == 4


def test_a_replica_without_a_rate_counts_at_capacity() -> None:
    signals = _with_demand(fleet(1, kv=0.75), 900.0) + fleet(1, kv=0.75, prefix="new")
    decision = decide(signals, 2, BASE, past((15, 2)), NOW, capacity=150.0)
    assert decision.signal_recommendations["arrival"] == 7  # (900 + 150) / 150
    assert decision.aggregate.demand_tokens_per_second == pytest.approx(900.0)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_rate_makes_the_sample_stale(bad: float) -> None:
    decision = decide(_with_demand(fleet(1, kv=0.75), bad), 1, BASE, past((15, 1)), NOW, 150.0)
    assert (decision.desired, decision.limited_by, decision.metrics_available) == (
        1,
        "Stale",
        False,
    )


def test_stale_samples_hold_whatever_they_say() -> None:
    old = _with_demand(fleet(2, kv=0.75, sample_age=120.0), 10_000.0)
    decision = decide(old, 2, BASE, past((15, 2)), NOW, capacity=150.0)
    assert (decision.desired, decision.limited_by) == (2, "Stale")


# -- the predictive term -------------------------------------------------------------------


def test_a_forecast_surge_scales_out_before_it_and_holds_a_scale_in() -> None:
    quiet = _with_demand(fleet(2, kv=0.75), 150.0)
    ahead = decide(quiet, 2, BASE, past((15, 2)), NOW, capacity=150.0, forecast=900.0)
    assert (ahead.signal_recommendations["history"], ahead.desired) == (6, 6)
    assert ahead.forecast_tokens_per_second == 900.0
    assert "earlier days: 900 tok/s ahead: 6" in ahead.reason
    # An idle fleet is not scaled in just before the surge earlier days saw.
    idle = _with_demand(fleet(4, kv=0.05), 10.0)
    window = past((400, 4))
    assert decide(idle, 4, BASE, window, NOW, capacity=150.0).desired == 3
    assert decide(idle, 4, BASE, window, NOW, capacity=150.0, forecast=600.0).desired == 4
    # Without a capacity there is nothing to size the forecast against.
    blind = decide(quiet, 2, BASE, past((15, 2)), NOW, capacity=None, forecast=900.0)
    assert "history" not in blind.signal_recommendations and blind.desired == 2


# -- standby -------------------------------------------------------------------------------


def test_standby_replicas_ride_on_top_of_what_the_arrivals_need() -> None:
    policy = replace(BASE, standby_replicas=2, replica_tokens_per_second=150.0)
    # 4 replicas take 450 tok/s: the arrivals need ceil(450 / (150 × 1.1)) = 3, so 5.
    quiet = _with_demand(fleet(4, kv=0.2), 112.5)
    decision = decide(quiet, 4, policy, past((15, 4)), NOW)
    assert (decision.signal_recommendations["standby"], decision.desired) == (5, 5)
    assert "3 for the arrivals + 2 standby" in decision.reason
    # A surge takes the standby and refills it: the arrivals' 8 and 2 more (step-limited).
    surge = _with_demand(fleet(4, kv=0.75), 300.0)
    climbing = decide(surge, 4, policy, past((15, 4)), NOW)
    assert climbing.signal_recommendations["standby"] == 10 and climbing.desired == 8
    # Without standby, or without a capacity, there is no such vote.
    assert "standby" not in decide(quiet, 4, BASE, past((15, 4)), NOW, 150.0).signal_recommendations
    unsized = replace(BASE, standby_replicas=2)
    assert "standby" not in decide(quiet, 4, unsized, past((15, 4)), NOW).signal_recommendations


def test_standby_needs_a_capacity_and_room_below_the_maximum() -> None:
    with pytest.raises(ValueError, match="standbyReplicas needs replicaTokensPerSecond"):
        AutoscalingSpec(max_replicas=8, standby_replicas=2)
    with pytest.raises(ValueError, match=r"standbyReplicas \(8\) must be below maxReplicas"):
        AutoscalingSpec(max_replicas=8, standby_replicas=8, replica_tokens_per_second=100)
    spec = AutoscalingSpec(max_replicas=8, standby_replicas=2, replica_tokens_per_second=100)
    assert Policy.from_spec(spec).standby_replicas == 2
