"""Engine statistics become Prometheus metrics; the names module stays importable without
torch or prometheus_client (the operator reads it)."""

from __future__ import annotations

import subprocess
import sys

from prometheus_client import CollectorRegistry

from brook_engine.metrics import names
from brook_engine.metrics.prometheus import EngineMetrics
from brook_engine.metrics.stats import EngineStats, FinishedRequestStats


def stats(**fields: object) -> EngineStats:
    values: dict[str, object] = {
        "num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0, "num_kv_blocks": 10,
        "num_prompt_tokens_total": 0, "num_generation_tokens_total": 0,
        "num_preemptions_total": 0, "memory_bytes": {"weights": 100, "kv_cache": 50},
    }  # fmt: skip
    values.update(fields)
    return EngineStats(**values)  # type: ignore[arg-type]


def test_counters_follow_the_running_totals_and_gauges_the_snapshot() -> None:
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry, {"model": "m", "dtype": "bfloat16"})
    metrics.record(stats(num_prompt_tokens_total=10, num_generation_tokens_total=3))
    metrics.record(
        stats(num_running=2, num_waiting=5, kv_cache_usage=0.25,
              num_prompt_tokens_total=25, num_generation_tokens_total=9, num_preemptions_total=1),
        [FinishedRequestStats("length", 7, 4, arrival_time=1.0, scheduled_time=1.5,
                              first_token_time=2.0, finished_time=5.0)],
    )  # fmt: skip

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert value(names.PROMPT_TOKENS_TOTAL) == 25
    assert value(names.GENERATION_TOKENS_TOTAL) == 9
    assert value(names.PREEMPTIONS_TOTAL) == 1
    assert value(names.NUM_REQUESTS_RUNNING) == 2
    for name in (names.NUM_REQUESTS_WAITING, names.GATEWAY_NUM_REQUESTS_WAITING):
        assert value(name) == 5
    assert value(names.VLLM_NUM_REQUESTS_WAITING, model_name="m") == 5
    assert value(names.GATEWAY_KV_CACHE_USAGE_PERC) == 0.25
    assert value(names.DEVICE_MEMORY_BYTES, kind="weights") == 100
    assert value(names.MODEL_INFO, model="m", dtype="bfloat16") == 1
    assert value(names.REQUESTS_TOTAL, finish_reason="length") == 1
    assert value(names.REQUESTS_TOTAL, finish_reason="abort") == 0
    assert value(names.TIME_TO_FIRST_TOKEN_SECONDS + "_sum") == 1.0
    assert value(names.TIME_PER_OUTPUT_TOKEN_SECONDS + "_sum") == 1.0  # 3 s over 3 gaps
    assert value(names.E2E_REQUEST_LATENCY_SECONDS + "_sum") == 4.0
    assert value(names.REQUEST_QUEUE_TIME_SECONDS + "_sum") == 0.5
    # the same figures under vLLM's names and its model_name label, for its dashboards
    vllm = {"model_name": "m"}
    assert value(names.VLLM_PROMPT_TOKENS_TOTAL, **vllm) == 25
    assert value(names.VLLM_GENERATION_TOKENS_TOTAL, **vllm) == 9
    assert value(names.VLLM_NUM_PREEMPTIONS_TOTAL, **vllm) == 1
    assert value(names.VLLM_REQUEST_SUCCESS_TOTAL, **vllm, finished_reason="length") == 1
    assert value(names.VLLM_TIME_TO_FIRST_TOKEN_SECONDS + "_sum", **vllm) == 1.0
    assert value(names.VLLM_REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS + "_sum", **vllm) == 1.0
    assert value(names.VLLM_E2E_REQUEST_LATENCY_SECONDS + "_count", **vllm) == 1
    assert value(names.VLLM_REQUEST_QUEUE_TIME_SECONDS + "_sum", **vllm) == 0.5
    assert value(names.VLLM_KV_CACHE_USAGE_PERC, **vllm) == 0.25


def test_two_engines_in_one_process_do_not_collide() -> None:
    EngineMetrics(CollectorRegistry(), {"model": "a"})
    EngineMetrics(CollectorRegistry(), {"model": "b"})


def test_an_aborted_request_without_tokens_has_no_latencies() -> None:
    request = FinishedRequestStats("abort", 5, 0, 1.0, None, None, 2.0)
    assert request.time_to_first_token is None
    assert request.time_per_output_token is None
    assert request.queue_time is None
    assert request.e2e_latency == 1.0


def test_the_names_module_needs_neither_torch_nor_prometheus() -> None:
    code = (
        "import sys, brook_engine.metrics.names as n; "
        "assert n.KV_CACHE_USAGE_RATIO.startswith(n.PREFIX); "
        "bad = {'torch', 'prometheus_client'} & set(sys.modules); "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_compile_and_cold_start_metrics() -> None:
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry, {"model": "m", "dtype": "bfloat16"})
    metrics.record(stats(compiled_graphs=3, compile_hits_total=5, compile_seconds_total=2.5))
    metrics.record(
        stats(
            compiled_graphs=4,
            compile_hits_total=9,
            compile_misses_total=1,
            compile_evictions_total=1,
            compile_failures_total=1,
            compile_seconds_total=4.0,
            cold_start_seconds={"ready": 7.5, "first_token": 8.0},
        )
    )

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert value(names.COMPILED_GRAPHS) == 4
    assert value(names.COMPILE_CACHE_HITS_TOTAL) == 9
    assert value(names.COMPILE_CACHE_MISSES_TOTAL) == 1
    assert value(names.COMPILE_CACHE_EVICTIONS_TOTAL) == 1
    assert value(names.COMPILE_FAILURES_TOTAL) == 1
    assert value(names.COMPILE_SECONDS_TOTAL) == 4.0
    assert value(names.COLD_START_SECONDS, until="ready") == 7.5
    assert value(names.COLD_START_SECONDS, until="first_token") == 8.0


def test_each_layer_exports_its_kv_dtype_and_a_fallback_replaces_the_old_series() -> None:
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry, {"model": "m", "dtype": "bfloat16"})

    def series() -> dict[tuple[str, str], float]:
        return {
            (s.labels["layer"], s.labels["dtype"]): s.value
            for family in registry.collect()
            if family.name == names.KV_CACHE_LAYER_DTYPE
            for s in family.samples
        }

    def count(dtype: str) -> float | None:
        return registry.get_sample_value(names.KV_CACHE_LAYERS, {"dtype": dtype})

    metrics.record(stats(kv_layer_dtypes=("fp8_e4m3", "fp8_e4m3", "bf16")))
    expected = {("0", "fp8_e4m3"): 1.0, ("1", "fp8_e4m3"): 1.0, ("2", "bf16"): 1.0}
    assert series() == expected
    metrics.record(stats(kv_layer_dtypes=("fp8_e4m3", "fp8_e4m3", "bf16")))  # unchanged
    assert series() == expected

    # Calibration moved layer 1 to the model dtype: its FP8 series is gone, not left at 1.
    metrics.record(stats(kv_layer_dtypes=("fp8_e4m3", "bf16", "bf16")))
    assert series() == {("0", "fp8_e4m3"): 1.0, ("1", "bf16"): 1.0, ("2", "bf16"): 1.0}
    assert (count("fp8_e4m3"), count("bf16")) == (1.0, 2.0)

    # Layer 0 as well: no layer stores FP8, so its count goes too.
    metrics.record(stats(kv_layer_dtypes=("bf16", "bf16", "bf16")))
    assert series() == {(str(layer), "bf16"): 1.0 for layer in range(3)}
    assert (count("fp8_e4m3"), count("bf16")) == (None, 3.0)
