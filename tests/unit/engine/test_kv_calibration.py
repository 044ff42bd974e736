"""Dynamic KV precision: per-layer errors are measured where storage loses precision, the
threshold decides the fallback, the outcome is logged and exported, and the memory
estimate follows the chosen dtypes."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from brook_engine import LLM
from brook_engine.config import ConfigError
from brook_engine.kv.cache import bytes_per_token
from brook_engine.metrics.prometheus import EngineMetrics

POLICY = [
    {"start": 0.0, "end": 0.5, "dtype": "fp8_e5m2"},
    {"start": 0.5, "end": 0.75, "dtype": "fp8_e4m3"},
    {"start": 0.75, "end": 1.0, "dtype": "fp16"},
]


def _llm(path: Path, **dynamic: Any) -> LLM:
    return LLM(
        str(path),
        dtype="float32",
        max_model_len=256,
        kv_cache={
            "num_blocks": 64,
            "layer_policies": POLICY,
            "dynamic_precision": {"enabled": True, **dynamic},
        },
        progress=False,
    )


@pytest.fixture(scope="module")
def tiny(make_tiny_model: Callable[..., Path]) -> Path:
    return make_tiny_model("llama", num_hidden_layers=4)


def test_errors_are_measured_for_lossy_layers_and_the_threshold_decides(tiny: Path) -> None:
    keep_all = _llm(tiny, sensitivity_threshold=1.0).engine.runner
    assert keep_all.calibration is not None
    assert keep_all.layer_kinds == ["fp8_e5m2", "fp8_e5m2", "fp8_e4m3", "fp16"]
    errors = keep_all.calibration.errors
    assert all(e is not None and 0 < e < 1 for e in errors)  # fp16 loses bits of float32
    # Two mantissa bits lose more than three (with scales), and more than FP16's ten.
    assert min(errors[0], errors[1]) > errors[2] > errors[3]  # type: ignore[operator]

    threshold = float(errors[2]) * 1.01  # type: ignore[arg-type]
    strict = _llm(tiny, sensitivity_threshold=threshold).engine.runner
    assert strict.calibration is not None
    retried = strict.calibration.errors  # INT8's error for the E5M2 layers that retried it
    for layer in (0, 1):  # E5M2 above the threshold: INT8 if that is close enough, else FP16
        assert retried[layer] is not None and retried[layer] < errors[layer]  # type: ignore[operator]
        expected = "int8" if retried[layer] <= threshold else "fp16"  # type: ignore[operator]
        assert strict.layer_kinds[layer] == expected
        assert (strict.calibration.int8[layer] is not None) == (expected == "int8")
    assert strict.layer_kinds[2:] == ["fp8_e4m3", "fp16"]

    # Nothing within reach: every lossy layer takes the fallback, INT8 tried first.
    none = _llm(tiny, sensitivity_threshold=1e-9).engine.runner
    assert none.layer_kinds == ["fp16"] * 4
    assert none.kv_bytes_per_token > keep_all.kv_bytes_per_token


def test_int8_layers_are_fitted_even_with_dynamic_precision_off(tiny: Path) -> None:
    """INT8's scales come from the calibration pass: it runs for them, and nothing falls back
    (dynamic precision is what would move a layer)."""
    llm = LLM(
        str(tiny),
        dtype="float32",
        max_model_len=256,
        kv_cache={
            "num_blocks": 64,
            "layer_policies": [{"start": 0.0, "end": 1.0, "dtype": "int8"}],
            "dynamic_precision": {"enabled": False, "sensitivity_threshold": 1e-9},
        },
        progress=False,
    )
    runner = llm.engine.runner
    assert runner.layer_kinds == ["int8"] * 4
    assert runner.calibration is not None
    assert all(p is not None for p in runner.calibration.int8)
    assert all(c.k.dtype == torch.int8 and c.int8 is not None for c in runner.caches)
    arch = llm.engine.arch
    assert runner.kv_bytes_per_token == 4 * 2 * arch.num_kv_heads * arch.head_dim  # no scales


def test_the_outcome_is_logged_and_exported(tiny: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="brook_engine.kv.setup"):
        llm = _llm(tiny, sensitivity_threshold=1e-9, fallback_dtype="bf16")
    assert "fell back: 0:fp8_e5m2→bf16" in caplog.text
    registry = CollectorRegistry()
    EngineMetrics(registry, {"model": "tiny"}).record(llm.engine.stats())
    layers = {
        dtype: registry.get_sample_value("brook_engine_kv_cache_layers", {"dtype": dtype})
        for dtype in ("bf16", "fp16")
    }
    assert layers == {"bf16": 3.0, "fp16": 1.0}
    per_layer = {
        (layer, dtype): registry.get_sample_value(
            "brook_engine_kv_cache_layer_dtype", {"layer": str(layer), "dtype": dtype}
        )
        for layer in range(4)
        for dtype in ("bf16", "fp16", "fp8_e5m2", "fp8_e4m3")
    }
    assert {key for key, value in per_layer.items() if value is not None} == {
        (0, "bf16"), (1, "bf16"), (2, "bf16"), (3, "fp16")
    }  # fmt: skip
    assert set(per_layer.values()) == {None, 1.0}
    assert registry.get_sample_value("brook_engine_kv_calibration_error", {"layer": "0"}) > 0
    assert (
        registry.get_sample_value("brook_engine_kv_cache_bytes_per_token")
        == llm.engine.runner.kv_bytes_per_token
    )


def test_memory_estimate_follows_the_chosen_dtypes(tiny: Path) -> None:
    engine = _llm(tiny, sensitivity_threshold=1.0).engine
    arch = engine.arch
    per_token = sum(
        bytes_per_token(kind, engine.runner.dtype, arch.num_kv_heads, arch.head_dim)
        for kind in engine.runner.layer_kinds
    )
    estimate = engine.estimate_memory(seq_len=100, batch=3)
    blocks = 3 * -(-100 // engine.block_manager.block_size)
    assert estimate["kv_cache"] == blocks * engine.block_manager.block_size * per_token
    assert estimate["total"] == estimate["kv_cache"] + engine.runner.weight_bytes
    budget = 10 * estimate["kv_cache"] // 3 + 1
    assert engine.sequences_fitting(100, budget) == 10


def test_a_calibration_file_is_read_and_an_empty_one_refused(tiny: Path, tmp_path: Path) -> None:
    text = tmp_path / "calibration.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    runner = _llm(tiny, calibration_file=str(text)).engine.runner
    assert runner.calibration is not None and runner.calibration.num_tokens > 100
    text.write_text("  \n")
    with pytest.raises((ConfigError, ValueError), match="calibrationFile"):
        _llm(tiny, calibration_file=str(text))


def test_shifting_stored_keys_leaves_attention_unchanged(
    make_tiny_model: Callable[..., Path],
) -> None:
    """Softmax ignores a constant added to all of a query's scores, so keys stored minus any
    per-head vector give the same logits and tokens, in prefill and decode."""
    llm = LLM(
        str(make_tiny_model("llama")),
        dtype="float32",
        max_model_len=128,
        kv_cache={
            "num_blocks": 32,
            "layer_policies": [{"start": 0.0, "end": 1.0, "dtype": "auto"}],
            "dynamic_precision": {"enabled": False},
            # Shifts are fixed at start-up; this test changes them on a live engine, so
            # cached blocks of unshifted keys must not be reused after the change.
            "prefix_sharing": {"enabled": False},
        },
        progress=False,
    )
    from brook_engine import SamplingParams

    prompt = list(range(5, 45))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain_logits = llm.engine.prompt_logits(prompt)
    plain_tokens = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    generator = torch.Generator().manual_seed(0)
    for cache in llm.engine.runner.caches:
        heads, dim = cache.k.shape[0], cache.k.shape[2]
        cache.k_shift = 3 * torch.randn(heads, dim, generator=generator)
    shifted_logits = llm.engine.prompt_logits(prompt)
    shifted_tokens = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    torch.testing.assert_close(shifted_logits, plain_logits, rtol=1e-4, atol=1e-4)
    assert shifted_tokens == plain_tokens


def test_int8_attention_is_the_exact_attention_up_to_rounding() -> None:
    """INT8 never turns the cache back: attention scores the stored integers with a turned,
    scaled query and turns the output back. Over keys with a large mean and one outlier
    channel, that equals attention over the real keys and values up to the rounding, which is
    finer than E4M3's with its per-token scales."""
    from brook_engine.kv.cache import Int8Params, LayerKVCache

    gen = torch.Generator().manual_seed(0)
    tokens, heads, kv_heads, dim = 48, 4, 2, 16
    q = torch.randn(tokens, heads, dim, generator=gen)
    k = torch.randn(tokens, kv_heads, dim, generator=gen) + 4.0
    k[:, :, 3] *= 20  # an outlier channel
    v = torch.randn(tokens, kv_heads, dim, generator=gen) / 3 - 1.0

    def attend(q_: torch.Tensor, k_: torch.Tensor, v_: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            q_.transpose(0, 1), k_, v_, is_causal=True, enable_gqa=True
        ).transpose(0, 1)

    exact = attend(q, k.transpose(0, 1), v.transpose(0, 1))
    errors = {}
    for kind in ("int8", "fp8_e4m3"):
        cache = LayerKVCache.allocate(6, 8, kv_heads, dim, kind, torch.float32, q.device)
        if kind == "int8":
            cache.int8 = Int8Params.fit(q, k, v)
        slots = torch.arange(tokens)
        cache.write(slots, k, v)
        ck, cv = cache.read(slots)
        assert torch.equal(torch.stack(cache.as_stored(k, v)), torch.stack((ck, cv)))
        out = cache.output(attend(cache.query(q), ck, cv))
        assert out.dtype == torch.float32
        errors[kind] = float((out - exact).norm() / exact.norm())
    assert errors["int8"] < 0.01
    assert errors["int8"] < errors["fp8_e4m3"] / 2


class _BiasedKeys:
    """An attention layer whose keys carry a large constant before rotary embedding, as real
    models' keys do: after rotary the mean key turns with the position."""

    scale = 0.25

    def __init__(self, dim: int) -> None:
        gen = torch.Generator().manual_seed(1)
        self.wq = torch.randn(dim, 2 * dim, generator=gen) / dim**0.5
        self.wk = torch.randn(dim, dim, generator=gen) / dim**0.5
        self.wv = torch.randn(dim, dim, generator=gen) / dim**0.5
        self.bias = torch.randn(dim, generator=gen) * 6
        self.dim = dim

    def project(
        self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from brook_engine.layers.rotary import apply_rotary

        tokens = x.shape[0]
        q = apply_rotary((x @ self.wq).view(tokens, 2, self.dim), *rotary)
        k = apply_rotary((x @ self.wk + self.bias).view(tokens, 1, self.dim), *rotary)
        return q, k, (x @ self.wv).view(tokens, 1, self.dim)


def test_int8_ranges_hold_at_positions_far_past_the_calibration_text() -> None:
    """Keys turn with their position, so a mean and ranges fitted at the text's own
    positions saturate far from them; fitted with the text also placed at random positions
    across the model's length (``calibration_positions``), the error at a far position
    stays small."""
    from brook_engine.kv.calibration import LayerSample, calibration_positions, decide
    from brook_engine.layers.rotary import RotaryEmbedding

    dim, tokens, max_positions = 16, 128, 8192
    rotary = RotaryEmbedding(dim, max_positions, 10000.0, "default", {}, torch.float32, "cpu")
    layer = _BiasedKeys(dim)
    x = torch.randn(tokens, dim, generator=torch.Generator().manual_seed(2))
    fit_at, measure_at = calibration_positions(tokens, max_positions)
    own = torch.arange(tokens)
    assert torch.equal(fit_at[0], own) and torch.equal(measure_at[0], own)
    assert all(int(p.max()) < max_positions for p in fit_at)
    assert int(measure_at[1][0]) == round((max_positions - tokens) * 5 / 6)

    def placed(at: torch.Tensor) -> Any:
        return layer.project(x, rotary.lookup(at))

    spread = LayerSample(placed, fit_at, measure_at, layer.scale)
    near = LayerSample(placed, fit_at[:1], measure_at, layer.scale)
    [fitted] = decide([spread], ["int8"], torch.float32, 1.0, "fp16")
    [naive] = decide([near], ["int8"], torch.float32, 1.0, "fp16")
    assert fitted.kind == naive.kind == "int8"
    assert fitted.error is not None and naive.error is not None
    assert fitted.error < 0.05
    assert naive.error > 5 * fitted.error
