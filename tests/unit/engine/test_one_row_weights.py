"""Copies of the weights for one-row products (``shapes.oneRowWeights``: FP32 of a float32
model, BF16 or FP16 of a bfloat16 one, read by Brook's one-row kernel; FP16 by PyTorch's
product where the kernels do not run): the copy is used for a single row and only then, it is
at least as exact as the packed product, a weight beyond FP16's range keeps no copy, a
PyTorch FP16 product that overflows is recomputed with the model's weights, and a copy that
cannot apply is refused, naming the field."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from brook_engine import LLM
from brook_engine.config import ConfigError
from brook_engine.layers import cpu_fused, cpu_matmul, linear
from brook_engine.layers.linear import dense, keep_one_row_copies, one_row_linear
from brook_engine.models import decode_row
from brook_engine.models.loader import add_one_row_copies

EXACT_KV = {
    "num_blocks": 32,
    "layer_policies": [{"start": 0.0, "end": 1.0, "dtype": "auto"}],
    "dynamic_precision": {"enabled": False},
}


def _without_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_fused, "one_row", lambda *args: None)


@pytest.mark.parametrize("kernel", [True, False])
def test_one_row_products_use_the_copy_and_lose_nothing_against_bf16(
    kernel: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    if not kernel:
        _without_kernels(monkeypatch)
    elif cpu_fused.one_row_path(torch.bfloat16, torch.float16) is None:
        pytest.skip("Brook's CPU kernels did not build here")
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(256, 128, generator=gen) / 10).to(torch.bfloat16)
    bias = torch.randn(256, generator=gen).to(torch.bfloat16)
    copy = weight.to(torch.float16)
    assert torch.equal(copy.to(torch.bfloat16), weight)  # BF16 → FP16 is exact here
    row = torch.randn(1, 128, generator=gen).to(torch.bfloat16)
    exact = F.linear(row.double(), weight.double(), bias.double())
    through_copy = one_row_linear(row, weight, bias, copy)
    plain = F.linear(row, weight, bias)
    if not kernel:  # PyTorch's FP16 product, then the bias in BF16
        assert torch.equal(through_copy, F.linear(row.half(), copy).to(torch.bfloat16) + bias)
    error_copy = float((through_copy.double() - exact).norm())
    error_plain = float((plain.double() - exact).norm())
    assert error_copy <= error_plain * 1.5 + 1e-3
    # More than one row: the model's weights, bit for bit.
    rows = torch.randn(3, 128, generator=gen).to(torch.bfloat16)
    assert torch.equal(one_row_linear(rows, weight, bias, copy), F.linear(rows, weight, bias))
    # A product beyond FP16's range: the kernel sums in float32 and rounds to BF16 once;
    # PyTorch's FP16 product overflows and is recomputed in BF16 (finite there).
    huge = row * 4e5
    assert not F.linear(huge.half(), copy).isfinite().all()
    monkeypatch.setattr(linear, "_overflow_logged", False)
    with caplog.at_level(logging.WARNING, logger="brook_engine.layers.linear"):
        got = one_row_linear(huge, weight, bias, copy)
    assert got.isfinite().all()
    recomputed = "a one-row product overflowed FP16" in caplog.text
    assert recomputed == (not kernel)
    if not kernel:
        assert torch.equal(got, F.linear(huge, weight, bias))


def _llm(folder: Path, one_row: str) -> LLM:
    return LLM(
        str(folder),
        dtype="bfloat16",
        max_model_len=128,
        kv_cache=EXACT_KV,
        shapes={"one_row_weights": one_row},
        progress=False,
    )


COPIES = [
    pytest.param(
        kind,
        marks=pytest.mark.skipif(
            cpu_fused.one_row_path(torch.bfloat16, torch.bfloat16) is None,
            reason="Brook's CPU kernels did not build here",
        ),
    )
    for kind in ("fp16", "bf16")
]


@pytest.mark.parametrize("kind", COPIES)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: tied head, qkv bias
def test_the_engine_keeps_copies_counts_them_and_decodes_alike(
    make_tiny_model: Callable[..., Path],
    arch: str,
    kind: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    folder = make_tiny_model(arch)
    packed = linear.cpu_packing_supported(torch.bfloat16)  # else BF16 weights stay plain
    if kind == "bf16" and not packed:  # plain BF16 weights are read as they are: no copy
        with pytest.raises(ConfigError, match=r"shapes\.oneRowWeights bf16: .*keeps no copy"):
            _llm(folder, kind)
        return
    plain, copies = _llm(folder, "model"), _llm(folder, kind)
    assert not plain.engine.runner.one_row_copies and copies.engine.runner.one_row_copies
    model = copies.engine.runner.model
    layers = model.model.layers
    products = [layers[0].self_attn.qkv_proj, layers[0].mlp.down_proj, model.lm_head]
    dtype = torch.float16 if kind == "fp16" else torch.bfloat16
    assert all(m.one_row is not None and m.one_row.dtype == dtype for m in products)
    for m in products:
        assert torch.equal(m.one_row, dense(m.weight).to(dtype))  # the same values
    embed = model.model.embed_tokens.weight
    tied = model.lm_head.one_row.data_ptr() == embed.data_ptr()
    assert tied == (kind == "bf16" and model.arch.tie_word_embeddings)  # no copy of a table
    copied = sum(
        m.weight.numel()
        for m in model.modules()
        if getattr(m, "one_row", None) is not None
        and m.one_row.data_ptr() != embed.data_ptr()
        and (linear.is_packed(m.weight) or m.one_row.data_ptr() != m.weight.data_ptr())
    )
    assert copied > 0
    assert copies.engine.runner.weight_bytes - plain.engine.runner.weight_bytes == 2 * copied
    # The products one at a time (not a decoder layer per kernel call, models/decode_row).
    monkeypatch.setattr(decode_row.RowDecoding, "begin", lambda *args: None)
    calls = []
    kernel = cpu_fused.one_row  # count the kernel's products: one per linear layer and the head
    monkeypatch.setattr(cpu_fused, "one_row", lambda *a: calls.append(a[0].shape) or kernel(*a))
    # One row: through the copies, as close to float32 as the BF16 products are.
    reference = LLM(
        str(folder), dtype="float32", max_model_len=128, kv_cache=EXACT_KV, progress=False
    )
    exact = reference.engine.prompt_logits([11])
    error = {"plain": float((plain.engine.prompt_logits([11]) - exact).norm())}
    calls.clear()  # the plain engine's own plain weights (a tied table) take the kernel too
    error["copies"] = float((copies.engine.prompt_logits([11]) - exact).norm())
    assert error["copies"] <= 1.5 * error["plain"] + 1e-2, error
    assert len(calls) == 4 * len(layers) + 1 and {shape[0] for shape in calls} == {1}
    calls.clear()
    longer = list(range(5, 25))  # more than one row: the model's weights, bit for bit
    assert torch.equal(copies.engine.prompt_logits(longer), plain.engine.prompt_logits(longer))
    assert not calls


def test_a_weight_beyond_fp16_keeps_no_copy(
    make_tiny_model: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    folder = make_tiny_model("llama")
    plain, copies = _llm(folder, "model"), _llm(folder, "fp16")
    for llm in (plain, copies):
        down = llm.engine.runner.model.model.layers[0].mlp.down_proj
        weight = dense(down.weight).clone()
        weight[0, 0] = 1e5  # beyond FP16's 65,504, fine in BF16
        down.weight = nn.Parameter(weight, requires_grad=False)
    with caplog.at_level(logging.WARNING, logger="brook_engine.layers.linear"):
        keep_one_row_copies(copies.engine.runner.model, torch.float16)
    down = copies.engine.runner.model.model.layers[0].mlp.down_proj
    assert down.one_row is None and "leaves float16's range" in caplog.text
    for module in copies.engine.runner.model.modules():  # the plain engine's step, exactly
        if hasattr(module, "one_row"):
            module.one_row = None
    assert torch.equal(copies.engine.prompt_logits([11]), plain.engine.prompt_logits([11]))


@pytest.mark.parametrize(
    ("dtype", "copy", "fix"),
    [("float32", "fp16", "use fp32 or model"), ("bfloat16", "fp32", "use bf16 or fp16 or model")],
)
def test_a_copy_of_another_type_than_the_model_is_refused(
    make_tiny_model: Callable[..., Path], dtype: str, copy: str, fix: str
) -> None:
    with pytest.raises(ConfigError, match=rf"shapes\.oneRowWeights {copy}: .*; {fix}"):
        LLM(
            str(make_tiny_model("llama")),
            dtype=dtype,
            max_model_len=128,
            kv_cache=EXACT_KV,
            shapes={"one_row_weights": copy},
            progress=False,
        )


@pytest.mark.skipif(
    cpu_fused.one_row_path(torch.float32, torch.float32) is None,
    reason="Brook's CPU kernels did not build here",
)
def test_a_float32_model_keeps_fp32_copies_where_its_weights_are_packed(
    make_tiny_model: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Mistral's 112-wide qkv and 80-wide o and down take oneDNN's layout (not multiples of
    # 32): those get copies; its 192-wide gate_up and 320-row head take Brook's, read as
    # they are.
    if not torch.backends.mkldnn.is_available():
        pytest.skip("without oneDNN no float32 weight is packed, and fp32 copies are refused")
    folder = make_tiny_model("mistral")
    options = {"dtype": "float32", "max_model_len": 128, "kv_cache": EXACT_KV, "progress": False}
    plain = LLM(str(folder), **options)
    copies = LLM(str(folder), shapes={"one_row_weights": "fp32"}, **options)
    model = copies.engine.runner.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    gate_up = model.model.layers[0].mlp.gate_up_proj
    assert qkv.one_row is not None and torch.equal(qkv.one_row, dense(qkv.weight))
    if cpu_matmul.available():
        assert cpu_matmul.is_packed(gate_up.weight) and gate_up.one_row is None
    copied = sum(
        m.weight.numel()
        for m in model.modules()
        if getattr(m, "one_row", None) is not None and m.weight.is_mkldnn
    )
    assert copied > 0
    assert copies.engine.runner.weight_bytes - plain.engine.runner.weight_bytes == 4 * copied
    # One row: the kernel's float32 sums, within float32 rounding of the packed product.
    monkeypatch.setattr(decode_row.RowDecoding, "begin", lambda *args: None)
    one, reference = copies.engine.prompt_logits([11]), plain.engine.prompt_logits([11])
    assert torch.allclose(one, reference, atol=1e-4, rtol=1e-4)
    longer = list(range(5, 25))  # more than one row: the packed weights, bit for bit
    assert torch.equal(copies.engine.prompt_logits(longer), plain.engine.prompt_logits(longer))


NEEDS_F32_KERNELS = pytest.mark.skipif(
    not cpu_matmul.available() or cpu_fused.one_row_path(torch.float32, torch.float32) is None,
    reason="Brook's float32 product or one-row kernel did not build here",
)


def _fp32_copies(make_tiny_model: Callable[..., Path]) -> LLM:
    """The tiny Llama in float32 with ``shapes.oneRowWeights: fp32``."""
    return LLM(
        str(make_tiny_model("llama")),
        dtype="float32",
        max_model_len=128,
        kv_cache=EXACT_KV,
        shapes={"one_row_weights": "fp32"},
        progress=False,
    )


@NEEDS_F32_KERNELS
def test_fp32_copies_of_a_model_in_brooks_layout_are_refused(
    make_tiny_model: Callable[..., Path],
) -> None:
    # Every float32 weight of the tiny Llama is a multiple of 32 wide: all in Brook's layout,
    # which one-row products read as it is. The setting would keep nothing: refused.
    with pytest.raises(
        ConfigError, match=r"shapes\.oneRowWeights fp32: .*keeps no copy.*use model"
    ):
        _fp32_copies(make_tiny_model)


@NEEDS_F32_KERNELS
def test_a_pipeline_stage_without_copies_is_not_refused(
    make_tiny_model: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    # A stage sees only its layers; the LM head's stage may keep copies the others do not.
    llm = LLM(str(make_tiny_model("llama")), dtype="float32", kv_cache=EXACT_KV, progress=False)
    model = llm.engine.runner.model
    model.shard = dataclasses.replace(model.shard, last_stage=False)
    with caplog.at_level(logging.INFO, logger="brook_engine.models.loader"):
        assert add_one_row_copies(model, "fp32", torch.float32, torch.device("cpu")) == 0
    assert "this pipeline stage keeps no copy" in caplog.text


def test_copies_only_the_kernels_read_are_refused_without_them(
    make_tiny_model: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu_fused, "one_row_path", lambda *args: None)  # no kernels here
    with pytest.raises(ConfigError, match=r"shapes\.oneRowWeights fp32: .*do not run here"):
        _fp32_copies(make_tiny_model)
