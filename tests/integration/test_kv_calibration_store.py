"""The KV calibration kept in ``shapes.cacheDir``: a second start with the same weights,
text and policy reuses the first's outcome (the same layer dtypes, errors, key shifts and
INT8 parameters, the same greedy tokens) without measuring; other weights, another text or
a file that does not load are measured again."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from brook_engine import LLM, SamplingParams
from brook_engine.kv.calibration_store import STORE_FOLDER

POLICY = [
    {"start": 0.0, "end": 0.5, "dtype": "fp8_e4m3"},
    {"start": 0.5, "end": 1.0, "dtype": "int8"},
]
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22]]


def _llm(folder: Path, cache: Path, engines: list[LLM], **dynamic: Any) -> LLM:
    llm = LLM(
        str(folder),
        dtype="float32",
        max_model_len=256,
        kv_cache={
            "num_blocks": 64,
            "layer_policies": POLICY,
            "dynamic_precision": {"enabled": True, "sensitivity_threshold": 0.5, **dynamic},
        },
        scheduler={"max_num_seqs": 4, "max_num_batched_tokens": 16},
        shapes={
            "mode": "compile",
            "cache_dir": str(cache),
            "patterns": [{"input_len": 8, "output_len": 2}],
        },
        progress=False,
    )
    engines.append(llm)
    return llm


def _tokens(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_a_second_start_reuses_the_calibration(
    make_tiny_model: Callable[..., Path],
    tmp_path: Path,
    engines: list[LLM],
    caplog: pytest.LogCaptureFixture,
) -> None:
    folder = make_tiny_model("llama", num_hidden_layers=4)
    cache = tmp_path / "cache"
    caplog.set_level(logging.INFO, logger="brook_engine.kv.setup")
    first = _llm(folder, cache, engines)
    measured = first.engine.runner.calibration
    assert measured is not None and "reused" not in caplog.text
    kept = list((cache / STORE_FOLDER).glob("*.pt"))
    assert len(kept) == 1
    expected = _tokens(first)
    first.close()

    caplog.clear()
    second = _llm(folder, cache, engines)
    reused = second.engine.runner.calibration
    assert reused is not None and "KV calibration reused" in caplog.text
    assert reused.chosen == measured.chosen and reused.errors == measured.errors
    assert "int8" in reused.chosen  # INT8 parameters came back, not only dtypes
    for a, b in zip(measured.int8, reused.int8, strict=True):
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            assert torch.equal(a.rotation, b.rotation) and torch.equal(a.k_scale, b.k_scale)
    for a, b in zip(measured.shifts, reused.shifts, strict=True):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b))  # type: ignore[arg-type]
    assert _tokens(second) == expected
    second.close()

    # another calibration text: measured again, kept beside the first
    text = tmp_path / "calibration.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    caplog.clear()
    other = _llm(folder, cache, engines, calibration_file=str(text))
    assert "reused" not in caplog.text
    assert len(list((cache / STORE_FOLDER).glob("*.pt"))) == 2
    other.close()

    # a kept file that does not load: measured again, with a warning, and replaced
    kept[0].write_bytes(b"not a calibration")
    caplog.clear()
    caplog.set_level(logging.WARNING, logger="brook_engine.kv.calibration_store")
    again = _llm(folder, cache, engines)
    assert "not reused" in caplog.text and "KV calibration reused" not in caplog.text
    assert again.engine.runner.calibration is not None
    assert again.engine.runner.calibration.chosen == measured.chosen
    assert kept[0].read_bytes() != b"not a calibration"


def test_other_weights_are_measured_again(
    make_tiny_model: Callable[..., Path],
    tmp_path: Path,
    engines: list[LLM],
    caplog: pytest.LogCaptureFixture,
) -> None:
    from safetensors.torch import load_file
    from tests.support.checkpoints import copy_with

    cache = tmp_path / "cache"
    caplog.set_level(logging.INFO, logger="brook_engine.kv.setup")
    folder = make_tiny_model("llama", num_hidden_layers=4)
    _llm(folder, cache, engines).close()
    # the same shapes and file size, every value moved a little, as a fine-tune moves them
    # (the fingerprint samples the data: it tells checkpoints apart, not single values)
    moved = {k: t * 1.01 for k, t in load_file(folder / "model.safetensors").items()}
    (tmp_path / "other").mkdir()
    other = copy_with(folder, tmp_path / "other", moved)
    caplog.clear()
    _llm(other, cache, engines).close()
    assert "reused" not in caplog.text
    assert len(list((cache / STORE_FOLDER).glob("*.pt"))) == 2
