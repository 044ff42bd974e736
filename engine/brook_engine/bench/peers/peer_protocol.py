"""What every peer runner shares: reading and checking the workload file, the fields of the
result line, and how busy the rest of the machine was meanwhile (formats in
``brook_engine/bench/peers/__init__.py``).

Standard library only, and no import of brook_engine: ``vllm_runner`` runs as a plain script
in vLLM's venv, where brook_engine is not installed, and imports this file as the top-level
module ``peer_protocol`` (the script's folder is the first entry of ``sys.path``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class WorkloadError(ValueError):
    """The workload file is malformed."""


@dataclass(frozen=True)
class Workload:
    model: Path
    dtype: str
    threads: int
    prompts: list[list[int]]
    max_tokens: list[int]
    ignore_eos: bool
    mode: str
    return_token_ids: bool = False


def load_workload(path: Path) -> Workload:
    """Read and check a workload JSON file."""
    raw = json.loads(path.read_text())
    if not isinstance(raw, dict):
        raise WorkloadError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    missing = {"model", "prompts", "max_tokens"} - raw.keys()
    if missing:
        raise WorkloadError(f"{path}: missing keys {sorted(missing)}")
    model = Path(raw["model"])
    if not (model / "config.json").is_file():
        raise WorkloadError(f"{path}: 'model' {model} is not a Hugging Face model folder")
    prompts = [[int(t) for t in p] for p in raw["prompts"]]
    max_tokens = [int(m) for m in raw["max_tokens"]]
    if len(prompts) != len(max_tokens) or not prompts:
        raise WorkloadError(
            f"{path}: 'prompts' ({len(prompts)}) and 'max_tokens' ({len(max_tokens)}) must be "
            "non-empty lists of the same length"
        )
    if any(not p for p in prompts) or any(m < 1 for m in max_tokens):
        raise WorkloadError(f"{path}: every prompt needs a token and every max_tokens must be >= 1")
    dtype = str(raw.get("dtype", "bfloat16"))
    if dtype not in ("float32", "bfloat16"):
        raise WorkloadError(f"{path}: 'dtype' must be 'float32' or 'bfloat16', got {dtype!r}")
    mode = str(raw.get("mode", "batch"))
    if mode not in ("batch", "single"):
        raise WorkloadError(f"{path}: 'mode' must be 'batch' or 'single', got {mode!r}")
    threads = int(raw.get("threads", os.cpu_count() or 1))
    if threads < 1:
        raise WorkloadError(f"{path}: 'threads' must be >= 1, got {threads}")
    return Workload(
        model=model,
        dtype=dtype,
        threads=threads,
        prompts=prompts,
        max_tokens=max_tokens,
        ignore_eos=bool(raw.get("ignore_eos", True)),
        mode=mode,
        return_token_ids=bool(raw.get("return_token_ids", False)),
    )


def workload_from_args(description: str, argv: Sequence[str] | None) -> Path:
    """The ``--workload FILE`` argument of a runner's command line."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--workload", type=Path, required=True, help="workload JSON file")
    return Path(parser.parse_args(argv).workload)


def read_workload(path: Path) -> Workload | None:
    """:func:`load_workload`, or None once the reason is on stderr (the runner exits with 2)."""
    try:
        return load_workload(path)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        print(f"error: bad workload: {exc}", file=sys.stderr)
        return None


def machine_busy_ticks() -> int:
    """Clock ticks every CPU has spent busy (less idle and iowait), from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)


def process_ticks(pid: int | str = "self") -> int:
    """Clock ticks process ``pid`` has spent (utime + stime); 0 for one that is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(stat[11]) + int(stat[12])


def other_cpu_frac(before: tuple[int, int], after: tuple[int, int], elapsed_s: float) -> float:
    """Share of the machine's CPU time that other processes used between two readings of
    (busy ticks of the machine, ticks of the runner): near 0 on a quiet machine; well above 0
    means the numbers are not trustworthy."""
    ticks = os.sysconf("SC_CLK_TCK") * elapsed_s * (os.cpu_count() or 1)
    others = (after[0] - before[0]) - (after[1] - before[1])
    return max(0.0, others / ticks) if ticks > 0 else 0.0


def result_fields(
    engine: str,
    version: str,
    torch_version: str,
    workload: Workload,
    *,
    output_tokens: int,
    computed_output_tokens: int,
    elapsed_s: float,
    load_s: float,
    ttft_s: list[float | None],
    peak_rss_mb: float,
    other_cpu_frac: float,
) -> dict[str, Any]:
    """The fields every runner's result line carries, in their order."""
    prompt_tokens = sum(len(p) for p in workload.prompts)
    return {
        "engine": engine,
        "version": version,
        "torch": torch_version,
        "mode": workload.mode,
        "dtype": workload.dtype,
        "threads": workload.threads,
        "requests": len(workload.prompts),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "useful_output_tokens": sum(workload.max_tokens),
        "computed_output_tokens": computed_output_tokens,
        "elapsed_s": elapsed_s,
        "load_s": load_s,
        "output_tok_s": output_tokens / elapsed_s,
        "total_tok_s": (prompt_tokens + output_tokens) / elapsed_s,
        "ttft_s": ttft_s if all(t is not None for t in ttft_s) else None,
        "peak_rss_mb": peak_rss_mb,
        "other_cpu_frac": other_cpu_frac,
    }


def summary(result: dict[str, Any]) -> str:
    """The runner's closing log line."""
    return (
        f"{result['output_tokens']} output tokens in {result['elapsed_s']:.2f} s: "
        f"{result['output_tok_s']:.1f} tok/s output, {result['total_tok_s']:.1f} tok/s total"
    )
