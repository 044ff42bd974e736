"""Decode attention on CPU by a small C kernel (``csrc/paged_decode.c``, built and loaded by
``cpu_kernels``): one query per sequence, keys and values read in place from the paged cache
in whatever type they are stored, so a step neither gathers the context into a padded copy
nor widens it first.

The batched-matmul path in ``attention.py`` stays the portable one (and the reference the
kernel is tested against); on CPU the kernel replaces it where the kernels are available.
"""

from __future__ import annotations

from typing import Any

import torch

from brook_engine.kv.cache import LayerKVCache
from brook_engine.layers import cpu_kernels

_KINDS = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.float16: 2,
    torch.int8: 3,
    torch.float8_e5m2: 4,
    torch.float8_e4m3fn: 4,
}
_LUT8 = 4
_luts: dict[torch.dtype, torch.Tensor] = {}


def kernel_enabled() -> bool:
    """Whether decode attention on CPU runs the C kernel (building it on the first call)."""
    return cpu_kernels.enabled()


def _lut(dtype: torch.dtype) -> torch.Tensor:
    """The 256 values of an 8-bit float type, as float32 (what ``.float()`` makes of them)."""
    table = _luts.get(dtype)
    if table is None:
        table = torch.arange(256, dtype=torch.uint8).view(dtype).float().contiguous()
        _luts[dtype] = table
    return table


def query(cache: LayerKVCache, q: torch.Tensor) -> torch.Tensor:
    """``cache.query(q)``: for an INT8 layer the query turned by its folded map in one C
    call (the torch path is a chain of small ops a layer, ~45 us at 16 rows)."""
    mapped = _head_map(cache, q, "query")
    return cache.query(q) if mapped is None else mapped


def output(cache: LayerKVCache, out: torch.Tensor) -> torch.Tensor:
    """``cache.output(out)``, an INT8 layer's by the C kernel as ``query``."""
    mapped = _head_map(cache, out, "output")
    return cache.output(out) if mapped is None else mapped.to(cache.compute_dtype)


def _head_map(cache: LayerKVCache, x: torch.Tensor, name: str) -> torch.Tensor | None:
    """x [tokens, heads, head_dim] by the per-head map ``name`` of an INT8 layer, float32;
    None where the kernel does not apply."""
    if x.device.type != "cpu" or cache.int8 is None:
        return None
    library = cpu_kernels.library()
    if library is None or not hasattr(library, "brook_head_map"):
        return None  # (a prebuilt library from before the kernel lacks it)
    tokens, heads, dim = x.shape
    matrix, offset = cache.int8.maps(name, heads)
    if matrix.shape != (heads, dim, dim) or matrix.device.type != "cpu":
        return None
    rows = x.float()
    if rows.stride()[1:] != (dim, 1):
        rows = rows.contiguous()
    out = torch.empty((tokens, heads, dim), dtype=torch.float32)
    status = library.brook_head_map(
        rows.data_ptr(),
        matrix.data_ptr(),
        None if offset is None else offset.data_ptr(),
        out.data_ptr(),
        tokens,
        heads,
        dim,
        rows.stride(0),
        torch.get_num_threads(),
    )
    return out if status == 0 else None


def store(cache: LayerKVCache, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """``cache.write(slots, k, v)`` by a C kernel: where the cache holds k and v as they are
    (their own type, no shift or scales) a memcpy per token and head instead of two
    ``index_copy_`` calls; an INT8 layer's rows turned and rounded in one pass. False, with
    nothing written, where it does not apply."""
    library = cpu_kernels.library()
    if library is not None and cache.int8 is not None:
        return _store_int8(library, cache, slots, k, v)
    if (
        library is None
        or cache.k_shift is not None
        or cache.k_scale is not None
        or k.dtype != cache.k.dtype
        or v.dtype != k.dtype
        or k.device.type != "cpu"
        or slots.dtype != torch.int64
        or not slots.is_contiguous()
    ):
        return False
    tokens, kv_heads, dim = k.shape
    stride = k.stride()
    if stride != v.stride() or stride[1:] != (dim, 1) or v.shape != k.shape:
        return False
    status = library.brook_kv_store(
        k.data_ptr(),
        v.data_ptr(),
        cache.k.data_ptr(),
        cache.v.data_ptr(),
        slots.data_ptr(),
        tokens,
        kv_heads,
        dim,
        stride[0],
        cache.k.shape[1],
        k.element_size(),
    )
    if status != 0:
        raise IndexError(f"KV store: a slot outside the cache's {cache.k.shape[1]} slots")
    return True


def _store_int8(
    library: Any, cache: LayerKVCache, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> bool:
    """An INT8 layer's ``cache.write``: each row turned by the layer's folded map, rounded
    and written at its slot in one pass (the torch path runs a chain of ops per call)."""
    params = cache.int8
    if (
        params is None
        or not hasattr(library, "brook_kv_store_int8")  # a prebuilt library from before it
        or cache.k_shift is not None
        or k.device.type != "cpu"
        or cache.k.dtype != torch.int8
        or v.shape != k.shape
        or not (cache.k.is_contiguous() and cache.v.is_contiguous())
        or slots.dtype != torch.int64
        or not slots.is_contiguous()
        or slots.shape != (k.shape[0],)
    ):
        return False
    tokens, kv_heads, dim = k.shape
    if cache.k.shape[0] != kv_heads or cache.k.shape[2] != dim or cache.v.shape != cache.k.shape:
        return False
    plan = []
    for x, name, target in ((k, "keys", cache.k), (v, "values", cache.v)):
        matrix, offset = params.maps(name)
        if (
            offset is None
            or matrix.shape != (kv_heads, dim, dim)
            or matrix.dtype != torch.float32
            or matrix.device.type != "cpu"
            or offset.shape != (kv_heads, 1, dim)
        ):
            return False
        rows = x.float()
        if rows.stride()[1:] != (dim, 1):
            rows = rows.contiguous()
        plan.append((rows, matrix, offset, target))
    for rows, matrix, offset, target in plan:
        status = library.brook_kv_store_int8(
            rows.data_ptr(),
            matrix.data_ptr(),
            offset.data_ptr(),
            target.data_ptr(),
            slots.data_ptr(),
            tokens,
            kv_heads,
            dim,
            rows.stride(0),
            target.shape[1],
            torch.get_num_threads(),
        )
        if status == -1:
            raise IndexError(f"KV store: a slot outside the cache's {target.shape[1]} slots")
        if status != 0:
            return False  # head_dim beyond the kernel's bound: the portable path
    return True


def decode_attention(
    q: torch.Tensor,  # [decodes, heads, head_dim], as ``cache.query`` returns it
    cache: LayerKVCache,
    tables: torch.Tensor,  # [decodes, width] int64 block ids
    lens: torch.Tensor,  # [decodes] int64 context lengths (the new token included)
    scale: float,
    window: int | None,
) -> torch.Tensor | None:
    """Float32 attention output [decodes, heads, head_dim], or None when the kernel is not
    available here (the caller then runs the portable path)."""
    library = cpu_kernels.library()
    kind = _KINDS.get(cache.k.dtype)
    if library is None or kind is None or q.device.type != "cpu":
        return None
    decodes, heads, dim = q.shape
    kv_heads, slots, _ = cache.k.shape
    q32 = q.to(torch.float32).contiguous()
    tables = tables.to(torch.int64).contiguous()
    lens = lens.to(torch.int64).contiguous()
    out = torch.empty((decodes, heads, dim), dtype=torch.float32)
    lut = _lut(cache.k.dtype) if kind == _LUT8 else None
    k_scale, v_scale = cache.k_scale, cache.v_scale
    status = library.brook_paged_decode(
        q32.data_ptr(),
        cache.k.data_ptr(),
        cache.v.data_ptr(),
        None if k_scale is None else k_scale.data_ptr(),
        None if v_scale is None else v_scale.data_ptr(),
        tables.data_ptr(),
        lens.data_ptr(),
        out.data_ptr(),
        decodes,
        heads,
        kv_heads,
        dim,
        slots,
        cache.block_size,
        tables.shape[1],
        window or 0,
        kind,
        None if lut is None else lut.data_ptr(),
        scale,
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("decode attention: the kernel could not allocate its scratch memory")
    return out
