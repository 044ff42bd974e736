"""What rank 0 tells the other ranks each step, and what the sampler sends back (torch-free,
sent as JSON over the control channel: ``parallel.wire``): the sequences' new tokens, where
their KV goes, who samples and how; the sampled tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from brook_engine.sampling_params import SamplingParams

#: "offload_out"/"offload_back": the adaptive weight offload's move, between steps.
PlanKind = Literal["step", "heartbeat", "stop", "offload_out", "offload_back"]


@dataclass(frozen=True)
class SeqChunk:
    """One sequence's share of a step."""

    request_id: str
    token_ids: list[int]  # the tokens computed this step
    start: int  # position of the first of them
    block_table: list[int]
    samples: bool  # the chunk reaches the sequence's end: sample its next token
    params: SamplingParams | None  # set when it samples

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass(frozen=True)
class StepPlan:
    kind: PlanKind
    chunks: list[SeqChunk] = field(default_factory=list)
    micro_batches: int = 1
    released: list[str] = field(default_factory=list)  # requests whose sampler state to drop
    report: bool = False  # reduce the overlap counters at rank 0 after this step
    blocking_sends: bool = False  # send activations synchronously (a benchmark baseline)
    blocks: int = 0  # offload_back: the KV blocks every rank gives back


@dataclass
class SampleResult:
    """The sampler's answer (``layers.sampler.sample``): per sequence its token, logprobs
    and error; what the last stage sends rank 0 for each sampling chunk."""

    token_ids: list[int]
    # Per sequence, when logprobs were asked for: (sampled logprob, {token: logprob} top-n)
    logprobs: list[tuple[float, dict[int, float]] | None]
    # Per sequence, why it could not be sampled (its token is then meaningless); empty: none
    errors: list[str | None] = field(default_factory=list)

    def error(self, row: int) -> str | None:
        return self.errors[row] if self.errors else None


#: What the last stage's sampler sends rank 0 each step: per chunk of the plan, in its
#: order, the sampled result (None for a prefill chunk that does not sample).
StepResults = list[SampleResult | None]


def split_micro_batches(chunks: list[SeqChunk], count: int) -> list[list[SeqChunk]]:
    """Contiguous groups of about equal token counts (at most ``count``, none empty)."""
    if not chunks:
        return []
    count = max(1, min(count, len(chunks)))
    total = sum(len(c.token_ids) for c in chunks)
    groups: list[list[SeqChunk]] = [[]]
    seen = 0
    for i, chunk in enumerate(chunks):
        left_chunks = len(chunks) - i
        left_groups = count - len(groups)
        boundary = total * len(groups) / count
        if groups[-1] and left_groups > 0 and (seen >= boundary or left_chunks <= left_groups):
            groups.append([])
        groups[-1].append(chunk)
        seen += len(chunk.token_ids)
    return groups
