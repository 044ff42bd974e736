"""Sections that tune how the engine runs: weights quantization, shape buckets, MoE routing
and the scheduler."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from brook_engine.config.base import Section


class QuantizationConfig(Section):
    """Weight quantization."""

    weights: Literal["none", "w8a16"] = "none"
    """none: weights in the model dtype. w8a16: int8 weights with per-channel scales,
    activations in the model dtype."""

    group_size: int | None = Field(default=None, ge=32, le=4096, multiple_of=32)
    """w8a16: a scale per output channel and group of this many input channels (a multiple
    of 32 dividing every projection's input width, e.g. 32 or 64) instead of one per
    channel: better quality for 1/group_size more bytes. Unset: one scale per channel. A
    quantized checkpoint's own grouping is used; a different one here is an error."""


class ShapePattern(Section):
    """A request shape the engine compiles for ahead of traffic."""

    input_len: int = Field(ge=1, le=1_048_576)
    """Prompt tokens."""

    output_len: int = Field(ge=1, le=1_048_576)
    """Generated tokens."""


class ShapesConfig(Section):
    """Shape buckets and the compiled-kernel cache."""

    mode: Literal["eager", "compile"] = "eager"
    """eager: run kernels as they come. compile: pad each step to a token bucket (1, 2, 4, ...
    up to scheduler.maxNumBatchedTokens) and run the decoder layers as a graph compiled for
    that bucket (Inductor on CPU and CUDA, torchair's graph mode on NPU); a bucket without a
    graph runs eager."""

    patterns: list[ShapePattern] = Field(default_factory=list, max_length=64)
    """compile: registered (inputLen, outputLen) patterns. The buckets they imply (their
    prefill chunks, and decode steps of 1 up to scheduler.maxNumSeqs sequences) are compiled
    before the engine is ready. Without patterns every bucket is."""

    kernel_cache_size: int = Field(default=32, ge=1, le=4096)
    """compile: compiled graphs held; the least recently used is dropped beyond this."""

    online_learning: bool = False
    """compile: a bucket that ran eager for 8 steps is compiled on a background thread and
    swapped in between steps (steps never wait for it)."""

    cache_dir: str | None = Field(default=None, min_length=1, max_length=4096)
    """compile: a folder (the model volume, a PVC) where compiled artifacts persist across
    processes, so a new replica loads its graphs instead of compiling them; fill it ahead
    with ``brook-engine compile --config FILE``. A stale or foreign cache in it is ignored
    with a warning. Unset: compile into a private temporary folder."""

    one_row_weights: Literal["model", "fp32", "bf16", "fp16"] = "model"
    """Weights a product with one row reads (every layer of a step decoding one sequence; the LM
    head over one sampled row). On CPU, where the weights are packed for batches in oneDNN's
    layout, a plain copy of every linear layer for Brook's one-row kernel, which streams it at
    about 1.2x (float32) to 1.5x (bfloat16) the rate of the packed weights and lets a decoder
    layer run as one kernel call, for the weights' memory once more: fp32, the values of a
    float32 model (float32 weights in Brook's own layout need no copy); bf16, the values of a
    bfloat16 model; fp16, an FP16 copy of a bfloat16 model (the same bytes). Refused at load: a
    copy of another type than the model's, one on an accelerator, and one that would keep
    nothing (weights already plain, as BF16 on CPUs without native BF16, or all float32 in
    Brook's layout)."""


class MoEConfig(Section):
    """Mixture-of-experts routing (Mixtral, Qwen2-MoE, Qwen3-MoE); a dense model refuses
    settings other than the defaults."""

    top_k: int | None = Field(default=None, ge=1, le=64)
    """Experts per token; defaults to the model's own (num_experts_per_tok). Another value
    changes what the model computes."""

    load_threshold: float = Field(default=1.25, gt=1, le=100)
    """With reroute: the most tokens one expert takes in a step, as a multiple of the
    step's mean (tokens x topK / experts)."""

    reroute: bool = False
    """Load-aware routing: a token whose chosen expert is full goes to its next choice with
    room (never outside its top-k), weights renormalized as the model's family does. Evens
    the experts' (and expert-parallel ranks') work; changes outputs, so it is off unless
    asked for."""


class SchedulerConfig(Section):
    """Continuous batching."""

    max_num_seqs: int = Field(default=256, ge=1, le=65536)
    """Sequences running at once."""

    max_num_batched_tokens: int = Field(default=2048, ge=1, le=1_048_576)
    """Tokens processed per step (the token budget shared by prefill and decode). A
    `brook-engine serve` on CPU whose file leaves it out takes 512 (at least maxNumSeqs), so
    the prompts of a wave get their first tokens sooner; an LLMInference always passes its
    value."""

    chunked_prefill: bool = True
    """Split long prompts across steps so decodes keep flowing."""

    max_waiting_requests: int = Field(default=1024, ge=0, le=1_048_576)
    """Requests queued beyond the running ones; further requests are refused (HTTP 429)."""

    @model_validator(mode="after")
    def _budget_fits_batch(self) -> SchedulerConfig:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"maxNumBatchedTokens ({self.max_num_batched_tokens}) is below maxNumSeqs "
                f"({self.max_num_seqs}): a decode step needs one token per sequence; raise "
                "maxNumBatchedTokens or lower maxNumSeqs"
            )
        return self
