"""RMSNorm, computed in float32 as the reference implementations do; on CPU fused with the
residual add before it (``layers.cpu_fused``)."""

from __future__ import annotations

import torch
from torch import nn

from brook_engine.layers import cpu_fused


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [tokens, hidden]; normalise in float32, scale in the model dtype (as the reference)
        return cpu_fused.add_rms_norm(x, None, self.weight, self.eps)[0]

    def add_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + delta), x + delta)``; ``delta`` None adds nothing."""
        return cpu_fused.add_rms_norm(x, delta, self.weight, self.eps)
