"""The TP=8 NPU example's compile settings (``crds/examples/llama-70b-npu-tp8.yaml``: its
shapes section, scheduler and KV block size as written) on CPU with tensor parallelism
reduced to 2: the configuration path from the manifest to a running replica, whose compiled
graphs reduce across the ranks and give eager's tokens."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from tests.support.examples import ROOT
from tests.support.greedy_reference import random_prompts
from tests.support.parallel_llm import parallel_llm

from brook_engine import SamplingParams

EXAMPLE = ROOT / "crds" / "examples" / "llama-70b-npu-tp8.yaml"


def test_tp8_example_compile_settings_run_on_cpu_with_tp2(
    make_tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    spec = yaml.safe_load(EXAMPLE.read_text())["spec"]
    shapes: dict[str, Any] = dict(spec["shapes"])
    assert shapes["mode"] == "compile" and shapes["patterns"] and shapes["onlineLearning"]
    shapes["cacheDir"] = str(tmp_path / "compile-cache")  # the pod's is its own volume
    settings = {
        "scheduler": spec["scheduler"],
        "kv_cache": {"blockSize": spec["kvCache"]["blockSize"], "numBlocks": 40},
        "max_model_len": 4096,
    }
    folder = make_tiny_model("llama", max_position_embeddings=4096)
    prompts = random_prompts(320, [3, 40, 100, 7], seed=11)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with parallel_llm(folder, 2, 1, **settings) as eager:
        expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    with parallel_llm(folder, 2, 1, shapes=shapes, **settings) as compiled:
        graphs = compiled.engine.runner.graphs
        assert graphs is not None and graphs.spec.reduce and graphs.spec.heads == 2
        # the buckets the example's patterns imply, compiled before ready
        assert sorted(graphs.cache.buckets) == [1, 2, 4, 8, 16, 32, 64, 128, 512, 2048]
        outs = compiled.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        stats = graphs.stats()
        assert stats.hits > 0 and stats.failures == 0


def test_compiled_pipeline_stages_match_eager(
    make_tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    """PP=2: each stage runs its own layers' graphs (the second from received activations)."""
    folder = make_tiny_model("qwen2", num_hidden_layers=4)
    settings: dict[str, Any] = {
        "scheduler": {"max_num_batched_tokens": 32, "max_num_seqs": 8},
        "kv_cache": {"num_blocks": 64},
        "max_model_len": 256,
    }
    shapes = {"mode": "compile", "cache_dir": str(tmp_path / "cache")}
    prompts = random_prompts(320, [5, 40, 12], seed=13)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with parallel_llm(folder, 1, 2, **settings) as eager:
        expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    with parallel_llm(folder, 1, 2, shapes=shapes, **settings) as compiled:
        outs = compiled.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        graphs = compiled.engine.runner.graphs
        assert graphs is not None and graphs.stats().hits > 0
