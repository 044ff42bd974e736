"""The int8-weight product on CPU.

With Brook's C kernels (``layers/csrc/int8_matmul.c``) every product runs there, over a
tiled copy of the weight made once at load time: each int8 weight is widened to float32 once
per pass and used for up to six rows, the sums of each group of input channels scaled as
the group ends, so one row streams the weight (half the bytes of BF16)
and a batch pays the widening once per six rows; AVX-512, AVX2 + FMA and portable C paths.
Without them (``BROOK_CPU_KERNELS=off``, no compiler), the weight is widened for PyTorch's
matrix multiply (PyTorch's own ``aten._weight_int8pack_mm`` was tried: fast for one row, but
slow for batches and it crashes the process on shapes it does not expect, e.g. 50 × 72).
Figures in docs/quantization.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from brook_engine.layers import cpu_kernels
from brook_engine.quant.quantize import dequantize

TILE = 16  # output channels per tile of the packed layout


def isa_limit() -> int:
    """The best path the kernel may take (``BROOK_CPU_ISA``: c, avx2 or avx512), so tests run
    every path on one machine; by default the best the CPU has."""
    return min(cpu_kernels.isa_limit(), 2)


@dataclass(frozen=True)
class TiledWeight:
    """What Brook's kernel reads: the int8 weight in tiles of 16 output channels (flat,
    ``out`` rounded up to 16), the scales as float32 [groups, out rounded up to 16] and
    the bias as float32."""

    packed: torch.Tensor
    scales: torch.Tensor
    out_features: int
    in_features: int
    bias: torch.Tensor | None = None  # float32, converted once here rather than per product

    @property
    def group_size(self) -> int:
        return self.in_features // self.scales.shape[0]

    @property
    def nbytes(self) -> int:
        bias = 0 if self.bias is None else self.bias.numel() * 4
        return self.packed.numel() + self.scales.numel() * 4 + bias

    def int8(self) -> torch.Tensor:
        """The plain int8 [out, in] weight back."""
        tiles = self.packed.view(-1, self.in_features, TILE)
        plain = tiles.permute(0, 2, 1).reshape(-1, self.in_features)
        return plain[: self.out_features].contiguous()


def tile(
    q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> TiledWeight | None:
    """The tiled copy of int8 ``q`` [out, in] with ``scale`` [out, groups] and ``bias``
    [out], or None where Brook's kernels do not run."""
    lib = cpu_kernels.library()
    if lib is None or q.device.type != "cpu":
        return None
    out, inn = q.shape
    padded = -(-out // TILE) * TILE
    packed = torch.empty(padded * inn, dtype=torch.int8)
    lib.brook_int8_pack(q.contiguous().data_ptr(), packed.data_ptr(), out, inn)
    scales = torch.zeros(scale.shape[1], padded, dtype=torch.float32)
    scales[:, :out] = scale.float().t()
    bias_f32 = None if bias is None else bias.detach().float().contiguous().clone()
    return TiledWeight(packed, scales, out, inn, bias_f32)


def tiled_linear(x: torch.Tensor, tiled: TiledWeight) -> torch.Tensor:
    """``x @ W.T + bias`` for x [rows, in] with Brook's kernel; float32 sums, one rounding
    to ``x``'s dtype."""
    lib = cpu_kernels.library()
    assert lib is not None, "a tiled weight exists only where the kernels run"
    kind = {torch.float32: 0, torch.bfloat16: 1}.get(x.dtype)
    source = (x if kind is not None else x.float()).contiguous()
    rows = source.shape[0]
    out = torch.empty(rows, tiled.out_features, dtype=source.dtype)
    status = lib.brook_int8_matmul(
        source.data_ptr(),
        tiled.packed.data_ptr(),
        tiled.scales.data_ptr(),
        None if tiled.bias is None else tiled.bias.data_ptr(),
        out.data_ptr(),
        rows,
        tiled.out_features,
        tiled.in_features,
        tiled.group_size,
        0 if kind is None else kind,
        isa(lib),
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError(f"int8 product: no memory to widen {rows} × {tiled.in_features} rows")
    return out if kind is not None else out.to(x.dtype)


def plain_linear(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The same without Brook's kernels: the weight widened for this product."""
    return F.linear(x, dequantize(q, scale, x.dtype), bias)


_isa_cache: dict[int, int] = {}


def isa(lib: object) -> int:
    """The path the kernel takes here (within ``isa_limit``)."""
    limit = isa_limit()
    if limit not in _isa_cache:
        _isa_cache[limit] = int(lib.brook_int8_isa(limit))  # type: ignore[attr-defined]
    return _isa_cache[limit]
