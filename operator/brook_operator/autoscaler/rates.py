"""Rates from two readings of an engine's counters, as PromQL's ``rate`` takes them: a counter
that went down has restarted from zero (the pod's engine restarted), so its growth since the
earlier reading is its value now."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class DemandCounters:
    """The counters one reading of a replica gives for its demand, in tokens."""

    prompt_tokens: float
    """Prompt tokens of the requests the engine accepted (``prompt_tokens_total``)."""

    generation_tokens: float
    """Tokens it generated (``generation_tokens_total``)."""

    refused_prompt_tokens: float = 0.0
    """Prompt tokens of requests it refused for a full queue (demand it did not serve)."""


def demand_rate(
    before: tuple[DemandCounters, float] | None, after: tuple[DemandCounters, float]
) -> float | None:
    """Tokens per second arriving at a replica between two readings ``(counters, time)``;
    None without an earlier reading, with time not moving forward, or with a non-finite
    counter (no rate is better than a wrong one: ``decide`` treats None as no sample)."""
    if before is None:
        return None
    (old, t0), (new, t1) = before, after
    if t1 <= t0:
        return None
    pairs = (
        (old.prompt_tokens, new.prompt_tokens),
        (old.generation_tokens, new.generation_tokens),
        (old.refused_prompt_tokens, new.refused_prompt_tokens),
    )
    if not all(math.isfinite(a) and math.isfinite(b) and b >= 0 for a, b in pairs):
        return None
    # The counters restart together (the engine restarted): one that dropped means every
    # one counted from zero, even one that has already passed its old value.
    restarted = any(b < a for a, b in pairs)
    grown = [b if restarted else b - a for a, b in pairs]
    # A refused request that retries counts again each time it is refused: count refused
    # tokens up to the tokens accepted over the same time, so a retry storm cannot read as a
    # surge many times the demand.
    prompt, generated, refused = grown
    return (prompt + generated + min(refused, prompt)) / (t1 - t0)
