"""Dynamic KV precision: measure, per layer, how much storing its keys and values in the
policy's low precision changes that layer's attention output, and move the layers where the
change is too large to the fallback precision.

One forward pass over calibration text (the user's file, or text that ships with Python:
the interpreter's own help topics) captures each attention layer's input. For each layer,
the queries, keys and values are recomputed from it — as if the text sat at several
positions, since rotary embedding turns keys with their position — and causal attention is
evaluated twice, with keys and values as computed and as the cache would store them (key
shifts and an INT8 layer's means, weights and scales are fitted on some positions, the error
is the largest over others):

    error = |attn(q, stored K, stored V) - attn(q, K, V)| / |attn(q, K, V)|

Each layer is measured on the same (exact) inputs, so the errors do not compound and one
layer's verdict does not depend on another's. Keys may be stored minus their mean over the
calibration text (per head): attention is unchanged, since every score of a query moves by
the same amount, and low precision rounds the smaller stored keys less; each layer keeps
the shift only where it measurably lowers the error. A layer above ``sensitivityThreshold`` falls
back step by step: an FP8 layer first tries INT8 (the same byte, more precise), and only
then the 16-bit fallback. With dynamic precision off, the pass
still runs where a policy names INT8 (its scales come from it), with no fallback.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from brook_engine.config import DynamicPrecisionConfig, KVDType
from brook_engine.kv.cache import Int8Params, LayerKVCache

log = logging.getLogger(__name__)

#: Storage kinds of one byte per element.
ONE_BYTE: tuple[KVDType, ...] = ("fp8_e5m2", "fp8_e4m3", "int8")

#: What a one-byte layer above the threshold tries before 16 bits: INT8, more precise than
#: either FP8 (measured 0.011-0.021 against E4M3's 0.026-0.048 on SmolLM2's layers) and,
#: unlike E4M3, without a scale per token.
_RETRY: dict[KVDType, tuple[KVDType, ...]] = {"fp8_e5m2": ("int8",), "fp8_e4m3": ("int8",)}


@dataclass(frozen=True)
class Calibration:
    policy: list[KVDType]
    """Each layer's dtype before calibration."""

    chosen: list[KVDType]
    """Each layer's dtype after it (the fallback where the error was above the threshold)."""

    errors: list[float | None]
    """Measured relative error per layer, of the chosen kind, or of the last one-byte kind
    tried where the layer fell back; None where it was not measured (a kind at least as
    precise as the compute dtype; or, with dynamic precision off, any kind but INT8)."""

    shifts: list[torch.Tensor | None]
    """Per FP8 layer, the key shift stored keys have subtracted (``LayerKVCache.k_shift``),
    where it lowered the error."""

    int8: list[Int8Params | None]
    """Per INT8 layer, its means, rotation and scales."""

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


@dataclass(frozen=True)
class StoredAs:
    """One way to store a layer's KV, and the error it adds."""

    kind: KVDType
    error: float | None  # None: not measured (stores at least the compute precision)
    shift: torch.Tensor | None = None
    int8: Int8Params | None = None


Projected = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class LayerSample:
    """One layer's calibration queries, keys and values [tokens, heads, head_dim], computed
    as if the text sat at several positions (rotary turns keys with their position, so a
    mean or a range taken at positions 0 to 1,023 alone would not hold at 30,000): ``fit`` to
    fit shifts and INT8 parameters on, ``measure`` to measure errors on (see
    ``calibration_positions``). ``project(positions)`` gives the layer's q, k, v with the
    text at ``positions``; nothing is projected until a measurement needs it, so layers that
    are not measured cost nothing."""

    def __init__(
        self,
        project: Callable[[torch.Tensor], Projected],
        fit_at: list[torch.Tensor],
        measure_at: list[torch.Tensor],
        scale: float,
    ) -> None:
        self._project = project
        self._fit_at, self._measure_at = fit_at, measure_at
        self.scale = scale

    @cached_property
    def measure(self) -> list[Projected]:
        return [self._project(at) for at in self._measure_at]

    @cached_property
    def fit(self) -> Projected:
        """The fit views' q, k, v, concatenated over the views."""
        views = [self._project(at) for at in self._fit_at]
        q, k, v = (torch.cat(parts) for parts in zip(*views, strict=True))
        return q, k, v

    @cached_property
    def exact(self) -> list[torch.Tensor]:
        """Attention with exact keys and values, per measured view."""
        return [
            _attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), self.scale)
            for q, k, v in self.measure
        ]


def _measure(sample: LayerSample, kind: KVDType, compute_dtype: torch.dtype) -> StoredAs:
    """The lowest error ``kind`` reaches on one layer (the largest over the measured
    views): FP8 with keys as they are or minus their mean (whichever is lower), INT8 with
    parameters fitted on the fit views."""
    if kind not in ONE_BYTE and not (kind in ("fp16", "bf16") and compute_dtype == torch.float32):
        return StoredAs(kind, None)

    fit_k = sample.fit[1]
    probe = LayerKVCache.allocate(
        1, 1, fit_k.shape[1], fit_k.shape[2], kind, compute_dtype, fit_k.device
    )

    def error(shift: torch.Tensor | None, int8: Int8Params | None) -> float:
        probe.k_shift, probe.int8 = shift, int8
        worst = 0.0
        for (q, k, v), exact in zip(sample.measure, sample.exact, strict=True):
            k_stored, v_stored = probe.as_stored(k, v)
            lossy = _attention(probe.query(q).transpose(0, 1), k_stored, v_stored, sample.scale)
            if int8 is not None:
                lossy = int8.output(lossy.transpose(0, 1), q.dtype).float().transpose(0, 1)
            worst = max(worst, float((lossy - exact).norm() / exact.norm().clamp_min(1e-12)))
        return worst

    if kind == "int8":
        params = Int8Params.fit(*sample.fit)
        return StoredAs(kind, error(None, params), int8=params)
    plain = StoredAs(kind, error(None, None))
    if kind not in ONE_BYTE:
        return plain
    k = fit_k
    shift = k.float().mean(dim=0).to(k.dtype)
    shifted = StoredAs(kind, error(shift, None), shift=shift)
    return shifted if shifted.error < plain.error else plain  # type: ignore[operator]


#: Mantissa bits of each storage kind ("auto" is the model dtype: see ``_bits``); INT8's
#: 8 bits against a per-channel range in a turned basis sit between E4M3 and BF16.
_MANTISSA = {"fp8_e5m2": 2, "fp8_e4m3": 3, "int8": 6, "bf16": 7, "fp16": 10}
_DTYPE_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}


def _bits(kind: KVDType, compute_dtype: torch.dtype) -> int:
    return _DTYPE_BITS[compute_dtype] if kind == "auto" else _MANTISSA[kind]


@torch.inference_mode()
def decide(
    samples: list[LayerSample],
    kinds: list[KVDType],
    compute_dtype: torch.dtype,
    threshold: float | None,
    fallback: KVDType,
) -> list[StoredAs]:
    """Per layer, how it is stored and its measured error. An FP8 layer above the threshold
    tries INT8 (the same byte, more precise); where that is not within it either, the layer
    takes the fallback — unless the fallback would store no more precisely than the last
    kind tried (bf16 never replaces fp16). ``threshold`` None (dynamic precision off): only
    INT8 layers are fitted, every layer keeps its kind."""
    out: list[StoredAs] = []
    for sample, kind in zip(samples, kinds, strict=True):
        if threshold is None:
            fitted = kind == "int8"
            out.append(_measure(sample, kind, compute_dtype) if fitted else StoredAs(kind, None))
            continue
        tried = _measure(sample, kind, compute_dtype)
        for more_precise in _RETRY.get(kind, ()):
            if tried.error is None or tried.error <= threshold:
                break
            tried = _measure(sample, more_precise, compute_dtype)
        if (
            tried.error is not None
            and tried.error > threshold
            and _bits(fallback, compute_dtype) > _bits(tried.kind, compute_dtype)
        ):
            tried = StoredAs(fallback, tried.error)
        out.append(tried)
    return out


def calibrate(
    samples: list[LayerSample],
    kinds: list[KVDType],
    compute_dtype: torch.dtype,
    threshold: float | None,
    fallback: KVDType,
    num_tokens: int,
) -> Calibration:
    stored = decide(samples, kinds, compute_dtype, threshold, fallback)
    return Calibration(
        policy=list(kinds),
        chosen=[s.kind for s in stored],
        errors=[s.error for s in stored],
        shifts=[s.shift for s in stored],
        int8=[s.int8 for s in stored],
        num_tokens=num_tokens,
    )


#: Views of the calibration text at random positions that shifts and INT8 ranges are
#: fitted on, besides its own positions.
RANDOM_POSITION_VIEWS = 7


def calibration_positions(
    num_tokens: int, max_positions: int, seed: int = 0
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Positions to place the calibration text at, to fit on and to measure on. Fit: its
    own positions, then each token at an independent random position below
    ``max_positions`` (rotary turns each pair of channels at its own speed; consecutive
    positions far out would sample few of the angle combinations keys take there). Measure:
    its own positions, and consecutive ones at five sixths of the room the model leaves."""
    own = torch.arange(num_tokens)
    gen = torch.Generator().manual_seed(seed)
    random_views = [
        torch.randint(0, max_positions, (num_tokens,), generator=gen)
        for _ in range(RANDOM_POSITION_VIEWS)
    ]
    far = own + round(max(0, max_positions - num_tokens) * 5 / 6)
    return [own, *random_views], [own, far]


def summarize(calibration: Calibration) -> str:
    """One log line: layers per dtype, the largest errors, and which layers fell back."""
    rows = list(zip(calibration.policy, calibration.chosen, calibration.errors, strict=True))

    def changes(same_byte: bool) -> list[str]:
        return [
            f"{i}:{before}→{after} ({error:.3f})"
            for i, (before, after, error) in enumerate(rows)
            if before != after and error is not None and (after in ONE_BYTE) == same_byte
        ]

    moved, retried = changes(same_byte=False), changes(same_byte=True)
    kept = [e for b, a, e in rows if e is not None and (a in ONE_BYTE or a == b)]
    counts: dict[str, int] = {}
    for kind in calibration.chosen:
        counts[kind] = counts.get(kind, 0) + 1
    layers = ", ".join(f"{n} layers {k}" for k, n in sorted(counts.items()))
    fell_back = f"fell back: {', '.join(moved)}" if moved else "no layer fell back"
    if retried:
        fell_back = f"the same byte, more precise: {', '.join(retried)}; {fell_back}"
    shifted = sum(shift is not None for shift in calibration.shifts)
    return (
        f"KV precision calibrated on {calibration.num_tokens} tokens: {layers} ({shifted} "
        f"with shifted keys); largest error kept {max(kept, default=0.0):.3f}; {fell_back}"
    )


#: Calibration tokens INT8 scales need at least (fewer when the model is shorter).
MIN_INT8_CALIBRATION_TOKENS = 256

#: Tokens of the calibration text one pass measures at most.
MAX_CALIBRATION_TOKENS = 1024


def check_int8_calibration(ids: list[int] | None, max_model_len: int) -> None:
    """INT8 layers take their scales from calibration: refuse a text too short to fit them."""
    need = min(MIN_INT8_CALIBRATION_TOKENS, max_model_len)
    have = len(ids or [])
    if have < need:
        raise ValueError(
            f"INT8 KV layers take their scales from calibration text: it gives {have} tokens, "
            f"they need at least {need}; give a longer kvCache.dynamicPrecision."
            "calibrationFile (or leave it unset for the built-in text)"
        )


def calibrate_layers(
    attention: list[Any],
    run_prefill: Callable[[], None],
    rotary_at: Callable[[torch.Tensor], Any],
    kinds: list[KVDType],
    compute_dtype: torch.dtype,
    dynamic: DynamicPrecisionConfig,
    num_tokens: int,
    max_positions: int,
    hold: Callable[[int], AbstractContextManager[None]] | None = None,
) -> Calibration:
    """Calibrate a rank's layers: ``run_prefill`` runs one prefill of the ``num_tokens``
    calibration tokens with exact KV while each of the ``attention`` modules' inputs is
    captured; the layers' q, k, v are then projected again from them (``project(x,
    rotary_at(positions))``, inside ``hold(layer)`` where weights stream) wherever a
    measurement needs them."""
    captured: list[Any] = [None] * len(attention)

    def capture(index: int, _module: Any, args: tuple[Any, ...]) -> None:
        captured[index] = args[0]

    hooks = [
        attn.register_forward_pre_hook(functools.partial(capture, i))
        for i, attn in enumerate(attention)
    ]
    try:
        run_prefill()
    finally:
        for hook in hooks:
            hook.remove()
    fit_at, measure_at = calibration_positions(num_tokens, max_positions)

    def placed(index: int, layer: Any, x: torch.Tensor) -> Callable[[torch.Tensor], Projected]:
        def project(at: torch.Tensor) -> Projected:
            with hold(index) if hold is not None else contextlib.nullcontext():
                return layer.project(x, rotary_at(at))  # type: ignore[no-any-return]

        return project

    samples = [
        LayerSample(placed(i, layer, x), fit_at, measure_at, layer.scale)
        for i, (layer, x) in enumerate(zip(attention, captured, strict=True))
    ]
    # Dynamic precision off: the pass only fits INT8 layers; nothing moves.
    threshold = dynamic.sensitivity_threshold if dynamic.enabled else None
    return calibrate(
        samples, list(kinds), compute_dtype, threshold, dynamic.fallback_dtype, num_tokens
    )
