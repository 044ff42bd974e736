"""The installed console scripts, run as a user runs them (separate processes)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).parents[2]


def _script(name: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail(f"{name} is not installed next to {sys.executable}: pip install -e .")
    return found


def _run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(args), capture_output=True, text=True, input=stdin, cwd=ROOT, timeout=60
    )


def test_brook_validates_and_renders_the_examples() -> None:
    result = _run(_script("brook"), "validate", "-f", "crds/examples/")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(": valid") == len(list((ROOT / "crds/examples").glob("*.yaml")))

    result = _run(_script("brook"), "render", "-f", "crds/examples/qwen-110b-npu-tp4-pp2.yaml")
    assert result.returncode == 0, result.stderr
    assert "2 pod(s) (LeaderWorkerSet), 8 device(s) per replica" in result.stderr
    assert "name: qwen-110b-engine" in result.stdout
    assert "engine.yaml: |" in result.stdout
    assert "kind: LeaderWorkerSet" in result.stdout and "kind: PodDisruptionBudget" in result.stdout


def test_brook_crd_prints_the_committed_crd() -> None:
    result = _run(_script("brook"), "crd")
    assert result.returncode == 0
    assert result.stdout == (ROOT / "crds" / "llminference.yaml").read_text()


def test_brook_validate_reads_stdin_and_fails_on_problems() -> None:
    manifest = (
        (ROOT / "crds/examples/tiny-cpu.yaml")
        .read_text()
        .replace("devicesPerNode: 1", "devicesPerNode: 0")
    )
    result = _run(_script("brook"), "validate", "-f", "-", stdin=manifest)
    assert result.returncode == 1
    assert "-: LLMInference/tiny-cpu: spec.accelerator.devicesPerNode: 0 is less than" in (
        result.stderr
    )


def test_brook_engine_checks_a_mounted_config(tmp_path: Path) -> None:
    rendered = _run(_script("brook"), "render", "-f", "crds/examples/tiny-cpu.yaml").stdout
    import yaml

    config_map = next(yaml.safe_load_all(rendered))
    mounted = tmp_path / "engine.yaml"
    mounted.write_text(config_map["data"]["engine.yaml"])
    result = _run(_script("brook-engine"), "config", "--config", str(mounted))
    assert result.returncode == 0, result.stderr
    assert result.stdout == mounted.read_text()

    mounted.write_text("model: {uri: 'ftp://x/y'}\nparallel: {tensor: 0}\n")
    result = _run(_script("brook-engine"), "config", "--config", str(mounted))
    assert result.returncode == 1
    assert "model.uri: scheme 'ftp' is not supported" in result.stderr
    assert "parallel.tensor: Input should be greater than or equal to 1" in result.stderr


def test_the_w8a16_example_renders_an_engine_config_that_runs(
    tmp_path: Path, make_tiny_model: Any
) -> None:
    """The W8A16 CPU example: valid, rendered into the engine's mounted config, and that
    config serves W8A16 (the example's model is fetched from the Hub in a cluster; here a
    tiny local folder stands in for it, every other setting as rendered)."""
    import yaml

    from brook_engine import LLM, SamplingParams
    from brook_engine.config import load_engine_config
    from brook_engine.quant.linear import Int8Linear

    example = "crds/examples/smollm2-w8a16-cpu.yaml"
    assert _run(_script("brook"), "validate", "-f", example).returncode == 0
    rendered = _run(_script("brook"), "render", "-f", example).stdout
    mounted = tmp_path / "engine.yaml"
    mounted.write_text(next(yaml.safe_load_all(rendered))["data"]["engine.yaml"])
    config = load_engine_config(mounted)
    assert config.quantization.weights == "w8a16"
    options = config.model_dump(exclude={"model"}, by_alias=False)
    options["dtype"] = config.model.dtype
    options["max_model_len"] = 256
    options["kv_cache"].update(num_blocks=32, memory_fraction=None)  # a small test cache
    llm = LLM(str(make_tiny_model("llama")), progress=False, **options)
    assert any(isinstance(m, Int8Linear) for m in llm.engine.runner.model.modules())
    [out] = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 4
