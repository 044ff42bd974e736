"""The paged KV cache: its size, the precision each layer stores, and prefix sharing."""

from __future__ import annotations

import math
from itertools import pairwise
from typing import Literal

from pydantic import Field, model_validator

from brook_engine.config.base import Section

#: How a layer's keys and values are stored. auto: the model's compute dtype.
KVDType = Literal["auto", "fp8_e5m2", "fp8_e4m3", "int8", "fp16", "bf16"]

#: Block sizes the attention kernels support.
BlockSize = Literal[8, 16, 32, 64, 128, 256]

#: Memory fraction used when neither memoryFraction nor numBlocks is set.
DEFAULT_MEMORY_FRACTION = 0.9

#: On CPU host memory is shared with everything else: the cache is sized from at most this
#: (unless numBlocks says otherwise), as vLLM's CPU backend does.
CPU_KV_CACHE_CAP = 4 << 30

#: Bytes of one stored element of each storage kind but ``auto`` (the compute dtype's).
KV_ELEMENT_BYTES: dict[str, int] = {"fp8_e5m2": 1, "fp8_e4m3": 1, "int8": 1, "fp16": 2, "bf16": 2}


def kv_bytes_per_token(kind: KVDType, compute_bytes: int, kv_heads: int, head_dim: int) -> int:
    """KV bytes one token takes in one layer (keys and values, scales included); torch-free,
    so the memory plan counts what the cache allocates."""
    element = compute_bytes if kind == "auto" else KV_ELEMENT_BYTES[kind]
    scales = 4 * kv_heads if kind == "fp8_e4m3" else 0
    return 2 * (kv_heads * head_dim * element + scales)


class LayerPolicy(Section):
    """The storage dtype of a range of layers, given as fractions of the depth, so one policy
    fits models of any depth: [start, end) — layer i is covered when
    start <= i / num_layers < end (end 1.0 includes the last layer)."""

    start: float = Field(ge=0, le=1)
    """Start of the range as a fraction of the layers (inclusive)."""

    end: float = Field(ge=0, le=1)
    """End of the range as a fraction of the layers (exclusive; 1.0 is the last layer)."""

    dtype: KVDType
    """Storage dtype of the range: fp8_e5m2 (no scale), fp8_e4m3 (a scale per token and
    head), int8 (per-channel scales fixed by the start-up calibration, in a rotated basis:
    the KV format Ascend NPUs store natively), fp16, bf16, or auto (the model dtype)."""

    @model_validator(mode="after")
    def _ordered(self) -> LayerPolicy:
        if self.start >= self.end:
            raise ValueError(
                f"start ({self.start}) must be below end ({self.end}); ranges are [start, end)"
            )
        return self


def seed_layer_policies() -> list[LayerPolicy]:
    """The default: early layers, whose KV errors attention averages out, in FP8 E5M2; the
    middle in INT8 (the most precise byte: per-channel scales in a rotated basis); the late
    layers, which shape the output most, in FP16. Calibration moves an early layer whose
    error is too high to E4M3 or INT8 (the same byte) before it would take 16 bits."""
    return [
        LayerPolicy(start=0.0, end=0.3, dtype="fp8_e5m2"),
        LayerPolicy(start=0.3, end=0.7, dtype="int8"),
        LayerPolicy(start=0.7, end=1.0, dtype="fp16"),
    ]


class DynamicPrecisionConfig(Section):
    """Calibration that moves error-sensitive layers to the fallback precision."""

    enabled: bool = True
    """Measure each low-precision layer's error at start-up and fall back where it is high."""

    sensitivity_threshold: float = Field(default=0.05, gt=0, le=1)
    """Largest relative error of a layer's attention output that its low precision may add."""

    fallback_dtype: Literal["fp16", "bf16", "auto"] = "fp16"
    """Storage dtype of layers above the threshold."""

    calibration_file: str | None = Field(default=None, min_length=1, max_length=4096)
    """Text file to calibrate on; built-in text when unset."""


class PrefixSharingConfig(Section):
    """Reuse of KV blocks between requests that share a prompt prefix."""

    enabled: bool = True
    """Share full KV blocks of identical prefixes."""

    min_prefix_len: int | None = Field(default=None, ge=0, le=1_048_576)
    """Shortest prefix shared, in tokens: a multiple of blockSize (only full blocks are
    shared); one block when unset."""

    hash: Literal["xxh64", "xxh3"] = "xxh64"
    """Hash chaining block keys; tokens are compared on every hit, so a collision cannot
    return another request's KV."""

    eviction: Literal["lru", "lfu"] = "lru"
    """Which cached, unreferenced block is evicted first: least recently or least frequently
    used."""


class KVCacheConfig(Section):
    """The paged KV cache."""

    block_size: BlockSize = 16
    """Tokens per KV block."""

    max_seq_len: int | None = Field(default=None, ge=1, le=1_048_576)
    """Longest sequence the cache must hold, in tokens; defaults to the model's length."""

    memory_fraction: float | None = Field(default=None, gt=0, le=1)
    """Fraction of the device memory left after weights that the cache takes; 0.9 when
    neither this nor numBlocks is set."""

    num_blocks: int | None = Field(default=None, ge=1, le=16_777_216)
    """Exact number of KV blocks (instead of memoryFraction)."""

    layer_policies: list[LayerPolicy] = Field(default_factory=seed_layer_policies, max_length=16)
    """Storage dtype by layer range. Layers no range covers use the model dtype."""

    dynamic_precision: DynamicPrecisionConfig = Field(default_factory=DynamicPrecisionConfig)
    """Per-layer fallback to a higher precision where the measured error is too high."""

    prefix_sharing: PrefixSharingConfig = Field(default_factory=PrefixSharingConfig)
    """Prefix sharing between requests."""

    @model_validator(mode="after")
    def _consistent(self) -> KVCacheConfig:
        if self.memory_fraction is not None and self.num_blocks is not None:
            raise ValueError("set memoryFraction or numBlocks, not both")
        ranges = sorted(self.layer_policies, key=lambda p: p.start)
        for before, after in pairwise(ranges):
            if after.start < before.end:
                raise ValueError(
                    f"layerPolicies ranges [{before.start}, {before.end}) and "
                    f"[{after.start}, {after.end}) overlap; make each layer fall in one range"
                )
        min_prefix = self.prefix_sharing.min_prefix_len
        if min_prefix is not None and min_prefix % self.block_size:
            up = math.ceil(min_prefix / self.block_size) * self.block_size
            raise ValueError(
                f"prefixSharing.minPrefixLen ({min_prefix}) is not a multiple of blockSize "
                f"({self.block_size}); only full blocks are shared, so use {up}"
            )
        return self

    @property
    def effective_memory_fraction(self) -> float | None:
        """The fraction to size the cache by, or None when numBlocks fixes it."""
        if self.num_blocks is not None:
            return None
        return (
            self.memory_fraction if self.memory_fraction is not None else (DEFAULT_MEMORY_FRACTION)
        )

    @property
    def needs_calibration(self) -> bool:
        """Whether start-up runs the calibration pass: for dynamic precision, or for the
        scales of INT8 layers."""
        return self.dynamic_precision.enabled or any(p.dtype == "int8" for p in self.layer_policies)

    @property
    def effective_min_prefix_len(self) -> int:
        """Shortest shared prefix in tokens (one block unless configured)."""
        configured = self.prefix_sharing.min_prefix_len
        return self.block_size if configured is None else configured

    def layer_dtypes(self, num_layers: int) -> list[KVDType]:
        """Storage dtype of each of ``num_layers`` layers (before dynamic fallback)."""
        dtypes: list[KVDType] = []
        for layer in range(num_layers):
            position = layer / num_layers
            dtype: KVDType = "auto"
            for policy in self.layer_policies:
                if policy.start <= position < policy.end:
                    dtype = policy.dtype
                    break
            dtypes.append(dtype)
        return dtypes
