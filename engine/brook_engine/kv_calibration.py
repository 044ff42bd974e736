"""Dynamic KV precision: measure, per layer, how much storing its keys and values in the
policy's low precision changes that layer's attention output, and move the layers where the
change is too large to the fallback precision.

One forward pass over calibration text (the user's file, or text that ships with Python:
the interpreter's own help topics) captures each attention layer's input. For each layer,
the queries, keys and values are recomputed from it, and causal attention is evaluated
twice, with keys and values as computed and as the cache would store them:

    error = |attn(q, stored K, stored V) - attn(q, K, V)| / |attn(q, K, V)|

Each layer is measured on the same (exact) inputs, so the errors do not compound and one
layer's verdict does not depend on another's. A layer above ``sensitivityThreshold`` falls
back step by step: an FP8 E5M2 layer first tries FP8 E4M3 with scales (the same byte, one
more mantissa bit), and only then the 16-bit fallback.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from brook_engine.config import KVDType
from brook_engine.kv_cache import LayerKVCache

log = logging.getLogger(__name__)

#: Storage kinds that lose precision against a 16-bit model, in bits per element.
_LOW = {"fp8_e5m2", "fp8_e4m3"}


@dataclass(frozen=True)
class Calibration:
    policy: list[KVDType]
    """Each layer's dtype before calibration."""

    chosen: list[KVDType]
    """Each layer's dtype after it (the fallback where the error was above the threshold)."""

    errors: list[float | None]
    """Measured relative error per layer, of the last low-precision dtype tried (E4M3 for
    an E5M2 layer that tried it); None where the layer was not low precision."""

    num_tokens: int


def builtin_calibration_text(max_chars: int = 20_000) -> str:
    """English prose that ships with every Python: the interactive help's topics."""
    from pydoc_data.topics import topics

    parts: list[str] = []
    size = 0
    for name in sorted(topics):
        parts.append(topics[name])
        size += len(topics[name])
        if size >= max_chars:
            break
    return "\n".join(parts)[:max_chars]


def calibration_text(path: str | None) -> str:
    if path is None:
        return builtin_calibration_text()
    text = Path(path).read_text("utf-8", errors="replace")
    if not text.strip():
        raise ValueError(f"kvCache.dynamicPrecision.calibrationFile {path} is empty")
    return text


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    # q [heads, tokens, dim]; k, v [kv_heads, tokens, dim]
    return F.scaled_dot_product_attention(
        q.unsqueeze(0).float(),
        k.unsqueeze(0).float(),
        v.unsqueeze(0).float(),
        is_causal=True,
        scale=scale,
        enable_gqa=q.shape[0] != k.shape[0],
    ).squeeze(0)


@torch.inference_mode()
def measure_errors(
    attention_layers: list[Any],
    captured: list[tuple[torch.Tensor, Any]],
    kinds: list[KVDType],
    compute_dtype: torch.dtype,
) -> list[float | None]:
    """Relative attention-output error per layer for its storage kind (None when the kind
    stores at least the compute precision)."""
    errors: list[float | None] = []
    for layer, (x, rotary), kind in zip(attention_layers, captured, kinds, strict=True):
        if kind not in _LOW and not (kind in ("fp16", "bf16") and compute_dtype == torch.float32):
            errors.append(None)
            continue
        q, k, v = layer.project(x, rotary)
        probe = LayerKVCache.allocate(1, 1, k.shape[1], k.shape[2], kind, compute_dtype, k.device)
        k_stored, v_stored = probe.as_stored(k, v)
        exact = _attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), layer.scale)
        lossy = _attention(q.transpose(0, 1), k_stored, v_stored, layer.scale)
        errors.append(float((lossy - exact).norm() / exact.norm().clamp_min(1e-12)))
    return errors


#: Mantissa bits of each storage kind ("auto" is the model dtype: see ``_bits``).
_MANTISSA = {"fp8_e5m2": 2, "fp8_e4m3": 3, "bf16": 7, "fp16": 10}
_DTYPE_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}


def _bits(kind: KVDType, compute_dtype: torch.dtype) -> int:
    return _DTYPE_BITS[compute_dtype] if kind == "auto" else _MANTISSA[kind]


def choose(
    kinds: list[KVDType],
    errors: list[float | None],
    threshold: float,
    fallback: KVDType,
    compute_dtype: torch.dtype,
) -> list[KVDType]:
    """The fallback for each layer above the threshold — unless it would store no more
    precisely than the layer already does (bf16 never replaces fp16)."""
    return [
        fallback
        if error is not None
        and error > threshold
        and _bits(fallback, compute_dtype) > _bits(kind, compute_dtype)
        else kind
        for kind, error in zip(kinds, errors, strict=True)
    ]


def summarize(calibration: Calibration) -> str:
    """One log line: layers per dtype, the largest errors, and which layers fell back."""
    rows = list(zip(calibration.policy, calibration.chosen, calibration.errors, strict=True))
    moved = [
        f"{i}:{before}→{after} ({error:.3f})"
        for i, (before, after, error) in enumerate(rows)
        if before != after and error is not None
    ]
    kept = [e for before, after, e in rows if e is not None and before == after]
    counts: dict[str, int] = {}
    for kind in calibration.chosen:
        counts[kind] = counts.get(kind, 0) + 1
    layers = ", ".join(f"{n} layers {k}" for k, n in sorted(counts.items()))
    fell_back = f"fell back: {', '.join(moved)}" if moved else "no layer fell back"
    return (
        f"KV precision calibrated on {calibration.num_tokens} tokens: {layers}; largest "
        f"error kept {max(kept, default=0.0):.3f}; {fell_back}"
    )
