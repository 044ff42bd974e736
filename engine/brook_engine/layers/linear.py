"""Linear layers that can keep a second, FP16 copy of their weights for one-row products.

PyTorch's CPU kernels multiply one row by a BF16 matrix at about 10 GB/s of weights read
from memory, and by an FP16 matrix at about 25 GB/s (AVX512-BF16 host, 2 threads; the FP16
path has a dedicated matrix-vector kernel). A step with a single token row — one sequence
decoding — is such a product in every layer, so with ``shapes.oneRowWeights: fp16`` the
runner keeps an FP16 copy of each BF16 weight for it; larger products (prefill, batched
decode), where BF16 runs at 10× the FP16 rate, keep the model's weights. BF16 values convert
to FP16 exactly (FP16 has 10 mantissa bits to BF16's 7) from 6.1e-5 up to 65,504; smaller
weights and activations lose bits, and a product whose input or output leaves FP16's range
is recomputed with the model's weights.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)


_overflow_logged = False


def one_row_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    one_row: torch.Tensor | None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through ``one_row`` (the weight in FP16) when ``x``
    is a single row; a product that overflows FP16 is recomputed with ``weight`` (the check
    sums one output row, a few microseconds next to reading the matrix)."""
    if one_row is None or x.shape[0] != 1:
        return F.linear(x, weight, bias)
    y = F.linear(x.to(one_row.dtype), one_row)
    if not math.isfinite(float(y.sum(dtype=torch.float32))):
        global _overflow_logged
        if not _overflow_logged:
            _overflow_logged = True
            log.warning(
                "a one-row product overflowed FP16 (shapes.oneRowWeights); recomputed with "
                "the model's weights (not logged again)"
            )
        return F.linear(x, weight, bias)
    y = y.to(x.dtype)
    return y if bias is None else y + bias


class Linear(nn.Linear):
    """``nn.Linear`` with an optional FP16 copy of its weight for one-row inputs (a plain
    attribute, not a parameter: checkpoints and ``parameters()`` never see it)."""

    one_row: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return one_row_linear(x, self.weight, self.bias, self.one_row)


def keep_one_row_copies(model: nn.Module) -> int:
    """Give every ``Linear`` and LM head of ``model`` an FP16 copy of its weight; returns
    the bytes the copies take."""
    added = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "one_row") and isinstance(weight, torch.Tensor):
            module.one_row = weight.detach().to(torch.float16).contiguous()
            added += module.one_row.numel() * module.one_row.element_size()
    return added
