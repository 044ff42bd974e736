"""The KV-cache tensors: one pair per layer, each stored in the dtype its layer policy names.

Slots are flat (``block * block_size + offset``); the block manager hands out blocks, the
runner turns block tables into slot indexes. Storage is head-major ([kv_heads, slots,
head_dim]), so the blocks of many sequences gather into the layout batched matmuls per head
want. FP8 E4M3 keeps a float32 scale per token and KV head (amax / 448), so a value never
saturates; FP8 E5M2 has the range to go without one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from brook_engine.config import KVDType

_FP8_E4M3_MAX = 448.0
_STORAGE = {
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8_e5m2": torch.float8_e5m2,
    "fp8_e4m3": torch.float8_e4m3fn,
}


def storage_dtype(kind: KVDType, compute_dtype: torch.dtype) -> torch.dtype:
    return compute_dtype if kind == "auto" else _STORAGE[kind]


def bytes_per_token(kind: KVDType, compute_dtype: torch.dtype, kv_heads: int, head_dim: int) -> int:
    """KV bytes one token takes in one layer (keys and values, scales included)."""
    element = storage_dtype(kind, compute_dtype).itemsize
    scales = 4 * kv_heads if kind == "fp8_e4m3" else 0
    return 2 * (kv_heads * head_dim * element + scales)


@dataclass
class LayerKVCache:
    k: torch.Tensor  # [kv_heads, slots, head_dim]
    v: torch.Tensor
    kind: KVDType
    compute_dtype: torch.dtype
    block_size: int
    k_scale: torch.Tensor | None = None  # [kv_heads, slots, 1], FP8 E4M3 only
    v_scale: torch.Tensor | None = None
    # Subtracted from every key before it is stored, [kv_heads, head_dim] in the compute
    # dtype. Attention is unchanged: a query's scores all move by q·shift, which softmax
    # ignores. The stored keys are smaller, so low precision rounds them less (calibration
    # sets it for the layers where it helps).
    k_shift: torch.Tensor | None = None

    @classmethod
    def allocate(
        cls,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        kind: KVDType,
        compute_dtype: torch.dtype,
        device: torch.device,
    ) -> LayerKVCache:
        dtype = storage_dtype(kind, compute_dtype)
        num_slots = num_blocks * block_size
        shape = (kv_heads, num_slots, head_dim)
        cache = cls(
            k=torch.zeros(shape, dtype=dtype, device=device),
            v=torch.zeros(shape, dtype=dtype, device=device),
            kind=kind,
            compute_dtype=compute_dtype,
            block_size=block_size,
        )
        if kind == "fp8_e4m3":
            scale_shape = (kv_heads, num_slots, 1)
            cache.k_scale = torch.ones(scale_shape, dtype=torch.float32, device=device)
            cache.v_scale = torch.ones(scale_shape, dtype=torch.float32, device=device)
        return cache

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [tokens, kv_heads, head_dim] at ``slots`` [tokens]."""
        if self.k_shift is not None:
            k = k - self.k_shift
        k, v = k.transpose(0, 1), v.transpose(0, 1)  # [kv_heads, tokens, head_dim]
        if self.k_scale is not None and self.v_scale is not None:
            k, k_scale = _quantize_e4m3(k)
            v, v_scale = _quantize_e4m3(v)
            self.k_scale.index_copy_(1, slots, k_scale)
            self.v_scale.index_copy_(1, slots, v_scale)
        _store(self.k, slots, k)
        _store(self.v, slots, v)

    def as_stored(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [tokens, kv_heads, head_dim] as ``read`` would return them after ``write``
        ([kv_heads, tokens, head_dim]): attention over a fresh prompt then sees exactly what
        a later chunk, a decode or a request sharing the prefix reads from the cache, so
        outputs do not depend on how a prompt was split or shared."""
        if self.k_shift is not None:
            k = k - self.k_shift
        k, v = k.transpose(0, 1), v.transpose(0, 1)
        dtype = self.k.dtype
        if self.k_scale is not None:
            (qk, sk), (qv, sv) = _quantize_e4m3(k), _quantize_e4m3(v)
            c = self.compute_dtype
            return qk.to(c) * sk.to(c), qv.to(c) * sv.to(c)
        if dtype == self.compute_dtype:
            return k, v
        return k.to(dtype).to(self.compute_dtype), v.to(dtype).to(self.compute_dtype)

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at ``slots`` (any shape S) as [kv_heads, *S, head_dim] in the
        compute dtype."""
        k = _load(self.k, slots).to(self.compute_dtype)
        v = _load(self.v, slots).to(self.compute_dtype)
        if self.k_scale is not None and self.v_scale is not None:
            k = k * self.k_scale[:, slots].to(self.compute_dtype)
            v = v * self.v_scale[:, slots].to(self.compute_dtype)
        return k, v

    def read_blocks(self, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole blocks of ``tables`` [sequences, blocks] as [kv_heads, sequences,
        blocks * block_size, head_dim]. Each head's blocks are copied with one index_select
        over contiguous block rows, far faster than a gather per token."""
        k = self._gather_blocks(self.k, tables).to(self.compute_dtype)
        v = self._gather_blocks(self.v, tables).to(self.compute_dtype)
        if self.k_scale is not None and self.v_scale is not None:
            k = k * self._gather_blocks(self.k_scale, tables).to(k.dtype)
            v = v * self._gather_blocks(self.v_scale, tables).to(v.dtype)
        return k, v

    def _gather_blocks(self, cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        raw = cache.view(torch.uint8) if _is_fp8(cache) else cache
        heads, slots, width = raw.shape
        blocks = slots // self.block_size
        rows = raw.view(heads * blocks, self.block_size * width)  # one row per (head, block)
        index = torch.arange(heads, device=tables.device)[:, None] * blocks + tables.reshape(1, -1)
        gathered = rows.index_select(0, index.reshape(-1)).view(heads, tables.shape[0], -1, width)
        return gathered.view(cache.dtype) if _is_fp8(cache) else gathered


def _is_fp8(t: torch.Tensor) -> bool:
    return t.dtype in (torch.float8_e5m2, torch.float8_e4m3fn)


def _store(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    # CPU kernels do not index float8 tensors: move their bytes as uint8.
    if _is_fp8(cache):
        cache.view(torch.uint8).index_copy_(1, slots, x.to(cache.dtype).view(torch.uint8))
    else:
        cache.index_copy_(1, slots, x.to(cache.dtype))


def _load(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    if _is_fp8(cache):
        return cache.view(torch.uint8)[:, slots].view(cache.dtype)
    return cache[:, slots]


def _quantize_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x32 = x.float()
    scale = (x32.abs().amax(dim=-1, keepdim=True) / _FP8_E4M3_MAX).clamp_min(1e-12)
    return (x32 / scale).to(torch.float8_e4m3fn), scale
