"""Run a workload through Brook's engine and report what a serving team compares: tokens/s,
time to first token, time per output token, peak memory, and model FLOPs utilization."""

from __future__ import annotations

import resource
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from tqdm import tqdm

from brook_engine.bench.workload import Workload
from brook_engine.compile.graph_cache import CompileStats
from brook_engine.core.llm_engine import LLMEngine
from brook_engine.offload.streamer import StreamStats
from brook_engine.sampling_params import SamplingParams


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


@dataclass
class BenchReport:
    engine: str
    mode: str
    requests: int
    prompt_tokens: int
    output_tokens: int
    elapsed_s: float
    output_tok_s: float
    total_tok_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tpot_p50_s: float | None
    tpot_p99_s: float | None
    peak_rss_mb: float
    mfu: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def measured(
        cls,
        engine: str,
        mode: str,
        *,
        requests: int,
        prompt_tokens: int,
        output_tokens: int,
        elapsed_s: float,
        ttft: list[float],
        tpot: list[float] | None = None,
        peak_rss_mb: float = 0.0,
        extra: dict[str, Any] | None = None,
    ) -> BenchReport:
        """The report of one run from its counts and per-request latencies (seconds): rates
        and percentiles derived; no latencies, no percentile."""
        return cls(
            engine=engine,
            mode=mode,
            requests=requests,
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            elapsed_s=elapsed_s,
            output_tok_s=output_tokens / elapsed_s,
            total_tok_s=(prompt_tokens + output_tokens) / elapsed_s,
            ttft_p50_s=percentile(ttft, 50),
            ttft_p99_s=percentile(ttft, 99),
            tpot_p50_s=percentile(tpot or [], 50),
            tpot_p99_s=percentile(tpot or [], 99),
            peak_rss_mb=peak_rss_mb,
            extra=extra if extra is not None else {},
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_engine(
    engine: LLMEngine, workload: Workload, mode: str, progress: bool = True
) -> BenchReport:
    """``batch``: every request at once (offline throughput). ``single``: one at a time."""
    # Warm-up: first calls allocate and pick kernels.
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("warm-up", workload.prompts[0][:16], warm)
    while engine.has_unfinished_requests():
        engine.step()

    ttft: list[float] = []
    tpot: list[float] = []
    generated = 0
    peak_blocks = 0
    cache = engine.block_manager.cache
    queries0, hits0 = (cache.num_queries, cache.num_hits) if cache else (0, 0)
    offload = engine.runner.model.offload
    if offload is not None and offload.holder.streamer is not None:
        offload.holder.streamer.reset_stats()  # this run's transfers only
    graphs = engine.runner.graphs
    compiled0 = graphs.stats() if graphs is not None else None
    start = time.perf_counter()
    bar = tqdm(total=len(workload.prompts), desc=f"brook ({mode})", disable=not progress)
    groups = (
        [list(range(len(workload.prompts)))]
        if mode == "batch"
        else [[i] for i in range(len(workload.prompts))]
    )
    for group in groups:
        arrival = time.monotonic()
        for i in group:
            params = SamplingParams(
                temperature=0, max_tokens=workload.max_tokens[i], ignore_eos=True
            )
            engine.add_request(f"bench-{i}", workload.prompts[i], params)
        while engine.has_unfinished_requests():
            step_outputs = engine.step()
            peak_blocks = max(peak_blocks, engine.block_manager.num_used_blocks)
            for out in step_outputs:
                if not out.finished:
                    continue
                n = len(out.outputs[0].token_ids)
                generated += n
                first, done = out.metrics.first_token_time, out.metrics.finished_time
                if first is not None and done is not None:
                    ttft.append(first - arrival)
                    if n > 1:
                        tpot.append((done - first) / (n - 1))
                bar.update(1)
    elapsed = time.perf_counter() - start
    bar.close()
    block_bytes = engine.runner.memory_bytes()["kv_cache"] / engine.runner.num_blocks
    return BenchReport.measured(
        "brook",
        mode,
        requests=len(workload.prompts),
        prompt_tokens=workload.num_prompt_tokens,
        output_tokens=generated,
        elapsed_s=elapsed,
        ttft=ttft,
        tpot=tpot,
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        extra={
            "preemptions": engine.scheduler.num_preemptions_total,
            "kv_blocks": engine.runner.num_blocks,
            "mean_ttft_s": statistics.fmean(ttft) if ttft else None,
            "peak_kv_blocks": peak_blocks,
            "peak_kv_mb": peak_blocks * block_bytes / 2**20,
            "prefix_hit_rate": (
                (cache.num_hits - hits0) / max(1, cache.num_queries - queries0) if cache else 0.0
            ),
            **({"offload": offload_figures(engine)} if offload is not None else {}),
            **({"compile": compile_figures(engine, compiled0)} if compiled0 is not None else {}),
        },
    )


def compile_figures(engine: LLMEngine, before: CompileStats) -> dict[str, Any]:
    """Compile mode over the run: steps that ran a compiled graph, the hit rate, graphs held,
    evictions, compile time spent online, and the start-up's compile time."""
    graphs = engine.runner.graphs
    assert graphs is not None
    now = graphs.stats()
    hits, misses = now.hits - before.hits, now.misses - before.misses
    return {
        "hits": hits,
        "misses": misses,
        "hit_rate": hits / max(1, hits + misses),
        "graphs": now.graphs,
        "evictions": now.evictions - before.evictions,
        "online_compile_s": now.compile_seconds - before.compile_seconds,
        "startup_compile_s": engine.runner.compile_seconds,
        "buckets": sorted(graphs.cache.buckets),
    }


def offload_figures(engine: LLMEngine) -> dict[str, float]:
    """Weight offload over the run: device and streamed weight bytes, transfer time and the
    share compute hid, plan changes."""
    stats = engine.stats()
    transfers = StreamStats(
        transfer_seconds=stats.offload_transfer_seconds_total,
        exposed_seconds=stats.offload_exposed_seconds_total,
    )
    return {
        "weights_device_mb": engine.runner.weight_bytes / 2**20,
        "streamed_mb": stats.offload_weight_bytes.get("streamed", 0) / 2**20,
        "transfer_s": stats.offload_transfer_seconds_total,
        "exposed_s": stats.offload_exposed_seconds_total,
        "hidden_ratio": transfers.hidden_ratio,
        "plan_changes": stats.offload_plan_changes_total,
    }


def greedy_outputs(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy token ids of each prompt (all at once; ``max_tokens`` each, EOS ignored)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"greedy-{i}", prompt, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done[f"greedy-{i}"] for i in range(len(prompts))]
