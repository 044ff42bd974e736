"""Symmetric int8 quantization of a weight matrix: one scale per output channel, or per
output channel and group of ``group_size`` input channels.

The scale and rounding are those of the ``compressed-tensors`` library's min-max observer
(what llm-compressor writes for its W8A16 scheme): ``scale = max|w| / 127.5`` per row and
``q = clamp(round(w / scale), -128, 127)`` (max over a row, or over a row's group), so a
checkpoint Brook quantizes is the one those tools would write for the same weights.
Quantization is computed in float32 whatever the model dtype; the scale is stored in the
model dtype, as the format does, and the kernels multiply in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Q_MIN, Q_MAX = -128, 127


@dataclass(frozen=True)
class QuantizedWeight:
    """``q`` int8 [out, in] and ``scale`` [out, groups] (the model dtype; one group is one
    scale per channel): ``w[n, k] ≈ q[n, k] * scale[n, k // (in / groups)]``."""

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def group_size(self) -> int:
        return self.q.shape[1] // self.scale.shape[1]

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The float weight these stand for, in ``dtype`` (the scale's by default)."""
        return dequantize(self.q, self.scale, dtype or self.scale.dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 ``q`` [out, in] times ``scale`` [out, groups], in float32, as ``dtype``."""
    out, groups = scale.shape
    grouped = q.float().view(out, groups, -1) * scale.float()[:, :, None]
    return grouped.view(q.shape).to(dtype)


def _grouped(weight: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """float32 [out, groups, group_size] view of ``weight`` [out, in]."""
    out, inn = weight.shape
    size = group_size or inn
    if inn % size != 0:
        raise ValueError(f"a group of {size} does not divide the {inn} input channels")
    return weight.detach().float().view(out, inn // size, size)


def quantize(
    weight: torch.Tensor, scale_dtype: torch.dtype | None = None, group_size: int | None = None
) -> QuantizedWeight:
    """``weight`` [out, in] as int8 and a scale per row (``group_size`` None) or per row and
    group of input channels, in ``scale_dtype`` (the weight's dtype by default). The values
    are rounded with the scale as stored, so ``dequantize`` is exactly what the checkpoint
    means."""
    if weight.dim() != 2:
        raise ValueError(f"W8A16 quantizes matrices; got a tensor of shape {tuple(weight.shape)}")
    grouped = _grouped(weight, group_size)
    scale = grouped.abs().amax(dim=2) / ((Q_MAX - Q_MIN) / 2)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero groups
    stored = scale.to(scale_dtype or weight.dtype)
    scaled = grouped / stored.float()[:, :, None]
    q = torch.clamp(torch.round(scaled), Q_MIN, Q_MAX).to(torch.int8)
    return QuantizedWeight(q.view(weight.shape), stored)
