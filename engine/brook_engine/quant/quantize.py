"""Symmetric int8 quantization of a weight matrix, one scale per output channel.

The scale and rounding are those of the ``compressed-tensors`` library's min-max observer
(what llm-compressor writes for its W8A16 scheme): ``scale = max|w| / 127.5`` per row and
``q = clamp(round(w / scale), -128, 127)``, so a checkpoint Brook quantizes is the one those
tools would write for the same weights. Quantization is computed in float32 whatever the
model dtype; the scale is stored in the model dtype, as the format does, and the kernels
multiply in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Q_MIN, Q_MAX = -128, 127


@dataclass(frozen=True)
class QuantizedWeight:
    """``q`` int8 [out, in] and ``scale`` [out] (the model dtype): ``w ≈ q * scale[:, None]``."""

    q: torch.Tensor
    scale: torch.Tensor

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The float weight these stand for, in ``dtype`` (the scale's by default)."""
        weight = self.q.float() * self.scale.float()[:, None]
        return weight.to(dtype or self.scale.dtype)


def channel_scales(weight: torch.Tensor) -> torch.Tensor:
    """float32 [out]: each row's scale (rows of zeros get 1, so nothing divides by zero)."""
    absmax = weight.detach().float().abs().amax(dim=1)
    scale = absmax / ((Q_MAX - Q_MIN) / 2)
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def quantize_rows(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 [out, in]: ``weight`` [out, in] divided by its rows' float32 ``scale`` [out]."""
    scaled = weight.detach().float() / scale[:, None]
    return torch.clamp(torch.round(scaled), Q_MIN, Q_MAX).to(torch.int8)


def quantize(weight: torch.Tensor, scale_dtype: torch.dtype | None = None) -> QuantizedWeight:
    """``weight`` [out, in] as int8 rows and a scale per row in ``scale_dtype`` (the
    weight's dtype by default). The values are rounded with the scale as stored, so
    ``dequantize`` is exactly what the checkpoint means."""
    if weight.dim() != 2:
        raise ValueError(f"W8A16 quantizes matrices; got a tensor of shape {tuple(weight.shape)}")
    stored = channel_scales(weight).to(scale_dtype or weight.dtype)
    return QuantizedWeight(quantize_rows(weight, stored.float()), stored)
