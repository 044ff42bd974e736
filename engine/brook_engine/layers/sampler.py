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
            logits[drawn], [params[i] for i in drawn], [generators[i] for i in drawn]
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
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int | str]:
    """A token (or why none) for each row: all at once, and one at a time only where the
    batch raised, so one row's failure is never another's. Each row's uniform number is
    drawn once, first: a retry reuses it, so a generator advances once a token."""
    device = logits.device
    exact = _exact(device)
    uniform = torch.cat([_uniform(generator, exact, device) for generator in generators])
    try:
        return draw(logits, params, uniform)
    except (SamplingFailed, RuntimeError):
        outcomes: list[int | str] = []
        for row, p in enumerate(params):
            try:
                outcomes += draw(logits[row : row + 1], [p], uniform[row : row + 1])
            except (SamplingFailed, RuntimeError) as exc:
                outcomes.append(str(exc))
        return outcomes


def draw(
    logits: torch.Tensor,  # [rows, vocab]
    params: list[SamplingParams],
    uniform: torch.Tensor,  # [rows], in [0, 1)
) -> list[int | str]:
    """One token per row from softmax(logits / temperature), cut to its top-k (ties with
    the k-th kept) and top-p, by inverting the distribution's cumulative sum, in vocabulary
    order, at the row's uniform number. So a row's token depends on its logits and its
    number only, never on the other rows; and a draw costs one random number, not one per
    vocabulary entry (as ``torch.multinomial`` does). Every step is one batched operation
    over the rows. A row whose probabilities are not a distribution gets the reason."""
    vocab, device = logits.shape[-1], logits.device

    def column(values: list[float] | list[int] | list[bool], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device).unsqueeze(1)

    scaled = logits.float() / column([p.temperature for p in params], torch.float32)
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(ks):
        top = torch.topk(scaled, max(ks), dim=-1).values
        kth = top.gather(1, column([max(k - 1, 0) for k in ks], torch.long))
        kth.masked_fill_(column([k == 0 for k in ks], torch.bool), float("-inf"))  # no top-k
        scaled.masked_fill_(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if any(p.top_p < 1.0 for p in params):
        # Only the candidates need sorting: every row's, ties included, where all have top-k.
        width = int((scaled > float("-inf")).sum(-1).max()) if all(ks) else vocab
        if width < vocab:
            sorted_probs, order = torch.topk(probs, width, dim=-1)
        else:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
        cut = column([p.top_p if p.top_p < 1.0 else float("inf") for p in params], probs.dtype)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = sorted_probs.cumsum(-1) - sorted_probs >= cut
        dropped = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, order, drop)
        probs = probs.masked_fill(dropped, 0.0)
    cdf = probs.cumsum(-1, dtype=_exact(device))
    total = cdf[:, -1]
    usable = (torch.isfinite(total) & (total > 0)).tolist()  # a NaN or inf reaches the total
    # the first entry whose cumulative mass passes u·total: never a zero-probability entry
    target = (uniform.to(cdf.dtype) * total).unsqueeze(1)
    picks = torch.searchsorted(cdf, target, right=True).clamp_(max=vocab - 1)
    # u·total rounded up to the total lands past the last entry with mass: take that entry
    landed = probs.gather(1, picks).squeeze(1) > 0
    outcomes: list[int | str] = []
    for row, (pick, ok, fine) in enumerate(
        zip(picks.squeeze(1).tolist(), landed.tolist(), usable, strict=True)
    ):
        if not fine:
            outcomes.append(
                f"temperature {params[row].temperature} leaves no distribution to draw from"
            )
        else:
            outcomes.append(pick if ok else int(probs[row].nonzero()[-1]))
    return outcomes


def _exact(device: torch.device) -> torch.dtype:
    """The cumulative sum's type: float64 where it is cheap; accelerators may lack it."""
    return torch.float64 if device.type == "cpu" else torch.float32


def _uniform(
    generator: torch.Generator | None, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """One number in [0, 1) from ``generator`` (the default one when None), on ``device``."""
    where = generator.device if generator is not None else device
    return torch.rand(1, dtype=dtype, generator=generator, device=where).to(device)
