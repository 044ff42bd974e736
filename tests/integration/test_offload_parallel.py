"""Weight offload under tensor and pipeline parallelism (real worker processes, gloo on
loopback): each rank plans its own shard under the per-device budget, and the replica
generates token for token what the all-resident replica generates."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tests.support.greedy_reference import random_prompts

from brook_engine import LLM, SamplingParams
from brook_engine.offload.plan import GIB

EXACT_KV = {
    "layer_policies": [{"start": 0.0, "end": 1.0, "dtype": "auto"}],
    "dynamic_precision": {"enabled": False},
}


def _engine(folder: Path, tensor: int, pipeline: int, **options: Any) -> LLM:
    # two micro-batches: tensor parallelism alone then runs forward_interleaved, a pipeline
    # runs each stage's layers once per micro-batch (both call the streamer's hooks)
    return LLM(
        str(folder),
        dtype="float32",
        device="cpu",
        kv_cache=EXACT_KV,
        progress=False,
        parallel={
            "tensor": tensor,
            "pipeline": pipeline,
            "timeout_seconds": 60,
            "micro_batches": 2,
        },
        **options,
    )


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize(("tensor", "pipeline"), [(2, 1), (1, 2)])
def test_offload_across_ranks_generates_what_resident_weights_do(
    make_tiny_model: Any, tensor: int, pipeline: int
) -> None:
    folder = make_tiny_model("llama", num_hidden_layers=12, intermediate_size=512)
    prompts = random_prompts(320, [6, 30, 11], seed=2)
    reference = _engine(folder, tensor, pipeline)
    try:
        expected = _generate(reference, prompts)
        per_rank = reference.engine.runner.weight_bytes  # rank 0's
    finally:
        reference.close()
    budget = 0.5 * per_rank
    llm = _engine(
        folder,
        tensor,
        pipeline,
        offload={"policy": "static", "device_memory_limit_gb": budget / GIB},
    )
    try:
        runner = llm.engine.runner
        assert runner.offload_plan.streamed
        assert runner.weight_bytes <= budget
        assert _generate(llm, prompts) == expected
    finally:
        llm.close()
