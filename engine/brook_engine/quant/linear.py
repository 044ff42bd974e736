"""The int8 linear layer of W8A16 and the quantized copy of the LM head.

``Int8Linear`` holds ``weight`` (int8 [out, in]) and ``weight_scale`` ([out, groups], the
model dtype; one group: a scale per output channel) — the names and meaning of the
compressed-tensors format — and multiplies with the fastest path of its device: Brook's CPU
kernel over a tiled copy of the weight (``cpu_int8``), Ascend's native W8A16 product
(``npu_int8``), and elsewhere (CUDA, CPU without Brook's kernels) the weight widened for the
product. Activations, bias and output stay in the model dtype; sums run in float32.

On CPU the tiled copy replaces the plain weight (no extra memory); ``dequantized`` gives the
float weight back either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from brook_engine.config import ConfigError
from brook_engine.quant import cpu_int8, npu_int8
from brook_engine.quant.cpu_int8 import TiledWeight
from brook_engine.quant.quantize import QuantizedWeight, dequantize, quantize


@dataclass(frozen=True)
class W8A16:
    """How a model's projections are quantized: a scale per output channel
    (``group_size`` None) or per channel and group of input channels."""

    group_size: int | None = None

    def group_for(self, in_features: int) -> int | None:
        """The group size for a projection this wide (as this rank holds it), or a
        ``ConfigError`` naming the setting when it does not divide the width."""
        size = self.group_size
        if size is not None and in_features % size:
            raise ConfigError(
                f"quantization.groupSize: {size} does not divide a projection's input width "
                f"of {in_features} (on this tensor rank); use a multiple of 32 that divides "
                "it, or leave groupSize unset for one scale per channel"
            )
        return size


class Int8Linear(nn.Module):
    """``y = x @ W.T + bias`` with ``W = weight * weight_scale`` (per channel and group)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        group_size: int | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.group_size = group_size  # None: one scale per output channel
        groups = 1 if group_size is None else in_features // group_size
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=torch.int8), requires_grad=False
        )
        self.weight_scale = nn.Parameter(torch.empty(out_features, groups, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        self.tiled: TiledWeight | None = None  # CPU: the copy Brook's kernel reads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_product(x, self.weight, self.weight_scale, self.bias, self.tiled)

    def int8(self) -> torch.Tensor:
        """The int8 [out, in] weight, from the tiled copy where it replaced the plain one."""
        return self.weight.detach() if self.tiled is None else self.tiled.int8()

    def dequantized(self) -> torch.Tensor:
        """The float weight this layer multiplies by, in the model dtype."""
        scale = self.weight_scale.detach()
        return dequantize(self.int8(), scale, scale.dtype)

    def held_bytes(self) -> int:
        """Bytes of the int8 weight (plain or tiled) and its scales."""
        held = self.weight.numel() if self.tiled is None else self.tiled.packed.numel()
        return held + self.weight_scale.numel() * self.weight_scale.element_size()

    def pack_for_cpu(self) -> int:
        """Replace the plain int8 weight by the tiled copy Brook's CPU kernel reads (where
        the kernels run); returns the bytes it takes more than the plain weight (padding
        and float32 scales)."""
        if self.tiled is not None or self.weight.device.type != "cpu":
            return 0
        tiled = cpu_int8.tile(self.weight.detach(), self.weight_scale.detach(), self.bias)
        if tiled is None:
            return 0
        self.tiled = tiled
        plain = self.weight.numel()
        self.weight = nn.Parameter(torch.empty(0, dtype=torch.int8), requires_grad=False)
        return tiled.nbytes - plain


def int8_product(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    tiled: TiledWeight | None = None,
) -> torch.Tensor:
    """``x @ (q * scale).T + bias`` on ``x``'s device by its fastest path."""
    device = x.device.type
    if device == "cpu":
        if tiled is not None:
            return cpu_int8.tiled_linear(x, tiled)  # the tiled copy holds the bias
        return cpu_int8.plain_linear(x, q, scale, bias)
    if device == "npu":
        return npu_int8.int8_linear(x, q, scale, bias)
    # CUDA and the rest: widen the weight for this product (dequantize on the fly).
    return torch.nn.functional.linear(x, dequantize(q, scale, x.dtype), bias)


class QuantizedHead(nn.Module):
    """An int8 copy of the LM head (rows: vocabulary entries). A tied model's float table
    stays for its embedding; float32 measurements dequantize this copy."""

    def __init__(
        self,
        weight: torch.Tensor,
        group_size: int | None = None,
        stored: QuantizedWeight | None = None,
    ) -> None:
        """``stored``: the checkpoint's own int8 head (a GPTQ-rounded folder's), used as it
        is; otherwise ``weight`` is quantized by the min-max rule."""
        super().__init__()
        if stored is not None and stored.q.shape[1] != weight.shape[1]:
            raise ConfigError(
                f"the checkpoint's quantized lm_head is {stored.q.shape[1]} wide; the model's "
                f"hidden size is {weight.shape[1]}: the checkpoint does not match config.json"
            )
        quantized = stored or quantize(weight.detach(), group_size=group_size)
        self.scale = quantized.scale
        self.tiled = cpu_int8.tile(quantized.q, quantized.scale)
        # the tiled copy replaces the plain weight, as in ``Int8Linear``
        self.q = quantized.q if self.tiled is None else torch.empty(0, dtype=torch.int8)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return int8_product(hidden, self.q, self.scale, None, self.tiled)

    def dequantized(self) -> torch.Tensor:
        """The float head this copy multiplies by, in the model dtype."""
        q = self.q if self.tiled is None else self.tiled.int8()
        return dequantize(q, self.scale, self.scale.dtype)

    def nbytes(self) -> int:
        if self.tiled is not None:
            return self.tiled.nbytes
        return self.q.numel() + self.scale.numel() * self.scale.element_size()
