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
    drawn = [i for i, p in enumerate(params) if not p.is_greedy and errors[i] is None]
    if drawn:
        outcomes = _draw_each(
            [logits[i] for i in drawn], [params[i] for i in drawn], [generators[i] for i in drawn]
        )
        for i, outcome in zip(drawn, outcomes, strict=True):
            if isinstance(outcome, str):
                errors[i] = f"sampling failed: {outcome}"
            else:
                tokens[i] = outcome
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


def _draw_each(
    rows: list[torch.Tensor], params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int | str]:
    """A token (or why none) for each row: all at once, and one at a time only where the
    batch raised, so one row's failure is never another's."""
    try:
        return draw(torch.stack(rows), params, generators)
    except (SamplingFailed, RuntimeError):
        outcomes: list[int | str] = []
        for row, p, generator in zip(rows, params, generators, strict=True):
            try:
                outcomes += draw(row.unsqueeze(0), [p], [generator])
            except (SamplingFailed, RuntimeError) as exc:
                outcomes.append(str(exc))
        return outcomes


def draw(
    logits: torch.Tensor,  # [rows, vocab]
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[int | str]:
    """One token per row from softmax(logits / temperature), cut to its top-k and top-p, by
    inverting the distribution's cumulative sum at one uniform number drawn from the row's
    generator: a row's tokens depend on its logits and its own generator only, and a draw
    costs one random number, not one per vocabulary entry (as ``torch.multinomial`` does).
    Every step is one batched operation over the rows. A row whose probabilities are not a
    distribution gets the reason instead."""
    vocab = logits.shape[-1]
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    scaled = logits.float() / temperature.unsqueeze(1)
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    order = None  # where the rows are sorted (candidates), the vocabulary entry of each
    if ks and all(ks):
        # Every row is cut to its top k: only the candidates matter, and topk sorts them.
        scaled, order = torch.topk(scaled, max(ks), dim=-1)
        beyond = torch.arange(max(ks)).unsqueeze(0) >= torch.tensor(ks).unsqueeze(1)
        scaled.masked_fill_(beyond, float("-inf"))
    elif any(ks):
        top = torch.topk(scaled, max(ks), dim=-1).values
        kth = top.gather(1, torch.tensor([max(k - 1, 0) for k in ks]).unsqueeze(1))
        kth[torch.tensor([k == 0 for k in ks])] = float("-inf")  # rows without top-k
        scaled.masked_fill_(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if any(p.top_p < 1.0 for p in params):
        if order is None:
            probs, order = probs.sort(dim=-1, descending=True)
        cut = [p.top_p if p.top_p < 1.0 else float("inf") for p in params]
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = probs.cumsum(-1) - probs >= torch.tensor(cut).unsqueeze(1)
        probs = probs.masked_fill(drop, 0.0)
    cdf = probs.cumsum(-1, dtype=torch.float64)
    total = cdf[:, -1]
    usable = (torch.isfinite(total) & (total > 0)).tolist()  # a NaN or inf reaches the total
    uniform = torch.cat(
        [torch.rand(1, dtype=torch.float64, generator=generator) for generator in generators]
    )
    # the first entry whose cumulative mass passes u·total: never a zero-probability entry
    picks = torch.searchsorted(cdf, (uniform * total).unsqueeze(1), right=True).squeeze(1)
    outcomes: list[int | str] = []
    for row, pick in enumerate(picks.tolist()):
        if not usable[row]:
            outcomes.append(
                f"temperature {params[row].temperature} leaves no distribution to draw from"
            )
            continue
        if pick >= probs.shape[-1] or float(probs[row, pick]) == 0.0:  # u·total rounded up
            pick = int(probs[row].nonzero()[-1])
        outcomes.append(pick if order is None else int(order[row, pick]))
    return outcomes
