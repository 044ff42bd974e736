"""An engine on a tiny model for token-for-token comparisons: float32 on CPU, every layer's
KV in the model dtype (no calibration), and, for replicas, tensor × pipeline ranks as worker
processes on loopback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from brook_engine import LLM

EXACT_KV: dict[str, Any] = {
    "layer_policies": [{"start": 0.0, "end": 1.0, "dtype": "auto"}],
    "dynamic_precision": {"enabled": False},
}


def parallel_llm(folder: Path, tensor: int, pipeline: int, **options: Any) -> LLM:
    """``LLM`` of ``folder`` on ``tensor`` × ``pipeline`` ranks; ``kv_cache`` and ``parallel``
    options merge over the exact KV and the layout."""
    kv = {**EXACT_KV, **options.pop("kv_cache", {})}
    return LLM(
        str(folder),
        dtype="float32",
        device="cpu",
        kv_cache=kv,
        progress=False,
        parallel={
            "tensor": tensor,
            "pipeline": pipeline,
            "timeout_seconds": 60,
            **options.pop("parallel", {}),
        },
        **options,
    )
