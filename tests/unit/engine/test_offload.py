"""Weight offload on CPU: static plans at several budgets generate exactly what the
all-resident engine generates (float and W8A16, Llama and Qwen2), the weight ledger never
passes the budget, the spill file (disk tier) and the host pool both serve pieces, and
budgets that cannot hold the fixed weights and slots are refused with the numbers."""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from tests.support.adaptive_offload import calm_until_restored, quick_policy, run_under_pressure
from tests.support.greedy_reference import random_prompts
from tests.support.parallel_llm import EXACT_KV

from brook_engine import LLM, SamplingParams
from brook_engine.config import ConfigError
from brook_engine.layers import cpu_kernels, cpu_matmul
from brook_engine.layers.linear import Linear
from brook_engine.metrics.prometheus import EngineMetrics
from brook_engine.offload import tiers
from brook_engine.offload.plan import GIB, aligned
from brook_engine.offload.streamer import WeightStreamer

NEW = 24


def _engine(folder: Path, **options: Any) -> LLM:
    return LLM(
        str(folder), dtype="float32", device="cpu", kv_cache=EXACT_KV, progress=False, **options
    )


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def _weights(llm: LLM) -> int:
    return int(llm.engine.runner.weight_bytes)


def _held_weight_bytes(llm: LLM) -> int:
    """Bytes of every weight tensor the model holds, counted from the tensors themselves
    (each storage once: slot views are one slot), independently of the ledger. Pieces read
    in place from the mapped spill file count as what of it is mapped in, not as the file's
    size: the kernel's count of the mapping's pages (/proc/self/smaps) must be no more than
    the pages of the pieces the streamer mapped in, and those pieces count at their bytes
    (a page's unused tail is the kernel's rounding, as malloc's is for other tensors)."""
    model = llm.engine.runner.model
    seen: dict[int, int] = {}
    mapped = getattr(model.streamer, "mapped", None)
    if mapped is not None:
        start = mapped.base
        in_place = range(start, start + mapped.length)
        sizes = [mapped.offsets[key][1] for key in model.streamer.mapped_in()]  # settled
        pages = sum(aligned(n, mmap.PAGESIZE) for n in sizes)
        assert 0 <= mapped.resident_bytes() <= pages
        seen[start] = sum(sizes)

    def count(t: object) -> None:
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            return
        if t.is_mkldnn:
            seen[id(t)] = t.numel() * t.element_size()
        elif mapped is not None and t.untyped_storage().data_ptr() in in_place:
            return  # counted above, as pages mapped in
        else:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()

    for module in model.modules():
        for tensor in module._parameters.values():
            count(tensor)
        for name in ("packed", "one_row"):
            count(module.__dict__.get(name))
        for holder in (module.__dict__.get("tiled"), module.__dict__.get("quantized")):
            if holder is not None:
                for name in ("packed", "scales", "bias", "q", "scale"):
                    count(getattr(holder, name, None))
                tiled = getattr(holder, "tiled", None)
                if tiled is not None:
                    for name in ("packed", "scales", "bias"):
                        count(getattr(tiled, name, None))
    streamer = model.streamer
    if streamer is not None:
        for ring in streamer.rings:
            for slot in ring.slots:
                count(slot)
    return sum(seen.values())


def _all_resident(model: Path, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    """The all-resident engine's tokens for ``prompts`` and its weight bytes."""
    reference = _engine(model)
    try:
        return _generate(reference, prompts), _weights(reference)
    finally:
        reference.close()


def _runner(llm: LLM) -> Any:
    return llm.engine.runner


def _assert_streamed_in_brooks_layout(llm: LLM) -> None:
    """Float32 pieces stream in Brook's packed layout (a slot holds a plain tensor's bytes,
    which it is), so they multiply with the same kernel as resident ones."""
    if cpu_kernels.library() is None:
        return  # no kernels, no packing: the plain layout streams
    offload = _runner(llm).model.offload
    layers = _runner(llm).model.model.layers
    assert offload.streamed
    for layer, kind in offload.streamed:
        part = layers[layer].self_attn if kind == "attention" else layers[layer].mlp
        weights = [m.weight for m in part.modules() if isinstance(m, Linear)]
        assert weights and all(cpu_matmul.is_packed(w) for w in weights), (layer, kind)


@pytest.fixture(scope="module")
def deep_llama(make_tiny_model: Any) -> Path:
    return make_tiny_model("llama", num_hidden_layers=20, intermediate_size=512)  # type: ignore[no-any-return]


@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.2])
@pytest.mark.parametrize("quantization", [None, "w8a16"])
def test_static_offload_generates_what_resident_weights_do(
    deep_llama: Path, fraction: float, quantization: str | None
) -> None:
    quant = {"quantization": {"weights": quantization}} if quantization else {}
    prompts = random_prompts(320, [5, 17, 40], seed=3)
    reference = _engine(deep_llama, **quant)
    expected = _generate(reference, prompts)
    expected_single = _generate(reference, [prompts[1]])
    total = _held_weight_bytes(reference)
    reference.close()
    budget = total * fraction
    llm = _engine(
        deep_llama,
        offload={"policy": "static", "device_memory_limit_gb": budget / GIB},
        **quant,
    )
    try:
        runner = _runner(llm)
        plan = runner.offload_plan
        if fraction < 1.0:
            assert plan.streamed, "a budget below the weights streams some pieces"
        else:
            assert not plan.streamed
            assert plan.device_bytes == total  # the torch-free plan counts what loads
        assert _held_weight_bytes(llm) <= budget  # counted from the tensors, not the ledger
        if fraction < 1.0 and quantization is None:
            _assert_streamed_in_brooks_layout(llm)
        assert _generate(llm, prompts) == expected
        assert _generate(llm, [prompts[1]]) == expected_single  # one sequence: decode_row
    finally:
        llm.close()


def test_ledger_holds_the_budget_every_step_and_transfers_are_counted(deep_llama: Path) -> None:
    reference = _engine(deep_llama)
    total = _weights(reference)
    reference.close()
    budget = 0.3 * total
    threads = torch.get_num_threads()
    llm = _engine(deep_llama, offload={"policy": "static", "device_memory_limit_gb": budget / GIB})
    try:
        # the spill file is read in place, not copied: no core is given up to the copy thread
        assert torch.get_num_threads() == threads
        runner = _runner(llm)
        streamer = runner.model.streamer
        assert isinstance(streamer, WeightStreamer)
        assert streamer.spill is not None  # on CPU the streamed pieces come from disk
        assert streamer.mapped is not None
        start = streamer.mapped.base
        for ring in streamer.rings:  # every piece's bytes are its own pages of the file
            assert all(s is None for s in ring.slots)
            for window in ring.windows:
                assert window is not None
                assert start <= window.data_ptr() < start + streamer.mapped.length
        engine = llm.engine
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        for i, prompt in enumerate(random_prompts(320, [7, 30, 12, 3], seed=5)):
            engine.add_request(f"r{i}", prompt, params)
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
            assert _held_weight_bytes(llm) <= budget
        assert steps >= 40
        stats = streamer.snapshot()
        assert stats.transfers >= steps * len(runner.offload_plan.streamed) // 2
        assert stats.bytes > 0 and stats.transfer_seconds > 0
        assert 0.0 <= stats.hidden_ratio <= 1.0
        assert stats.out_of_turn == 0  # every piece was on its way before its layer asked
        reported = engine.stats()  # what /metrics serves
        assert reported.offload_weight_bytes["streamed"] > 0
        assert (
            0
            < reported.offload_weight_bytes["resident"] + reported.offload_weight_bytes["slots"]
            <= budget
        )
        assert reported.offload_transfer_seconds_total > 0
        registry = CollectorRegistry()
        EngineMetrics(registry, {"model": "m"}).record(reported)
        text = generate_latest(registry).decode()
        assert 'brook_engine_offload_weight_bytes{where="streamed"}' in text
        assert "brook_engine_offload_transfer_exposed_seconds_total" in text
    finally:
        llm.close()
    assert torch.get_num_threads() == threads


def test_host_pool_tier_serves_pieces_too(deep_llama: Path) -> None:
    """The tier accelerators stream from (pinned host memory), run on CPU: with a pool that
    holds half the streamed pieces, the rest come from the spill file."""
    prompts = random_prompts(320, [9, 21], seed=4)
    threads = torch.get_num_threads()
    expected, total = _all_resident(deep_llama, prompts)
    llm = _engine(
        deep_llama,
        offload={
            "policy": "static",
            "device_memory_limit_gb": 0.4 * total / GIB,
            "cpu_memory_pool_gb": 0.2 * total / GIB,
        },
    )
    try:
        plan = _runner(llm).offload_plan
        assert 0 < plan.host_pieces < len(plan.streamed)
        # pool pieces are copied into slots: one core is left to the copy thread
        assert torch.get_num_threads() == max(1, threads - 1)
        rings = _runner(llm).model.streamer.rings
        assert any(w is None for r in rings for w in r.windows)  # copied from the pool
        assert any(w is not None for r in rings for w in r.windows)  # read in place
        assert _generate(llm, prompts) == expected
    finally:
        llm.close()
    assert torch.get_num_threads() == threads


def test_a_spill_file_that_cannot_be_mapped_is_copied_instead(
    deep_llama: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A filesystem that refuses mmap (nothing here refuses it, so the mapping call is made
    to fail): pieces are read into slots by the copy thread, on a core of its own, and the
    tokens are the same."""
    prompts = random_prompts(320, [9, 21], seed=4)
    threads = torch.get_num_threads()
    expected, total = _all_resident(deep_llama, prompts)

    def refuse(fd: int, length: int) -> int:
        raise OSError(19, "No such device")

    monkeypatch.setattr(tiers, "_map_aligned", refuse)
    with caplog.at_level("WARNING", logger="brook_engine.offload.state"):
        llm = _engine(
            deep_llama, offload={"policy": "static", "device_memory_limit_gb": 0.4 * total / GIB}
        )
    try:
        streamer = _runner(llm).model.streamer
        assert streamer.mapped is None
        assert all(slot is not None for ring in streamer.rings for slot in ring.slots)
        assert torch.get_num_threads() == max(1, threads - 1)
        assert "cannot be mapped" in caplog.text and "BROOK_OFFLOAD_DIR" in caplog.text
        assert _generate(llm, prompts) == expected
    finally:
        llm.close()
    assert torch.get_num_threads() == threads


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_plan_counts_what_a_tied_model_loads(make_tiny_model: Any, dtype: str) -> None:
    """A tied LM head (on CPU a packed copy beside the embedding where weights are packed)
    and both dtypes: the torch-free plan's bytes are the bytes the tensors hold."""
    folder = make_tiny_model("llama", num_hidden_layers=4, tie_word_embeddings=True)
    llm = LLM(
        str(folder),
        dtype=dtype,
        device="cpu",
        kv_cache=EXACT_KV,
        progress=False,
        offload={"policy": "static", "device_memory_limit_gb": 1},
    )
    try:
        plan = _runner(llm).offload_plan
        assert not plan.streamed
        assert plan.device_bytes == _held_weight_bytes(llm)
    finally:
        llm.close()


def test_qwen2_with_biases_streams_exactly(make_tiny_model: Any) -> None:
    folder = make_tiny_model("qwen2", num_hidden_layers=10, intermediate_size=384)
    prompts = random_prompts(320, [6, 25], seed=8)
    reference = _engine(folder)
    expected = _generate(reference, prompts)
    total = _weights(reference)
    reference.close()
    llm = _engine(folder, offload={"policy": "static", "device_memory_limit_gb": 0.5 * total / GIB})
    try:
        assert _runner(llm).offload_plan.streamed
        assert _generate(llm, prompts) == expected
    finally:
        llm.close()


def test_a_budget_below_the_fixed_weights_and_slots_is_refused(deep_llama: Path) -> None:
    with pytest.raises(ConfigError, match=r"deviceMemoryLimitGb: .* cannot hold rank 0's fixed"):
        _engine(deep_llama, offload={"policy": "static", "device_memory_limit_gb": 1e-6})


@pytest.mark.parametrize(("quantization", "fraction"), [(None, 1.0), ("w8a16", 1.0), (None, 0.5)])
def test_adaptive_moves_weights_out_under_kv_pressure_and_back_after(
    deep_llama: Path, quantization: str | None, fraction: float
) -> None:
    """From a budget that holds every weight and from one that streams half of them; W8A16
    too (its tiled weights are what the one-row kernel reads, so its per-layer plans must
    follow pieces that move)."""
    quant = {"quantization": {"weights": quantization}} if quantization else {}
    prompts = random_prompts(320, [20, 33, 17, 28, 40, 25, 31, 22], seed=9)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    reference = _engine(deep_llama, **quant)
    expected = _generate(reference, prompts)
    expected_single = [_generate(reference, [p])[0] for p in prompts[:2]]
    total = _held_weight_bytes(reference)
    reference.close()
    kv = {**EXACT_KV, "num_blocks": 8}  # 128 tokens: two or three of these requests at once
    llm = LLM(
        str(deep_llama),
        dtype="float32",
        device="cpu",
        kv_cache=kv,
        max_model_len=128,
        progress=False,
        offload={"policy": "adaptive", "device_memory_limit_gb": fraction * total / GIB},
        **quant,
    )
    try:
        engine = llm.engine
        policy = quick_policy(engine)
        ledger = engine.runner.model.offload.ledger
        planned = list(engine.runner.model.offload.streamed)
        assert bool(planned) == (fraction < 1.0)  # the static plan adaptive starts from

        def held() -> int:
            return _held_weight_bytes(llm)

        got, most_blocks = run_under_pressure(engine, prompts, params, held, ledger.budget)
        assert got == expected
        assert policy.counters.offloaded >= 1 and most_blocks > 8  # weights out, KV in
        assert len(engine.runner.model.offload.streamed) > len(planned) or policy.counters.restored
        if quantization is None and engine.runner.model.offload.streamed:
            _assert_streamed_in_brooks_layout(llm)  # evicted pieces too
        # pressure gone: one short request at a time, until every piece is back
        calm_until_restored(engine, prompts[0][:5], held, ledger.budget)
        assert policy.counters.restored == policy.counters.offloaded
        assert engine.block_manager.num_blocks == 8
        assert sorted(engine.runner.model.offload.streamed) == sorted(planned)
        # and it still computes the same, one sequence at a time (the one-row kernel's plans
        # were built during the calm phase, before the last pieces came back)
        assert [_generate(llm, [p])[0] for p in prompts[:2]] == expected_single
    finally:
        llm.close()
