"""The KV-cache benchmarks: workloads whose prompts share prefixes, run with the cache
configured two ways, reported side by side.

- ``shared-prefix``: every request is one long system prompt plus its own question; sharing
  off vs on: peak KV memory and time to first token.
- ``zipf-prefix``: requests draw one of many long prefixes with Zipf-distributed popularity;
  a cache of a fifth of the prefixes' blocks; LRU vs LFU hit rates.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from brook_engine.bench.run import BenchReport, greedy_outputs, run_engine
from brook_engine.bench.workload import Workload, prompt_token_ids, random_tokens
from brook_engine.core.llm_engine import LLMEngine
from brook_engine.llm import engine_config_from_options


@dataclass(frozen=True)
class KVBenchResult:
    reports: list[BenchReport]
    summary: dict[str, Any]


def shared_prefix_workload(
    allowed: list[int],
    num_requests: int = 64,
    system_len: int = 1024,
    question_len: int = 64,
    output_len: int = 64,
    seed: int = 0,
) -> Workload:
    rng = random.Random(seed)
    system = random_tokens(rng, allowed, system_len)
    prompts = [system + random_tokens(rng, allowed, question_len) for _ in range(num_requests)]
    return Workload(prompts, [output_len] * num_requests)


def zipf_prefix_workload(
    allowed: list[int],
    num_requests: int = 200,
    num_prefixes: int = 32,
    prefix_len: int = 256,
    suffix_len: int = 16,
    output_len: int = 4,
    exponent: float = 1.1,
    seed: int = 0,
) -> Workload:
    rng = random.Random(seed)
    prefixes = [random_tokens(rng, allowed, prefix_len) for _ in range(num_prefixes)]
    weights = [1 / (rank + 1) ** exponent for rank in range(num_prefixes)]
    prompts = [
        rng.choices(prefixes, weights)[0] + random_tokens(rng, allowed, suffix_len)
        for _ in range(num_requests)
    ]
    return Workload(prompts, [output_len] * num_requests)


def _engine(model: str, options: dict[str, Any], kv: dict[str, Any], progress: bool) -> LLMEngine:
    merged = {**options, "kv_cache": {**(options.get("kv_cache") or {}), **kv}}
    return LLMEngine(engine_config_from_options(model, merged), progress=progress)


def shared_prefix(
    model: str, options: dict[str, Any], num_requests: int, seed: int, progress: bool
) -> KVBenchResult:
    options = {"max_model_len": 2048, **options}
    reports: dict[bool, BenchReport] = {}
    singles: dict[bool, BenchReport] = {}
    workload: Workload | None = None
    for sharing in (False, True):
        engine = _engine(model, options, {"prefix_sharing": {"enabled": sharing}}, progress)
        workload = workload or shared_prefix_workload(
            prompt_token_ids(engine), num_requests=num_requests, seed=seed
        )
        report = run_engine(engine, workload, "batch", progress=progress)
        report.engine = f"brook (sharing {'on' if sharing else 'off'}, all at once)"
        reports[sharing] = report
        # Time to first token as a server sees it at light load: requests one at a time,
        # new questions on the same system prompt (which the batch above left cached).
        questions = shared_prefix_workload(
            prompt_token_ids(engine), num_requests=16, seed=seed + 1, output_len=4
        )
        single = run_engine(engine, questions, "single", progress=progress)
        single.engine = f"brook (sharing {'on' if sharing else 'off'}, one at a time)"
        singles[sharing] = single
        del engine
    off, on = reports[False], reports[True]
    saved = 1 - on.extra["peak_kv_mb"] / off.extra["peak_kv_mb"]
    return KVBenchResult(
        [off, on, singles[False], singles[True]],
        {
            "peak_kv_mb_off": off.extra["peak_kv_mb"],
            "peak_kv_mb_on": on.extra["peak_kv_mb"],
            "kv_memory_saved": saved,
            "ttft_p50_speedup_one_at_a_time": (singles[False].ttft_p50_s or 0)
            / (singles[True].ttft_p50_s or float("inf")),
            "ttft_p50_speedup_all_at_once": (off.ttft_p50_s or 0) / (on.ttft_p50_s or float("inf")),
            "throughput_speedup": on.total_tok_s / off.total_tok_s,
            "prefix_hit_rate": on.extra["prefix_hit_rate"],
        },
    )


def zipf_prefix(
    model: str, options: dict[str, Any], num_requests: int, seed: int, progress: bool
) -> KVBenchResult:
    options = {"max_model_len": 512, **options}
    probe = _engine(model, options, {"num_blocks": 64}, progress=False)
    block = probe.block_manager.block_size
    allowed = prompt_token_ids(probe)
    del probe
    num_prefixes, prefix_len, suffix_len, output_len = 32, 256, 16, 4
    workload = zipf_prefix_workload(
        allowed, num_requests, num_prefixes, prefix_len, suffix_len, output_len, seed=seed
    )
    max_seqs = 4
    per_request = -(-(prefix_len + suffix_len + output_len) // block)
    working_set = num_prefixes * prefix_len // block
    cache_blocks = working_set // 5
    reports = []
    summary: dict[str, Any] = {
        "working_set_blocks": working_set,
        "cache_blocks": cache_blocks,
    }
    for eviction in ("lru", "lfu"):
        engine = _engine(
            model,
            {**options, "max_num_seqs": max_seqs},
            {
                # Room for the running requests plus a cache of 20% of the working set.
                "num_blocks": cache_blocks + max_seqs * per_request,
                "prefix_sharing": {"enabled": True, "eviction": eviction},
            },
            progress,
        )
        report = run_engine(engine, workload, "batch", progress=progress)
        report.engine = f"brook ({eviction})"
        reports.append(report)
        summary[f"hit_rate_{eviction}"] = report.extra["prefix_hit_rate"]
        del engine
    return KVBenchResult(reports, summary)


def _held_out_text(skip_chars: int = 40_000) -> str:
    """Help-topic prose past what calibration reads (it takes the first 20,000 characters)."""
    from pydoc_data.topics import topics

    text = "\n".join(topics[name] for name in sorted(topics))
    return text[skip_chars:]


def long_context(
    model: str, options: dict[str, Any], num_requests: int, seed: int, progress: bool
) -> KVBenchResult:
    """KV bytes per token under the default (calibrated) policy vs FP16, how many
    2,048-token sequences one KV budget holds, and the quality cost: teacher-forced top-1
    agreement and perplexity on held-out text, and where free-running greedy output first
    diverges."""
    import math

    import torch
    import torch.nn.functional as F

    options = {"max_model_len": 2048, **options}
    fp16 = _engine(
        model,
        options,
        {
            "layer_policies": [{"start": 0.0, "end": 1.0, "dtype": "fp16"}],
            "dynamic_precision": {"enabled": False},
        },
        progress,
    )
    policy = _engine(model, options, {}, progress)
    seq_len, budget = 2048, 1 << 30
    text_ids = policy.tokenizer.encode(_held_out_text(), add_special_tokens=False)
    chunk_len, num_chunks = 512, 8
    chunks = [text_ids[i * chunk_len : (i + 1) * chunk_len] for i in range(num_chunks)]

    # Logits come from a float32 LM head here: a 16-bit head rounds logits so coarsely that
    # the reference's top two tie exactly at some positions (a few % on SmolLM2 in bf16),
    # where any change flips an arbitrary tie-break. The agreement with the model-dtype head
    # and the number of such ties are reported beside it.
    def float32_logits(chunk: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        reference, lossy = (e.prompt_logits(chunk, in_float32=True)[:-1] for e in (fp16, policy))
        return reference, lossy

    def top1_agreeing(reference: torch.Tensor, lossy: torch.Tensor) -> int:
        return int((reference.argmax(-1) == lossy.argmax(-1)).sum())

    agree = agree_model_dtype = agree_untied = ties = total = 0
    nll: dict[str, float] = {"fp16": 0.0, "policy": 0.0}
    for chunk in chunks:
        target = torch.tensor(chunk[1:])
        reference, lossy = float32_logits(chunk)
        agree += top1_agreeing(reference, lossy)
        total += len(chunk) - 1
        nll["fp16"] += float(F.cross_entropy(reference, target, reduction="sum"))
        nll["policy"] += float(F.cross_entropy(lossy, target, reduction="sum"))
        coarse_ref, coarse = (e.prompt_logits(chunk)[:-1] for e in (fp16, policy))
        same = coarse_ref.argmax(-1) == coarse.argmax(-1)
        top2 = coarse_ref.topk(2, dim=-1).values
        tied = top2[:, 0] == top2[:, 1]
        agree_model_dtype += int(same.sum())
        agree_untied += int((same & ~tied).sum())
        ties += int(tied.sum())
    ppl = {name: math.exp(value / total) for name, value in nll.items()}
    # The same text as 2 × 2,048 tokens: positions past the 1,024 that calibration reads.
    agree_long = total_long = 0
    for i in range(2):
        chunk = text_ids[i * seq_len : (i + 1) * seq_len]
        agree_long += top1_agreeing(*float32_logits(chunk))
        total_long += len(chunk) - 1
    # Free-running greedy: where does the policy's output first differ from FP16's?
    rng = random.Random(seed)
    starts = [rng.randrange(0, len(text_ids) - 64) for _ in range(max(1, num_requests // 2))]
    prompts = [text_ids[s : s + 64] for s in starts]

    outputs = {
        name: greedy_outputs(e, prompts, 64) for name, e in (("fp16", fp16), ("policy", policy))
    }
    diverge = []
    for a, b in zip(outputs["fp16"], outputs["policy"], strict=True):
        position = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))
        diverge.append(position)
    diverge.sort()
    calibration = policy.runner.calibration
    summary: dict[str, Any] = {
        "kv_bytes_per_token_fp16": fp16.runner.kv_bytes_per_token,
        "kv_bytes_per_token_policy": policy.runner.kv_bytes_per_token,
        "kv_bytes_ratio": policy.runner.kv_bytes_per_token / fp16.runner.kv_bytes_per_token,
        "sequences_2048_in_1GiB_fp16": fp16.sequences_fitting(seq_len, budget),
        "sequences_2048_in_1GiB_policy": policy.sequences_fitting(seq_len, budget),
        "layers_policy": " ".join(policy.runner.layer_kinds),
        "calibration_errors": [None if e is None else round(e, 4) for e in calibration.errors]
        if calibration
        else None,
        "top1_agreement": agree / total,
        "top1_agreement_model_dtype_head": agree_model_dtype / total,
        "top1_agreement_2048_token_chunks": agree_long / total_long,
        "reference_top2_ties_model_dtype_head": ties,
        "top1_agreement_model_dtype_head_untied": agree_untied / max(1, total - ties),
        "perplexity_fp16": ppl["fp16"],
        "perplexity_policy": ppl["policy"],
        "perplexity_increase": ppl["policy"] / ppl["fp16"] - 1,
        "greedy_divergence_median": diverge[len(diverge) // 2],
        "greedy_prompts": len(prompts),
        "teacher_forced_tokens": total,
    }
    summary["sequences_ratio"] = (
        summary["sequences_2048_in_1GiB_policy"] / summary["sequences_2048_in_1GiB_fp16"]
    )
    return KVBenchResult([], summary)
