"""What the engine reports after every step: the scheduler's queues, the KV cache's use and
precision, memory, and under TP × PP the replica's communication figures (plain values:
``metrics.prometheus`` turns them into metrics)."""

from __future__ import annotations

from typing import Any

from brook_engine.core.model_runner import ModelRunner
from brook_engine.core.scheduler import Scheduler
from brook_engine.kv.blocks import BlockManager
from brook_engine.metrics.stats import EngineStats
from brook_engine.offload.streamer import StreamStats, WeightStreamer


def engine_stats(
    scheduler: Scheduler,
    blocks: BlockManager,
    runner: ModelRunner,
    num_prompt_tokens_total: int,
    num_generation_tokens_total: int,
    cold_start_seconds: dict[str, float] | None = None,
    num_refused_prompt_tokens_total: int = 0,
) -> EngineStats:
    cache = blocks.cache
    return EngineStats(
        num_running=scheduler.num_running,
        num_waiting=scheduler.num_waiting,
        kv_cache_usage=blocks.usage,
        num_kv_blocks=blocks.num_blocks,
        num_prompt_tokens_total=num_prompt_tokens_total,
        num_generation_tokens_total=num_generation_tokens_total,
        num_refused_prompt_tokens_total=num_refused_prompt_tokens_total,
        num_preemptions_total=scheduler.num_preemptions_total,
        prefix_cache_queries_total=cache.num_queries if cache else 0,
        prefix_cache_hits_total=cache.num_hits if cache else 0,
        prefix_cache_evictions_total=cache.num_evictions if cache else 0,
        num_cached_blocks=blocks.num_cached_blocks,
        kv_bytes_per_token=runner.kv_bytes_per_token,
        kv_layer_dtypes=tuple(runner.replica.layer_kinds),
        kv_calibration_errors=tuple(runner.replica.calibration_errors or ()),
        kv_used_bytes=runner.kv_bytes_by_dtype(blocks.num_used_blocks),
        memory_bytes=runner.memory_bytes(),
        **_parallel_stats(runner),
        **_offload_stats(runner),
        **_compile_stats(runner),
        **_moe_stats(runner),
        cold_start_seconds=dict(cold_start_seconds or {}),
    )


def _moe_stats(runner: ModelRunner) -> dict[str, Any]:
    load = runner.model.expert_load
    if load is None:
        return {}
    figures = load.figures()
    return {
        "moe_routed_total": figures.routed_total,
        "moe_rerouted_total": figures.rerouted_total,
        "moe_load_cv": figures.load_cv,
        "moe_load_std": figures.load_std,
        "moe_expert_utilization": figures.utilization,
        "moe_rank_utilization": figures.rank_utilization,
        "moe_expert_tokens_total": figures.expert_tokens_total,
    }


def _compile_stats(runner: ModelRunner) -> dict[str, Any]:
    graphs = runner.graphs
    if graphs is None:
        return {}
    stats = graphs.stats()
    return {
        "compiled_graphs": stats.graphs,
        "compile_hits_total": stats.hits,
        "compile_misses_total": stats.misses,
        "compile_evictions_total": stats.evictions,
        "compile_failures_total": stats.failures,
        "compile_seconds_total": stats.compile_seconds,
    }


def _offload_stats(runner: ModelRunner) -> dict[str, Any]:
    state = runner.model.offload
    if state is None:
        return {}
    streamer = state.holder.streamer
    stats = streamer.snapshot() if isinstance(streamer, WeightStreamer) else StreamStats()
    ledger = state.ledger
    slots = ledger.by_kind.get("slots", 0)
    return {
        "offload_weight_bytes": {
            "resident": ledger.held - slots,
            "slots": slots,
            "streamed": sum(state.piece_bytes[k] for _, k in state.streamed),
        },
        "offload_budget_bytes": ledger.budget or 0,
        "offload_transfer_seconds_total": stats.transfer_seconds,
        "offload_exposed_seconds_total": stats.exposed_seconds,
        "offload_plan_changes_total": state.changes,
    }


def _parallel_stats(runner: ModelRunner) -> dict[str, Any]:
    if runner.comm is None:
        return {}
    totals, window, topo = runner.replica_counters, runner.window, runner.topology
    return {
        "comm_compute_overlap": window.overlap,
        "comm_seconds_total": dict(totals.by_kind),
        "comm_exposed_seconds_total": totals.comm_exposed,
        "pipeline_bubble": window.bubble(topo.world_size),
        "stage_compute_seconds_total": tuple(c / topo.tensor for c in totals.stage_compute),
        "micro_batches": runner.micro_batches.micro_batches,
    }
