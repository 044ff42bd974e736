"""``brook-engine bench --rounds N``: Brook and a peer (transformers) run N times on the same
prompts, alternating, and each engine is reported at its median round (tiny model, small
counts: this checks the tool, not speed)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from brook_engine.bench.command import median_round
from brook_engine.bench.machine import (
    VECTOR_FLAGS,
    _products,
    model_parameters,
    model_product_rate,
)
from brook_engine.bench.run import BenchReport
from brook_engine.cli import main


def _report(engine: str, output_tok_s: float) -> BenchReport:
    return BenchReport(engine, "batch", 1, 1, 1, 1.0, output_tok_s, output_tok_s, *[None] * 4, 0)


def test_the_median_round_is_reported_with_every_round() -> None:
    rounds = [_report("brook", x) for x in (30.0, 10.0, 20.0)]
    middle = median_round(rounds)
    assert middle.output_tok_s == 20.0
    assert middle.extra["rounds_output_tok_s"] == [30.0, 10.0, 20.0]  # in run order
    assert median_round([_report("hf", 4.0), _report("hf", 2.0)]).output_tok_s == 2.0
    assert median_round([_report("hf", 5.0)]).extra["rounds_output_tok_s"] == [5.0]


def test_rounds_alternate_brook_and_a_peer_on_the_same_prompts(
    make_tiny_model: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    model = str(make_tiny_model("llama"))
    args = ["bench", "--model", model, "--dtype", "float32", "--num-requests", "3"]
    args += ["--input-len", "8", "--output-len", "4", "--compare", "hf", "--json"]
    assert main([*args, "--rounds", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    brook, (hf,) = out["brook"], out["peers"]
    for row in (brook, hf):
        rounds = row["extra"]["rounds_output_tok_s"]
        assert len(rounds) == 3
        assert round(row["output_tok_s"], 2) == sorted(rounds)[1]
        assert row["requests"] == 3 and row["prompt_tokens"] == brook["prompt_tokens"]
    assert out["ratios"]["hf"]["output_tok_s"] == pytest.approx(
        brook["output_tok_s"] / hf["output_tok_s"]
    )


def test_rounds_below_one_are_refused(
    make_tiny_model: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    model = str(make_tiny_model("llama"))
    assert main(["bench", "--model", model, "--rounds", "0"]) == 2
    assert "--rounds 0: use 1 or more" in capsys.readouterr().err


def test_every_report_names_the_cpu_and_the_model_products_rate(
    make_tiny_model: Callable[..., Path],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = str(make_tiny_model("llama"))
    args = ["bench", "--model", model, "--dtype", "float32", "--num-requests", "3"]
    args += ["--input-len", "8", "--output-len", "4"]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    machine = out["machine"]
    assert machine["cpu"] and machine["threads"] >= 1 and machine["brook_cpu_isa"] == "native"
    assert set(machine["vector_flags"]) <= set(VECTOR_FLAGS)
    extra = out["brook"]["extra"]
    assert extra["products_rows"] == 3 and extra["products_gflops"] > 0
    # The same tokens over the same time: the two utilizations differ by their denominators.
    assert extra["mfu_products"] == pytest.approx(
        out["brook"]["mfu"] * extra["gemm_gflops"] / extra["products_gflops"]
    )
    monkeypatch.setenv("BROOK_CPU_ISA", "avx2")
    assert main([*args, "--mode", "single"]) == 0
    text = capsys.readouterr().out
    assert f"CPU: {machine['cpu']} (" in text and "BROOK_CPU_ISA=avx2" in text
    assert "of the model's own products at 1 rows" in text


def test_the_model_products_rate_counts_every_linear_layer_and_the_head(
    make_tiny_model: Callable[..., Path],
) -> None:
    from brook_engine import LLM

    llm = LLM(str(make_tiny_model("llama")), dtype="float32", max_model_len=64, progress=False)
    model = llm.engine.runner.model
    products = _products(model)
    layers = len(model.model.layers)
    assert len(products) == 4 * layers + 1  # qkv, o, gate_up, down per layer; the head
    assert model_product_rate(model, rows=2, dtype=torch.float32) > 0


def test_a_w8a16_model_counts_its_int8_weights_as_parameters(
    make_tiny_model: Callable[..., Path],
) -> None:
    from brook_engine import LLM

    folder = str(make_tiny_model("llama"))
    plain = LLM(folder, dtype="float32", max_model_len=64, progress=False)
    quantized = LLM(
        folder,
        dtype="float32",
        max_model_len=64,
        quantization={"weights": "w8a16"},
        progress=False,
    )
    # Scales aside, the same weights: the tiled int8 copies replace the plain parameters.
    counted = model_parameters(quantized.engine.runner.model)
    scales = sum(
        m.weight_scale.numel()
        for m in quantized.engine.runner.model.modules()
        if hasattr(m, "weight_scale")
    )
    assert counted - scales == model_parameters(plain.engine.runner.model)
