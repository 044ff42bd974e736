"""Every shipped example validates, and its engine sections are exactly the EngineConfig the
operator mounts into its pods."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from brook_engine.config import EngineConfig, dump_engine_config, load_engine_config
from brook_operator.api import API_KEY_PATH, LLMInference, to_engine_config, topology
from brook_operator.cli import main
from brook_operator.crd.validate import (
    apply_defaults,
    cel_problems,
    schema_problems,
    validate_object,
)
from brook_operator.render import ENGINE_CONFIG_FILE, engine_config_map

ROOT = Path(__file__).parents[3]
EXAMPLES = sorted((ROOT / "crds" / "examples").glob("*.yaml"))
ENGINE_SECTIONS = (
    "parallel",
    "offload",
    "kvCache",
    "quantization",
    "shapes",
    "moe",
    "scheduler",
)


def _load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def crd_schema() -> dict[str, Any]:
    crd = yaml.safe_load((ROOT / "crds" / "llminference.yaml").read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]  # type: ignore[no-any-return]


def test_the_examples_cover_the_documented_deployments() -> None:
    names = {p.stem for p in EXAMPLES}
    assert names == {
        "tiny-cpu",
        "smollm2-cpu",
        "smollm2-w8a16-cpu",
        "llama-70b-npu-tp8",
        "qwen-110b-npu-tp4-pp2",
        "qwen-7b-autoscaled",
        "qwen3-moe-npu-ep4",
    }


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_is_valid(path: Path, crd_schema: dict[str, Any]) -> None:
    obj = _load(path)
    # By the committed CRD's own schema and CEL rules...
    assert schema_problems(obj, crd_schema) == []
    assert cel_problems(apply_defaults(obj, crd_schema), crd_schema) == []
    # ...and by everything `brook validate` checks.
    assert validate_object(obj) == []
    assert main(["validate", "-f", str(path)]) == 0


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_engine_sections_parse_into_exactly_the_mounted_engine_config(
    path: Path, tmp_path: Path
) -> None:
    obj = _load(path)
    spec = obj["spec"]
    llmi = LLMInference.model_validate(obj)
    config = to_engine_config(llmi.spec)

    # The CR's engine sections, read by the engine's own model, are that EngineConfig.
    model = {k: v for k, v in spec["model"].items() if k != "credentialsSecretRef"}
    server = {k: v for k, v in spec.get("server", {}).items() if k != "apiKeySecretRef"}
    server["host"] = "0.0.0.0"
    if "apiKeySecretRef" in spec.get("server", {}):
        server["apiKey"] = {"file": API_KEY_PATH}
    direct = EngineConfig.model_validate(
        {
            "model": model,
            "device": spec.get("accelerator", {}).get("type", "npu"),
            "server": server,
            **{k: spec[k] for k in ENGINE_SECTIONS if k in spec},
        }
    )
    assert direct == config

    # The ConfigMap carries it as a file the engine loads back unchanged, but for the model's
    # URI: inside the pod the model is a local folder (mounted or fetched there).
    config_map = engine_config_map(llmi)
    mounted = tmp_path / ENGINE_CONFIG_FILE
    mounted.write_text(config_map["data"][ENGINE_CONFIG_FILE])
    loaded = load_engine_config(mounted)
    assert loaded.model.uri.startswith("file:///")
    assert loaded.model.model_copy(update={"uri": config.model.uri}) == config.model
    assert loaded.model_copy(update={"model": config.model}) == config
    assert config_map["data"][ENGINE_CONFIG_FILE] == dump_engine_config(loaded)


def test_topology_of_the_examples() -> None:
    shapes = {p.stem: topology(LLMInference.model_validate(_load(p)).spec) for p in EXAMPLES}
    seed = shapes["qwen-110b-npu-tp4-pp2"]
    assert (seed.devices_per_replica, seed.pods_per_replica, seed.devices_per_pod) == (8, 2, 4)
    assert seed.workload == "LeaderWorkerSet"
    tp8 = shapes["llama-70b-npu-tp8"]
    assert (tp8.devices_per_replica, tp8.pods_per_replica, tp8.workload) == (8, 1, "Deployment")
    assert shapes["tiny-cpu"].devices_per_pod == 1


def test_validate_reads_folders_and_multi_document_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bundle = tmp_path / "bundle.yaml"
    bundle.write_text("---\n".join(p.read_text() for p in EXAMPLES))
    assert main(["validate", "-f", str(bundle)]) == 0
    out = capsys.readouterr().out
    assert out.count(": valid") == len(EXAMPLES)
    assert f"{bundle}#2" in out
    assert main(["validate", "-f", str(ROOT / "crds" / "examples")]) == 0
