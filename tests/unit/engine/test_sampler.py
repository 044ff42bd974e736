"""The sampler draws from the distribution it is asked for: softmax(logits / temperature)
cut to top-k and top-p and renormalized, each row from its own generator, whatever the
other rows ask. Frequencies over many seeded draws are compared with the exact
probabilities (seeded: the test is deterministic, and its bound is ~6 standard errors)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from brook_engine.layers.sampler import draw, sample
from brook_engine.sampling_params import SamplingParams

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
DRAWS = 10_000


def _expected(temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    probs = torch.softmax(LOGITS.double() / temperature, -1)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    mass = 0.0
    for rank, index in enumerate(order.tolist()):
        if (top_k and rank >= top_k) or (rank > 0 and mass >= top_p):
            break
        keep[index] = True
        mass += float(probs[index])
    kept = probs * keep
    return kept / kept.sum()


def _frequencies(params: SamplingParams, rows: int = 8) -> torch.Tensor:
    """DRAWS tokens, ``rows`` at a time, the other rows of each batch asking other things."""
    counts = torch.zeros(len(LOGITS), dtype=torch.float64)
    generator = torch.Generator().manual_seed(7)
    others = [SamplingParams(temperature=0.3, top_k=2, max_tokens=1)] * (rows - 1)
    other_generators = [torch.Generator().manual_seed(i) for i in range(rows - 1)]
    logits = LOGITS.repeat(rows, 1)
    for _ in range(DRAWS):
        token = draw(logits, [params, *others], [generator, *other_generators])[0]
        assert isinstance(token, int)
        counts[token] += 1
    return counts / DRAWS


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 1.0), (0.5, 0, 1.0), (2.0, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.8), (1.5, 4, 0.9)],
)
def test_draws_follow_the_asked_distribution(temperature: float, top_k: int, top_p: float) -> None:
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=1)
    seen = _frequencies(params, rows=1 + (top_k % 2) * 3)
    expected = _expected(temperature, top_k, top_p)
    for token, p in enumerate(expected.tolist()):
        if p == 0.0:
            assert seen[token] == 0.0, f"token {token} is cut off and was drawn"
        else:
            bound = 6 * math.sqrt(p * (1 - p) / DRAWS) + 1e-9
            assert abs(float(seen[token]) - p) <= bound, (token, float(seen[token]), p)


def test_a_row_draws_the_same_whatever_the_batch() -> None:
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=1)
    alone = [draw(LOGITS.unsqueeze(0), [params], [torch.Generator().manual_seed(3)])[0]]
    generator = torch.Generator().manual_seed(3)
    logits = torch.stack([LOGITS.flip(0), LOGITS, LOGITS * 2])
    others = [SamplingParams(temperature=0.7, top_k=2, max_tokens=1)] * 2
    together = draw(logits, [others[0], params, others[1]], [None, generator, None])
    assert together[1] == alone[0]


def test_a_row_without_a_distribution_fails_alone() -> None:
    huge = LOGITS.clone()
    huge[0] = 3e38  # finite, but divided by the temperature it is not
    logits = torch.stack([huge, LOGITS])
    tiny = SamplingParams(temperature=0.01, max_tokens=1)
    fine = SamplingParams(temperature=1.0, max_tokens=1, seed=1)
    outcomes = draw(logits, [tiny, fine], [None, torch.Generator().manual_seed(1)])
    assert isinstance(outcomes[0], str) and "no distribution" in outcomes[0]
    assert isinstance(outcomes[1], int)
    drawn = sample(logits, [tiny, fine], [None, torch.Generator().manual_seed(1)])
    assert "no distribution" in (drawn.error(0) or "") and drawn.error(1) is None


def test_a_row_that_makes_the_batch_raise_fails_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    from brook_engine.layers import sampler

    real = sampler.draw

    def failing(logits: torch.Tensor, params: list[SamplingParams], generators: Any) -> Any:
        if any(p.seed == 666 for p in params):
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(logits, params, generators)

    monkeypatch.setattr(sampler, "draw", failing)
    bad = SamplingParams(temperature=1.0, seed=666, max_tokens=1)
    fine = SamplingParams(temperature=1.0, seed=1, max_tokens=1)
    alone = sample(LOGITS.unsqueeze(0), [fine], [torch.Generator().manual_seed(1)])
    logits = torch.stack([LOGITS, LOGITS])
    both = sample(logits, [bad, fine], [torch.Generator(), torch.Generator().manual_seed(1)])
    assert "probability tensor" in (both.error(0) or "")
    assert both.error(1) is None and both.token_ids[1] == alone.token_ids[0]
