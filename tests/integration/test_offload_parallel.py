"""Weight offload under tensor and pipeline parallelism (real worker processes, gloo on
loopback): each rank plans its own shard under the per-device budget, and the replica
generates token for token what the all-resident replica generates."""

from __future__ import annotations

from typing import Any

import pytest
from tests.support.greedy_reference import random_prompts
from tests.support.parallel_llm import parallel_llm

from brook_engine import LLM, SamplingParams
from brook_engine.offload.plan import GIB


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize(("tensor", "pipeline"), [(2, 1), (1, 2)])
def test_offload_across_ranks_generates_what_resident_weights_do(
    make_tiny_model: Any, tensor: int, pipeline: int
) -> None:
    folder = make_tiny_model("llama", num_hidden_layers=12, intermediate_size=512)
    prompts = random_prompts(320, [6, 30, 11], seed=2)
    # two micro-batches: tensor parallelism alone then runs forward_interleaved, a pipeline
    # runs each stage's layers once per micro-batch (both call the streamer's hooks)
    layout = {"micro_batches": 2}
    reference = parallel_llm(folder, tensor, pipeline, parallel=layout)
    try:
        expected = _generate(reference, prompts)
        per_rank = reference.engine.runner.weight_bytes  # rank 0's
    finally:
        reference.close()
    budget = 0.5 * per_rank
    llm = parallel_llm(
        folder,
        tensor,
        pipeline,
        parallel=layout,
        offload={"policy": "static", "device_memory_limit_gb": budget / GIB},
    )
    try:
        runner = llm.engine.runner
        assert runner.offload_plan.streamed
        assert runner.weight_bytes <= budget
        assert _generate(llm, prompts) == expected
    finally:
        llm.close()
