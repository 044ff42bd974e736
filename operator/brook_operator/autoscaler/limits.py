"""Steps 8 to 10 of ``policy.decide``: what may clip the recommendation (startup grace,
stabilization, steps, bounds), one pure function each, numbered as in the docstring of
``brook_operator.autoscaler.policy``. Each names what limited the count
(``Decision.limited_by``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from brook_operator.autoscaler.policy_types import Policy, Recommendation
from brook_operator.autoscaler.recommend import Load


@dataclass(frozen=True)
class Outcome:
    """The count as the clipping steps (7 to 9) leave it, what limited it, and why."""

    desired: int
    limited_by: str | None
    reason: str

    def clipped(self, desired: int, limited_by: str, note: str) -> Outcome:
        return replace(self, desired=desired, limited_by=limited_by, reason=self.reason + note)


# 8. Startup grace (and a waiting queue): no scale-in


def hold_scale_in(outcome: Outcome, current: int, load: Load) -> Outcome:
    if outcome.desired < current and load.queue_high:
        outcome = outcome.clipped(current, "Cooldown", "; requests are waiting: no scale-in")
    if outcome.desired < current and load.starting:
        outcome = outcome.clipped(
            current,
            "Startup",
            f"; {load.starting} replica(s) starting: no scale-in during startup grace",
        )
    return outcome


# 9. Stabilization


def stabilize(
    outcome: Outcome,
    current: int,
    policy: Policy,
    history: Sequence[Recommendation],
    now: float,
) -> Outcome:
    """Up: the lowest recommendation over the scale-up window; down: the highest over the
    scale-down window."""
    desired = outcome.desired
    up, down = policy.scale_up_stabilization_seconds, policy.scale_down_stabilization_seconds
    if desired > current and up > 0:
        window = [h.replicas for h in history if now - h.time < up]
        stabilized = max(current, min([desired, *window]))
        if stabilized < desired:
            return outcome.clipped(
                stabilized, "Cooldown", f"; scale-up window {up:g}s: {stabilized}"
            )
    elif desired < current and down > 0:
        window = [h.replicas for h in history if now - h.time < down]
        stabilized = min(current, max([desired, *window]))
        if stabilized > desired:
            return outcome.clipped(
                stabilized, "Cooldown", f"; scale-down window {down:g}s holds {stabilized}"
            )
    return outcome


# 10. Steps, then bounds


def limit_step(outcome: Outcome, current: int, policy: Policy) -> Outcome:
    up, down = policy.max_scale_up_step, policy.max_scale_down_step
    if outcome.desired > current + up:
        return outcome.clipped(current + up, "StepLimit", f"; at most +{up} per decision")
    if outcome.desired < current - down:
        return outcome.clipped(current - down, "StepLimit", f"; at most -{down} per decision")
    return outcome


def apply_bounds(outcome: Outcome, recommendation: int, policy: Policy) -> Outcome:
    low, high = policy.min_replicas, policy.max_replicas
    desired = outcome.desired
    if (desired >= high and recommendation > high) or desired > high:
        return outcome.clipped(high, "AtMax", f"; maxReplicas {high}")
    if (desired <= low and recommendation < low) or desired < low:
        return outcome.clipped(low, "AtMin", f"; minReplicas {low}")
    return outcome
