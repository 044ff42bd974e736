"""The int8-weight product on Ascend NPUs: ``torch_npu.npu_weight_quant_batchmatmul``, the
native W8A16 matrix multiply (``y = x @ (weight * antiquant_scale) + bias``).

Its contract, from the torch_npu documentation: ``x`` 2-D [M, K] in float16 or bfloat16;
``weight`` int8 [K, N], here the transposed view of the [N, K] tensor Brook keeps (the
layout the documentation recommends for per-channel scales in the plain format);
``antiquant_scale`` [N] per channel, or [K / group, N] with ``antiquant_group_size`` (a
multiple of 32) per group, in ``x``'s dtype; no offset (symmetric); ``bias`` [N], float32
when ``x`` is bfloat16 and float16 when it is float16. torch_npu is imported only here, on the
first NPU product.
"""

from __future__ import annotations

from typing import Any

import torch

_op: Any = None


def _quant_matmul() -> Any:
    global _op
    if _op is None:
        import torch_npu  # only on NPU hosts: it breaks `import torch` elsewhere

        _op = torch_npu.npu_weight_quant_batchmatmul
    return _op


def int8_linear(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x @ W.T + bias`` for x [..., in], q int8 [out, in] and scale [out, groups]."""
    flat = x.reshape(-1, x.shape[-1])
    if bias is not None:
        bias = bias.to(torch.float32 if x.dtype == torch.bfloat16 else x.dtype).contiguous()
    groups = scale.shape[1]
    y: torch.Tensor = _quant_matmul()(
        flat,
        q.t(),
        scale[:, 0].to(x.dtype) if groups == 1 else scale.to(x.dtype).t(),
        antiquant_offset=None,
        bias=bias,
        antiquant_group_size=0 if groups == 1 else q.shape[1] // groups,
    )
    return y.reshape(*x.shape[:-1], q.shape[0])
