"""Every metric name the engine serves on /metrics, in one place.

The operator's autoscaler imports this module to read the engine's metrics by name, so it
must stay free of torch and of prometheus_client. Counters end in ``_total``, durations in
``_seconds``, ratios in ``_ratio`` (0..1).
"""

from __future__ import annotations

from typing import Final

PREFIX: Final = "brook_engine_"

# Gauges sampled after every engine step.
NUM_REQUESTS_RUNNING: Final = "brook_engine_num_requests_running"
NUM_REQUESTS_WAITING: Final = "brook_engine_num_requests_waiting"
KV_CACHE_USAGE_RATIO: Final = "brook_engine_kv_cache_usage_ratio"
KV_CACHE_NUM_BLOCKS: Final = "brook_engine_kv_cache_num_blocks"
COMM_COMPUTE_OVERLAP_RATIO: Final = "brook_engine_comm_compute_overlap_ratio"
PIPELINE_BUBBLE_RATIO: Final = "brook_engine_pipeline_bubble_ratio"
PIPELINE_MICRO_BATCHES: Final = "brook_engine_pipeline_micro_batches"
DEVICE_MEMORY_BYTES: Final = "brook_engine_device_memory_bytes"  # label: kind
KV_CACHE_BYTES_PER_TOKEN: Final = "brook_engine_kv_cache_bytes_per_token"
KV_CACHE_LAYERS: Final = "brook_engine_kv_cache_layers"  # label: dtype
KV_CACHE_LAYER_DTYPE: Final = "brook_engine_kv_cache_layer_dtype"  # labels: layer, dtype; value 1
KV_CACHE_USED_BYTES: Final = "brook_engine_kv_cache_used_bytes"  # label: dtype
KV_CALIBRATION_ERROR: Final = "brook_engine_kv_calibration_error"  # label: layer
KV_CACHE_CACHED_BLOCKS: Final = "brook_engine_kv_cache_cached_blocks"  # unreferenced, kept
MODEL_INFO: Final = "brook_engine_model_info"  # value 1; labels describe model and config
OFFLOAD_WEIGHT_BYTES: Final = "brook_engine_offload_weight_bytes"  # label: where
OFFLOAD_BUDGET_BYTES: Final = "brook_engine_offload_budget_bytes"
COMPILED_GRAPHS: Final = "brook_engine_compiled_graphs"  # held by the kernel cache
COLD_START_SECONDS: Final = "brook_engine_cold_start_seconds"  # label: until
MOE_LOAD_CV: Final = "brook_engine_moe_load_cv"  # tokens per expert: std / mean
MOE_EXPERT_UTILIZATION: Final = "brook_engine_moe_expert_utilization"  # mean / busiest
MOE_RANK_UTILIZATION: Final = "brook_engine_moe_rank_utilization"  # over expert-parallel ranks

# Counters.
REQUESTS_TOTAL: Final = "brook_engine_requests_total"  # label: finish_reason
PROMPT_TOKENS_TOTAL: Final = "brook_engine_prompt_tokens_total"
REFUSED_PROMPT_TOKENS_TOTAL: Final = "brook_engine_refused_prompt_tokens_total"  # queue full
GENERATION_TOKENS_TOTAL: Final = "brook_engine_generation_tokens_total"
PREEMPTIONS_TOTAL: Final = "brook_engine_num_preemptions_total"
PREFIX_CACHE_QUERIES_TOTAL: Final = "brook_engine_prefix_cache_queries_total"  # tokens looked up
PREFIX_CACHE_HITS_TOTAL: Final = "brook_engine_prefix_cache_hits_total"  # tokens found
PREFIX_CACHE_EVICTIONS_TOTAL: Final = "brook_engine_prefix_cache_evictions_total"  # blocks
COMM_SECONDS_TOTAL: Final = "brook_engine_comm_seconds_total"  # label: kind
COMM_EXPOSED_SECONDS_TOTAL: Final = "brook_engine_comm_exposed_seconds_total"
STAGE_COMPUTE_SECONDS_TOTAL: Final = "brook_engine_stage_compute_seconds_total"  # label: stage
OFFLOAD_TRANSFER_SECONDS_TOTAL: Final = "brook_engine_offload_transfer_seconds_total"
OFFLOAD_EXPOSED_SECONDS_TOTAL: Final = "brook_engine_offload_transfer_exposed_seconds_total"
OFFLOAD_PLAN_CHANGES_TOTAL: Final = "brook_engine_offload_plan_changes_total"
COMPILE_CACHE_HITS_TOTAL: Final = "brook_engine_compile_cache_hits_total"  # steps
COMPILE_CACHE_MISSES_TOTAL: Final = "brook_engine_compile_cache_misses_total"  # steps
COMPILE_CACHE_EVICTIONS_TOTAL: Final = "brook_engine_compile_cache_evictions_total"
COMPILE_FAILURES_TOTAL: Final = "brook_engine_compile_failures_total"  # buckets
COMPILE_SECONDS_TOTAL: Final = "brook_engine_compile_seconds_total"
MOE_ROUTED_TOKENS_TOTAL: Final = "brook_engine_moe_routed_tokens_total"  # token slots
MOE_REROUTED_TOKENS_TOTAL: Final = "brook_engine_moe_rerouted_tokens_total"  # slots moved
MOE_EXPERT_TOKENS_TOTAL: Final = "brook_engine_moe_expert_tokens_total"  # label: expert

# Histograms (per finished request).
TIME_TO_FIRST_TOKEN_SECONDS: Final = "brook_engine_time_to_first_token_seconds"
TIME_PER_OUTPUT_TOKEN_SECONDS: Final = "brook_engine_time_per_output_token_seconds"
E2E_REQUEST_LATENCY_SECONDS: Final = "brook_engine_e2e_request_latency_seconds"
REQUEST_QUEUE_TIME_SECONDS: Final = "brook_engine_request_queue_time_seconds"

# Label values.
MEMORY_KINDS: Final = ("weights", "kv_cache", "activations")
OFFLOAD_WHERE: Final = ("resident", "slots", "streamed")
FINISH_REASONS: Final = ("stop", "length", "abort", "error")
COMM_KINDS: Final = ("all_reduce", "all_gather", "p2p", "control")
COLD_START_UNTIL: Final = ("ready", "first_token")  # from process start

# The names the Kubernetes inference ecosystem reads: the Gateway API Inference Extension's
# model-server protocol (queue, running, KV usage as a 0..1 ratio), under the plain names and
# under the vLLM names that its endpoint picker and most KEDA/HPA recipes read by default.
GATEWAY_NUM_REQUESTS_WAITING: Final = "num_requests_waiting"
GATEWAY_NUM_REQUESTS_RUNNING: Final = "num_requests_running"
GATEWAY_KV_CACHE_USAGE_PERC: Final = "kv_cache_usage_perc"
VLLM_NUM_REQUESTS_WAITING: Final = "vllm:num_requests_waiting"
VLLM_NUM_REQUESTS_RUNNING: Final = "vllm:num_requests_running"
VLLM_KV_CACHE_USAGE_PERC: Final = "vllm:kv_cache_usage_perc"
# The same figures under vLLM's names, where they mean the same thing, so the dashboards and
# recipes written for vLLM read Brook; all carry vLLM's ``model_name`` label. Brook's TPOT is
# a request's mean, which is vLLM's request_time_per_output_token (not its per-token ITL).
VLLM_PROMPT_TOKENS_TOTAL: Final = "vllm:prompt_tokens_total"
VLLM_GENERATION_TOKENS_TOTAL: Final = "vllm:generation_tokens_total"
VLLM_NUM_PREEMPTIONS_TOTAL: Final = "vllm:num_preemptions_total"
VLLM_PREFIX_CACHE_QUERIES_TOTAL: Final = "vllm:prefix_cache_queries_total"  # tokens
VLLM_PREFIX_CACHE_HITS_TOTAL: Final = "vllm:prefix_cache_hits_total"  # tokens
VLLM_REQUEST_SUCCESS_TOTAL: Final = "vllm:request_success_total"  # label: finished_reason
VLLM_TIME_TO_FIRST_TOKEN_SECONDS: Final = "vllm:time_to_first_token_seconds"
VLLM_REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS: Final = "vllm:request_time_per_output_token_seconds"
VLLM_E2E_REQUEST_LATENCY_SECONDS: Final = "vllm:e2e_request_latency_seconds"
VLLM_REQUEST_QUEUE_TIME_SECONDS: Final = "vllm:request_queue_time_seconds"
VLLM_MODEL_LABEL: Final = "model_name"
