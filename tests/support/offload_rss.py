"""Run in a process of its own: load a model with weight offload, generate, and print the
process's memory as JSON (peak RSS of loading, and of generating after the peak is reset).

``python -m tests.support.offload_rss MODEL_DIR BUDGET_GIB``"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def main() -> None:
    import torch

    from brook_engine import LLM, SamplingParams

    torch.set_num_threads(2)
    folder, budget_gib = sys.argv[1], float(sys.argv[2])
    offload: dict[str, object] = {"policy": "none"}
    if budget_gib > 0:
        offload = {"policy": "static", "device_memory_limit_gb": budget_gib}
    base = _status_kb("VmRSS")
    llm = LLM(
        folder,
        dtype="float32",
        device="cpu",
        progress=False,
        offload=offload,
        # every layer's KV in the model dtype: no calibration prefill (its activations would
        # be the peak, and are not what is measured here)
        kv_cache={
            "num_blocks": 64,
            "layer_policies": [{"start": 0.0, "end": 1.0, "dtype": "auto"}],
            "dynamic_precision": {"enabled": False},
        },
    )
    load_peak = _status_kb("VmHWM")
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak: measure generation alone
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate([[5, 6, 7, 8] * 8, [9, 10, 11] * 5], params, use_tqdm=False)
    runner = llm.engine.runner
    print(
        json.dumps(
            {
                "base_rss": base,
                "load_peak_rss": load_peak,
                "run_peak_rss": _status_kb("VmHWM"),
                "weight_device_bytes": runner.weight_bytes,
                "kv_bytes": runner.memory_bytes()["kv_cache"],
                "tokens": [list(o.outputs[0].token_ids) for o in outputs],
            }
        )
    )
    llm.close()


if __name__ == "__main__":
    main()
