"""W8A16 checkpoints in the compressed-tensors format: Brook's converter writes what the
``compressed-tensors`` library itself reads back (bit for bit), a folder written with that
library loads in Brook, and Brook → folder → Brook generates what load-time quantization
generates. A quantized folder served with the wrong setting is an error naming the field."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from brook_engine import LLM, SamplingParams
from brook_engine.cli import main as engine_cli
from brook_engine.config import ConfigError
from brook_engine.quant.checkpoint import pack_int8, unpack_int8
from brook_engine.quant.linear import Int8Linear
from brook_engine.quant.quantize import quantize

EXACT_KV = {
    "layer_policies": [{"start": 0.0, "end": 1.0, "dtype": "auto"}],
    "dynamic_precision": {"enabled": False},
}
PROMPTS = [[5, 9, 31, 7, 100], list(range(40, 70))]


def _greedy(folder: Path, **options: Any) -> list[list[int]]:
    llm = LLM(str(folder), dtype="float32", kv_cache=EXACT_KV, progress=False, **options)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def _int8_layers(folder: Path, group_size: int | None = None) -> dict[str, torch.Tensor]:
    llm = LLM(
        str(folder),
        dtype="float32",
        kv_cache=EXACT_KV,
        progress=False,
        quantization={"weights": "w8a16", "group_size": group_size},
    )
    return {
        name: module.dequantized()
        for name, module in llm.engine.runner.model.named_modules()
        if isinstance(module, Int8Linear)
    }


@pytest.fixture(params=[None, 32], ids=["channel", "group32"])
def converted(
    request: pytest.FixtureRequest, make_tiny_model: Callable[..., Path], tmp_path: Path
) -> tuple[Path, Path, int | None]:
    source = make_tiny_model("qwen2")  # qkv bias, tied embeddings
    output = tmp_path / "w8a16"
    group = [] if request.param is None else ["--group-size", str(request.param)]
    command = ["convert", str(source), "--quantize", "w8a16", "--output", str(output), *group]
    assert engine_cli(command) == 0
    return source, output, request.param


def test_packing_follows_the_library() -> None:
    from compressed_tensors.compressors.pack_quantized.helpers import (
        pack_to_int32,
        unpack_from_int32,
    )

    q = torch.randint(-128, 128, (7, 45), dtype=torch.int8)  # 45: a partial last word
    assert torch.equal(pack_int8(q), pack_to_int32(q, 8))
    assert torch.equal(unpack_int8(pack_to_int32(q, 8), 45), q)
    assert torch.equal(unpack_from_int32(pack_int8(q), 8, q.shape), q)
    word = pack_int8(torch.tensor([[-128, -1, 0, 127]], dtype=torch.int8)).item()
    assert word & 0xFFFF_FFFF == 0xFF80_7F00  # q + 128 per byte, the first in the lowest


def test_the_library_reads_brooks_folder_bit_for_bit(
    converted: tuple[Path, Path, int | None],
) -> None:
    from compressed_tensors.entrypoints.convert import CompressedTensorsDequantizer

    source, output, group_size = converted
    config = json.loads((output / "config.json").read_text())["quantization_config"]
    assert config["format"] == "pack-quantized" and config["ignore"] == ["lm_head"]
    weights = config["config_groups"]["group_0"]["weights"]
    assert weights["strategy"] == ("channel" if group_size is None else "group")
    assert weights["group_size"] == group_size
    stored = load_file(str(output / "model.safetensors"))
    dense = CompressedTensorsDequantizer(str(output), dtype=torch.float32).process(dict(stored))
    original = load_file(str(source / "model.safetensors"))
    projections = [n for n in original if "_proj.weight" in n]
    assert len(projections) == 7 * 3
    for name in projections:
        assert name.removesuffix(".weight") + ".weight_packed" in stored
        expected = quantize(original[name], group_size=group_size).dequantize(torch.float32)
        assert torch.equal(dense[name], expected), name
    # Everything else is copied as it was.
    for name in ("model.embed_tokens.weight", "model.norm.weight"):
        assert torch.equal(stored[name], original[name])


def test_brook_to_folder_to_brook_equals_load_time_quantization(
    converted: tuple[Path, Path, int | None],
) -> None:
    source, output, group_size = converted
    at_load = _int8_layers(source, group_size)
    from_folder = _int8_layers(output)  # the folder's own grouping
    assert at_load.keys() == from_folder.keys()
    for name, weight in at_load.items():
        assert torch.equal(from_folder[name], weight), name
    w8a16 = {"weights": "w8a16", "group_size": group_size}
    assert _greedy(output, quantization={"weights": "w8a16"}) == _greedy(source, quantization=w8a16)
    other = 64 if group_size is None else None
    if other is not None:  # asking for another grouping than the folder's: an error
        with pytest.raises(ConfigError, match=r"quantization\.groupSize is 64"):
            _int8_layers(output, other)


@pytest.mark.parametrize("group_size", [None, 32])
def test_a_folder_written_by_the_library_loads(
    group_size: int | None, make_tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    """llm-compressor's way: the library's own compressor writes the folder (channel or
    group scales, pack-quantized); Brook generates what transformers generates with the weights
    the library decompresses."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from transformers import AutoModelForCausalLM

    source = make_tiny_model("llama")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(
            num_bits=8,
            type="int",
            symmetric=True,
            dynamic=False,
            strategy="channel" if group_size is None else "group",
            group_size=group_size,
        ),
    )
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    )
    dequantized: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if getattr(module, "quantization_scheme", None) is None:
            continue
        quantized = quantize(module.weight.detach(), group_size=group_size)
        module.weight_scale.data.copy_(quantized.scale)
        module.weight = torch.nn.Parameter(quantized.dequantize(), requires_grad=False)
        dequantized[name] = quantized.dequantize()
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    folder = tmp_path / "library"
    model.save_pretrained(folder)
    compressor.update_config(str(folder))
    for item in source.iterdir():
        if item.name.startswith("tokenizer") or item.name.endswith(".jinja"):
            (folder / item.name).write_bytes(item.read_bytes())

    reference = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, weight in dequantized.items():
            reference.get_submodule(name).weight.copy_(weight)
    w8a16 = {"quantization": {"weights": "w8a16"}}
    llm = LLM(str(folder), dtype="float32", kv_cache=EXACT_KV, progress=False, **w8a16)
    # The head is float in the folder (ignored); Brook's int8 copy of it is compared too.
    head = llm.engine.runner.model.lm_head.quantized.dequantized()  # type: ignore[union-attr]
    with torch.no_grad():
        reference.lm_head.weight.copy_(head)
        for prompt in PROMPTS:
            expected = reference(torch.tensor([prompt])).logits[0]
            got = llm.engine.prompt_logits(prompt)
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_a_quantized_folder_asks_for_the_setting(
    converted: tuple[Path, Path, int | None],
) -> None:
    _, output, _ = converted
    with pytest.raises(ConfigError, match=r"set quantization\.weights: w8a16"):
        LLM(str(output), dtype="float32", progress=False)


def test_convert_refuses_bad_input(
    converted: tuple[Path, Path, int | None], tmp_path: Path
) -> None:
    source, output, _ = converted
    # an existing non-empty output, a quantized source, a folder without a model
    assert engine_cli(["convert", str(source), "--quantize", "w8a16", "--output", str(output)]) == 1
    again = tmp_path / "again"
    assert engine_cli(["convert", str(output), "--quantize", "w8a16", "--output", str(again)]) == 1
    empty = tmp_path / "empty"
    empty.mkdir()
    assert engine_cli(["convert", str(empty), "--quantize", "w8a16", "--output", str(again)]) == 1
    # settings convert would not act on: refused rather than ignored
    bf16 = ["--dtype", "bfloat16"]
    assert (
        engine_cli(["convert", str(source), "--quantize", "w8a16", "--output", str(again), *bf16])
        == 2
    )
    assert engine_cli(["convert", "--group-size", "32", "--output", str(again)]) == 2
    assert not again.exists()
    odd = ["--group-size", "48"]
    assert (
        engine_cli(["convert", str(source), "--quantize", "w8a16", "--output", str(again), *odd])
        == 1
    )


def test_offload_plans_a_quantized_folder_with_its_own_groups(
    converted: tuple[Path, Path, int | None],
) -> None:
    """groupSize unset on a grouped checkpoint: the loader takes the checkpoint's groups, and
    the memory plan must count their scales too (or streaming a piece would not fit its
    slot)."""
    _, output, _ = converted
    quantization = {"weights": "w8a16"}
    expected = _greedy(output, quantization=quantization)
    llm = LLM(
        str(output),
        dtype="float32",
        kv_cache=EXACT_KV,
        progress=False,
        quantization=quantization,
        offload={"policy": "static", "device_memory_limit_gb": 0.00023, "prefetch_layers": 0},
    )
    try:
        assert llm.engine.runner.offload_plan.streamed
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        assert got == expected
    finally:
        llm.close()


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_moe_experts_convert_and_load_with_routers_in_float(
    family: str, make_tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    """Every expert (Mixtral's w1/w2/w3, Qwen2-MoE's and its shared expert's projections) is
    quantized, the routers are copied in float and listed in ``ignore``; the library reads
    the folder, and Brook runs it as it runs load-time quantization."""
    from compressed_tensors.entrypoints.convert import CompressedTensorsDequantizer

    source = make_tiny_model(family)
    output = tmp_path / "w8a16"
    assert engine_cli(["convert", str(source), "--quantize", "w8a16", "--output", str(output)]) == 0
    config = json.loads((output / "config.json").read_text())["quantization_config"]
    assert config["ignore"][0] == "lm_head" and any("gate$" in i for i in config["ignore"])
    stored = load_file(str(output / "model.safetensors"))
    original = load_file(str(source / "model.safetensors"))
    experts = [n for n in original if ".experts." in n or ".shared_expert." in n]
    assert experts and all(n.removesuffix(".weight") + ".weight_packed" in stored for n in experts)
    routers = [n for n in original if n.endswith(("mlp.gate.weight", "moe.gate.weight"))]
    assert routers and all(torch.equal(stored[n], original[n]) for n in routers)
    dense = CompressedTensorsDequantizer(str(output), dtype=torch.float32).process(dict(stored))
    for name in experts:
        assert torch.equal(dense[name], quantize(original[name]).dequantize(torch.float32)), name
    at_load, from_folder = _int8_layers(source), _int8_layers(output)
    assert at_load.keys() == from_folder.keys()
    assert all(torch.equal(from_folder[n], w) for n, w in at_load.items())
    w8a16 = {"weights": "w8a16"}
    assert _greedy(output, quantization=w8a16) == _greedy(source, quantization=w8a16)
