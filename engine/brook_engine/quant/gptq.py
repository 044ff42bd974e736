"""GPTQ rounding for W8A16 (Frantar et al., 2022): the same int8 format and scales as the
min-max rule (``quant.quantize``), but each weight is rounded knowing what the layer's
inputs look like, and the error of every rounded column is pushed onto the columns not yet
rounded, so the layer's output on real inputs moves less than with rounding to nearest.

Only the rounding changes: the scales are the min-max ones (per output channel, or per
channel and group), computed from the float weight before any update, and the result is
stored in input-channel order. Columns are visited in order of decreasing activation energy
(the "act order" heuristic); with fixed scales that needs no column index in the
checkpoint, so the folder stays a plain ``strategy: channel`` (or ``group``) one.

The statistics are ``H = 2 XᵀX / n`` over the layer's calibration inputs ``X``
(`HessianAccumulator`); rows are independent given ``H``, so a fused q/k/v or gate/up
weight is rounded as its parts would be one by one.
"""

from __future__ import annotations

import torch

from brook_engine.quant.quantize import Q_MAX, Q_MIN, QuantizedWeight, _grouped

#: ridge added to H's diagonal, as a share of its mean (GPTQ's "percdamp")
DAMPING = 0.01
#: columns rounded between two lazy updates of the rest of the weight
BLOCK = 128


class HessianAccumulator:
    """``2 XᵀX / n`` of a layer's inputs, summed in float64 over calibration batches."""

    def __init__(self, width: int) -> None:
        self.sum = torch.zeros(width, width, dtype=torch.float64)
        self.rows = 0

    def add(self, inputs: torch.Tensor) -> None:
        x = inputs.detach().reshape(-1, inputs.shape[-1]).to(torch.float64)
        self.sum += x.T @ x
        self.rows += x.shape[0]

    def hessian(self) -> torch.Tensor:
        if self.rows == 0:
            raise ValueError("no calibration inputs reached this layer")
        return (2 * self.sum / self.rows).float()


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    scale_dtype: torch.dtype | None = None,
    group_size: int | None = None,
    damping: float = DAMPING,
) -> QuantizedWeight:
    """``weight`` [out, in] as int8 with min-max scales in ``scale_dtype`` (the weight's by
    default), rounded by GPTQ against ``hessian`` [in, in]."""
    if weight.dim() != 2 or hessian.shape != (weight.shape[1], weight.shape[1]):
        raise ValueError(
            f"GPTQ needs a matrix and its [in, in] statistics; got {tuple(weight.shape)} "
            f"and {tuple(hessian.shape)}"
        )
    out, width = weight.shape
    grouped = _grouped(weight, group_size)  # float32 [out, groups, size]
    scale = grouped.abs().amax(dim=2) / ((Q_MAX - Q_MIN) / 2)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    stored = scale.to(scale_dtype or weight.dtype)
    size = group_size or width
    # the stored (rounded) scale of every column, so the integers mean what the file says
    column_scale = stored.float().repeat_interleave(size, dim=1)  # [out, in]

    w = weight.detach().float().clone()
    h = hessian.detach().float().clone()
    dead = torch.diagonal(h) == 0  # inputs that never carried signal: any value is exact
    h[dead, dead] = 1
    w[:, dead] = 0
    order = torch.argsort(torch.diagonal(h), descending=True)
    w, h, column_scale = w[:, order], h[order][:, order], column_scale[:, order]
    h += damping * torch.diagonal(h).mean() * torch.eye(width)
    inverse = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)

    q = torch.empty(out, width, dtype=torch.int8)
    for start in range(0, width, BLOCK):
        end = min(start + BLOCK, width)
        block = w[:, start:end].clone()
        errors = torch.empty_like(block)
        h_block = inverse[start:end, start:end]
        for i in range(end - start):
            column = block[:, i]
            s = column_scale[:, start + i]
            integer = torch.clamp(torch.round(column / s), Q_MIN, Q_MAX)
            q[:, start + i] = integer.to(torch.int8)
            error = (column - integer * s) / h_block[i, i]
            block[:, i:] -= error[:, None] * h_block[i, i:][None, :]
            errors[:, i] = error
        w[:, end:] -= errors @ inverse[start:end, end:]
    restored = torch.empty_like(q)
    restored[:, order] = q
    return QuantizedWeight(restored, stored)
