"""Synthetic workloads: prompts of random token ids with given (or uniformly random) input and
output lengths, reproducible from a seed. Token ids avoid the tokenizer's special tokens."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_tokens)


def parse_length(text: str) -> tuple[int, int]:
    """``128`` → (128, 128); ``32:256`` → (32, 256) (uniform, inclusive)."""
    low, _, high = text.partition(":")
    lo, hi = int(low), int(high or low)
    if not 1 <= lo <= hi:
        raise ValueError(f"length {text!r} must be N or LOW:HIGH with 1 <= LOW <= HIGH")
    return lo, hi


def random_workload(
    num_requests: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab_size: int,
    excluded: set[int],
    seed: int = 0,
) -> Workload:
    rng = random.Random(seed)
    allowed = [t for t in range(vocab_size) if t not in excluded]
    prompts = [
        [rng.choice(allowed) for _ in range(rng.randint(*input_len))] for _ in range(num_requests)
    ]
    max_tokens = [rng.randint(*output_len) for _ in range(num_requests)]
    return Workload(prompts, max_tokens)
