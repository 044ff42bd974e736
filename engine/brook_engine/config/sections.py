"""``EngineSections``: the configuration sections the engine's ``EngineConfig`` and the
operator's ``LLMInference`` spec both hold, declared once.

The attribute docstrings are the descriptions in the CRD. Pydantic lists inherited fields
first, so a class that wants fields before these sections puts them in a base listed after
``EngineSections`` (see ``EngineConfig``).
"""

from __future__ import annotations

from pydantic import Field

from brook_engine.config.base import Section
from brook_engine.config.kv_cache import KVCacheConfig
from brook_engine.config.offload import OffloadConfig
from brook_engine.config.parallel import ParallelConfig
from brook_engine.config.runtime import MoEConfig, QuantizationConfig, SchedulerConfig, ShapesConfig


class EngineSections(Section):
    """The engine's tuning sections, the same in the engine's file and in the CRD."""

    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    """Tensor and pipeline parallelism of one replica."""

    offload: OffloadConfig = Field(default_factory=OffloadConfig)
    """Weight offload to host memory."""

    kv_cache: KVCacheConfig = Field(default_factory=KVCacheConfig)
    """The paged KV cache."""

    quantization: QuantizationConfig = Field(default_factory=QuantizationConfig)
    """Weight quantization."""

    shapes: ShapesConfig = Field(default_factory=ShapesConfig)
    """Shape buckets and compiled kernels."""

    moe: MoEConfig = Field(default_factory=MoEConfig)
    """Mixture-of-experts routing."""

    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    """Continuous batching."""
