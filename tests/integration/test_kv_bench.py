"""The KV-cache benchmarks run end to end (on a tiny model, with small counts) and report
what they promise: sharing saves KV memory and hits, LRU and LFU hit rates, the precision
policy's bytes and quality against FP16."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from brook_engine.bench import kv_workloads


@pytest.fixture(scope="module")
def model(make_tiny_model: Callable[..., Path]) -> str:
    return str(make_tiny_model("llama", max_position_embeddings=2048))


OPTIONS = {"dtype": "float32"}


def test_shared_prefix_saves_memory_and_time_to_first_token(model: str) -> None:
    result = kv_workloads.shared_prefix(model, dict(OPTIONS), 6, seed=0, progress=False)
    summary = result.summary
    assert len(result.reports) == 4
    assert summary["peak_kv_mb_on"] < summary["peak_kv_mb_off"]
    assert summary["kv_memory_saved"] > 0.5  # six copies of 1,024 tokens become one
    assert summary["prefix_hit_rate"] > 0.5
    assert summary["ttft_p50_speedup_one_at_a_time"] > 1


def test_zipf_prefix_reports_both_eviction_policies(model: str) -> None:
    result = kv_workloads.zipf_prefix(model, dict(OPTIONS), 40, seed=0, progress=False)
    summary = result.summary
    assert summary["cache_blocks"] == summary["working_set_blocks"] // 5
    assert 0 < summary["hit_rate_lru"] < 1 and 0 < summary["hit_rate_lfu"] < 1


def test_long_context_compares_the_policy_with_fp16(model: str) -> None:
    summary = kv_workloads.long_context(model, dict(OPTIONS), 4, seed=0, progress=False).summary
    assert summary["kv_bytes_per_token_policy"] <= summary["kv_bytes_per_token_fp16"]
    assert summary["sequences_2048_in_1GiB_policy"] >= summary["sequences_2048_in_1GiB_fp16"]
    assert 0 <= summary["top1_agreement"] <= 1
    assert summary["perplexity_fp16"] > 1 and summary["perplexity_policy"] > 1
    assert 0 <= summary["greedy_divergence_median"] <= 64
