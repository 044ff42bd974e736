"""The int8 linear layer of W8A16 and the quantized copy of the LM head.

``Int8Linear`` holds ``weight`` (int8 [out, in]) and ``weight_scale`` ([out], the model
dtype) — the names and meaning of the compressed-tensors format — and multiplies with the
fastest path of its device: Brook's CPU kernel over a tiled copy of the weight
(``cpu_int8``), Ascend's native W8A16 product (``npu_int8``), and elsewhere (CUDA, CPU
without Brook's kernels) the weight widened for the product. Activations, bias and output
stay in the model dtype; sums run in float32.

On CPU the tiled copy replaces the plain weight (no extra memory); ``dequantized`` gives the
float weight back either way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from brook_engine.quant import cpu_int8, npu_int8
from brook_engine.quant.quantize import QuantizedWeight, quantize


class Int8Linear(nn.Module):
    """``y = x @ (weight * weight_scale[:, None]).T + bias`` with an int8 ``weight``."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=torch.int8), requires_grad=False
        )
        self.weight_scale = nn.Parameter(torch.empty(out_features, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        self.packed: torch.Tensor | None = None  # CPU: the tiled copy (layers/csrc)
        self.scale_f32: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_product(
            x, self.weight, self.weight_scale, self.bias, self.packed, self.scale_f32
        )

    def dequantized(self) -> torch.Tensor:
        """The float weight this layer multiplies by, in the model dtype."""
        q = self.weight if self.packed is None else cpu_int8.unpack(self.packed, self.shape)
        return QuantizedWeight(q, self.weight_scale.detach()).dequantize()

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    def pack_for_cpu(self) -> int:
        """Replace the plain int8 weight by the tiled copy Brook's CPU kernel reads (where
        the kernels run); returns the bytes it takes more than the plain weight (padding)."""
        if self.packed is not None or self.weight.device.type != "cpu":
            return 0
        packed = cpu_int8.pack(self.weight.detach())
        if packed is None:
            return 0
        self.packed = packed
        self.scale_f32 = self.weight_scale.detach().float().contiguous()
        plain = self.weight.numel()
        self.weight = nn.Parameter(torch.empty(0, dtype=torch.int8), requires_grad=False)
        return packed.numel() - plain


def int8_product(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    packed: torch.Tensor | None = None,
    scale_f32: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ (q * scale[:, None]).T + bias`` on ``x``'s device by its fastest path."""
    device = x.device.type
    if device == "cpu":
        if packed is not None and scale_f32 is not None:
            return cpu_int8.packed_linear(x, packed, scale_f32, bias, scale.shape[0])
        return cpu_int8.plain_linear(x, q, scale, bias)
    if device == "npu":
        return npu_int8.int8_linear(x, q, scale, bias)
    # CUDA and the rest: widen the weight for this product (dequantize on the fly).
    return F.linear(x, q.to(x.dtype) * scale.to(x.dtype)[:, None], bias)


class QuantizedHead(nn.Module):
    """An int8 copy of the LM head (rows: vocabulary entries, one scale each); the float
    table stays for the embedding of a tied model and for float32 measurements."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        quantized = quantize(weight.detach())
        self.in_features = weight.shape[1]
        self.q: torch.Tensor | None = quantized.q
        self.scale = quantized.scale
        self.packed = cpu_int8.pack(quantized.q) if weight.device.type == "cpu" else None
        self.scale_f32 = self.scale.float().contiguous()
        if self.packed is not None:
            self.q = None  # the tiled copy replaces it

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        q = self.q if self.q is not None else torch.empty(0, dtype=torch.int8)
        return int8_product(hidden, q, self.scale, None, self.packed, self.scale_f32)

    def dequantized(self) -> torch.Tensor:
        """The float head this copy multiplies by, in the model dtype."""
        q = self.q if self.q is not None else None
        if q is None:
            assert self.packed is not None
            q = cpu_int8.unpack(self.packed, (self.scale.shape[0], self.in_features))
        return QuantizedWeight(q, self.scale).dequantize()

    def nbytes(self) -> int:
        held = self.packed if self.packed is not None else self.q
        assert held is not None
        return held.numel() + self.scale.numel() * self.scale.element_size()
