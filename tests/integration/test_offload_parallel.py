"""Weight offload under tensor and pipeline parallelism (real worker processes, gloo on
loopback): each rank plans its own shard under the per-device budget, and the replica
generates token for token what the all-resident replica generates."""

from __future__ import annotations

import re
from typing import Any

import pytest
from tests.support.adaptive_offload import calm_until_restored, quick_policy, run_under_pressure
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


@pytest.mark.parametrize(
    ("tensor", "pipeline", "weights"), [(2, 1, "none"), (1, 2, "none"), (2, 2, "w8a16")]
)
def test_adaptive_offload_moves_every_ranks_weights_in_step(
    make_tiny_model: Any,
    tensor: int,
    pipeline: int,
    weights: str,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Under KV pressure rank 0 decides and every rank streams more of its own weights
    between the same two steps; the shared block table grows by the fewest blocks any rank
    freed (so it grows only where every rank moved), every rank's cache follows, and all of
    it comes back when the pressure is gone — with the tokens of all-resident weights."""
    folder = make_tiny_model("llama", num_hidden_layers=12, intermediate_size=512)
    prompts = random_prompts(320, [20, 33, 17, 28, 40, 25, 31, 22], seed=9)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kv = {"num_blocks": 8}  # 128 tokens: two or three of these requests at once
    # the 110B example's combination too: W8A16 weights (int8 streams) on TP x PP
    quantization = {"weights": weights}
    reference = parallel_llm(
        folder, tensor, pipeline, kv_cache=kv, max_model_len=128, quantization=quantization
    )
    try:
        outputs = reference.generate(prompts, params, use_tqdm=False)
        expected = [list(o.outputs[0].token_ids) for o in outputs]
        per_rank = reference.engine.runner.weight_bytes
    finally:
        reference.close()
    llm = parallel_llm(
        folder,
        tensor,
        pipeline,
        kv_cache=kv,
        max_model_len=128,
        quantization=quantization,
        offload={"policy": "adaptive", "device_memory_limit_gb": per_rank / GIB},
    )
    try:
        engine = llm.engine
        policy = quick_policy(engine)
        state = engine.runner.model.offload
        assert state is not None and not state.streamed  # the budget holds every weight

        def held() -> int:
            return state.ledger.held

        got, most_blocks = run_under_pressure(engine, prompts, params, held, state.ledger.budget)
        assert got == expected
        # the table grows by the smallest share any rank freed: every rank moved weights
        assert policy.counters.offloaded >= 1 and most_blocks > 8
        # pressure gone: one short request at a time
        calm_until_restored(engine, prompts[0][:5], held, state.ledger.budget)
        assert policy.counters.restored == policy.counters.offloaded
        assert engine.block_manager.num_blocks == engine.runner.num_blocks == 8
        assert not state.streamed
        # and every rank still computes what it did: its cache and weights are back in place
        again = llm.generate(prompts[:3], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in again] == expected[:3]
    finally:
        llm.close()
    # Each worker logged its own moves (the worker processes write to this test's stderr):
    # at least as many out as rank 0 counted (a move that could not grow the cache is undone
    # at once), and each brought back.
    log = capfd.readouterr().err
    for rank in range(1, tensor * pipeline):
        out = re.findall(rf"rank {rank} INFO weight offload \(adaptive\): .* now stream", log)
        back = re.findall(rf"rank {rank} INFO weight offload \(adaptive\): .* resident again", log)
        assert len(out) == len(back) >= policy.counters.offloaded, (rank, log[-3000:])


def test_adaptive_offload_moves_nothing_where_a_rank_cannot_pay(make_tiny_model: Any) -> None:
    """A two-layer first stage cannot stream a piece and still free more than its new ring
    takes: the cache could not grow, so no rank keeps streaming weights for nothing."""
    folder = make_tiny_model("llama", num_hidden_layers=12, intermediate_size=512)
    prompts = random_prompts(320, [20, 33, 17, 28, 40, 25, 31, 22], seed=9)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    layout = {"stage_layers": [2, 10]}
    options: dict[str, Any] = {"kv_cache": {"num_blocks": 8}, "max_model_len": 128}
    reference = parallel_llm(folder, 1, 2, parallel=layout, **options)
    try:
        outputs = reference.generate(prompts, params, use_tqdm=False)
        expected = [list(o.outputs[0].token_ids) for o in outputs]
        budget = 4 * reference.engine.runner.weight_bytes  # holds either stage's weights
    finally:
        reference.close()
    llm = parallel_llm(
        folder,
        1,
        2,
        parallel=layout,
        offload={"policy": "adaptive", "device_memory_limit_gb": budget / GIB},
        **options,
    )
    try:
        policy = quick_policy(llm.engine)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == expected
        assert policy.exhausted  # it tried once, every rank undid it, and it stopped trying
        assert policy.counters.offloaded == 0 and llm.engine.block_manager.num_blocks == 8
    finally:
        llm.close()
