"""The float32 product on CPU over Brook's packed weight layout (``csrc/f32_matmul.c``).

A float32 weight [out, in] whose output count is a multiple of 32 is packed once at load
time into ``out / 32`` pairs of ``[in][32]``: a float32 tensor of shape ``[out / 32, in,
32]``, the same bytes as the plain weight. That shape is what marks a weight as
Brook-packed (a linear weight is otherwise two-dimensional). Every row count runs the same
kernel: one row streams the weight, a decode batch of 2-64 rows reads it once per 12 rows
(AVX-512) or 3 (AVX2), and a prefill chunk is a GEMM of such blocks. Sums run in input
order, one multiply-add chain per output, so a row's result does not depend on the rows
beside it in the product.

Measured against oneDNN's inner product on its own packed layout (the previous default, and
the stock PyTorch path): ``tests/bench/small_m_rate.py``.
"""

from __future__ import annotations

import torch

from brook_engine.layers import cpu_kernels

PAIR = 32  # output channels per pair of the packed layout


def packs(weight: torch.Tensor) -> bool:
    """Whether ``weight`` can take Brook's float32 layout here: a float32 [out, in] CPU
    weight with ``out`` a multiple of 32, and the kernels built."""
    return (
        weight.dtype == torch.float32
        and weight.dim() == 2
        and weight.device.type == "cpu"
        and not weight.is_mkldnn
        and weight.shape[0] % PAIR == 0
        and weight.shape[0] > 0
        and weight.shape[1] > 0
        and available()
    )


def available() -> bool:
    """Whether the kernel runs here: the library built, and with it (a copy prebuilt from
    older sources has not)."""
    lib = cpu_kernels.library()
    return lib is not None and hasattr(lib, "brook_f32_matmul")


def is_packed(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is in Brook's float32 layout."""
    return (
        weight.dim() == 3
        and not weight.is_mkldnn
        and weight.dtype == torch.float32
        and weight.shape[2] == PAIR
    )


def logical_shape(packed: torch.Tensor) -> tuple[int, int]:
    """The [out, in] of a packed weight."""
    return int(packed.shape[0]) * PAIR, int(packed.shape[1])


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] in Brook's layout, [out / 32, in, 32] (see ``packs``)."""
    lib = cpu_kernels.library()
    assert lib is not None and packs(weight), "pack() needs a float32 weight packs() accepts"
    out, inn = weight.shape
    plain = weight.detach().contiguous()
    packed = torch.empty(out // PAIR, inn, PAIR, dtype=torch.float32)
    lib.brook_f32_pack(plain.data_ptr(), packed.data_ptr(), out, inn, torch.get_num_threads())
    return packed


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The plain [out, in] weight back."""
    pairs, inn, _ = packed.shape
    return packed.permute(0, 2, 1).reshape(pairs * PAIR, inn)


_isa_cache: dict[int, int] = {}


def isa() -> int:
    """The path the kernel takes here: 0 portable C, 1 AVX2 + FMA, 2 AVX-512, within
    ``BROOK_CPU_ISA`` (read on every product: tests change it between calls)."""
    limit = min(cpu_kernels.isa_limit(), 2)
    if limit not in _isa_cache:
        lib = cpu_kernels.library()
        if lib is None or not available():
            return 0  # nothing calls the kernel then; the portable number
        _isa_cache[limit] = int(lib.brook_f32_isa(limit))
    return _isa_cache[limit]


def matmul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, unpack(packed), bias)`` for x [..., in]: float32 sums in input order.
    An x of another type is multiplied in float32 and the result returned in its type."""
    lib = cpu_kernels.library()
    assert lib is not None, "a packed weight exists only where the kernels run"
    assert is_packed(packed) and packed.is_contiguous() and packed.device.type == "cpu"
    if x.device.type != "cpu" or (bias is not None and bias.device.type != "cpu"):
        raise ValueError(f"a CPU weight multiplied by a tensor on {x.device}")
    pairs, inn, _ = packed.shape
    if x.shape[-1] != inn:
        raise ValueError(f"a product of {tuple(x.shape)} by a [{pairs * PAIR}, {inn}] weight")
    if bias is not None and bias.shape != (pairs * PAIR,):
        raise ValueError(f"a bias of {tuple(bias.shape)} for {pairs * PAIR} outputs")
    rows = x.reshape(-1, inn).to(torch.float32).contiguous()
    lead = x.shape[:-1]
    if bias is not None:
        bias = bias.to(torch.float32).contiguous()
    out = torch.empty(rows.shape[0], pairs * PAIR, dtype=torch.float32)
    lib.brook_f32_matmul(
        rows.data_ptr(),
        packed.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        rows.shape[0],
        pairs * PAIR,
        inn,
        isa(),
        torch.get_num_threads(),
    )
    return out.reshape(*lead, pairs * PAIR).to(x.dtype)
