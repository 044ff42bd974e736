"""The engine's memory plan for a manifest (``brook validate --model-config``, and the
operator where it can read the model's config.json): the plan is torch-free and shared with
the engine (``brook_engine.offload.plan``), so a budget that cannot hold a rank's weights is
refused here, with the numbers, before a pod crash-loops; and a pod that sets no memory
request gets the one its plan implies."""

from __future__ import annotations

from typing import Any

from brook_engine.config import ConfigError
from brook_engine.offload.command import plan_for
from brook_engine.offload.plan import GIB, MemoryPlan, RankPlan, Target
from brook_operator.api import LLMInference, topology
from brook_operator.api.spec import to_engine_config


def manifest_plan(
    llmi: LLMInference,
    model_config: dict[str, Any],
    device_memory_gb: float | None,
    dtype: str | None = None,
) -> MemoryPlan:
    """The plan of ``llmi``'s ranks; ``ConfigError`` (a ``PlanError`` for a budget that
    cannot hold them) naming the field. ``dtype``: the one to plan a ``dtype: auto`` model
    in (by default the larger the engine may pick)."""
    config = to_engine_config(llmi.spec)
    device = llmi.spec.accelerator.type
    if config.model.dtype != "auto":
        dtype = config.model.dtype
    elif dtype is None:  # as the engine picks: bf16 on accelerators; on CPU it depends on
        dtype = "bfloat16" if device != "cpu" else "float32"  # the node (float32: larger)
    target = Target(
        device=device,
        dtype=dtype,
        cpu_packs_float=device == "cpu",
        cpu_tiles_int8=device == "cpu",
        device_memory_bytes=None if device_memory_gb is None else int(device_memory_gb * GIB),
    )
    return plan_for(config, model_config, target)


def fitting_plan(
    llmi: LLMInference, model_config: dict[str, Any], device_memory_gb: float | None = None
) -> MemoryPlan:
    """The plan to size ``llmi``'s pods by; ``ConfigError`` only where no dtype the engine
    may pick fits (on CPU ``dtype: auto`` is bfloat16 on nodes with AVX-512 BF16 or AMX and
    float32 elsewhere: the larger sizes the pods, the smaller decides whether it can run)."""
    try:
        return manifest_plan(llmi, model_config, device_memory_gb)
    except ConfigError:
        if llmi.spec.model.dtype != "auto" or llmi.spec.accelerator.type != "cpu":
            raise
        return manifest_plan(llmi, model_config, device_memory_gb, dtype="bfloat16")


#: What one engine process holds besides weights and KV: Python, torch, the runtime's caches
#: (0.5-1.0 GiB measured on CPU in the soak, docs/reliability.md).
PROCESS_BYTES = GIB


def memory_request_bytes(llmi: LLMInference, plan: MemoryPlan) -> int:
    """Host memory one pod of ``llmi`` needs by its plan: per rank (each its own process),
    what lives in host memory — on CPU the device is the host: resident weights, slots and
    the KV cache; on an accelerator the pool of streamed weights, and the staging buffers
    reads from disk go through — plus the process itself; times the ranks a pod runs.
    Weights read from disk on demand are page cache, not counted."""
    shape = topology(llmi.spec)
    ranks_per_pod = shape.devices_per_replica // shape.pods_per_replica
    on_cpu = plan.target.device == "cpu"

    def host(rank: RankPlan) -> int:
        held = rank.host_bytes
        if on_cpu:
            held += rank.device_bytes + rank.kv.get("bytes", 0)
        elif rank.disk_bytes:
            held += rank.slot_bytes  # pinned staging for reads from the spill file
        return held + PROCESS_BYTES

    return ranks_per_pod * max(host(rank) for rank in plan.ranks)


def with_memory_request(llmi: LLMInference, request: str | None) -> LLMInference:
    """``llmi`` with ``resources.requests.memory`` = ``request`` where the spec sets no
    memory request or limit (with a limit Kubernetes requests the limit; a request only
    schedules the pod where the memory is, no limit is added)."""
    resources = llmi.spec.resources
    if request is None or "memory" in resources.requests or "memory" in resources.limits:
        return llmi
    resources = resources.model_copy(update={"requests": {**resources.requests, "memory": request}})
    spec = llmi.spec.model_copy(update={"resources": resources})
    return llmi.model_copy(update={"spec": spec})


def memory_request(llmi: LLMInference, plan: MemoryPlan) -> str:
    """The plan's memory request of one pod, as a Kubernetes quantity (MiB, rounded up)."""
    return f"{-(-memory_request_bytes(llmi, plan) // (1024 * 1024))}Mi"
