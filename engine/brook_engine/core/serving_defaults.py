"""What a server (`brook-engine serve`, and the bench's `--mode serve`) takes where its
configuration leaves a choice to Brook.

A server answers people waiting for a first token; the offline API and `bench` want the most
tokens a second. On CPU the two pull the step's token budget apart: a wave of prompts is
prefilled in steps of ``scheduler.maxNumBatchedTokens`` tokens, and every prompt of a step
gets its first token only when the whole step ends. At 2,048 tokens (the offline default) a
wave of 16 prompts of 128 tokens is one step of ~2 s for SmolLM2-135M on two cores, and each
of the 16 waits all of it; at 512 the first four have theirs after a quarter of it, at the
same output rate (docs/performance.md, "A server's token budget on CPU"). vLLM makes the same
split by usage context (4,096 offline, 2,048 for its API server on CPU).

Accelerators prefill 2,048 tokens in milliseconds, so their servers keep the default.
"""

from __future__ import annotations

import logging

from brook_engine.config import EngineConfig
from brook_engine.device import device_kind

log = logging.getLogger(__name__)

CPU_SERVING_BATCHED_TOKENS = 512


def serving_defaults(config: EngineConfig) -> EngineConfig:
    """``config`` with a server's scheduler defaults: on CPU, where
    ``scheduler.maxNumBatchedTokens`` is not set and prompts may be chunked, a budget of 512
    tokens a step (at least ``maxNumSeqs``, which a decode step may need). Anything set
    stays as it is."""
    scheduler = config.scheduler
    if (
        "max_num_batched_tokens" in scheduler.model_fields_set
        or not scheduler.chunked_prefill
        or device_kind(config.device) != "cpu"
    ):
        return config
    budget = max(CPU_SERVING_BATCHED_TOKENS, scheduler.max_num_seqs)
    if budget == scheduler.max_num_batched_tokens:
        return config
    log.info(
        "scheduler.maxNumBatchedTokens is not set: %d tokens a step, a server's default on "
        "CPU (first tokens sooner; %d, the offline default, favours throughput)",
        budget,
        scheduler.max_num_batched_tokens,
    )
    chosen = scheduler.model_copy(update={"max_num_batched_tokens": budget})
    return config.model_copy(update={"scheduler": chosen})
