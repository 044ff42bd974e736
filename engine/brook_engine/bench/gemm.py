"""The machine's matrix-multiply rate, the denominator of model FLOPs utilization."""

from __future__ import annotations

import time

import torch


def measure_gemm_flops(
    rows: int = 64, inner: int = 1024, cols: int = 4096, dtype: torch.dtype = torch.float32
) -> float:
    """FLOP/s of a [rows, inner] × [inner, cols] product (best of several runs)."""
    a = torch.randn(rows, inner, dtype=dtype)
    b = torch.randn(inner, cols, dtype=dtype)
    for _ in range(3):
        torch.mm(a, b)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(10):
            torch.mm(a, b)
        best = min(best, (time.perf_counter() - start) / 10)
    return 2.0 * rows * inner * cols / best
