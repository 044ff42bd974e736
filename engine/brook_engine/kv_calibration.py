"""Dynamic KV precision: measure, per layer, how much storing its keys and values in the
policy's low precision changes that layer's attention output, and move the layers where the
change is too large to the fallback precision.

One forward pass over calibration text (the user's file, or text that ships with Python:
the interpreter's own help topics) captures each attention layer's input. For each layer,
the queries, keys and values are recomputed from it, and causal attention is evaluated
twice, with keys and values as computed and as the cache would store them:

    error = |attn(q, stored K, stored V) - attn(q, K, V)| / |attn(q, K, V)|

Each layer is measured on the same (exact) inputs, so the errors do not compound and one
layer's verdict does not depend on another's. Keys may be stored minus their mean over the
calibration text (per head): attention is unchanged, since every score of a query moves by
the same amount, and low precision rounds the smaller stored keys less; each layer keeps
the shift only where it measurably lowers the error. A layer above ``sensitivityThreshold`` falls
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

    shifts: list[torch.Tensor | None]
    """Per layer, the key shift stored keys have subtracted (``LayerKVCache.k_shift``), where
    it lowered the error."""

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


def key_shift(layer: Any, captured: tuple[torch.Tensor, Any]) -> torch.Tensor:
    """The per-head mean key on the calibration text, [kv_heads, head_dim]."""
    k: torch.Tensor = layer.project(*captured)[1]
    return k.float().mean(dim=0).to(k.dtype)


@torch.inference_mode()
def measure_errors(
    attention_layers: list[Any],
    captured: list[tuple[torch.Tensor, Any]],
    kinds: list[KVDType],
    compute_dtype: torch.dtype,
    shifts: list[torch.Tensor | None] | None = None,
) -> list[float | None]:
    """Relative attention-output error per layer for its storage kind (None when the kind
    stores at least the compute precision), with each layer's key shift if given."""
    errors: list[float | None] = []
    shifts = shifts or [None] * len(kinds)
    for layer, (x, rotary), kind, shift in zip(
        attention_layers, captured, kinds, shifts, strict=True
    ):
        if kind not in _LOW and not (kind in ("fp16", "bf16") and compute_dtype == torch.float32):
            errors.append(None)
            continue
        q, k, v = layer.project(x, rotary)
        probe = LayerKVCache.allocate(1, 1, k.shape[1], k.shape[2], kind, compute_dtype, k.device)
        probe.k_shift = shift
        k_stored, v_stored = probe.as_stored(k, v)
        exact = _attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), layer.scale)
        lossy = _attention(q.transpose(0, 1), k_stored, v_stored, layer.scale)
        errors.append(float((lossy - exact).norm() / exact.norm().clamp_min(1e-12)))
    return errors


def best_of(
    plain: list[float | None],
    shifted: list[float | None],
    shifts: list[torch.Tensor],
) -> tuple[list[float | None], list[torch.Tensor | None]]:
    """Per layer, the lower error of storing keys as they are or shifted, and the shift
    that goes with it (None: keys as they are)."""
    errors: list[float | None] = []
    chosen: list[torch.Tensor | None] = []
    for p, s, shift in zip(plain, shifted, shifts, strict=True):
        if p is not None and s is not None and s < p:
            errors.append(s)
            chosen.append(shift)
        else:
            errors.append(p)
            chosen.append(None)
    return errors, chosen


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


def decide(
    layers: list[Any],
    captured: list[tuple[torch.Tensor, Any]],
    kinds: list[KVDType],
    compute_dtype: torch.dtype,
    threshold: float,
    fallback: KVDType,
) -> tuple[list[KVDType], list[float | None], list[torch.Tensor | None]]:
    """Each layer's dtype, its measured error and its key shift. A layer above the threshold
    in FP8 E5M2 tries E4M3 (one more mantissa bit, still one byte) before the fallback."""
    candidates = [key_shift(layer, c) for layer, c in zip(layers, captured, strict=True)]

    def measure(
        kinds_: list[KVDType],
    ) -> tuple[list[float | None], list[torch.Tensor | None]]:
        plain = measure_errors(layers, captured, kinds_, compute_dtype)
        shifted = measure_errors(layers, captured, kinds_, compute_dtype, list(candidates))
        return best_of(plain, shifted, candidates)

    errors, shifts = measure(kinds)
    chosen = list(kinds)
    retry: list[KVDType] = [
        "fp8_e4m3" if kind == "fp8_e5m2" and e is not None and e > threshold else "auto"
        for kind, e in zip(kinds, errors, strict=True)
    ]
    second, second_shifts = measure(retry)
    for i, e in enumerate(second):
        if e is not None:
            errors[i], shifts[i] = e, second_shifts[i]
            if e <= threshold:
                chosen[i] = "fp8_e4m3"
    chosen = choose(chosen, errors, threshold, fallback, compute_dtype)
    shifts = [shift if kind in _LOW else None for kind, shift in zip(chosen, shifts, strict=True)]
    return chosen, errors, shifts


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
    shifted = sum(shift is not None for shift in calibration.shifts)
    return (
        f"KV precision calibrated on {calibration.num_tokens} tokens: {layers} ({shifted} "
        f"with shifted keys); largest error kept {max(kept, default=0.0):.3f}; {fell_back}"
    )
