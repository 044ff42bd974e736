"""The disk tier on CPU: a model whose weights are several times the budget runs from the
spill file, generating what the all-resident model generates, and the process's peak RSS
while it generates stays within what it held before the engine + budget + KV + a stated
overhead (OVERHEAD: the engine's own objects, activations, oneDNN's scratch, the mapped
pages of the checkpoint's resident tensors; ~90 MiB measured here).
Each engine runs in a process of its own so that its peak is its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from brook_engine.offload.plan import GIB

MIB = 1 << 20
#: What a generating process holds beyond its weights' budget and KV cache.
OVERHEAD = 128 * MIB


def _run(folder: Path, budget_gib: float) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "tests.support.offload_rss", str(folder), str(budget_gib)],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "BROOK_CPU_KERNELS": "off"},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_a_model_larger_than_the_budget_runs_from_disk_within_it(make_tiny_model: Any) -> None:
    folder = make_tiny_model(
        "llama",
        hidden_size=512,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=2048,
        num_hidden_layers=16,
    )
    resident = _run(folder, 0)
    weights = resident["weight_device_bytes"]
    budget = 0.2 * weights
    offloaded = _run(folder, budget / GIB)
    assert offloaded["tokens"] == resident["tokens"]
    assert offloaded["weight_device_bytes"] <= budget
    assert weights > budget + OVERHEAD  # the bound below could not hold with every weight in
    grown = offloaded["run_peak_rss"] - offloaded["base_rss"]
    print(
        f"weights {weights / MIB:.0f} MiB, budget {budget / MIB:.0f} MiB, KV "
        f"{offloaded['kv_bytes'] / MIB:.1f} MiB; peak RSS growth while generating "
        f"{grown / MIB:.0f} MiB (all resident: "
        f"{(resident['run_peak_rss'] - resident['base_rss']) / MIB:.0f} MiB); loading peak "
        f"growth {(offloaded['load_peak_rss'] - offloaded['base_rss']) / MIB:.0f} MiB"
    )
    assert grown <= budget + offloaded["kv_bytes"] + OVERHEAD
