"""What engine tests compare against: random prompts and transformers' own greedy decoding."""

from __future__ import annotations

from typing import Any

import torch


def random_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Prompts of these lengths of random ids in [3, vocab), the same for a seed."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model: Any, prompt: list[int], new: int) -> list[int]:
    """Greedy decoding with a transformers model, EOS included (no generate() logit rules)."""
    out: list[int] = []
    with torch.no_grad():
        step = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(new):
            out.append(int(step.logits[0, -1].argmax()))
            step = model(
                torch.tensor([[out[-1]]]), past_key_values=step.past_key_values, use_cache=True
            )
    return out
