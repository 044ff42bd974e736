"""Linear layers: packed weights on CPU, and an optional copy for one-row products.

**Packed weights.** On CPU the runner reorders every linear weight once, after loading, into
the layout its products read fastest (``pack_cpu_weights``); the packed weight replaces the
plain one (no extra memory), except where a weight is shared (an LM head tied to the
embedding keeps the table and gains a packed copy). ``BROOK_CPU_KERNELS=off`` keeps the
plain weights.

- Float32 weights whose output count is a multiple of 32 take Brook's own layout
  (``cpu_matmul``: pairs of 16-channel tiles, one kernel for every row count). Against
  oneDNN's inner product on oneDNN's packed layout, which stock PyTorch and the previous
  default run: 1.07-1.45x at 1-64 rows, even (0.98x) on 2,048-row prefill chunks
  (``tests/bench/small_m_rate.py``). The kernel sums every output in input order, so a
  product's row does not depend on the rows beside it.
- BF16 weights (on CPUs that multiply BF16 natively) and float32 weights of other shapes
  take oneDNN's blocked layout, the one vLLM's CPU backend runs on: 2-3x the rate of
  ``F.linear`` on a plain weight for decode batches of 8-64 rows, 1.4x for 2,048-row
  prefill chunks.

Results differ from ``F.linear``'s by float rounding of the sums' order.

**One-row products.** A step with a single token row — one sequence decoding — multiplies
one row by every weight matrix: a pure stream of the weights from memory, where oneDNN's and
PyTorch's kernels for a 16-bit model reach about half the machine's memory rate. Brook's
one-row kernel (``cpu_fused.one_row``: AVX512-BF16, AVX-512, AVX2 + FMA and C paths; each
weight widened to float32 in registers, float32 sums, one rounding to the model's type, as
PyTorch's product) reads a plain BF16 or FP16 weight. It reads the model's own weight where
that is plain: BF16 models on CPUs without native BF16 products (no packing there), FP16
models, a tied LM head's embedding table. Where BF16 weights are packed (AVX512-BF16 CPUs),
batches want the packed layout, so the fast one-row path needs a second copy:

- ``shapes.oneRowWeights: bf16``: a plain copy of the model's BF16 weights. The model's own
  values, so nothing can overflow. A tied LM head reads the embedding table itself.
- ``shapes.oneRowWeights: fp16``: an FP16 copy, the same bytes. BF16 values convert to FP16
  exactly (FP16 has 10 mantissa bits to BF16's 7) from 6.1e-5 up to 65,504; smaller weights
  lose bits, and a matrix with a weight beyond FP16's range keeps no copy. Without Brook's
  kernels the copy goes through PyTorch's FP16 product, and a product whose input or
  output leaves FP16's range is recomputed with the model's weights.
"""

from __future__ import annotations

import logging
import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from brook_engine.layers import cpu_fused, cpu_kernels, cpu_matmul

log = logging.getLogger(__name__)


_overflow_logged = False


def product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a plain, oneDNN-packed or Brook-packed ``weight``."""
    if weight.is_mkldnn:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        return out
    if cpu_matmul.is_packed(weight):
        return cpu_matmul.matmul(x, weight, bias)
    return F.linear(x, weight, bias)


def is_packed(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is in a packed layout (oneDNN's or Brook's), not [out, in]."""
    return weight.is_mkldnn or cpu_matmul.is_packed(weight)


def weight_shape(weight: torch.Tensor) -> tuple[int, int]:
    """A weight's [out, in], whatever its layout."""
    if cpu_matmul.is_packed(weight):
        return cpu_matmul.logical_shape(weight)
    out, inn = weight.shape
    return int(out), int(inn)


def one_row_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    one_row: torch.Tensor | None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (``weight`` plain or packed). A single row goes through
    Brook's one-row kernel when it can read a plain 16-bit weight: ``one_row`` (a BF16 or
    FP16 copy) or ``weight`` itself. Without the kernel an FP16 copy goes through PyTorch's
    FP16 product, and one that overflows FP16 is recomputed with ``weight`` (the check sums
    one output row, a few microseconds next to reading the matrix)."""
    if x.shape[0] != 1:
        return product(x, weight, bias)
    plain = one_row if one_row is not None else weight
    if not is_packed(plain) and plain.dtype in cpu_fused.ONE_ROW_WEIGHTS:
        y = cpu_fused.one_row(x.contiguous(), plain, bias)
        if y is not None:
            return y
    if one_row is None or one_row.dtype != torch.float16:
        return product(x, weight, bias)
    y = F.linear(x.to(one_row.dtype), one_row)
    if not math.isfinite(float(y.sum(dtype=torch.float32))):
        global _overflow_logged
        if not _overflow_logged:
            _overflow_logged = True
            log.warning(
                "a one-row product overflowed FP16 (shapes.oneRowWeights); recomputed with "
                "the model's weights (not logged again)"
            )
        return product(x, weight, bias)
    y = y.to(x.dtype)
    return y if bias is None else y + bias


class Linear(nn.Linear):
    """``nn.Linear`` whose weight may be packed, with an optional copy of it for
    one-row inputs (a plain attribute, not a parameter: checkpoints and ``parameters()``
    never see it)."""

    one_row: torch.Tensor | None = None
    packed: torch.Tensor | None = None  # a packed copy where the weight itself is shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight if self.packed is None else self.packed
        return one_row_linear(x, weight, self.bias, self.one_row)


def dense(weight: torch.Tensor) -> torch.Tensor:
    """A weight in the plain layout (a packed one reordered back)."""
    if weight.is_mkldnn:
        return weight.to_dense()
    return cpu_matmul.unpack(weight) if cpu_matmul.is_packed(weight) else weight


def cpu_packing_supported(dtype: torch.dtype) -> bool:
    """Whether weights of ``dtype`` get packed on this CPU: float32 wherever Brook's kernels
    or oneDNN run, bfloat16 where the CPU multiplies it natively (otherwise oneDNN emulates
    it, and one row reads the plain weight faster), nothing with ``BROOK_CPU_KERNELS=off``."""
    if os.environ.get("BROOK_CPU_KERNELS", "").lower() == "off":
        return False
    onednn = bool(torch.backends.mkldnn.is_available())  # type: ignore[no-untyped-call]
    if dtype == torch.float32:
        return onednn or cpu_matmul.available()
    if not onednn:
        return False
    if dtype != torch.bfloat16 or cpu_kernels.isa_limit() < cpu_kernels.ISA_LEVELS["avx512bf16"]:
        return False  # BROOK_CPU_ISA below avx512bf16 measures a CPU without native BF16
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_cpu_weights(model: nn.Module, streamable_only: bool = False) -> int:
    """Reorder the weight of every ``Linear`` and LM head of ``model`` (on CPU) into a packed
    layout: Brook's for float32 weights it takes, oneDNN's otherwise. A weight that another
    module shares (a tied LM head's embedding table) stays plain and the module gets a packed
    copy; returns the bytes such copies take. ``streamable_only``: Brook's layout alone, for
    a piece that weight offload streams (a slot holds a plain tensor's bytes, which Brook's
    layout is and oneDNN's opaque one is not)."""
    holders: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            holders[id(param)] = holders.get(id(param), 0) + 1
    added = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not hasattr(module, "packed") or not isinstance(weight, nn.Parameter):
            continue
        if getattr(module, "quantized", None) is not None:
            continue  # a W8A16 head multiplies by its int8 copy
        if getattr(module, "streamed", False):
            continue  # an offloaded piece: its slot holds the layout it was stored in
        if is_packed(weight) or weight.device.type != "cpu" or weight.dim() != 2:
            continue
        if not cpu_packing_supported(weight.dtype):
            continue
        if cpu_matmul.packs(weight):
            reordered = cpu_matmul.pack(weight)
        elif streamable_only:
            continue
        elif torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
            reordered = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        else:
            continue
        if holders[id(weight)] > 1:
            module.packed = reordered
            added += weight.numel() * weight.element_size()
        else:
            module.weight = nn.Parameter(reordered, requires_grad=False)
    return added


def keep_one_row_copies(model: nn.Module, dtype: torch.dtype) -> int:
    """Give every ``Linear`` and LM head of ``model`` a plain copy of its weight in ``dtype``
    (a weight that is plain in that dtype already, such as a tied head's embedding table, is
    used as it is; a matrix whose values leave ``dtype``'s range gets none, and so does a
    float32 weight in Brook's layout, which one-row products read as fast as a copy);
    returns the bytes the copies take."""
    added, brooks = 0, 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "one_row") and isinstance(weight, torch.Tensor):
            plain = weight.detach()
            if cpu_matmul.is_packed(plain):
                brooks += 1
                continue
            if is_packed(plain) or plain.dtype != dtype or not plain.is_contiguous():
                plain = dense(plain).to(dtype).contiguous()
                if not bool(plain.isfinite().all()):
                    log.warning(
                        "a %s weight leaves %s's range: it keeps no one-row copy",
                        tuple(plain.shape),
                        str(dtype).removeprefix("torch."),
                    )
                    setattr(module, "one_row", None)  # noqa: B010 (an attribute, not a module)
                    continue
                added += plain.numel() * plain.element_size()
            module.one_row = plain
    if brooks:
        log.info(
            "shapes.oneRowWeights: %d float32 weights in Brook's packed layout keep no copy "
            "(one-row products and the decoder-layer kernel read that layout directly)",
            brooks,
        )
    return added
