"""Fused steps of a decoder layer on CPU, each with the portable PyTorch sequence it replaces.

A decode step of one sequence is hundreds of tiny operations besides its matrix products:
RMSNorm alone is six of them, rotary embedding seven, each a few microseconds of dispatch
for a few hundred numbers. The C kernels of ``csrc/fused_ops.c`` do each step in one pass
over the rows, rounding where the PyTorch sequence rounds (to the model's 16-bit type after
every operation PyTorch runs in it), so the two agree up to the order of a sum. The one-row
product (``csrc/one_row.c``) streams a plain BF16 or FP16 weight for a single row at up to
twice the rate PyTorch's kernels do, with AVX512-BF16, AVX-512, AVX2 and C paths.

Every function takes the kernel where it can (a CPU tensor of float32, bfloat16 or float16,
the C kernels built: ``cpu_kernels``) and otherwise runs the portable sequence, which is
what accelerators and ``BROOK_CPU_KERNELS=off`` run.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from brook_engine.layers import cpu_kernels
from brook_engine.layers.rotary import apply_rotary

_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_tracing = threading.local()


@contextmanager
def portable() -> Iterator[None]:
    """Run the portable sequences on this thread: what a graph compiler traces (the kernels
    read raw pointers, which a traced tensor has not), and fuses itself."""
    before = getattr(_tracing, "on", False)
    _tracing.on = True
    try:
        yield
    finally:
        _tracing.on = before


def _kernels(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    """The kernel library when every tensor is a contiguous CPU tensor of one supported
    dtype; None where the portable path must run."""
    if getattr(_tracing, "on", False):
        return None
    dtype = tensors[0].dtype
    for t in tensors:
        if t.device.type != "cpu" or t.dtype != dtype or not t.is_contiguous():
            return None
    if dtype not in _KINDS:
        return None
    return cpu_kernels.library()


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight * rms_norm(residual), residual)`` with ``residual = x + delta`` (``x`` when
    ``delta`` is None), for x [tokens, hidden]: the residual add and the next RMSNorm of a
    pre-norm block. RMSNorm normalizes in float32 and scales in the model's dtype, as the
    reference implementations do."""
    operands = (x, weight) if delta is None else (x, delta, weight)
    lib = _kernels(*operands) if x.dim() == 2 else None
    if lib is None:
        residual = x if delta is None else x + delta
        normed = F.rms_norm(residual.float(), (residual.shape[-1],), eps=eps)
        return weight * normed.to(residual.dtype), residual
    rows, hidden = x.shape
    out = torch.empty_like(x)
    residual = x if delta is None else torch.empty_like(x)
    lib.brook_add_rms_norm(
        x.data_ptr(),
        None if delta is None else delta.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        None if delta is None else residual.data_ptr(),
        rows,
        hidden,
        eps,
        _KINDS[x.dtype],
        torch.get_num_threads(),
    )
    return out, residual


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for gate_up [tokens, 2 * inter] (gate first), the SiLU-gated
    MLP's activation."""
    inter = gate_up.shape[-1] // 2
    lib = _kernels(gate_up) if gate_up.dim() == 2 else None
    if lib is None:
        return F.silu(gate_up[..., :inter]) * gate_up[..., inter:]
    rows = gate_up.shape[0]
    out = torch.empty((rows, inter), dtype=gate_up.dtype)
    lib.brook_silu_mul(
        gate_up.data_ptr(), out.data_ptr(), rows, inter, _KINDS[gate_up.dtype],
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def rotary(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotated: int) -> torch.Tensor:
    """The first ``rotated`` heads of qkv [tokens, heads, head_dim] (the query and key heads,
    adjacent in the projection) rotated by cos and sin [tokens, 1, head_dim]. The kernel
    rotates them in place and returns a view of qkv; the portable path returns a new tensor
    and leaves qkv as it is."""
    tokens, heads, dim = qkv.shape
    cos2, sin2 = cos.reshape(tokens, dim), sin.reshape(tokens, dim)
    lib = _kernels(qkv, cos2, sin2) if dim % 2 == 0 else None
    if lib is None:
        return apply_rotary(qkv[:, :rotated], cos, sin)
    lib.brook_rotary(
        qkv.data_ptr(), cos2.data_ptr(), sin2.data_ptr(), tokens, heads, rotated, dim,
        _KINDS[qkv.dtype], torch.get_num_threads(),
    )  # fmt: skip
    return qkv[:, :rotated]


ONE_ROW_WEIGHTS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # what it reads
_isa_cache: dict[tuple[int, int, int], int] = {}
_isa_lib: ctypes.CDLL | None = None
_one_row_fn: Any = None  # the library's brook_one_row, looked up once per library


def one_row_path(x_dtype: torch.dtype, weight_dtype: torch.dtype) -> int | None:
    """The path the one-row kernel takes for these types here (3 AVX512-BF16, 2 AVX-512,
    1 AVX2, 0 C; capped by ``BROOK_CPU_ISA``), None where it does not run."""
    global _isa_lib, _one_row_fn
    lib = cpu_kernels.library()
    if lib is None or x_dtype not in _KINDS or weight_dtype not in ONE_ROW_WEIGHTS:
        return None
    if _isa_lib is not lib:
        _isa_cache.clear()
        _isa_lib = lib
        _one_row_fn = getattr(lib, "brook_one_row", None)
    if _one_row_fn is None:
        return None
    key = (cpu_kernels.isa_limit(), _KINDS[x_dtype], ONE_ROW_WEIGHTS[weight_dtype])
    isa = _isa_cache.get(key)
    if isa is None:
        isa = _isa_cache[key] = int(lib.brook_one_row_isa(*key))
    return isa


def one_row(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """``F.linear(x, weight, bias)`` in x's type for one row x [1, in] (float32, bfloat16 or
    float16) and a plain FP32, BF16 or FP16 weight [out, in], by the C kernel: the weight
    widened in registers, float32 sums, one rounding to x's type. None where the kernel does not
    run (the caller takes its own path). Called ~120 times a step: the checks are few."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[0] != 1:
        return None
    out_features, in_features = weight.shape
    if x.shape[1] != in_features or x.device.type != "cpu" or weight.device.type != "cpu":
        return None
    if weight.is_mkldnn or not (x.is_contiguous() and weight.is_contiguous()):
        return None
    if bias is not None and (
        bias.dtype != x.dtype or bias.shape != (out_features,) or not bias.is_contiguous()
    ):
        return None
    isa = one_row_path(x.dtype, weight.dtype)
    if isa is None:
        return None
    out = torch.empty((1, out_features), dtype=x.dtype)
    failed = _one_row_fn(
        x.data_ptr(),
        weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        out_features,
        in_features,
        _KINDS[x.dtype],
        ONE_ROW_WEIGHTS[weight.dtype],
        isa,
        torch.get_num_threads(),
    )
    return None if failed else out
