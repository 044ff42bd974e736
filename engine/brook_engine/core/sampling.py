"""Sampling a step's next tokens: one draw over the logits of every chunk that samples, each
seeded request with its own generator, kept across steps until the request ends."""

from __future__ import annotations

import torch

from brook_engine.layers.sampler import SampleResult, sample
from brook_engine.parallel.plan import SeqChunk
from brook_engine.sampling_params import SamplingParams


class ChunkSampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.generators: dict[str, torch.Generator] = {}

    def sample(self, logits: torch.Tensor, chunks: list[SeqChunk]) -> list[SampleResult]:
        """The next token of each of ``chunks`` from its row of ``logits`` [chunks, vocab]."""
        params = [chunk.params or SamplingParams() for chunk in chunks]
        generators = [self._generator(chunk) for chunk in chunks]
        drawn = sample(logits, params, generators)
        return [
            SampleResult(
                [drawn.token_ids[row]],
                [drawn.logprobs[row]],
                [error] if (error := drawn.error(row)) is not None else [],
            )
            for row in range(len(chunks))
        ]

    def release(self, request_id: str) -> None:
        """Forget a request's generator (it ended)."""
        self.generators.pop(request_id, None)

    def _generator(self, chunk: SeqChunk) -> torch.Generator | None:
        params = chunk.params
        if params is None or params.seed is None or params.is_greedy:
            return None
        generator = self.generators.get(chunk.request_id)
        if generator is None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
            self.generators[chunk.request_id] = generator
        return generator
