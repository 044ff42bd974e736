"""Turn logits into tokens: greedy, or temperature / top-k / top-p sampling, each request with
its own seeded generator so its tokens do not depend on what else is in the batch.

A row that cannot be sampled (logits with NaN or +inf, no finite logit, or probabilities
that do not form a distribution) fails alone: its error is returned in place of a token, so
one bad request never fails the others in the batch."""

from __future__ import annotations

import torch

from brook_engine.parallel.plan import SampleResult
from brook_engine.sampling_params import SamplingParams

__all__ = ["SampleResult", "SamplingFailed", "sample"]


class SamplingFailed(RuntimeError):
    """One sequence's logits cannot be sampled."""


def sample(
    logits: torch.Tensor,  # [sequences, vocab] float32
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> SampleResult:
    # One pass gives the greedy tokens and the check of the common case: a row's maximum is
    # finite only when it has no NaN (the maximum propagates it), no +inf and a finite logit
    # (-inf ones, e.g. masked tokens, are allowed); else the exact check below names the row.
    peak, greedy = torch.max(logits, dim=-1)
    tokens = greedy.tolist()
    errors: list[str | None] = [None] * len(params)
    if not bool(torch.isfinite(peak).all()):
        broken = torch.isnan(logits).any(-1) | torch.isposinf(logits).any(-1)
        broken |= torch.isneginf(logits).all(-1)
        for i in broken.nonzero().flatten().tolist():
            errors[i] = "the model's logits for this sequence are not finite (NaN or inf)"
    for i, p in enumerate(params):
        if not p.is_greedy and errors[i] is None:
            try:
                tokens[i] = _sample_one(logits[i], p, generators[i])
            except (SamplingFailed, RuntimeError) as exc:
                errors[i] = f"sampling failed: {exc}"
    logprobs: list[tuple[float, dict[int, float]] | None] = [None] * len(params)
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None and errors[i] is None]
    if wanted:
        logp = torch.log_softmax(logits[wanted], dim=-1)
        for row, i in enumerate(wanted):
            n = params[i].logprobs or 0
            top = torch.topk(logp[row], n) if n else None
            alternatives = (
                dict(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top else {}
            )
            logprobs[i] = (float(logp[row, tokens[i]]), alternatives)
    return SampleResult(tokens, logprobs, errors if any(errors) else [])


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
    if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0.0:
        raise SamplingFailed(f"temperature {p.temperature} leaves no distribution to draw from")
    return int(torch.multinomial(probs, 1, generator=generator).item())
