"""`brook validate --model-config`: the engine's memory plan checked offline, so a budget that
cannot hold a rank's weights is refused with the numbers before a pod crash-loops."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from brook_operator.cli import main

ROOT = Path(__file__).parents[3]
EXAMPLE = ROOT / "crds" / "examples" / "qwen-110b-npu-tp4-pp2.yaml"
QWEN_110B = ROOT / "tests" / "data" / "model_configs" / "Qwen1.5-110B-Chat.json"


def _with_offload(tmp_path: Path, budget_gb: float) -> Path:
    manifest = yaml.safe_load(EXAMPLE.read_text())
    manifest["spec"]["quantization"] = {"weights": "none"}
    manifest["spec"]["offload"] = {"policy": "static", "deviceMemoryLimitGb": budget_gb}
    path = tmp_path / "offload.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return path


def test_a_plan_that_fits_is_printed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _with_offload(tmp_path, 20)
    code = main(["validate", "-f", str(path), "--model-config", str(QWEN_110B)])
    out = capsys.readouterr().out
    assert code == 0
    assert "memory plan" in out and "policy static" in out and "valid" in out
    assert "pieces streamed per rank: 13" in out  # bf16 110B over 8 ranks, 20 GiB budget


def test_a_budget_below_the_fixed_weights_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _with_offload(tmp_path, 0.5)
    code = main(["validate", "-f", str(path), "--model-config", str(QWEN_110B)])
    err = capsys.readouterr().err
    assert code == 1
    assert "spec.offload.deviceMemoryLimitGb: 0.500 GiB cannot hold rank 0's fixed" in err
    assert "raise it to" in err


def test_an_unreadable_model_config_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["validate", "-f", str(EXAMPLE), "--model-config", str(tmp_path / "nope.json")])
    assert code != 0
    assert "nope.json" in capsys.readouterr().err
