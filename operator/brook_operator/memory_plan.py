"""The engine's memory plan for a manifest (``brook validate --model-config``): the plan is
torch-free and shared with the engine (``brook_engine.offload.plan``), so a budget that
cannot hold a rank's weights is refused here, with the numbers, before a pod crash-loops."""

from __future__ import annotations

from typing import Any

from brook_engine.offload.command import plan_for
from brook_engine.offload.plan import GIB, MemoryPlan, Target
from brook_operator.api import LLMInference
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
