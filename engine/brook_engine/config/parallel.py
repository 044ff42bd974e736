"""How one replica's devices split the model."""

from __future__ import annotations

from pydantic import Field

from brook_engine.config.base import Section


class ParallelConfig(Section):
    """Tensor and pipeline parallel degrees of one replica (devices = tensor × pipeline)."""

    tensor: int = Field(default=1, ge=1, le=64)
    """Tensor-parallel degree: devices that split every layer's weights and KV heads."""

    pipeline: int = Field(default=1, ge=1, le=64)
    """Pipeline-parallel degree: stages that each hold a contiguous range of layers."""

    micro_batches: int | None = Field(default=None, ge=1, le=256)
    """Micro-batches in flight through the pipeline; defaults to the pipeline degree, the
    fewest that keep every stage busy."""

    @property
    def world_size(self) -> int:
        return self.tensor * self.pipeline

    @property
    def num_micro_batches(self) -> int:
        return self.micro_batches if self.micro_batches is not None else self.pipeline
