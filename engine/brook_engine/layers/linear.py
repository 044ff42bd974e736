"""Linear layers that can keep a second, FP16 copy of their weights for one-row products.

PyTorch's CPU kernels multiply one row by a BF16 matrix at about 10 GB/s of weights read
from memory, and by an FP16 matrix at about 25 GB/s (AVX512-BF16 host, 2 threads; the FP16
path has a dedicated matrix-vector kernel). A step with a single token row — one sequence
decoding — is such a product in every layer, so with ``shapes.oneRowWeights: fp16`` the
runner keeps an FP16 copy of each BF16 weight for it; larger products (prefill, batched
decode), where BF16 runs at 10× the FP16 rate, keep the model's weights. BF16 values convert
to FP16 exactly (FP16 has 10 mantissa bits to BF16's 7) from 6.1e-5 up to 65,504; smaller
weights lose bits, and a product beyond FP16's range turns into inf: the runner checks a
one-row step's output (and logits) and recomputes the step with the model's weights then.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn


class _Products:
    fp16_copies = True  # off inside ``model_dtype_products``


@contextmanager
def model_dtype_products() -> Iterator[None]:
    """Within: every product uses the model's own weights (the runner recomputes a step
    this way when an FP16 product overflowed: a one-row step's output is checked once, not
    every product)."""
    _Products.fp16_copies = False
    try:
        yield
    finally:
        _Products.fp16_copies = True


def one_row_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    one_row: torch.Tensor | None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through ``one_row`` (the weight in FP16) when ``x``
    is a single row."""
    if one_row is None or x.shape[0] != 1 or not _Products.fp16_copies:
        return F.linear(x, weight, bias)
    y = F.linear(x.to(one_row.dtype), one_row).to(x.dtype)
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
