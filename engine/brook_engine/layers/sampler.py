"""Turn logits into tokens: greedy, or temperature / top-k / top-p sampling, each request with
its own seeded generator so its tokens do not depend on what else is in the batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from brook_engine.sampling_params import SamplingParams


@dataclass
class SampleResult:
    token_ids: list[int]
    # Per sequence, when logprobs were asked for: (sampled logprob, {token: logprob} top-n)
    logprobs: list[tuple[float, dict[int, float]] | None]


def sample(
    logits: torch.Tensor,  # [sequences, vocab] float32
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> SampleResult:
    greedy = logits.argmax(dim=-1)
    tokens = greedy.tolist()
    for i, p in enumerate(params):
        if not p.is_greedy:
            tokens[i] = _sample_one(logits[i], p, generators[i])
    logprobs: list[tuple[float, dict[int, float]] | None] = [None] * len(params)
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
    if wanted:
        logp = torch.log_softmax(logits[wanted], dim=-1)
        for row, i in enumerate(wanted):
            n = params[i].logprobs or 0
            top = torch.topk(logp[row], n) if n else None
            alternatives = (
                dict(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top else {}
            )
            logprobs[i] = (float(logp[row, tokens[i]]), alternatives)
    return SampleResult(tokens, logprobs)


def _sample_one(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    scaled = logits / p.temperature
    if p.top_k and p.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator).item())
