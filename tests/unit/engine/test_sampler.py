"""The sampler draws from the distribution it is asked for: softmax(logits / temperature)
cut to top-k (ties with the k-th kept) and top-p and renormalized, each row from one
uniform number of its own generator, whatever the other rows ask. Frequencies over many
seeded draws are compared with the exact probabilities (seeded: deterministic, with a bound
of ~6 standard errors); the inversion itself is checked exactly with chosen numbers."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from brook_engine.layers import sampler
from brook_engine.layers.sampler import draw, sample
from brook_engine.sampling_params import SamplingParams

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
DRAWS = 10_000


def _params(temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> SamplingParams:
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=1)


def _expected(temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    probs = torch.softmax(LOGITS.double() / temperature, -1)
    if top_k:
        kth = probs.sort(descending=True).values[top_k - 1]
        probs = torch.where(probs >= kth, probs, 0.0)
        probs = probs / probs.sum()
    keep = torch.zeros_like(probs, dtype=torch.bool)
    mass = 0.0
    for rank, index in enumerate(probs.argsort(descending=True).tolist()):
        if probs[index] == 0 or (rank > 0 and mass >= top_p):
            break
        keep[index] = True
        mass += float(probs[index])
    kept = probs * keep
    return kept / kept.sum()


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "neighbours"),
    [
        (1.0, 0, 1.0, "none"),
        (0.5, 0, 1.0, "none"),
        (2.0, 0, 1.0, "top-p"),
        (1.0, 3, 1.0, "none"),  # every row cut to its top-k
        (1.0, 3, 1.0, "plain"),  # rows with and without top-k together
        (1.0, 0, 0.8, "plain"),
        (1.0, 3, 0.8, "top-k"),
        (1.5, 4, 0.9, "plain"),
    ],
)
def test_draws_follow_the_asked_distribution(
    temperature: float, top_k: int, top_p: float, neighbours: str
) -> None:
    params = _params(temperature, top_k, top_p)
    others = {
        "none": [],
        "plain": [_params(0.7)] * 2,
        "top-p": [_params(1.0, top_p=0.5)],
        "top-k": [_params(0.3, top_k=2)] * 3,
    }[neighbours]
    generator = torch.Generator().manual_seed(7)
    logits = LOGITS.repeat(1 + len(others), 1)
    counts = torch.zeros(len(LOGITS), dtype=torch.float64)
    for _ in range(DRAWS):
        drawn = sample(logits, [params, *others], [generator] + [None] * len(others))
        counts[drawn.token_ids[0]] += 1
    seen = counts / DRAWS
    expected = _expected(temperature, top_k, top_p)
    for token, p in enumerate(expected.tolist()):
        if p == 0.0:
            assert seen[token] == 0.0, f"token {token} is cut off and was drawn"
        else:
            bound = 6 * math.sqrt(p * (1 - p) / DRAWS)
            assert abs(float(seen[token]) - p) <= bound, (token, float(seen[token]), p)


def test_the_draw_inverts_the_distribution_exactly() -> None:
    probs = torch.softmax(LOGITS.double(), -1)
    cdf = probs.cumsum(-1)
    grid = torch.linspace(0, 0.999999, 401, dtype=torch.float64)
    drawn = draw(LOGITS.repeat(len(grid), 1), [_params()] * len(grid), grid)
    expected = torch.searchsorted(cdf, grid * cdf[-1], right=True).tolist()
    assert drawn == expected
    # u = 0 is the first token with mass; a number rounding onto the total is the last one
    assert draw(LOGITS.unsqueeze(0), [_params(top_k=2)], torch.tensor([0.0])) == [0]
    edge = torch.tensor([1.0], dtype=torch.float64)
    assert draw(LOGITS.unsqueeze(0), [_params(top_k=2)], edge) == [1]


def test_top_k_keeps_the_tokens_tied_with_the_kth() -> None:
    logits = torch.tensor([3.0, 2.0, 1.0, 1.0, 1.0, 0.0, -1.0])
    grid = torch.linspace(0, 0.999, 300, dtype=torch.float64)
    for others in ([], [_params()], [_params(top_k=5)]):
        rows = 1 + len(others)
        tokens = set()
        for u in grid:
            uniform = torch.cat([u.view(1), torch.full((rows - 1,), 0.5, dtype=u.dtype)])
            tokens.add(draw(logits.repeat(rows, 1), [_params(top_k=3), *others], uniform)[0])
        assert tokens == {0, 1, 2, 3, 4}, others


@pytest.mark.parametrize("params", [_params(), _params(top_k=3), _params(top_p=0.8)])
def test_a_row_draws_the_same_whatever_the_batch(params: SamplingParams) -> None:
    neighbours = [
        ([_params(top_p=0.9)], [LOGITS.flip(0)]),
        ([_params(top_k=10), _params(top_k=2)], [LOGITS * 2, LOGITS]),
        ([_params(0.5)], [LOGITS - 1]),
    ]
    generator = torch.Generator().manual_seed(11)
    for u in torch.rand(200, dtype=torch.float64, generator=generator):
        alone = draw(LOGITS.unsqueeze(0), [params], u.view(1))[0]
        for others, their_logits in neighbours:
            logits = torch.stack([their_logits[0], LOGITS, *their_logits[1:]])
            ps = [others[0], params, *others[1:]]
            uniform = torch.cat([torch.tensor([0.3], dtype=u.dtype), u.view(1)])
            uniform = torch.cat([uniform, torch.full((len(ps) - 2,), 0.7, dtype=u.dtype)])
            assert draw(logits, ps, uniform)[1] == alone, (float(u), others)


def test_a_row_without_a_distribution_fails_alone() -> None:
    huge = LOGITS.clone()
    huge[0] = 3e38  # finite, but divided by the temperature it is not
    logits = torch.stack([huge, LOGITS])
    drawn = sample(logits, [_params(0.01), _params()], [None, torch.Generator().manual_seed(1)])
    assert "no distribution" in (drawn.error(0) or "") and drawn.error(1) is None


def test_a_row_that_makes_the_batch_raise_fails_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    real = sampler.draw

    def failing(logits: torch.Tensor, params: list[SamplingParams], uniform: Any) -> Any:
        if any(p.seed == 666 for p in params):
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(logits, params, uniform)

    monkeypatch.setattr(sampler, "draw", failing)
    bad = SamplingParams(temperature=1.0, seed=666, max_tokens=1)
    fine = SamplingParams(temperature=1.0, seed=1, max_tokens=1)
    alone = sample(LOGITS.unsqueeze(0), [fine], [torch.Generator().manual_seed(1)])
    generator = torch.Generator().manual_seed(1)
    both = sample(torch.stack([LOGITS, LOGITS]), [bad, fine], [torch.Generator(), generator])
    assert "probability tensor" in (both.error(0) or "")
    assert both.error(1) is None and both.token_ids[1] == alone.token_ids[0]
    # the retry reused the row's number: its generator advanced once, as alone
    once = torch.Generator().manual_seed(1)
    torch.rand(1, dtype=torch.float64, generator=once)
    assert torch.equal(generator.get_state(), once.get_state())
