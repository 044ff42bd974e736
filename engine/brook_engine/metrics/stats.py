"""Plain statistics the engine produces; no Prometheus here (``prometheus`` turns them into
metrics), so the engine loop and tests deal in values only."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineStats:
    """A snapshot after a step: gauges as they are, counters as running totals."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks held by live sequences
    num_kv_blocks: int
    num_prompt_tokens_total: int
    num_generation_tokens_total: int
    num_preemptions_total: int
    num_refused_prompt_tokens_total: int = 0  # of requests the full queue turned away
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    prefix_cache_evictions_total: int = 0
    num_cached_blocks: int = 0  # unreferenced blocks kept for their prefix
    kv_bytes_per_token: int = 0  # all layers, keys and values, scales included
    kv_layer_dtypes: tuple[str, ...] = ()  # storage dtype per layer, after calibration
    kv_calibration_errors: tuple[float | None, ...] = ()  # per layer; None: not measured
    kv_used_bytes: dict[str, int] = field(default_factory=dict)  # dtype -> bytes live blocks hold
    comm_compute_overlap: float = 1.0  # 1 when nothing is communicated (latest window)
    comm_seconds_total: dict[str, float] = field(default_factory=dict)  # kind -> seconds
    comm_exposed_seconds_total: float = 0.0
    pipeline_bubble: float = 0.0  # share of the ranks' step time not computing (latest window)
    stage_compute_seconds_total: tuple[float, ...] = ()  # per pipeline stage, mean over ranks
    micro_batches: int = 1
    memory_bytes: dict[str, int] = field(default_factory=dict)  # kind -> bytes
    # weight offload (this rank's): device bytes by where they are (resident, slots) and the
    # bytes that stream; transfer time, the part compute did not hide, plan changes
    offload_weight_bytes: dict[str, int] = field(default_factory=dict)
    offload_budget_bytes: int = 0
    offload_transfer_seconds_total: float = 0.0
    offload_exposed_seconds_total: float = 0.0
    offload_plan_changes_total: int = 0
    # compile mode (this rank's kernel cache); cold start of this process
    compiled_graphs: int = 0
    compile_hits_total: int = 0
    compile_misses_total: int = 0
    compile_evictions_total: int = 0
    compile_failures_total: int = 0
    compile_seconds_total: float = 0.0
    cold_start_seconds: dict[str, float] = field(default_factory=dict)  # until -> seconds
    # mixture-of-experts routing (this rank's layers; layers.moe.ExpertLoadFigures)
    moe_routed_total: int = 0  # token slots sent to experts (after rerouting)
    moe_rerouted_total: int = 0  # slots dropped for a choice with room
    moe_load_cv: float = 0.0
    moe_load_std: float = 0.0  # tokens per expert per layer-step
    moe_expert_utilization: float = 1.0
    moe_rank_utilization: float = 1.0
    moe_expert_tokens_total: tuple[int, ...] = ()  # per expert, all layers


@dataclass(frozen=True)
class FinishedRequestStats:
    """One request that ended (finished, stopped or aborted); monotonic times in seconds."""

    finish_reason: str
    num_prompt_tokens: int
    num_generation_tokens: int
    arrival_time: float
    scheduled_time: float | None
    first_token_time: float | None
    finished_time: float

    @property
    def queue_time(self) -> float | None:
        return None if self.scheduled_time is None else self.scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        if self.first_token_time is None or self.num_generation_tokens < 2:
            return None
        decode = self.finished_time - self.first_token_time
        return decode / (self.num_generation_tokens - 1)

    @property
    def e2e_latency(self) -> float:
        return self.finished_time - self.arrival_time
