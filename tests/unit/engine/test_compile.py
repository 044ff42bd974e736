"""Compile mode (``shapes.mode: compile``): buckets, the same greedy tokens as eager through
bucket edges, chunked prefill and preemption, the kernel cache's bound, online learning, the
persistent cache (warm, corrupt, foreign) and the fallback to eager when compiling fails.

Graphs are compiled by Inductor for real (C++ kernels built with the machine's compiler);
token budgets stay small so a test compiles a few buckets of a tiny model. Tests that need
no fresh compilation share one cache folder, as replicas sharing a volume would."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.support.greedy_reference import random_prompts

from brook_engine import LLM, SamplingParams
from brook_engine.compile import graphs as graphs_module
from brook_engine.compile.buckets import bucket_for, pattern_buckets, token_buckets
from brook_engine.compile.graph_cache import GraphCache
from brook_engine.compile.graphs import CompiledLayers
from brook_engine.compile.persistent import MANIFEST
from brook_engine.config import ConfigError
from brook_engine.layers import cpu_kernels, cpu_matmul
from brook_engine.models.decode_row import RowStep

EXACT_KV = {
    "layer_policies": [{"start": 0.0, "end": 1.0, "dtype": "auto"}],
    "dynamic_precision": {"enabled": False},
}
BUDGET = {"max_num_batched_tokens": 32, "max_num_seqs": 8}  # buckets 1, 2, 4, ..., 32


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("compile-cache")


def _llm(folder: Path, shapes: dict[str, Any] | None = None, **options: Any) -> LLM:
    options.setdefault("kv_cache", {**EXACT_KV, "num_blocks": 64})
    options.setdefault("scheduler", BUDGET)
    options.setdefault("max_model_len", 256)
    return LLM(
        str(folder),
        dtype="float32",
        shapes=shapes or {"mode": "eager"},
        progress=False,
        **options,
    )


def row_kernel_runs_here() -> bool:
    """Whether Brook's C kernels (the decoder-layer kernel among them) are built here, with
    the float32 product whose packed layout that kernel reads without copies."""
    return cpu_kernels.enabled() and cpu_matmul.available()


def _graphs(llm: LLM) -> CompiledLayers:
    graphs = llm.engine.runner.graphs
    assert graphs is not None
    return graphs


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = 12) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


# -- buckets and the cache, torch-free ---------------------------------------------------------


def test_buckets_cover_every_step_up_to_the_budget() -> None:
    assert token_buckets(32) == (1, 2, 4, 8, 16, 32)
    assert token_buckets(48) == (1, 2, 4, 8, 16, 32, 48)
    buckets = token_buckets(48)
    assert [bucket_for(n, buckets) for n in (1, 3, 17, 33, 48, 49)] == [1, 4, 32, 48, 48, None]
    # A 40-token prompt under a 32-token budget: chunks of 32 and 8; decodes of 1..4 seqs.
    assert pattern_buckets([(40, 10)], 32, 4) == [1, 2, 4, 8, 32]
    assert pattern_buckets([], 32, 4) == []


def test_graph_cache_drops_the_least_recently_used() -> None:
    cache = GraphCache(2)
    for bucket in (1, 2):
        cache.put(bucket, print)
    assert cache.get(1) is print  # 1 is now the most recent
    assert cache.put(4, print) == [2]
    assert cache.buckets == [1, 4] and cache.evictions == 1
    assert cache.get(2) is None
    assert (cache.hits, cache.misses) == (1, 1)
    with pytest.raises(ValueError):
        GraphCache(0)


def test_compile_settings_are_refused_in_eager_mode(make_tiny_model: Callable[..., Path]) -> None:
    folder = make_tiny_model("llama")
    for shapes, field in (
        ({"patterns": [{"input_len": 8, "output_len": 8}]}, "shapes.patterns"),
        ({"kernel_cache_size": 4}, "shapes.kernelCacheSize"),
        ({"online_learning": True}, "shapes.onlineLearning"),
        ({"cache_dir": "/tmp/x"}, "shapes.cacheDir"),
    ):
        with pytest.raises(ConfigError, match=field + ".*shapes.mode: compile"):
            _llm(folder, {"mode": "eager", **shapes})


# -- the same tokens as eager ------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_compiled_greedy_tokens_match_eager(
    arch: str, make_tiny_model: Callable[..., Path], shared_cache: Path
) -> None:
    folder = make_tiny_model(arch)
    # 1 to 70 tokens: every bucket, prompts past the 32-token budget (chunked prefill), and
    # batches whose decodes share steps with prefill chunks
    prompts = random_prompts(300, [1, 3, 7, 15, 16, 17, 31, 40, 70], seed=1)
    eager = _llm(folder)
    expected = [_greedy(eager, [p]) for p in prompts[:3]], _greedy(eager, prompts)
    compiled = _llm(folder, {"mode": "compile", "cache_dir": str(shared_cache)})
    graphs = _graphs(compiled)
    assert graphs.cache.buckets == [1, 2, 4, 8, 16, 32]  # compiled before the first request
    got = [_greedy(compiled, [p]) for p in prompts[:3]], _greedy(compiled, prompts)
    assert got == expected
    stats = graphs.stats()
    # The single requests' decode steps (one sequence, float32 weights in Brook's layout) run
    # the decoder-layer kernel, not a graph: the prefills and the batch's steps are the hits.
    assert stats.misses == 0 and stats.hits > 15 and stats.failures == 0
    reported = compiled.engine.stats()  # what /metrics serves
    assert (reported.compiled_graphs, reported.compile_hits_total) == (6, stats.hits)
    cold = reported.cold_start_seconds
    assert 0 < cold["ready"] <= cold["first_token"]


def test_compiled_tokens_match_eager_under_preemption(
    make_tiny_model: Callable[..., Path], shared_cache: Path
) -> None:
    folder = make_tiny_model("llama")
    prompts = random_prompts(300, [20, 25, 30, 12, 9, 28], seed=2)
    # 12 blocks of 16 tokens for six sequences growing to ~50 tokens: preemption is certain
    small = {"kv_cache": {**EXACT_KV, "num_blocks": 12}, "max_model_len": 64}
    expected = _greedy(_llm(folder, **small), prompts, max_tokens=24)
    compiled = _llm(folder, {"mode": "compile", "cache_dir": str(shared_cache)}, **small)
    assert _greedy(compiled, prompts, max_tokens=24) == expected
    assert compiled.engine.scheduler.num_preemptions_total > 0
    assert _graphs(compiled).stats().misses == 0


# -- the kernel cache's bound and online learning ----------------------------------------------


@pytest.fixture
def learn_fast(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(graphs_module, "ONLINE_AFTER", 2)
    yield


def test_cache_bound_holds_under_a_shape_sweep(
    make_tiny_model: Callable[..., Path], shared_cache: Path, learn_fast: None
) -> None:
    folder = make_tiny_model("llama")
    shapes = {
        "mode": "compile",
        "cache_dir": str(shared_cache),
        "patterns": [{"input_len": 3, "output_len": 4}],  # buckets 1..8 (decodes of 8 seqs)
        "kernel_cache_size": 2,
        "online_learning": True,
    }
    compiled = _llm(folder, shapes)
    graphs = _graphs(compiled)
    assert len(graphs.cache) == 2  # two of the four registered, the rest left to learning
    eager = _llm(folder)
    for length in (3, 9, 20, 5, 30, 12, 1):
        prompts = random_prompts(300, [length] * 3, seed=length)
        assert _greedy(compiled, prompts, 6) == _greedy(eager, prompts, 6)
        graphs.wait_for_pending(timeout=120)
        assert len(graphs.cache) <= 2
    stats = graphs.stats()
    assert stats.evictions > 0 and stats.failures == 0


def test_online_learning_compiles_a_hot_bucket(
    make_tiny_model: Callable[..., Path], shared_cache: Path, learn_fast: None
) -> None:
    folder = make_tiny_model("qwen2")
    shapes = {
        "mode": "compile",
        "cache_dir": str(shared_cache),
        "patterns": [{"input_len": 2, "output_len": 4}],  # buckets 1, 2: decodes of 1-2
        "online_learning": True,
    }
    one_at_a_time = {"scheduler": {"max_num_batched_tokens": 32, "max_num_seqs": 2}}
    compiled = _llm(folder, shapes, **one_at_a_time)
    graphs = _graphs(compiled)
    assert graphs.cache.buckets == [1, 2]
    prompts = random_prompts(300, [20, 21, 19], seed=3)  # 20-token prefills: bucket 32
    expected = [_greedy(_llm(folder), [p], 4)[0] for p in prompts]
    for prompt, tokens in zip(prompts, expected, strict=True):
        assert _greedy(compiled, [prompt], 4) == [tokens]
    graphs.wait_for_pending(timeout=120)
    assert 32 in graphs.cache.buckets
    before = graphs.stats()
    fresh = random_prompts(300, [20, 21, 19], seed=6)  # new prompts: no prefix is cached
    expected = [_greedy(_llm(folder), [p], 4)[0] for p in fresh]
    assert [_greedy(compiled, [p], 4)[0] for p in fresh] == expected
    after = graphs.stats()
    assert after.misses == before.misses  # every step now hits
    assert after.hit_rate > before.hit_rate


# -- the persistent cache and failures ---------------------------------------------------------


def test_corrupt_or_foreign_cache_is_ignored(
    make_tiny_model: Callable[..., Path],
    shared_cache: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    folder = make_tiny_model("llama")
    prompts = random_prompts(300, [5, 18], seed=4)
    expected = _greedy(_llm(folder), prompts)
    first = _llm(folder, {"mode": "compile", "cache_dir": str(shared_cache)})
    engine_folder = _graphs(first).cache_dir
    # a copy of a good cache with damaged artifacts, a foreign folder beside it
    damaged = tmp_path / "cache"
    target = damaged / engine_folder.name
    target.mkdir(parents=True)
    (target / MANIFEST).write_text((engine_folder / MANIFEST).read_text())
    for artifact in engine_folder.glob("layer-*.bin"):
        (target / artifact.name).write_bytes(b"not an artifact")
    (damaged / "0123456789abcdef").mkdir()
    with caplog.at_level(logging.WARNING):
        compiled = _llm(folder, {"mode": "compile", "cache_dir": str(damaged)})
    assert "unreadable" in caplog.text
    assert _greedy(compiled, prompts) == expected
    assert _graphs(compiled).stats().failures == 0
    assert (damaged / "0123456789abcdef").is_dir()  # left alone
    # a manifest that names other facts: the folder is emptied, not trusted
    (target / MANIFEST).write_text('{"torch": "0.0"}')
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        again = _llm(folder, {"mode": "compile", "cache_dir": str(damaged)})
    assert "ignored and emptied" in caplog.text
    assert _greedy(again, prompts) == expected


def test_compile_errors_fall_back_to_eager(
    make_tiny_model: Callable[..., Path],
    shared_cache: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    folder = make_tiny_model("llama")
    prompts = random_prompts(300, [5, 18, 2], seed=5)  # a 25-token step: bucket 32
    single = random_prompts(300, [7], seed=7)  # a 7-token step: bucket 8
    eager = _llm(folder)
    expected = _greedy(eager, prompts), _greedy(eager, single)
    real = graphs_module.compile_layer

    def failing(spec: Any, tokens: int, store: Path | None) -> Any:
        if tokens == 32:
            raise RuntimeError("the C++ compiler is missing")
        graph = real(spec, tokens, store)
        if tokens != 8:
            return graph

        def broken(*args: Any) -> Any:
            raise RuntimeError("a kernel failed at run time")

        return broken

    monkeypatch.setattr(graphs_module, "compile_layer", failing)
    with caplog.at_level(logging.WARNING):
        compiled = _llm(folder, {"mode": "compile", "cache_dir": str(shared_cache)})
        graphs = _graphs(compiled)
        assert 32 not in graphs.cache.buckets and "compiler is missing" in caplog.text
        # both failures serve eager
        assert (_greedy(compiled, prompts), _greedy(compiled, single)) == expected
    assert "failed at run time" in caplog.text
    assert 8 not in graphs.cache.buckets
    assert graphs.stats().failures == 2


# -- with the other engine features ---------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {"quantization": {"weights": "w8a16"}},  # the int8 product inside brook::linear
        {"offload": {"policy": "static", "device_memory_limit_gb": 0.00066}},  # slots swap
        {  # INT8 KV layers: their query and output maps inside brook::attention
            "kv_cache": {
                "layer_policies": [{"start": 0.0, "end": 1.0, "dtype": "int8"}],
                "dynamic_precision": {"enabled": False},
                "num_blocks": 64,
            }
        },
    ],
    ids=["w8a16", "offload", "int8-kv"],
)
def test_compiled_tokens_match_eager_with_w8a16_and_offload(
    options: dict[str, Any], make_tiny_model: Callable[..., Path], shared_cache: Path
) -> None:
    folder = make_tiny_model("qwen2")
    prompts = random_prompts(300, [4, 19, 33], seed=12)
    eager = _llm(folder, **options)
    expected = _greedy(eager, prompts)
    eager.close()
    compiled = _llm(folder, {"mode": "compile", "cache_dir": str(shared_cache)}, **options)
    try:
        if "offload" in options:
            assert compiled.engine.runner.offload_plan.streamed  # some weights do stream
        assert _greedy(compiled, prompts) == expected
        stats = _graphs(compiled).stats()
        assert stats.hits > 0 and stats.failures == 0
    finally:
        compiled.close()


def test_one_sequence_mixes_the_row_kernel_and_the_graph(
    make_tiny_model: Callable[..., Path], shared_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FP8 layers are not the decoder-layer kernel's: a single sequence's step runs them as
    the graph and the others as one kernel call each — eager's tokens all the same."""
    folder = make_tiny_model("llama")
    mixed_kv = {
        "layer_policies": [
            {"start": 0.0, "end": 0.5, "dtype": "fp8_e5m2"},
            {"start": 0.5, "end": 1.0, "dtype": "auto"},
        ],
        "dynamic_precision": {"enabled": False},
        "num_blocks": 64,
    }
    prompts = random_prompts(300, [6, 13], seed=14)
    # float32 weights in Brook's layout: what the decoder-layer kernel reads without copies
    eager = _llm(folder, {"mode": "eager"}, kv_cache=mixed_kv)
    expected = [_greedy(eager, [p]) for p in prompts]
    shapes = {"mode": "compile", "cache_dir": str(shared_cache)}
    compiled = _llm(folder, shapes, kv_cache=mixed_kv)
    kernel_layers = []
    original = RowStep.layer

    def counted(self: RowStep, *args: Any) -> Any:
        done = original(self, *args)
        kernel_layers.append(done is not None)
        return done

    monkeypatch.setattr(RowStep, "layer", counted)
    assert [_greedy(compiled, [p]) for p in prompts] == expected
    assert _graphs(compiled).stats().hits > 20  # the one-token steps ran the graph too
    if row_kernel_runs_here():
        assert any(kernel_layers) and not all(kernel_layers)  # and the kernel the others
