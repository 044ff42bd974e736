"""Brook's engine against Hugging Face transformers' own implementation of the same random
weights: prefill logits, and greedy tokens for single requests and for a mixed batch run with
chunked prefill and preemption forced on."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from brook_engine import LLM, SamplingParams
from support.greedy_reference import hf_greedy, random_prompts

ARCHS = ["llama", "qwen2", "mistral", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe"]
EXACT_KV = {
    "layer_policies": [{"start": 0.0, "end": 1.0, "dtype": "auto"}],
    "dynamic_precision": {"enabled": False},
}


def _reference(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _llm(folder: Path, **options: Any) -> LLM:
    kv = {**EXACT_KV, **options.pop("kv_cache", {})}
    return LLM(str(folder), dtype="float32", kv_cache=kv, progress=False, **options)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match(arch: str, make_tiny_model: Callable[..., Path]) -> None:
    folder = make_tiny_model(arch)
    reference = _reference(folder)
    llm = _llm(folder, kv_cache={"num_blocks": 64, "block_size": 8})
    for prompt in random_prompts(reference.config.vocab_size, [1, 7, 40]):
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0]
        got = llm.engine.prompt_logits(prompt)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_single_request_greedy_is_identical(
    arch: str, make_tiny_model: Callable[..., Path]
) -> None:
    folder = make_tiny_model(arch)
    reference = _reference(folder)
    llm = _llm(folder, kv_cache={"num_blocks": 64, "block_size": 8})
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    for prompt in random_prompts(reference.config.vocab_size, [5, 30], seed=1):
        [out] = llm.generate([prompt], params, use_tqdm=False)
        assert out.outputs[0].token_ids == hf_greedy(reference, prompt, 32)
        assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_batch_with_chunked_prefill_and_preemption(
    arch: str, make_tiny_model: Callable[..., Path]
) -> None:
    folder = make_tiny_model(arch)
    reference = _reference(folder)
    # 16-token budget: prompts are chunked. 14 blocks of 8 tokens cannot hold six sequences
    # of up to 70 tokens: sequences get preempted and recomputed.
    llm = _llm(
        folder,
        kv_cache={"num_blocks": 14, "block_size": 8},
        max_num_batched_tokens=16,
        max_num_seqs=8,
        max_model_len=96,
    )
    prompts = random_prompts(reference.config.vocab_size, [3, 38, 11, 25, 1, 17], seed=2)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions_total > 0
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == hf_greedy(reference, prompt, 32)
    llm.engine.block_manager.check_invariants()
    assert llm.engine.block_manager.num_free_blocks == 14
