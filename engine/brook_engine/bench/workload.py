"""Synthetic workloads: prompts of random token ids with given (or uniformly random) input and
output lengths, reproducible from a seed. Token ids avoid the tokenizer's special tokens."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import argparse

    from brook_engine.core.llm_engine import LLMEngine


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


def prompt_token_ids(engine: LLMEngine) -> list[int]:
    """The token ids a synthetic prompt for ``engine`` draws from: its vocabulary less its
    tokenizer's special tokens and its EOS tokens."""
    excluded = engine.tokenizer.special_ids | set(engine.eos_token_ids)
    return [t for t in range(engine.arch.vocab_size) if t not in excluded]


def random_tokens(rng: random.Random, allowed: list[int], n: int) -> list[int]:
    return [rng.choice(allowed) for _ in range(n)]


def random_workload(
    num_requests: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    allowed: list[int],
    seed: int = 0,
) -> Workload:
    rng = random.Random(seed)
    prompts = [random_tokens(rng, allowed, rng.randint(*input_len)) for _ in range(num_requests)]
    max_tokens = [rng.randint(*output_len) for _ in range(num_requests)]
    return Workload(prompts, max_tokens)


def random_workload_for(args: argparse.Namespace, engine: LLMEngine) -> Workload:
    """The ``--num-requests``/``--input-len``/``--output-len`` workload for ``engine``."""
    return random_workload(
        args.num_requests,
        parse_length(args.input_len),
        parse_length(args.output_len),
        prompt_token_ids(engine),
        seed=args.seed,
    )
