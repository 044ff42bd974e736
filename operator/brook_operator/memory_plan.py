"""The engine's memory plan for a manifest (``brook validate --model-config``, and the
operator where it can read the model's config.json): the plan is torch-free and shared with
the engine (``brook_engine.offload.plan``), so a budget that cannot hold a rank's weights is
refused here, with the numbers, before a pod crash-loops; and a pod that sets no memory
request gets the one its plan implies."""

from __future__ import annotations

from typing import Any

from brook_engine.offload.command import plan_for
from brook_engine.offload.plan import GIB, MemoryPlan, RankPlan, Target
from brook_operator.api import LLMInference, topology
from brook_operator.api.spec import to_engine_config


def manifest_plan(
    llmi: LLMInference, model_config: dict[str, Any], device_memory_gb: float | None
) -> MemoryPlan:
    """The plan of ``llmi``'s ranks; ``ConfigError`` (a ``PlanError`` for a budget that
    cannot hold them) naming the field."""
    config = to_engine_config(llmi.spec)
    device = llmi.spec.accelerator.type
    dtype = config.model.dtype
    if dtype == "auto":  # as the engine picks: bf16 on accelerators; on CPU it depends on
        dtype = "bfloat16" if device != "cpu" else "float32"  # the node (float32: the larger)
    target = Target(
        device=device,
        dtype=dtype,
        cpu_packs_float=device == "cpu",
        cpu_tiles_int8=device == "cpu",
        device_memory_bytes=None if device_memory_gb is None else int(device_memory_gb * GIB),
    )
    return plan_for(config, model_config, target)


#: What an engine process holds besides weights and KV: Python, torch, the runtime's caches
#: (0.5-1.0 GiB measured on CPU in the soak, docs/reliability.md).
PROCESS_BYTES = GIB


def memory_request_bytes(llmi: LLMInference, plan: MemoryPlan) -> int:
    """Host memory one pod of ``llmi`` needs by its plan: per rank, what lives in host
    memory (on CPU the device is the host: resident weights, slots and the KV cache; on an
    accelerator the pinned pool of streamed weights), for the ranks a pod runs, plus the
    process itself. Weights read from disk on demand are page cache, not counted."""
    shape = topology(llmi.spec)
    ranks_per_pod = shape.devices_per_replica // shape.pods_per_replica
    on_cpu = plan.target.device == "cpu"

    def host(rank: RankPlan) -> int:
        held = rank.host_bytes
        if on_cpu:
            held += rank.device_bytes + rank.kv.get("bytes", 0)
        return held

    return ranks_per_pod * max(host(rank) for rank in plan.ranks) + PROCESS_BYTES


def with_memory_request(llmi: LLMInference, plan: MemoryPlan) -> LLMInference:
    """``llmi`` with ``resources.requests.memory`` from its plan, where it sets none (a
    request only schedules the pod where the memory is; no limit is added)."""
    requests = llmi.spec.resources.requests
    if "memory" in requests:
        return llmi
    mebibytes = -(-memory_request_bytes(llmi, plan) // (1024 * 1024))
    resources = llmi.spec.resources.model_copy(
        update={"requests": {**requests, "memory": f"{mebibytes}Mi"}}
    )
    spec = llmi.spec.model_copy(update={"resources": resources})
    return llmi.model_copy(update={"spec": spec})
