"""The dependency rules of DESIGN.md hold at run time, not only in import-linter's static view:
importing the operator side (CLI, API, CRD, validation) loads no torch."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "torch_npu", "safetensors", "tokenizers", "transformers")


def _modules_after(imports: str) -> set[str]:
    code = f"import sys\n{imports}\nprint('\\n'.join(sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    return {line.split(".")[0] for line in out.splitlines()}


def test_operator_side_loads_no_torch() -> None:
    loaded = _modules_after(
        "import brook_operator.cli, brook_operator.crd.validate, brook_operator.render"
    )
    assert "brook_engine" in loaded  # it does use the engine's configuration...
    assert not loaded & set(HEAVY)  # ...and nothing heavy behind it


def test_engine_config_is_torch_free() -> None:
    loaded = _modules_after("import brook_engine.config, brook_engine.cli")
    assert not loaded & set(HEAVY)
    assert not loaded & {"brook_operator", "kopf", "kubernetes"}
