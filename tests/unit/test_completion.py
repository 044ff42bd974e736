"""Shell completion generated from the command lines: bash runs the script with the words a
user typed, and offers the subcommands, the command's flags, a flag's choices and files."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from brook_engine.cli import build_parser as engine_parser
from brook_engine.completion import bash_completion
from brook_operator.cli import build_parser as operator_parser

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _complete(script: str, prog: str, words: list[str], cwd: Path) -> list[str]:
    """COMPREPLY for the command line ``prog words...`` with the cursor on the last word."""
    line = " ".join(f"'{w}'" for w in [prog, *words])
    program = f"""{script}
COMP_WORDS=({line}); COMP_CWORD={len(words)}
_{prog.replace("-", "_")}_complete
printf '%s\\n' "${{COMPREPLY[@]}}"
"""
    out = subprocess.run(
        ["bash", "-c", program], capture_output=True, text=True, check=True, cwd=cwd
    ).stdout
    return sorted(w for w in out.splitlines() if w)


def test_brook_completes_commands_flags_choices_and_files(tmp_path: Path) -> None:
    script = bash_completion(operator_parser(), "brook")
    assert {"up", "deploy", "validate", "completion"} <= set(
        _complete(script, "brook", [""], tmp_path)
    )
    assert _complete(script, "brook", ["de"], tmp_path) == ["deploy"]
    assert "--dry-run" in _complete(script, "brook", ["deploy", "--"], tmp_path)
    assert _complete(script, "brook", ["up", "--device", ""], tmp_path) == [
        "auto", "cpu", "cuda", "npu",
    ]  # fmt: skip
    assert _complete(script, "brook", ["autoscale", "simulate", "--uncached"], tmp_path) == [
        "--uncached-start"
    ]
    (tmp_path / "model.yaml").write_text("{}")
    assert _complete(script, "brook", ["up", "-f", "mo"], tmp_path) == ["model.yaml"]
    assert {"bash", "zsh"} <= set(_complete(script, "brook", ["completion", ""], tmp_path))


def test_brook_engine_completes_its_flags(tmp_path: Path) -> None:
    script = bash_completion(engine_parser(), "brook-engine")
    assert "--moe-reroute" in _complete(script, "brook-engine", ["serve", "--moe"], tmp_path)
    assert _complete(script, "brook-engine", ["bench", "--workload", "m"], tmp_path) == ["moe"]
    assert _complete(script, "brook-engine", ["serve", "--quantization", ""], tmp_path) == [
        "none",
        "w8a16",
    ]


def test_the_completion_command_prints_a_script_zsh_can_load(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from brook_operator.cli import main

    assert main(["completion", "zsh"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("autoload -U +X bashcompinit && bashcompinit")
    assert "complete -o default -F _brook_complete brook" in out
    subprocess.run(["bash", "-n", "-c", out.split("\n", 1)[1]], check=True)  # valid bash
