"""``brook-engine bench``: throughput and latency of the engine on a synthetic workload, and
the same workload on peers (transformers, vLLM's CPU build) for comparison."""
