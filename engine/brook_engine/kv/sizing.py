"""How large this rank's KV cache is: bytes per token under the layer policy, the block count
a memory budget holds, and the cache tensors themselves, allocated per layer in its storage
dtype (with the calibration's shifts and INT8 parameters attached)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from brook_engine.config import EngineConfig, KVDType
from brook_engine.kv.cache import LayerKVCache, bytes_per_token
from brook_engine.kv.calibration import Calibration


@dataclass(frozen=True)
class KVLayout:
    """This rank's share of the cache: a storage kind per local layer, its KV heads."""

    layer_kinds: list[KVDType]
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # the model's compute dtype ("auto" layers store in it)

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token takes in this rank's layers."""
        return sum(self._layer_bytes(kind) for kind in self.layer_kinds)

    def bytes_by_dtype(self, num_blocks: int) -> dict[str, int]:
        """Bytes ``num_blocks`` blocks take in this rank's layers of each storage dtype."""
        out: dict[str, int] = {}
        for kind in self.layer_kinds:
            name = str(self.dtype).removeprefix("torch.") if kind == "auto" else kind
            per_token = self._layer_bytes(kind)
            out[name] = out.get(name, 0) + per_token * num_blocks * self.block_size
        return out

    def allocate(
        self, num_blocks: int, device: torch.device, calibration: Calibration | None = None
    ) -> list[LayerKVCache]:
        """One cache per layer, holding ``num_blocks`` blocks."""
        caches = [
            LayerKVCache.allocate(
                num_blocks,
                self.block_size,
                self.num_kv_heads,
                self.head_dim,
                kind,
                self.dtype,
                device,
            )
            for kind in self.layer_kinds
        ]
        if calibration is not None:
            for cache, shift, int8 in zip(
                caches, calibration.shifts, calibration.int8, strict=True
            ):
                cache.k_shift, cache.int8 = shift, int8
        return caches

    def _layer_bytes(self, kind: KVDType) -> int:
        return bytes_per_token(kind, self.dtype, self.num_kv_heads, self.head_dim)


def num_blocks(
    config: EngineConfig, max_model_len: int, bytes_per_token: int, budget: Callable[[], int]
) -> int:
    """Blocks the cache holds: ``kvCache.numBlocks`` when set, else what the device's
    ``budget()`` bytes (times ``memoryFraction``) hold, but no more than every sequence slot
    at full length needs."""
    kv = config.kv_cache
    if kv.num_blocks is not None:
        return kv.num_blocks
    max_seq = kv.max_seq_len or max_model_len
    blocks_per_seq = -(-max_seq // kv.block_size)
    fraction = kv.effective_memory_fraction or 0.9
    per_block = max(1, bytes_per_token) * kv.block_size
    budget_blocks = int(budget() * fraction) // per_block
    enough = config.scheduler.max_num_seqs * blocks_per_seq
    return max(1, min(budget_blocks, enough))


def cache_bytes(caches: list[LayerKVCache]) -> int:
    """Bytes the allocated cache tensors take (scales included)."""
    return sum(
        t.numel() * t.element_size()
        for c in caches
        for t in (c.k, c.v, c.k_scale, c.v_scale)
        if t is not None
    )
