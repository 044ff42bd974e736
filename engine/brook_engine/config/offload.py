"""Which weights stay on the device and which stream from host memory."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from brook_engine.config.base import Section

OffloadPolicy = Literal["none", "static", "adaptive"]
LayerKind = Literal["attention", "ffn"]


def _attention_first() -> list[LayerKind]:
    return ["attention"]


class OffloadConfig(Section):
    """Weight offload between device memory and pinned host memory."""

    policy: OffloadPolicy = "none"
    """none: every weight on the device. static: a plan fixed at start-up from the budget.
    adaptive: the static plan to start with; while requests wait for KV blocks more weights
    stream and the KV cache grows into their room, and they come back once the pressure is
    gone (every rank of a replica moves in step)."""

    device_memory_limit_gb: float | None = Field(default=None, gt=0, le=4096)
    """Device memory the weights may use, in GiB; required unless policy is none."""

    cpu_memory_pool_gb: float | None = Field(default=None, gt=0, le=65536)
    """Pinned host memory for offloaded weights, in GiB; defaults to what they need."""

    priority_layers: list[LayerKind] = Field(default_factory=_attention_first, max_length=2)
    """Kinds of weights kept resident first when the budget cannot hold them all."""

    prefetch_layers: int = Field(default=1, ge=0, le=64)
    """Layers fetched ahead of compute on a side stream."""

    @model_validator(mode="after")
    def _budget_given(self) -> OffloadConfig:
        if self.policy != "none" and self.device_memory_limit_gb is None:
            raise ValueError(
                f"deviceMemoryLimitGb is required when policy is {self.policy!r}; "
                "set it to the GiB the weights may use, or set policy: none"
            )
        if len(set(self.priority_layers)) != len(self.priority_layers):
            raise ValueError("priorityLayers lists a kind twice; list each kind once")
        return self
