"""The int8-weight product on CPU.

With Brook's C kernels (``layers/csrc/int8_matmul.c``) every product runs there, over a
tiled copy of the weight made once at load time: each int8 weight is widened to float32 once
per pass and used for up to six rows, so one row streams the weight (half the bytes of BF16)
and a batch pays the widening once per six rows; AVX-512, AVX2 + FMA and portable C paths.
Without them (``BROOK_CPU_KERNELS=off``, no compiler), the weight is widened for PyTorch's
matrix multiply (PyTorch's own ``aten._weight_int8pack_mm`` was tried: fast for one row, but
slow for batches and it crashes the process on shapes it does not expect, e.g. 50 × 72).
Figures in docs/quantization.md.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from brook_engine.layers import cpu_kernels

TILE = 16  # output channels per tile of the packed layout

_ISA_NAMES = {"c": 0, "avx2": 1, "avx512": 2}


def isa_limit() -> int:
    """``BROOK_INT8_ISA`` (c, avx2 or avx512): the best path the kernel may take, so tests
    run every path on one machine; by default the best the CPU has."""
    return _ISA_NAMES.get(os.environ.get("BROOK_INT8_ISA", "avx512").lower(), 2)


def pack(q: torch.Tensor) -> torch.Tensor | None:
    """The tiled copy of int8 ``q`` [out, in] Brook's kernel reads (flat, ``out`` rounded up
    to 16), or None where the kernels do not run."""
    lib = cpu_kernels.library()
    if lib is None or q.device.type != "cpu":
        return None
    out, inn = q.shape
    packed = torch.empty(-(-out // TILE) * TILE * inn, dtype=torch.int8)
    q = q.contiguous()
    lib.brook_int8_pack(q.data_ptr(), packed.data_ptr(), out, inn)
    return packed


def unpack(packed: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """The plain int8 [out, in] weight of a tiled copy."""
    out, inn = shape
    tiles = packed.view(-1, inn, TILE)
    return tiles.permute(0, 2, 1).reshape(-1, inn)[:out].contiguous()


def packed_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale_f32: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
) -> torch.Tensor:
    """``x @ (q * scale).T + bias`` for x [rows, in] with Brook's kernel over the tiled
    copy; float32 sums, one rounding to ``x``'s dtype."""
    lib = cpu_kernels.library()
    assert lib is not None, "a tiled weight exists only where the kernels run"
    kind = {torch.float32: 0, torch.bfloat16: 1}.get(x.dtype)
    source = (x if kind is not None else x.float()).contiguous()
    rows, inn = source.shape
    out = torch.empty(rows, out_features, dtype=source.dtype)
    bias_f32 = None if bias is None else bias.float().contiguous()
    lib.brook_int8_matmul(
        source.data_ptr(),
        packed.data_ptr(),
        scale_f32.data_ptr(),
        None if bias_f32 is None else bias_f32.data_ptr(),
        out.data_ptr(),
        rows,
        out_features,
        inn,
        0 if kind is None else kind,
        _isa(lib),
        torch.get_num_threads(),
    )
    return out if kind is not None else out.to(x.dtype)


def plain_linear(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The same without Brook's kernels: the weight widened for this product."""
    return F.linear(x, q.to(x.dtype) * scale.to(x.dtype)[:, None], bias)


_isa_cache: dict[int, int] = {}


def _isa(lib: object) -> int:
    limit = isa_limit()
    if limit not in _isa_cache:
        _isa_cache[limit] = int(lib.brook_int8_isa(limit))  # type: ignore[attr-defined]
    return _isa_cache[limit]
