"""The NPU's W8A16 product is ``torch_npu.npu_weight_quant_batchmatmul``. torch_npu cannot be
imported on this machine (it breaks ``import torch`` without an NPU), so the op is replaced
by a reference implementation that checks every argument against the op's documented
contract — a stand-in only because nothing real can run here; the arithmetic it performs
is the documented ``y = x @ (weight * antiquant_scale) + bias``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from brook_engine.quant import npu_int8
from brook_engine.quant.quantize import quantize


def documented_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    antiquant_scale: torch.Tensor,
    antiquant_offset: torch.Tensor | None = None,
    quant_scale: torch.Tensor | None = None,
    quant_offset: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    antiquant_group_size: int = 0,
    inner_precise: int = 0,
) -> torch.Tensor:
    # x: 2-D [M, K], float16 or bfloat16
    assert x.dim() == 2 and x.dtype in (torch.float16, torch.bfloat16)
    k, n = weight.shape
    # weight: int8 [K, N], contiguous or the transposed view of a contiguous [N, K]
    assert weight.dtype == torch.int8 and x.shape[1] == k
    assert weight.is_contiguous() or weight.t().is_contiguous()
    # per channel: scale [N] or [1, N]; per group (a multiple of 32 in [32, K - 1]):
    # [ceil(K / group), N]; in x's dtype; symmetric: no offset
    if antiquant_group_size == 0:
        assert tuple(antiquant_scale.shape) in ((n,), (1, n))
        full_scale = antiquant_scale.float().reshape(1, n).expand(k, n)
    else:
        assert antiquant_group_size % 32 == 0 and 32 <= antiquant_group_size < k
        groups = -(-k // antiquant_group_size)
        assert tuple(antiquant_scale.shape) == (groups, n)
        full_scale = antiquant_scale.float().repeat_interleave(antiquant_group_size, 0)[:k]
    assert antiquant_scale.dtype == x.dtype
    assert antiquant_offset is None and quant_scale is None and quant_offset is None
    assert inner_precise == 0
    if bias is not None:  # contiguous [N]: float32 for bfloat16 x, float16 for float16 x
        wanted = torch.float32 if x.dtype == torch.bfloat16 else torch.float16
        assert bias.dtype == wanted and bias.is_contiguous() and tuple(bias.shape) == (n,)
    y = x.float() @ (weight.float() * full_scale)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("group_size", [None, 32])
def test_the_call_follows_the_documented_signature(
    dtype: torch.dtype, with_bias: bool, group_size: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[dict[str, Any]] = []

    def recording(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(kwargs)
        return documented_op(*args, **kwargs)

    monkeypatch.setattr(npu_int8, "_op", recording)
    torch.manual_seed(0)
    quantized = quantize(torch.randn(48, 64, dtype=dtype), group_size=group_size)
    bias = torch.randn(48, dtype=dtype) if with_bias else None
    x = torch.randn(2, 3, 64, dtype=dtype)  # [batch, tokens, in]: flattened for the op
    got = npu_int8.int8_linear(x, quantized.q, quantized.scale, bias)
    assert got.shape == (2, 3, 48) and got.dtype == dtype
    expected = x.float() @ quantized.dequantize(torch.float32).t()
    if bias is not None:
        expected = expected + bias.float()
    torch.testing.assert_close(got.float(), expected, atol=0.05, rtol=0.02)
    assert len(calls) == 1
    assert calls[0]["antiquant_group_size"] == (group_size or 0)
