"""A single sequence's decode step with a layer per kernel call (``models/decode_row.py``):
the same tokens and log-probabilities as the Python path, bit for bit, on every layer it
runs (16-bit or float32 weights read plain, float32 weights in Brook's packed layout,
W8A16's int8 weights), and the Python path wherever it cannot run (a cache that encodes what
it stores, oneDNN-packed weights, more than one token)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from brook_engine import LLM, SamplingParams
from brook_engine.layers import cpu_kernels
from brook_engine.layers.linear import cpu_packing_supported
from brook_engine.models import decode_row

AUTO_KV = {"layer_policies": [{"start": 0.0, "end": 1.0, "dtype": "auto"}]}

needs_kernels = pytest.mark.skipif(
    cpu_kernels.library() is None or not hasattr(cpu_kernels.library(), "brook_decode_row_layer"),
    reason="Brook's CPU kernels (the decode-layer one included) did not build here",
)


def _run(
    folder: Path, fast: bool, monkeypatch: pytest.MonkeyPatch, **options: Any
) -> tuple[list[list[int]], list[list[float]], int]:
    """Greedy tokens and their log-probabilities, one sequence at a time, and how many
    layers the kernel ran."""
    calls = [0]
    with monkeypatch.context() as patch:
        if not fast:
            patch.setattr(decode_row.RowDecoding, "begin", lambda *args: None)
        original = decode_row.RowStep.layer

        def counted(self: Any, *args: Any) -> Any:
            done = original(self, *args)
            calls[0] += done is not None
            return done

        patch.setattr(decode_row.RowStep, "layer", counted)
        llm = LLM(str(folder), max_model_len=128, progress=False, **options)
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
        tokens, logprobs = [], []
        for prompt in ([5, 9, 17, 3], [40, 41, 7]):
            out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            tokens.append(list(out.token_ids))
            assert out.logprobs is not None
            logprobs.append([entry[0] for entry in out.logprobs])
    return tokens, logprobs, calls[0]


@needs_kernels
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])  # biases; a sliding window
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_kernel_layer_decodes_as_the_python_path_bit_for_bit(
    make_tiny_model: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, arch: str, dtype: str
) -> None:
    # Mistral's window of 6 is shorter than the contexts: the window path runs too.
    folder = make_tiny_model(arch, sliding_window=6) if arch == "mistral" else make_tiny_model(arch)
    options: dict[str, Any] = {"dtype": dtype, "kv_cache": AUTO_KV}
    if dtype == "bfloat16" and cpu_packing_supported(torch.bfloat16):
        options["shapes"] = {"one_row_weights": "bf16"}  # plain BF16 beside packed weights
    fast = _run(folder, True, monkeypatch, **options)
    slow = _run(folder, False, monkeypatch, **options)
    assert fast[0] == slow[0] and fast[1] == slow[1]
    assert fast[2] == 2 * 11 * 3  # every decode step (11 a prompt), every layer
    assert slow[2] == 0


@needs_kernels
def test_layers_it_cannot_run_take_the_python_path_in_the_same_step(
    make_tiny_model: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = make_tiny_model("llama")
    # The first layer's cache stores FP8 (with scales): the kernel runs the other two.
    kv = {
        "layer_policies": [
            {"start": 0.0, "end": 0.2, "dtype": "fp8_e4m3"},
            {"start": 0.2, "end": 1.0, "dtype": "auto"},
        ]
    }
    options: dict[str, Any] = {"dtype": "bfloat16", "kv_cache": kv}
    if cpu_packing_supported(torch.bfloat16):
        options["shapes"] = {"one_row_weights": "bf16"}  # plain BF16 beside packed weights
    fast = _run(folder, True, monkeypatch, **options)
    slow = _run(folder, False, monkeypatch, **options)
    assert fast[:2] == slow[:2]
    assert fast[2] == 2 * 11 * 2
    # float32 weights in oneDNN's layout (Mistral's 112-wide qkv and 80-wide o are not
    # multiples of 32, so they are not in Brook's): no layer is the kernel's.
    if torch.backends.mkldnn.is_available():
        mistral = make_tiny_model("mistral")
        assert _run(mistral, True, monkeypatch, dtype="float32", kv_cache=AUTO_KV)[2] == 0


@needs_kernels
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: biases and a tied head
def test_float32_weights_in_brooks_layout_run_the_kernel_layer_without_copies(
    make_tiny_model: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, arch: str
) -> None:
    folder = make_tiny_model(arch)
    fast = _run(folder, True, monkeypatch, dtype="float32", kv_cache=AUTO_KV)
    slow = _run(folder, False, monkeypatch, dtype="float32", kv_cache=AUTO_KV)
    assert fast[:2] == slow[:2]
    assert fast[2] == 2 * 11 * 3


@needs_kernels
@pytest.mark.parametrize(
    ("arch", "dtype", "copy"),
    # mistral: its 112-wide qkv and 80-wide o and down take oneDNN's layout, which the
    # kernel reads through fp32 copies (the others are in Brook's layout, read as they are)
    [("mistral", "float32", "fp32"), ("qwen2", "bfloat16", "fp16")],
)
def test_one_row_copies_are_what_the_kernel_layer_reads(
    make_tiny_model: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
    arch: str,
    dtype: str,
    copy: str,
) -> None:
    if copy == "fp32" and not torch.backends.mkldnn.is_available():
        pytest.skip("without oneDNN no float32 weight is packed, and fp32 copies are refused")
    folder = make_tiny_model(arch)
    options = {"dtype": dtype, "kv_cache": AUTO_KV, "shapes": {"one_row_weights": copy}}
    fast = _run(folder, True, monkeypatch, **options)
    slow = _run(folder, False, monkeypatch, **options)
    assert fast[:2] == slow[:2] and fast[2] == 2 * 11 * 3


@needs_kernels
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: the int8 product's float32 bias
@pytest.mark.parametrize(("dtype", "group_size"), [("bfloat16", None), ("float32", 32)])
def test_w8a16_layers_run_in_the_kernel_bit_for_bit(
    make_tiny_model: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
    arch: str,
    dtype: str,
    group_size: int | None,
) -> None:
    # The tiled int8 weights are read by the same kernel the Python path calls; float32
    # activations too (a float32 model's float weights are the Python path's, not the kernel's).
    folder = make_tiny_model(arch)
    quantization = {"weights": "w8a16", "group_size": group_size}
    options: dict[str, Any] = {"dtype": dtype, "kv_cache": AUTO_KV, "quantization": quantization}
    fast = _run(folder, True, monkeypatch, **options)
    slow = _run(folder, False, monkeypatch, **options)
    assert fast[0] == slow[0] and fast[1] == slow[1]
    assert fast[2] == 2 * 11 * 3 and slow[2] == 0


@needs_kernels
def test_float16_w8a16_layers_take_the_python_path(
    make_tiny_model: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The int8 kernel reads float32 or bfloat16 activations; float16 ones are widened in
    # PyTorch, so no layer is the kernel's.
    options = {"dtype": "float16", "kv_cache": AUTO_KV, "quantization": {"weights": "w8a16"}}
    assert _run(make_tiny_model("llama"), True, monkeypatch, **options)[2] == 0
