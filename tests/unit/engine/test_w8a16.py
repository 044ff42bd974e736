"""W8A16 against an independent reference: random Llama, Qwen2 and Mistral models quantized
by Brook generate what transformers generates with the dequantized weights loaded (int8
values times their scales), so the int8 kernels are exact up to float rounding. Every CPU
kernel path (AVX-512, AVX2 + FMA, portable C) and the path without Brook's kernels run the
same products."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from brook_engine import LLM, SamplingParams
from brook_engine.config import ConfigError
from brook_engine.layers import cpu_kernels
from brook_engine.quant import cpu_int8
from brook_engine.quant.linear import Int8Linear, int8_product
from brook_engine.quant.quantize import Q_MAX, Q_MIN, quantize
from support.greedy_reference import hf_greedy, random_prompts

ARCHS = ["llama", "qwen2", "mistral"]
EXACT_KV = {
    "layer_policies": [{"start": 0.0, "end": 1.0, "dtype": "auto"}],
    "dynamic_precision": {"enabled": False},
}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def dequantized_reference(folder: Path, group_size: int | None = None) -> Any:
    """transformers' model of ``folder`` with every projection and the LM head replaced by
    the float weights Brook's int8 values and scales stand for (the embedding stays)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.rpartition(".")[2] in PROJECTIONS:
                module.weight.copy_(quantize(module.weight, group_size=group_size).dequantize())
        head = quantize(model.lm_head.weight, group_size=group_size).dequantize()
        model.lm_head.weight = torch.nn.Parameter(head)  # unties a tied head
    return model


def _llm(folder: Path | str, **options: Any) -> LLM:
    kv = {**EXACT_KV, **options.pop("kv_cache", {})}
    options.setdefault("dtype", "float32")
    options.setdefault("quantization", {"weights": "w8a16"})
    return LLM(str(folder), kv_cache=kv, progress=False, **options)


@pytest.fixture(params=["avx512", "avx2", "c"])
def kernel_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Each path of Brook's int8 kernel (a CPU without AVX-512 runs the best it has). The
    library is loaded first: the cap set at its build would also pick its baseline."""
    cpu_kernels.library()
    monkeypatch.setenv("BROOK_CPU_ISA", request.param)
    yield request.param


def test_quantizer_matches_the_compressed_tensors_rule() -> None:
    weight = torch.tensor([[1.0, -0.3, 0.5], [0.0, 0.0, 0.0], [-2.0, 0.2, 1e-3]])
    quantized = quantize(weight)
    # scale = max|w| / 127.5 (a row of zeros: 1); q = clamp(round(w / scale), -128, 127)
    assert quantized.scale[:, 0].tolist() == pytest.approx([1 / 127.5, 1.0, 2 / 127.5])
    assert quantized.q.tolist() == [[127, -38, 64], [0, 0, 0], [-127, 13, 0]]
    assert quantized.q.dtype == torch.int8
    assert int(quantized.q.min()) >= Q_MIN and int(quantized.q.max()) <= Q_MAX
    error = (quantized.dequantize() - weight).abs()
    assert bool((error <= quantized.scale / 2 + 1e-7).all())


def test_group_scales_cover_their_input_channels() -> None:
    torch.manual_seed(0)
    weight = torch.randn(5, 96)
    weight[:, 32:64] *= 100  # one loud group: it must not coarsen the others
    grouped, channel = quantize(weight, group_size=32), quantize(weight)
    assert grouped.scale.shape == (5, 3) and channel.scale.shape == (5, 1)
    assert grouped.group_size == 32
    for g in range(3):
        part = weight[:, 32 * g : 32 * (g + 1)]
        assert torch.allclose(grouped.scale[:, g], part.abs().amax(1) / 127.5)
    quiet = slice(0, 32)
    grouped_error = (grouped.dequantize() - weight)[:, quiet].abs().max()
    channel_error = (channel.dequantize() - weight)[:, quiet].abs().max()
    assert grouped_error * 50 < channel_error
    with pytest.raises(ValueError, match="does not divide"):
        quantize(weight, group_size=64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 13])
@pytest.mark.parametrize("group_size", [None, 32])
def test_every_product_path_equals_the_dequantized_product(
    kernel_path: str, dtype: torch.dtype, rows: int, group_size: int | None
) -> None:
    torch.manual_seed(rows)
    weight = torch.randn(50, 96, dtype=dtype)  # 50: a partial last tile
    quantized = quantize(weight, group_size=group_size)
    layer = Int8Linear(96, 50, bias=True, dtype=dtype, group_size=group_size)
    with torch.no_grad():
        layer.weight.copy_(quantized.q)
        layer.weight_scale.copy_(quantized.scale)
        layer.bias.normal_()  # type: ignore[union-attr]
    x = torch.randn(rows, 96).to(dtype)
    expected = torch.nn.functional.linear(
        x.float(),
        quantized.dequantize(torch.float32),
        layer.bias.float(),  # type: ignore[union-attr]
    )
    plain = layer(x)  # the path without Brook's kernels (plain int8 weight)
    assert layer.pack_for_cpu() >= 0 and layer.tiled is not None
    assert layer.weight.numel() == 0  # the tiled copy replaced the plain weight
    tiled = layer(x)
    assert torch.equal(layer.dequantized(), quantized.dequantize())
    tolerance = {torch.float32: 1e-4, torch.bfloat16: 0.15, torch.float16: 0.02}[dtype]
    for got in (plain, tiled):
        assert got.dtype == dtype and got.shape == (rows, 50)
        torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=0.01)


def test_cuda_and_other_devices_widen_the_weight() -> None:
    """The device-independent path (CUDA, the rest): the same product, by definition."""
    quantized = quantize(torch.randn(24, 64), group_size=32)
    x = torch.randn(3, 64)
    got = int8_product(x.to("meta"), quantized.q.to("meta"), quantized.scale.to("meta"), None)
    assert got.shape == (3, 24) and got.device.type == "meta"


@pytest.mark.parametrize("group_size", [None, 32])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_equal_transformers_with_the_dequantized_weights(
    arch: str, group_size: int | None, kernel_path: str, make_tiny_model: Callable[..., Path]
) -> None:
    # every projection's input width divisible by 32 (Mistral's tiny model has 5 heads)
    wide = {"hidden_size": 160, "head_dim": 32} if arch == "mistral" else {}
    folder = make_tiny_model(arch, intermediate_size=128, **wide)
    reference = dequantized_reference(folder, group_size)
    llm = _llm(
        folder,
        kv_cache={"num_blocks": 64, "block_size": 8},
        quantization={"weights": "w8a16", "group_size": group_size},
    )
    assert any(isinstance(m, Int8Linear) for m in llm.engine.runner.model.modules())
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    for prompt in random_prompts(reference.config.vocab_size, [5, 30], seed=1):
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(llm.engine.prompt_logits(prompt), expected, rtol=1e-4, atol=1e-4)
        [out] = llm.generate([prompt], params, use_tqdm=False)
        assert out.outputs[0].token_ids == hf_greedy(reference, prompt, 32)


def test_mixed_batch_with_chunked_prefill_and_preemption(
    make_tiny_model: Callable[..., Path],
) -> None:
    folder = make_tiny_model("qwen2")
    reference = dequantized_reference(folder)
    llm = _llm(
        folder,
        kv_cache={"num_blocks": 14, "block_size": 8},
        max_num_batched_tokens=16,
        max_num_seqs=8,
        max_model_len=96,
    )
    prompts = random_prompts(reference.config.vocab_size, [3, 38, 11, 25, 1, 17], seed=2)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions_total > 0
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(reference, prompt, 32)


def test_bfloat16_w8a16_follows_the_dequantized_model(
    make_tiny_model: Callable[..., Path],
) -> None:
    """In bfloat16 the products round to bfloat16 as transformers' do; logits agree to
    bfloat16's precision."""
    folder = make_tiny_model("llama")
    reference = dequantized_reference(folder).to(torch.bfloat16)
    llm = _llm(folder, dtype="bfloat16", kv_cache={"num_blocks": 64, "block_size": 8})
    prompt = random_prompts(320, [24], seed=4)[0]
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0].float()
    got = llm.engine.prompt_logits(prompt)
    assert (got - expected).abs().max() < 0.1 * expected.abs().max()
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9


def test_weight_bytes_count_the_int8_weights(make_tiny_model: Callable[..., Path]) -> None:
    folder = make_tiny_model("llama", intermediate_size=256, hidden_size=128, head_dim=32)
    full = LLM(str(folder), dtype="float32", kv_cache=EXACT_KV, progress=False)
    w8 = _llm(folder)
    float_linear = sum(
        m.weight.numel() * 4
        for m in full.engine.runner.model.modules()
        if type(m).__name__ == "Linear"
    )
    int8_linear = sum(
        m.int8().numel() for m in w8.engine.runner.model.modules() if isinstance(m, Int8Linear)
    )
    assert int8_linear == float_linear // 4  # one byte a weight instead of four
    saved = full.engine.runner.weight_bytes - w8.engine.runner.weight_bytes
    assert saved > 0.6 * float_linear  # scales and the head's int8 copy take the rest
    assert w8.engine.estimate_memory(64, 1)["weights"] == w8.engine.runner.weight_bytes


def test_wrong_or_mixed_settings_name_the_field(
    make_tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    folder = make_tiny_model("llama")
    with pytest.raises(ConfigError, match=r"shapes\.oneRowWeights"):
        _llm(folder, dtype="bfloat16", shapes={"one_row_weights": "bf16"})
    with pytest.raises(Exception, match=r"quantization\.weights"):
        LLM(str(folder), quantization={"weights": "int4"}, progress=False)
    with pytest.raises(ConfigError, match=r"quantization\.groupSize: groups apply"):
        LLM(str(folder), quantization={"group_size": 32}, progress=False)
    with pytest.raises(Exception, match="multiple of 32"):
        _llm(folder, quantization={"weights": "w8a16", "group_size": 48})
    with pytest.raises(ConfigError, match=r"quantization\.groupSize: 64 does not divide"):
        _llm(folder, quantization={"weights": "w8a16", "group_size": 64})  # MLP width 96
    # A checkpoint quantized otherwise than Brook runs: refused, naming its field.
    odd = tmp_path / "odd"
    odd.mkdir()
    for item in folder.iterdir():
        (odd / item.name).symlink_to(item)
    (odd / "config.json").unlink()
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "tensor",
                },
            }
        },
    }
    (odd / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"weights\.strategy is 'tensor'"):
        _llm(odd)
    config["quantization_config"]["quant_method"] = "gptq"
    (odd / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="quant_method is 'gptq'"):
        _llm(odd)


def test_the_tiled_copy_gives_the_weight_back() -> None:
    q = torch.randint(-128, 128, (37, 96), dtype=torch.int8)
    scale = torch.rand(37, 3)
    tiled = cpu_int8.tile(q, scale)
    assert tiled is not None and tiled.group_size == 32
    assert torch.equal(tiled.int8(), q)
    assert torch.equal(tiled.scales[:, :37], scale.t()) and not tiled.scales[:, 37:].any()
