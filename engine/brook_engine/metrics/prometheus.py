"""The engine's Prometheus metrics: created once with help text and explicit buckets in an
injected registry (several engines can live in one process, as in tests), fed from
``EngineStats`` snapshots and finished-request stats."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from brook_engine.metrics import names
from brook_engine.metrics.stats import EngineStats, FinishedRequestStats

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
_TOKEN_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2,
    0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry, info: Mapping[str, str]) -> None:
        def gauge(name: str, text: str, labels: Iterable[str] = ()) -> Gauge:
            return Gauge(name, text, list(labels), registry=registry)

        def counter(name: str, text: str, labels: Iterable[str] = ()) -> Counter:
            # prometheus_client appends _total itself; give it the stem.
            return Counter(name.removesuffix("_total"), text, list(labels), registry=registry)

        def histogram(name: str, text: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, text, buckets=buckets, registry=registry)

        model = {names.VLLM_MODEL_LABEL: info.get("model", "")}
        label = [names.VLLM_MODEL_LABEL]

        def vllm_gauge(name: str, text: str) -> Any:
            return gauge(name, text, label).labels(**model)

        def vllm_counter(name: str, text: str) -> Any:
            return counter(name, text, label).labels(**model)

        def vllm_histogram(name: str, text: str, buckets: tuple[float, ...]) -> Any:
            metric = Histogram(name, text, label, buckets=buckets, registry=registry)
            return metric.labels(**model)

        self.info = gauge(names.MODEL_INFO, "Model and configuration; the value is 1.", info)
        self.info.labels(**info).set(1)
        self.running = [
            gauge(names.NUM_REQUESTS_RUNNING, "Requests in the running batch."),
            gauge(names.GATEWAY_NUM_REQUESTS_RUNNING, "Requests running (inference gateway)."),
            vllm_gauge(names.VLLM_NUM_REQUESTS_RUNNING, "Requests running (vLLM name)."),
        ]
        self.waiting = [
            gauge(names.NUM_REQUESTS_WAITING, "Requests queued for the running batch."),
            gauge(names.GATEWAY_NUM_REQUESTS_WAITING, "Requests queued (inference gateway)."),
            vllm_gauge(names.VLLM_NUM_REQUESTS_WAITING, "Requests queued (vLLM name)."),
        ]
        self.kv_usage = [
            gauge(names.KV_CACHE_USAGE_RATIO, "Fraction of KV-cache blocks in use (0..1)."),
            gauge(names.GATEWAY_KV_CACHE_USAGE_PERC, "KV-cache usage, 0..1 (inference gateway)."),
            vllm_gauge(names.VLLM_KV_CACHE_USAGE_PERC, "KV-cache usage, 0..1 (vLLM name)."),
        ]
        self.kv_blocks = gauge(names.KV_CACHE_NUM_BLOCKS, "KV-cache blocks allocated.")
        self.overlap = gauge(
            names.COMM_COMPUTE_OVERLAP_RATIO,
            "1 - exposed communication time / total communication time; 1 without communication.",
        )
        self.memory = gauge(
            names.DEVICE_MEMORY_BYTES,
            "Device memory by kind: weights, kv_cache, activations (peak; estimated on CPU).",
            ["kind"],
        )
        self.requests = counter(
            names.REQUESTS_TOTAL, "Requests ended, by finish reason.", ["finish_reason"]
        )
        for reason in names.FINISH_REASONS:
            self.requests.labels(finish_reason=reason)
        self.prompt_tokens = counter(names.PROMPT_TOKENS_TOTAL, "Prompt tokens received.")
        self.generation_tokens = counter(names.GENERATION_TOKENS_TOTAL, "Tokens generated.")
        self.refused_prompt_tokens = counter(
            names.REFUSED_PROMPT_TOKENS_TOTAL,
            "Prompt tokens of requests refused because the waiting queue was full "
            "(scheduler.maxWaitingRequests): demand the engine did not serve.",
        )
        self.preemptions = counter(names.PREEMPTIONS_TOTAL, "Sequences preempted.")
        self.prefix_queries = counter(
            names.PREFIX_CACHE_QUERIES_TOTAL, "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = counter(
            names.PREFIX_CACHE_HITS_TOTAL, "Prompt tokens found in the prefix cache."
        )
        self.prefix_evictions = counter(
            names.PREFIX_CACHE_EVICTIONS_TOTAL, "Cached KV blocks evicted for new ones."
        )
        self.cached_blocks = gauge(
            names.KV_CACHE_CACHED_BLOCKS,
            "KV blocks no request holds, kept for a later request with the same prefix.",
        )
        self.kv_bytes_per_token = gauge(
            names.KV_CACHE_BYTES_PER_TOKEN,
            "KV-cache bytes one token takes over all layers (keys, values, scales).",
        )
        self.kv_layers = gauge(names.KV_CACHE_LAYERS, "Layers storing KV in each dtype.", ["dtype"])
        self.kv_layer_dtype = gauge(
            names.KV_CACHE_LAYER_DTYPE,
            "Storage dtype of each layer's KV cache (after calibration); the value is 1.",
            ["layer", "dtype"],
        )
        self._kv_layer_dtypes: tuple[str, ...] = ()  # as last exported
        self.kv_used_bytes = gauge(
            names.KV_CACHE_USED_BYTES,
            "KV-cache bytes held by live requests, by storage dtype.",
            ["dtype"],
        )
        self.kv_errors = gauge(
            names.KV_CALIBRATION_ERROR,
            "Relative attention-output error low-precision KV storage adds, per measured layer.",
            ["layer"],
        )
        self.bubble = gauge(
            names.PIPELINE_BUBBLE_RATIO,
            "Share of the ranks' step time not spent computing (latest window; 0 unparallel).",
        )
        self.micro_batches = gauge(
            names.PIPELINE_MICRO_BATCHES,
            "Micro-batches a step is split into between pipeline stages.",
        )
        self.comm_seconds = counter(
            names.COMM_SECONDS_TOTAL,
            "Model communication time summed over ranks, issue to completion, by kind "
            "(all_reduce, all_gather, p2p; control is the engine's own step plans).",
            ["kind"],
        )
        for kind in names.COMM_KINDS:
            self.comm_seconds.labels(kind=kind)
        self.comm_exposed = counter(
            names.COMM_EXPOSED_SECONDS_TOTAL,
            "Model communication time no computation hid, summed over ranks.",
        )
        self.stage_compute = counter(
            names.STAGE_COMPUTE_SECONDS_TOTAL,
            "Compute time per pipeline stage (mean over its tensor-parallel ranks).",
            ["stage"],
        )
        self.offload_bytes = gauge(
            names.OFFLOAD_WEIGHT_BYTES,
            "Weight offload: device bytes of resident weights and of the streaming slots, "
            "and the bytes that stream from host memory or disk (this rank).",
            ["where"],
        )
        self.offload_budget = gauge(
            names.OFFLOAD_BUDGET_BYTES, "Weight offload: the device bytes weights may use."
        )
        self.offload_transfer = counter(
            names.OFFLOAD_TRANSFER_SECONDS_TOTAL, "Weight offload: time spent streaming weights."
        )
        self.offload_exposed = counter(
            names.OFFLOAD_EXPOSED_SECONDS_TOTAL,
            "Weight offload: streaming time compute did not hide (layers waited for it).",
        )
        self.offload_changes = counter(
            names.OFFLOAD_PLAN_CHANGES_TOTAL,
            "Weight offload: pieces moved between resident and streamed (adaptive policy).",
        )
        self.compiled_graphs = gauge(
            names.COMPILED_GRAPHS,
            "Compile mode: compiled layer graphs the kernel cache holds (one per token bucket).",
        )
        self.compile_hits = counter(
            names.COMPILE_CACHE_HITS_TOTAL, "Compile mode: steps that ran a compiled graph."
        )
        self.compile_misses = counter(
            names.COMPILE_CACHE_MISSES_TOTAL,
            "Compile mode: steps that ran eager (their bucket not compiled, or failed).",
        )
        self.compile_evictions = counter(
            names.COMPILE_CACHE_EVICTIONS_TOTAL,
            "Compile mode: graphs dropped to keep the cache within kernelCacheSize.",
        )
        self.compile_failures = counter(
            names.COMPILE_FAILURES_TOTAL,
            "Compile mode: buckets whose compilation or graph failed (they run eager).",
        )
        self.compile_seconds = counter(
            names.COMPILE_SECONDS_TOTAL,
            "Compile mode: time spent compiling or loading graphs (start-up and online).",
        )
        self.cold_start = gauge(
            names.COLD_START_SECONDS,
            "Seconds from process start until the engine was ready, and until its first "
            "generated token.",
            ["until"],
        )
        self.moe_cv = gauge(
            names.MOE_LOAD_CV,
            "MoE: coefficient of variation of tokens per expert (each layer's step, "
            "token-weighted over recent steps); 0 is even.",
        )
        self.moe_utilization = gauge(
            names.MOE_EXPERT_UTILIZATION,
            "MoE: mean tokens per expert over the busiest expert's (recent steps); 1 is even.",
        )
        self.moe_rank_utilization = gauge(
            names.MOE_RANK_UTILIZATION,
            "MoE: mean tokens per expert-parallel rank over the busiest rank's; 1 is even.",
        )
        self.moe_routed = counter(
            names.MOE_ROUTED_TOKENS_TOTAL, "MoE: token slots sent to experts (this stage's layers)."
        )
        self.moe_rerouted = counter(
            names.MOE_REROUTED_TOKENS_TOTAL,
            "MoE: token slots moved off an overloaded expert (moe.reroute).",
        )
        self.moe_expert_tokens = counter(
            names.MOE_EXPERT_TOKENS_TOTAL,
            "MoE: token slots each expert served (this stage's layers).",
            ["expert"],
        )

        def latency(
            name: str, vllm_name: str, text: str, buckets: tuple[float, ...]
        ) -> tuple[Histogram, Any]:
            """A request latency histogram and its vLLM-named twin."""
            twin = vllm_histogram(vllm_name, f"{text.rstrip('.')} (vLLM name).", buckets)
            return histogram(name, text, buckets), twin

        self.ttft, self.vllm_ttft = latency(
            names.TIME_TO_FIRST_TOKEN_SECONDS,
            names.VLLM_TIME_TO_FIRST_TOKEN_SECONDS,
            "Arrival to first generated token.",
            _LATENCY_BUCKETS,
        )
        self.tpot, self.vllm_tpot = latency(
            names.TIME_PER_OUTPUT_TOKEN_SECONDS,
            names.VLLM_REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS,
            "Mean time between generated tokens of a request.",
            _TOKEN_LATENCY_BUCKETS,
        )
        self.e2e, self.vllm_e2e = latency(
            names.E2E_REQUEST_LATENCY_SECONDS,
            names.VLLM_E2E_REQUEST_LATENCY_SECONDS,
            "Arrival to the last token.",
            _LATENCY_BUCKETS,
        )
        self.queue, self.vllm_queue = latency(
            names.REQUEST_QUEUE_TIME_SECONDS,
            names.VLLM_REQUEST_QUEUE_TIME_SECONDS,
            "Arrival to first scheduled.",
            _LATENCY_BUCKETS,
        )
        self.vllm_requests = Counter(
            names.VLLM_REQUEST_SUCCESS_TOTAL.removesuffix("_total"),
            "Requests ended, by finish reason (vLLM name).",
            [names.VLLM_MODEL_LABEL, "finished_reason"],
            registry=registry,
        )
        for reason in names.FINISH_REASONS:  # present from the start, as vLLM's are
            self.vllm_requests.labels(model[names.VLLM_MODEL_LABEL], reason)
        self.vllm_counters = {
            "num_prompt_tokens_total": vllm_counter(
                names.VLLM_PROMPT_TOKENS_TOTAL, "Prompt tokens received (vLLM name)."
            ),
            "num_generation_tokens_total": vllm_counter(
                names.VLLM_GENERATION_TOKENS_TOTAL, "Tokens generated (vLLM name)."
            ),
            "num_preemptions_total": vllm_counter(
                names.VLLM_NUM_PREEMPTIONS_TOTAL, "Sequences preempted (vLLM name)."
            ),
            "prefix_cache_queries_total": vllm_counter(
                names.VLLM_PREFIX_CACHE_QUERIES_TOTAL, "Prompt tokens looked up (vLLM name)."
            ),
            "prefix_cache_hits_total": vllm_counter(
                names.VLLM_PREFIX_CACHE_HITS_TOTAL, "Prompt tokens found (vLLM name)."
            ),
        }
        self._model = model[names.VLLM_MODEL_LABEL]
        self._last: EngineStats | None = None

    def record(self, stats: EngineStats, finished: Iterable[FinishedRequestStats] = ()) -> None:
        for g in self.running:
            g.set(stats.num_running)
        for g in self.waiting:
            g.set(stats.num_waiting)
        for g in self.kv_usage:
            g.set(stats.kv_cache_usage)
        self.kv_blocks.set(stats.num_kv_blocks)
        self.cached_blocks.set(stats.num_cached_blocks)
        self.kv_bytes_per_token.set(stats.kv_bytes_per_token)
        if stats.kv_layer_dtypes != self._kv_layer_dtypes:
            self._record_kv_layer_dtypes(stats.kv_layer_dtypes)
        for dtype, value in stats.kv_used_bytes.items():
            self.kv_used_bytes.labels(dtype=dtype).set(value)
        for layer, error in enumerate(stats.kv_calibration_errors):
            if error is not None:
                self.kv_errors.labels(layer=str(layer)).set(error)
        self.overlap.set(stats.comm_compute_overlap)
        self.bubble.set(stats.pipeline_bubble)
        self.micro_batches.set(stats.micro_batches)
        before_stats = self._last
        _advance(
            self.comm_seconds,
            "kind",
            stats.comm_seconds_total,
            before_stats.comm_seconds_total if before_stats else {},
        )
        previous_exposed = before_stats.comm_exposed_seconds_total if before_stats else 0.0
        if stats.comm_exposed_seconds_total > previous_exposed:
            self.comm_exposed.inc(stats.comm_exposed_seconds_total - previous_exposed)
        _advance(
            self.stage_compute,
            "stage",
            _by_index(stats.stage_compute_seconds_total),
            _by_index(before_stats.stage_compute_seconds_total if before_stats else ()),
        )
        for kind, value in stats.memory_bytes.items():
            self.memory.labels(kind=kind).set(value)
        for where, value in stats.offload_weight_bytes.items():
            self.offload_bytes.labels(where=where).set(value)
        self.offload_budget.set(stats.offload_budget_bytes)
        self.compiled_graphs.set(stats.compiled_graphs)
        for until, seconds in stats.cold_start_seconds.items():
            self.cold_start.labels(until=until).set(seconds)
        last = self._last
        if stats.moe_routed_total:
            self.moe_cv.set(stats.moe_load_cv)
            self.moe_utilization.set(stats.moe_expert_utilization)
            self.moe_rank_utilization.set(stats.moe_rank_utilization)
        _advance(
            self.moe_expert_tokens,
            "expert",
            _by_index(stats.moe_expert_tokens_total),
            _by_index(last.moe_expert_tokens_total if last else ()),
        )
        for metric, field in (
            (self.offload_transfer, "offload_transfer_seconds_total"),
            (self.offload_exposed, "offload_exposed_seconds_total"),
            (self.offload_changes, "offload_plan_changes_total"),
            (self.compile_hits, "compile_hits_total"),
            (self.compile_misses, "compile_misses_total"),
            (self.compile_evictions, "compile_evictions_total"),
            (self.compile_failures, "compile_failures_total"),
            (self.compile_seconds, "compile_seconds_total"),
            (self.moe_routed, "moe_routed_total"),
            (self.moe_rerouted, "moe_rerouted_total"),
            (self.prompt_tokens, "num_prompt_tokens_total"),
            (self.refused_prompt_tokens, "num_refused_prompt_tokens_total"),
            (self.generation_tokens, "num_generation_tokens_total"),
            (self.preemptions, "num_preemptions_total"),
            (self.prefix_queries, "prefix_cache_queries_total"),
            (self.prefix_hits, "prefix_cache_hits_total"),
            (self.prefix_evictions, "prefix_cache_evictions_total"),
        ):
            now, before = getattr(stats, field), getattr(last, field) if last else 0
            if now > before:
                metric.inc(now - before)
                if field in self.vllm_counters:
                    self.vllm_counters[field].inc(now - before)
        self._last = stats
        for request in finished:
            self.requests.labels(finish_reason=request.finish_reason).inc()
            self.vllm_requests.labels(self._model, request.finish_reason).inc()
            observed: tuple[tuple[tuple[Any, Any], float | None], ...] = (
                ((self.e2e, self.vllm_e2e), request.e2e_latency),
                ((self.queue, self.vllm_queue), request.queue_time),
                ((self.ttft, self.vllm_ttft), request.time_to_first_token),
                ((self.tpot, self.vllm_tpot), request.time_per_output_token),
            )
            for twins, latency in observed:
                if latency is not None:
                    for twin in twins:
                        twin.observe(latency)

    def _record_kv_layer_dtypes(self, dtypes: tuple[str, ...]) -> None:
        """The per-layer dtype series and the per-dtype counts, brought to ``dtypes`` from
        the tuple last exported: a layer whose dtype changed (a calibration fallback) or
        that is gone loses its old series, and a dtype no layer stores any more its count.
        Layers are indexed as the stats give them. Runs only when the tuple changed."""
        before = self._kv_layer_dtypes
        for layer, dtype in enumerate(before):
            if layer >= len(dtypes) or dtypes[layer] != dtype:
                self.kv_layer_dtype.remove(str(layer), dtype)
        for layer, dtype in enumerate(dtypes):
            if layer >= len(before) or before[layer] != dtype:
                self.kv_layer_dtype.labels(layer=str(layer), dtype=dtype).set(1)
        for dtype in set(before) - set(dtypes):
            self.kv_layers.remove(dtype)
        for dtype in set(dtypes):
            self.kv_layers.labels(dtype=dtype).set(dtypes.count(dtype))
        self._kv_layer_dtypes = dtypes


def _advance(
    counter: Counter, label: str, now: Mapping[str, float], before: Mapping[str, float]
) -> None:
    """A labelled counter brought up to running totals ``now`` from ``before`` (per label
    value; a total that did not grow adds nothing)."""
    for value, total in now.items():
        previous = before.get(value, 0)
        if total > previous:
            counter.labels(**{label: value}).inc(total - previous)


def _by_index(totals: Sequence[float]) -> dict[str, float]:
    """Per-position running totals (stages, experts) keyed by their index, as labels are."""
    return {str(i): total for i, total in enumerate(totals)}
