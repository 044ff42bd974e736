"""How one replica's devices split the model."""

from __future__ import annotations

from pydantic import Field, model_validator

from brook_engine.config.base import Section


class ParallelConfig(Section):
    """Tensor and pipeline parallel degrees of one replica (devices = tensor × pipeline)."""

    tensor: int = Field(default=1, ge=1, le=64)
    """Tensor-parallel degree: devices that split every layer's weights and KV heads."""

    pipeline: int = Field(default=1, ge=1, le=64)
    """Pipeline-parallel degree: stages that each hold a contiguous range of layers."""

    micro_batches: int | None = Field(default=None, ge=1, le=64)
    """Micro-batches a step is split into on its way through the pipeline (with tensor
    parallelism alone, 2 interleaves the all-reduces). Unset: start at the pipeline degree
    (the fewest that keep every stage busy; 1 without a pipeline, or when a step per stage
    is in flight — see ``stepsInFlight``) and let the overlap
    monitor try more while communication stays exposed, keeping them only if throughput
    holds; set: exactly this many, never changed."""

    steps_in_flight: int | None = Field(default=None, ge=1, le=64)
    """Steps a pipeline runs at once, each over its own sequences: the first stage starts
    the next step while the later stages finish this one (the idea of vLLM's virtual
    engines). Unset: the pipeline degree, so every stage has a step to work on; 1: one step
    at a time (only micro-batches fill the pipeline). No effect without a pipeline."""

    stage_layers: list[int] | None = Field(default=None, min_length=1)
    """Decoder layers per pipeline stage, first stage first (e.g. [13, 11]); unset: split
    by cost so that the stages holding the embedding and the LM head get fewer layers."""

    timeout_seconds: float = Field(default=120.0, gt=0, le=3600)
    """How long a rank waits for the others (rendezvous, and any one collective) before the
    replica gives up, reports not ready and exits non-zero."""

    @model_validator(mode="after")
    def _stages_match(self) -> ParallelConfig:
        layers = self.stage_layers
        if layers is not None:
            if len(layers) != self.pipeline:
                raise ValueError(
                    f"parallel.stageLayers lists {len(layers)} stages but parallel.pipeline is "
                    f"{self.pipeline}; give one layer count per stage"
                )
            if min(layers) < 1:
                raise ValueError("parallel.stageLayers: every stage needs at least one layer")
        return self

    @property
    def world_size(self) -> int:
        return self.tensor * self.pipeline
