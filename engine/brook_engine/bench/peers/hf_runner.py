"""Hugging Face transformers as a benchmark peer: greedy ``generate`` on a peer workload.

    python -m brook_engine.bench.peers.hf_runner --workload FILE

"single" runs the requests one after another (batch 1); "batch" runs a static batch, left
padded, in sub-batches of at most ``MAX_BATCH`` requests, each decoding ``max_new_tokens`` =
the largest ``max_tokens`` of its sub-batch. Only each request's own ``max_tokens`` count as
its output; the padding rows' extra decode steps show in ``computed_output_tokens``.
The workload and result formats are described in ``brook_engine.bench.peers``.
"""

from __future__ import annotations

import copy
import json
import resource
import sys
import time
from collections.abc import Sequence
from typing import Any

from brook_engine.bench.peers.peer_protocol import (
    Workload,
    machine_busy_ticks,
    other_cpu_frac,
    process_ticks,
    read_workload,
    result_fields,
    summary,
    workload_from_args,
)

MAX_BATCH = 64
# Warm-up covers both code paths: batch 1 and a left-padded batch (its first call is slow).
_WARMUP_BATCHES = ([[1, 2, 3, 4]], [[1, 2, 3, 4], [1, 2]])
_WARMUP_TOKENS = 2


def _log(message: str) -> None:
    print(f"[hf-runner] {message}", file=sys.stderr, flush=True)


def peak_rss_mb() -> float:
    """Peak resident memory of this process, in MiB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _cpu_ticks() -> tuple[int, int]:
    """(ticks every CPU spent busy, ticks this process spent): two /proc readings."""
    return machine_busy_ticks(), process_ticks()


def _useful_length(tokens: Sequence[int], max_tokens: int, eos_ids: set[int]) -> int:
    """How many of ``tokens`` the request receives: up to its budget and its first EOS."""
    for i, token in enumerate(tokens[:max_tokens]):
        if token in eos_ids:
            return i + 1
    return min(len(tokens), max_tokens)


def run(workload: Workload) -> dict[str, Any]:
    import torch
    import transformers
    from transformers.generation.streamers import BaseStreamer

    class _FirstTokenClock(BaseStreamer):
        """Records when ``generate`` emits its first new token (the prompt comes first)."""

        def __init__(self) -> None:
            self.num_puts = 0
            self.first_token_at: float | None = None

        def put(self, value: Any) -> None:
            self.num_puts += 1
            if self.num_puts == 2 and self.first_token_at is None:
                self.first_token_at = time.perf_counter()

        def end(self) -> None:
            pass

    torch.set_num_threads(workload.threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[workload.dtype]

    _log(f"loading {workload.model} ({workload.dtype}, {workload.threads} threads)")
    load_started = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(workload.model), dtype=dtype, attn_implementation="sdpa"
    )  # from_pretrained returns the model in eval mode
    gen_config = model.generation_config
    eos = gen_config.eos_token_id
    eos_ids: set[int] = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
    pad_id = gen_config.pad_token_id
    if pad_id is None:
        pad_id = min(eos_ids) if eos_ids else 0
    gen_config.pad_token_id = pad_id
    gen_config.do_sample = False
    gen_config.num_beams = 1
    for name in ("temperature", "top_p", "top_k"):
        setattr(gen_config, name, None)  # silence "sampling flags set but do_sample=False"
    if workload.ignore_eos:
        # Without an EOS id generate stops only at max_new_tokens: exact output lengths.
        gen_config.eos_token_id = None
        eos_ids = set()

    def generate(
        batch: list[list[int]], max_new_tokens: int, streamer: BaseStreamer | None
    ) -> list[list[int]]:
        width = max(len(p) for p in batch)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)  # [batch, width]
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, prompt in enumerate(batch):  # left padding
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[row, width - len(prompt) :] = 1
        config = copy.deepcopy(gen_config)
        config.max_new_tokens = max_new_tokens
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                generation_config=config,
                streamer=streamer,
            )
        return [row[width:].tolist() for row in out]  # [batch, new tokens]

    for warmup_batch in _WARMUP_BATCHES:
        generate(warmup_batch, _WARMUP_TOKENS, None)
    load_s = time.perf_counter() - load_started
    _log(f"loaded and warmed up in {load_s:.2f} s; mode {workload.mode}")

    num_requests = len(workload.prompts)
    if workload.mode == "single":
        groups = [[i] for i in range(num_requests)]
    else:
        groups = [
            list(range(start, min(start + MAX_BATCH, num_requests)))
            for start in range(0, num_requests, MAX_BATCH)
        ]

    ttft_s: list[float | None] = [None] * num_requests
    token_ids: list[list[int]] = [[] for _ in range(num_requests)]
    output_tokens = 0
    computed_output_tokens = 0
    ticks_before = _cpu_ticks()
    started = time.perf_counter()
    for group in groups:
        prompts = [workload.prompts[i] for i in group]
        budgets = [workload.max_tokens[i] for i in group]
        group_started = time.perf_counter()
        clock = _FirstTokenClock()
        outputs = generate(prompts, max(budgets), clock)
        for i, tokens, budget in zip(group, outputs, budgets, strict=True):
            useful = _useful_length(tokens, budget, eos_ids)
            if workload.ignore_eos and useful != budget:
                raise RuntimeError(f"request {i} got {useful} tokens, expected {budget}")
            output_tokens += useful
            token_ids[i] = tokens[:useful]
            if clock.first_token_at is not None:
                # Single: from the request's own start. Batch: every request arrives at once.
                since = group_started if workload.mode == "single" else started
                ttft_s[i] = clock.first_token_at - since
        computed_output_tokens += sum(len(tokens) for tokens in outputs)
        _log(f"requests {group[0]}..{group[-1]} done, {time.perf_counter() - started:.2f} s")
    elapsed_s = time.perf_counter() - started
    ticks_after = _cpu_ticks()

    result = result_fields(
        "hf",
        transformers.__version__,
        torch.__version__,
        workload,
        output_tokens=output_tokens,
        computed_output_tokens=computed_output_tokens,
        elapsed_s=elapsed_s,
        load_s=load_s,
        ttft_s=ttft_s,
        peak_rss_mb=peak_rss_mb(),
        other_cpu_frac=other_cpu_frac(ticks_before, ticks_after, elapsed_s),
    )
    if workload.return_token_ids:
        result["token_ids"] = token_ids
    return result


def main(argv: Sequence[str] | None = None) -> int:
    path = workload_from_args("Run a peer workload on HF transformers.", argv)
    workload = read_workload(path)
    if workload is None:
        return 2
    result = run(workload)
    _log(summary(result))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
