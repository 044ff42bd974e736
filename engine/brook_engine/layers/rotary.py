"""Rotary position embedding with the scalings Llama, Qwen2 and Mistral configs use.

The frequency formulas follow the published ones (default, linear interpolation, Llama 3.1,
YaRN); cos/sin are computed once in float32 for every position up to the model length.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def inverse_frequencies(
    head_dim: int, theta: float, rope_type: str, scaling: dict[str, Any], max_positions: int
) -> tuple[torch.Tensor, float]:
    """Per-pair inverse frequencies [head_dim / 2] and the attention (cos/sin) factor."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if rope_type == "default":
        return inv_freq, 1.0
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor, 1.0
    if rope_type == "llama3":
        low_factor = float(scaling["low_freq_factor"])
        high_factor = float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low_factor, old_len / high_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_factor) / (high_factor - low_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if rope_type == "yarn":
        return _yarn(head_dim, theta, scaling, max_positions)
    raise ValueError(f"rope type {rope_type!r} is not supported")


def _yarn(
    head_dim: int, theta: float, scaling: dict[str, Any], max_positions: int
) -> tuple[torch.Tensor, float]:
    factor = float(scaling["factor"])
    original = scaling.get("original_max_position_embeddings") or max_positions

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = (
            mscale(factor, m) / mscale(factor, m_all) if m and m_all else (mscale(factor))
        )
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp(
        (torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1
    )
    extrapolation_share = 1 - ramp
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_share) + (
        1.0 / pos_freqs
    ) * extrapolation_share
    return inv_freq, float(attention_factor)


class RotaryEmbedding:
    """Applies rotary embedding to q and k of shape [tokens, heads, head_dim]."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        rope_type: str,
        scaling: dict[str, Any],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        inv_freq, factor = inverse_frequencies(head_dim, theta, rope_type, scaling, max_positions)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [positions, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * factor).to(dtype=dtype, device=device)
        self.sin = (emb.sin() * factor).to(dtype=dtype, device=device)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [tokens, 1, head_dim] of ``positions``; once per step, shared by layers."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [tokens, heads, head_dim] (q and k heads together, in one pass)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
