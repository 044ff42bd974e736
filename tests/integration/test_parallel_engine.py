"""Tensor and pipeline parallelism across real processes (gloo on loopback): every layout
generates token for token what the single-process engine and transformers generate, for
single requests and for a mixed batch with chunked prefill and preemption forced on.

Each engine here is rank 0 in this process and starts its other ranks as worker processes,
exactly as ``brook-engine serve`` does in a pod.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.support.parallel_llm import EXACT_KV
from tests.support.parallel_llm import parallel_llm as _engine

from brook_engine import LLM, SamplingParams

NEW_TOKENS = 32


def _prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _hf_greedy(folder: Path, prompts: list[list[int]], new: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            got = model.generate(
                ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0
            )
            outs.append(got[0, len(prompt) :].tolist())
    return outs


def _run(llm: LLM, prompts: list[list[int]], logprobs: bool = False) -> list[Any]:
    params = SamplingParams(
        temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2 if logprobs else None
    )
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


LAYOUTS = [
    # (model, overrides, tensor, pipeline)
    pytest.param("llama", {}, 2, 1, id="llama-tp2"),  # GQA 4:2, untied: 2 heads, 1 KV each
    pytest.param("llama", {}, 1, 2, id="llama-pp2"),
    pytest.param("llama", {}, 2, 2, id="llama-tp2xpp2"),
    # qkv bias, tied embeddings split over the vocabulary, 3 query heads per rank
    pytest.param("qwen2", {}, 2, 1, id="qwen2-tp2"),
    # tied embeddings on a last stage that does not hold the embedding
    pytest.param("qwen2", {}, 1, 2, id="qwen2-pp2"),
    # MQA: one KV head, replicated on both ranks; an odd vocabulary padded on the last rank
    pytest.param("llama", {"num_key_value_heads": 1, "vocab_size": 321}, 2, 1, id="llama-mqa-tp2"),
    # sliding window, odd head count (5): pipeline only
    pytest.param("mistral", {}, 1, 2, id="mistral-pp2"),
]


@pytest.mark.parametrize(("arch", "overrides", "tensor", "pipeline"), LAYOUTS)
def test_parallel_greedy_matches_single_process_and_transformers(
    arch: str,
    overrides: dict[str, Any],
    tensor: int,
    pipeline: int,
    make_tiny_model: Callable[..., Path],
    engines: list[LLM],
) -> None:
    folder = make_tiny_model(arch, num_hidden_layers=4, **overrides)
    vocab = 320 if "vocab_size" not in overrides else int(overrides["vocab_size"])
    singles = _prompts(vocab, [9, 23], seed=1)
    mixed = _prompts(vocab, [3, 38, 11, 25, 1, 17], seed=2)
    reference = _hf_greedy(folder, singles, NEW_TOKENS)

    baseline = LLM(str(folder), dtype="float32", device="cpu", kv_cache=EXACT_KV, progress=False)
    base_single = [_run(baseline, [p], logprobs=True)[0] for p in singles]
    base_mixed = _run(baseline, mixed)
    assert [o.token_ids for o in base_single] == reference  # the baseline is right

    parallel = _engine(folder, tensor, pipeline)
    engines.append(parallel)
    for prompt, base in zip(singles, base_single, strict=True):
        out = _run(parallel, [prompt], logprobs=True)[0]
        assert out.token_ids == base.token_ids
        for mine, theirs in zip(out.logprobs, base.logprobs, strict=True):
            assert mine[0] == pytest.approx(theirs[0], abs=1e-4)
    assert [o.token_ids for o in _run(parallel, mixed)] == [o.token_ids for o in base_mixed]
    engine = parallel.engine
    engine.block_manager.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize(
    ("tensor", "pipeline", "micro_batches", "steps_in_flight"),
    [
        pytest.param(2, 1, None, None, id="tp2"),
        pytest.param(2, 1, 2, None, id="tp2-interleaved"),  # all-reduces behind the other
        pytest.param(1, 2, None, None, id="pp2"),  # a step per stage in flight
        pytest.param(1, 2, 3, None, id="pp2-m3"),
        pytest.param(1, 2, 2, 1, id="pp2-one-step-m2"),  # only micro-batches fill it
        pytest.param(2, 2, None, None, id="tp2xpp2"),
        # more steps in flight than stages: a rank waits for a step's sends only after
        # it ran the later step rank 0 needs it for (tensor peers' all-reduces included)
        pytest.param(2, 2, None, 3, id="tp2xpp2-three-steps"),
    ],
)
def test_mixed_batch_with_chunked_prefill_and_preemption(
    tensor: int,
    pipeline: int,
    micro_batches: int | None,
    steps_in_flight: int | None,
    make_tiny_model: Callable[..., Path],
    engines: list[LLM],
) -> None:
    folder = make_tiny_model("llama", num_hidden_layers=4)
    # 16-token budget: prompts are chunked; 14 blocks of 8 tokens cannot hold six sequences
    # of up to 70 tokens, so sequences are preempted and recomputed.
    options: dict[str, Any] = {
        "kv_cache": {"num_blocks": 14, "block_size": 8},
        "max_num_batched_tokens": 16,
        "max_num_seqs": 8,
        "max_model_len": 96,
    }
    prompts = _prompts(320, [3, 38, 11, 25, 1, 17], seed=3)
    baseline = LLM(
        str(folder),
        dtype="float32",
        device="cpu",
        progress=False,
        **{**options, "kv_cache": {**EXACT_KV, **options["kv_cache"]}},
    )
    expected = [o.token_ids for o in _run(baseline, prompts)]
    assert baseline.engine.scheduler.num_preemptions_total > 0
    par = {"micro_batches": micro_batches, "steps_in_flight": steps_in_flight}
    parallel = _engine(folder, tensor, pipeline, parallel=par, **options)
    engines.append(parallel)
    got = [o.token_ids for o in _run(parallel, prompts)]
    if micro_batches is not None:  # pinned: the schedule ran as asked, never adapted
        assert parallel.engine.runner.micro_batches.micro_batches == micro_batches
    assert parallel.engine.scheduler.num_preemptions_total > 0
    assert got == expected
    assert parallel.engine.block_manager.num_free_blocks == 14


def test_a_pipeline_keeps_a_step_per_stage_in_flight_and_cancels_inside_them(
    make_tiny_model: Callable[..., Path], engines: list[LLM]
) -> None:
    """PP=2 runs two steps at once over disjoint sequences; a request cancelled while its
    step is in flight ends without its late token, frees every block, and the others
    still generate exactly what one process does."""
    folder = make_tiny_model("llama", num_hidden_layers=4)
    prompts = _prompts(320, [5, 12, 7, 20, 9, 3], seed=6)
    baseline = LLM(str(folder), dtype="float32", device="cpu", kv_cache=EXACT_KV, progress=False)
    expected = [o.token_ids for o in _run(baseline, prompts)]
    llm = _engine(folder, 1, 2)
    engines.append(llm)
    engine = llm.engine
    assert engine.runner.steps_in_flight == 2
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    in_flight_at_issue: list[int] = []
    issue = engine.runner.issue

    def counting_issue(batch: Any) -> Any:
        in_flight_at_issue.append(len(engine._in_flight) + 1)
        return issue(batch)

    engine.runner.issue = counting_issue  # type: ignore[method-assign]
    done: dict[str, Any] = {}
    cancelled: Any = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
        held = [s for batch, _ in engine._in_flight for s in batch.seqs]
        if cancelled is None and held and held[0].num_output_tokens >= 3:
            cancelled = held[0]
            tokens_at_cancel = cancelled.num_output_tokens
            assert cancelled.in_flight
            assert engine.abort_request(cancelled.request_id)
    assert max(in_flight_at_issue) == 2
    assert cancelled is not None and cancelled.request_id not in done
    assert cancelled.num_output_tokens == tokens_at_cancel  # its late token was dropped
    assert cancelled.finish_reason == "abort"
    engine.block_manager.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    for i, want in enumerate(expected):
        if f"r{i}" != cancelled.request_id:
            assert done[f"r{i}"].token_ids == want


def test_stage_split_override_and_overlap_counters(
    make_tiny_model: Callable[..., Path], engines: list[LLM]
) -> None:
    """A configured split is honoured, and the pipeline's sends are timed: the replica
    reports communication, a ratio in [0, 1] and compute on both stages."""
    folder = make_tiny_model("llama", num_hidden_layers=4)
    llm = _engine(folder, 1, 2, parallel={"stage_layers": [3, 1], "micro_batches": 4})
    engines.append(llm)
    runner = llm.engine.runner
    assert (runner.layer_start, runner.layer_end) == (0, 3)
    assert len(runner.model.model.layers) == 3
    assert runner.model.lm_head is None  # the head lives on the last stage
    prompts = _prompts(320, [20] * 8, seed=4)
    for _ in range(3):  # enough steps for a report (every 8 steps)
        _run(llm, prompts)
    stats = llm.engine.stats()
    assert stats.comm_seconds_total["p2p"] > 0
    assert 0.0 <= stats.comm_compute_overlap <= 1.0
    assert all(seconds > 0 for seconds in stats.stage_compute_seconds_total)
    assert len(stats.stage_compute_seconds_total) == 2
    assert stats.micro_batches == 4  # pinned: never adapted


def test_an_idle_offline_engine_outlives_the_collective_timeout(
    make_tiny_model: Callable[..., Path], engines: list[LLM]
) -> None:
    """Workers wait for the next step plan without a deadline (only collectives inside a
    step have one), so an offline engine left idle longer than timeoutSeconds still runs."""
    import time

    folder = make_tiny_model("llama", num_hidden_layers=4)
    llm = _engine(folder, 2, 1, parallel={"timeout_seconds": 2})
    engines.append(llm)
    prompts = _prompts(320, [9], seed=5)
    first = [o.token_ids for o in _run(llm, prompts)]
    time.sleep(3.5)
    assert [o.token_ids for o in _run(llm, prompts)] == first


def test_int8_kv_is_fitted_per_rank_and_matches_one_process(
    make_tiny_model: Callable[..., Path], engines: list[LLM]
) -> None:
    """INT8 KV under TP=2 × PP=2: each rank calibrates its own layers and KV heads (means,
    weights, scales per head, so they are the ones a single process fits for those heads),
    and the replica decodes as one process with the same policy does."""
    folder = make_tiny_model("llama", num_hidden_layers=4)
    int8 = {
        "layer_policies": [{"start": 0.0, "end": 1.0, "dtype": "int8"}],
        "dynamic_precision": {"enabled": False},
    }
    prompts = _prompts(320, [9, 23, 14], seed=3)
    single = LLM(str(folder), dtype="float32", device="cpu", kv_cache=int8, progress=False)
    assert single.engine.runner.layer_kinds == ["int8"] * 4
    expected = [o.token_ids for o in _run(single, prompts)]
    parallel = _engine(folder, 2, 2, kv_cache=int8)
    engines.append(parallel)
    assert parallel.engine.runner.replica.layer_kinds == ["int8"] * 4
    assert [o.token_ids for o in _run(parallel, prompts)] == expected
    assert parallel.engine.runner.kv_bytes_per_token == single.engine.runner.kv_bytes_per_token


@pytest.mark.parametrize(
    ("arch", "tensor", "pipeline", "group_size", "gptq"),
    [
        # row-parallel o/down: whole-row scales
        pytest.param("llama", 2, 1, None, False, id="llama-tp2"),
        # groups of a row-parallel layer split between the ranks
        pytest.param("llama", 2, 1, 32, False, id="llama-tp2-group32"),
        pytest.param("qwen2", 2, 1, None, False, id="qwen2-tp2"),  # tied head split by vocabulary
        pytest.param("llama", 1, 2, 32, False, id="llama-pp2-group32"),
        # a stored int8 head (vocabulary 320 over 2 ranks); stored groups on two stages
        pytest.param("qwen2", 2, 1, None, True, id="qwen2-tp2-gptq"),
        pytest.param("llama", 1, 2, 32, True, id="llama-pp2-gptq-group32"),
    ],
)
def test_w8a16_under_parallelism_matches_one_process(
    arch: str,
    tensor: int,
    pipeline: int,
    group_size: int | None,
    gptq: bool,
    make_tiny_model: Callable[..., Path],
    engines: list[LLM],
    tmp_path: Path,
) -> None:
    """W8A16 quantizes after sharding with scales per output channel: every rank holds the
    int8 values and scales one process holds for its slice, so TP=2 and PP=2 generate what
    one process generates."""
    from brook_engine.quant.linear import Int8Linear

    # MLP width 128: 64 per tensor rank, two groups of 32 each; a GPTQ folder's stored head
    # over a vocabulary of 321: the second tensor rank's slice ends in a padding row
    vocab = {"vocab_size": 321} if gptq else {}
    folder = make_tiny_model(arch, num_hidden_layers=4, intermediate_size=128, **vocab)
    w8a16 = {"weights": "w8a16", "group_size": group_size}
    if gptq:  # a GPTQ folder: its int8 head is split over the ranks' vocabulary slices
        from brook_engine.convert.w8a16 import quantize_folder

        converted = tmp_path / "gptq"
        quantize_folder(folder, converted, group_size, progress=False, method="gptq")
        folder, w8a16 = converted, {"weights": "w8a16"}
    prompts = _prompts(320, [9, 23, 3, 30], seed=5)
    single = LLM(
        str(folder),
        dtype="float32",
        device="cpu",
        kv_cache=EXACT_KV,
        progress=False,
        quantization=w8a16,
    )
    expected = _run(single, prompts, logprobs=True)
    parallel = _engine(folder, tensor, pipeline, quantization=w8a16)
    engines.append(parallel)
    assert any(isinstance(m, Int8Linear) for m in parallel.engine.runner.model.modules())
    got = _run(parallel, prompts, logprobs=True)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    for mine, theirs in zip(got, expected, strict=True):
        for a, b in zip(mine.logprobs, theirs.logprobs, strict=True):
            assert a[0] == pytest.approx(b[0], abs=1e-4)
