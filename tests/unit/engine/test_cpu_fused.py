"""The fused CPU steps of a decoder layer (``layers.cpu_fused``) against the PyTorch
sequences they replace: residual add + RMSNorm, SiLU-gated activation, rotary embedding and
the one-row BF16 product, in every dtype the model may run in, one row (decode) and many
(prefill, split over threads). The whole engine through them is held to transformers in
``test_engine_vs_transformers.py``; ``test_cpu_kernels.py`` runs it with them off."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from brook_engine.layers import cpu_fused, cpu_kernels
from brook_engine.layers.rotary import RotaryEmbedding, apply_rotary

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None, reason="no C compiler: the kernels cannot build"
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ROWS = [1, 3, 80]  # 80 x 576 crosses the threshold above which rows are split over threads


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to the order of a float32 sum: one unit in the last place of the type."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    ulp = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[got.dtype]
    torch.testing.assert_close(got, expected, rtol=ulp, atol=ulp)
    # Only a few elements may land on the other side of a rounding boundary.
    differ = (got != expected).float().mean().item()
    assert differ <= (0.05 if got.dtype != torch.float32 else 1.0), differ


def _portable_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_add_rms_norm_matches_the_add_and_the_norm(dtype: torch.dtype, rows: int) -> None:
    assert cpu_kernels.enabled()
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=gen) * 3).to(dtype)
    delta = torch.randn(rows, 576, generator=gen).to(dtype)
    weight = (1 + torch.randn(576, generator=gen) / 4).to(dtype)
    normed, residual = cpu_fused.add_rms_norm(x, delta, weight, 1e-5)
    assert torch.equal(residual, x + delta)  # one rounding of one addition: bit for bit
    _close(normed, _portable_norm(x + delta, weight, 1e-5))
    alone, same = cpu_fused.add_rms_norm(x, None, weight, 1e-6)
    assert same is x
    _close(alone, _portable_norm(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_silu_mul_matches_silu_times_up(dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(7)
    gate_up = (torch.randn(rows, 2 * 768, generator=gen) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's range ends
    got = cpu_fused.silu_mul(gate_up)
    _close(got, F.silu(gate_up[:, :768]) * gate_up[:, 768:])
    ends = torch.tensor([[float("-inf"), float("inf"), float("nan"), -1e30, 2.0, 2.0, 2.0, 2.0]])
    ends = ends.to(dtype)
    torch.testing.assert_close(
        cpu_fused.silu_mul(ends),
        F.silu(ends[:, :4]) * ends[:, 4:],
        equal_nan=True,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", ROWS)
def test_rotary_in_place_matches_apply_rotary(dtype: torch.dtype, tokens: int) -> None:
    heads, kv_heads, dim = 9, 3, 64
    rotary = RotaryEmbedding(dim, 4096, 10000.0, "default", {}, dtype, torch.device("cpu"))
    gen = torch.Generator().manual_seed(tokens)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    cos, sin = rotary.lookup(positions)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim, generator=gen).to(dtype)
    rotated = heads + kv_heads
    expected = qkv.clone()
    expected[:, :rotated] = apply_rotary(qkv[:, :rotated], cos, sin)
    got = cpu_fused.rotary(qkv, cos, sin, rotated)
    assert got.data_ptr() == qkv.data_ptr() and got.shape == (tokens, rotated, dim)  # in place
    _close(qkv, expected)
    assert torch.equal(qkv[:, rotated:], expected[:, rotated:])  # values are left alone


def test_without_the_kernels_the_portable_sequences_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_kernels, "_tried", True)
    monkeypatch.setattr(cpu_kernels, "_library", None)
    x = torch.randn(2, 16).bfloat16()
    weight = torch.ones(16).bfloat16()
    normed, residual = cpu_fused.add_rms_norm(x, x, weight, 1e-5)
    assert torch.equal(residual, x + x)
    assert torch.equal(normed, _portable_norm(x + x, weight, 1e-5))
    gate_up = torch.randn(2, 8)
    assert torch.equal(cpu_fused.silu_mul(gate_up), F.silu(gate_up[:, :4]) * gate_up[:, 4:])
    assert cpu_fused.one_row_path(torch.bfloat16, torch.bfloat16) is None
    qkv = torch.randn(3, 4, 8)
    cos, sin = torch.rand(3, 1, 8), torch.rand(3, 1, 8)
    before = qkv.clone()
    got = cpu_fused.rotary(qkv, cos, sin, 3)
    assert torch.equal(got, apply_rotary(before[:, :3], cos, sin))
    assert torch.equal(qkv, before)  # the portable path makes a new tensor, no copy back
    row, weight = torch.randn(1, 16).bfloat16(), torch.randn(4, 16).bfloat16()
    assert cpu_fused.one_row(row, weight, None) is None  # the caller takes its own path


def test_non_contiguous_or_other_dtypes_take_the_portable_path() -> None:
    x = torch.randn(4, 32, dtype=torch.float64)
    weight = torch.ones(32, dtype=torch.float64)
    normed, _ = cpu_fused.add_rms_norm(x, None, weight, 1e-5)
    assert torch.equal(normed, _portable_norm(x, weight, 1e-5))
    wide = torch.randn(4, 64)[:, ::2]  # a strided view
    assert not wide.is_contiguous()
    normed, _ = cpu_fused.add_rms_norm(wide, None, torch.ones(32), 1e-5)
    assert torch.equal(normed, _portable_norm(wide, torch.ones(32), 1e-5))


ONE_ROW_PATHS = {"c": 0, "avx2": 1, "avx512": 2, "avx512bf16": 3}


@pytest.fixture(params=list(ONE_ROW_PATHS))
def one_row_isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each path of the one-row kernel that this CPU runs (BROOK_CPU_ISA caps it; the library
    is loaded first, as the cap at build time would also pick its baseline)."""
    if cpu_kernels.library() is None:
        pytest.skip("Brook's CPU kernels did not build here")
    monkeypatch.setenv("BROOK_CPU_ISA", request.param)
    wanted = ONE_ROW_PATHS[request.param]
    if cpu_fused.one_row_path(torch.bfloat16, torch.bfloat16) != wanted:
        pytest.skip(f"this CPU has no {request.param} path")
    return str(request.param)


@pytest.mark.parametrize(
    ("out_features", "in_features"),
    [(960, 576), (13, 40), (7, 32), (64, 1536), (1, 5), (9, 33)],  # odd rows, short tails
)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_the_one_row_product_matches_float64_on_every_path(
    one_row_isa: str,
    out_features: int,
    in_features: int,
    with_bias: bool,
    weight_dtype: torch.dtype,
    x_dtype: torch.dtype,
) -> None:
    gen = torch.Generator().manual_seed(out_features)
    weight = (torch.randn(out_features, in_features, generator=gen) / 8).to(weight_dtype)
    bias = torch.randn(out_features, generator=gen).to(x_dtype) if with_bias else None
    row = torch.randn(1, in_features, generator=gen).to(x_dtype)
    got = cpu_fused.one_row(row, weight, bias)
    assert got is not None
    exact = F.linear(row.double(), weight.double(), None if bias is None else bias.double())
    assert got.dtype == x_dtype and got.shape == (1, out_features)
    # Float32 sums rounded once to x's type: within half a unit of that type of the exact
    # value (plus float32 summation error), never worse than PyTorch's own product.
    unit = {torch.bfloat16: 2**-8, torch.float16: 2**-11, torch.float32: 2**-20}[x_dtype]
    error = (got.double() - exact).abs()
    assert bool((error <= exact.abs() * unit + 1e-5).all()), float(error.max())
    plain = F.linear(row, weight.to(x_dtype), bias)  # PyTorch's product in x's type
    assert float(error.norm()) <= float((plain.double() - exact).norm()) * 1.05 + 1e-5


def test_a_misshapen_or_unreadable_one_row_product_is_declined() -> None:
    weight = torch.ones(4, 32).bfloat16()
    assert cpu_fused.one_row(torch.ones(1, 16).bfloat16(), weight, None) is None
    assert cpu_fused.one_row(torch.ones(2, 32).bfloat16(), weight, None) is None
    assert cpu_fused.one_row(torch.ones(1, 32), torch.ones(4, 32).double(), None) is None


def test_the_one_row_product_keeps_nan_and_infinity(one_row_isa: str) -> None:
    weight = torch.ones(16, 32).bfloat16()
    row = torch.ones(1, 32).bfloat16()
    row[0, 3] = float("nan")
    got = cpu_fused.one_row(row, weight, None)
    assert got is not None and got.isnan().all()
    huge = torch.full((1, 32), 3e38).bfloat16()
    got = cpu_fused.one_row(huge, weight, None)
    assert got is not None and got.isinf().all()


def test_an_unknown_isa_cap_is_an_error_naming_the_choices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("BROOK_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="BROOK_CPU_ISA='sse9' is not one of c, avx2"):
        cpu_kernels.isa_limit()
