"""The machine's matrix-multiply rate, the denominator of model FLOPs utilization."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from brook_engine.layers import cpu_matmul
from brook_engine.layers.linear import cpu_packing_supported, product


def measure_gemm_flops(
    rows: int = 64, inner: int = 1024, cols: int = 4096, dtype: torch.dtype = torch.float32
) -> float:
    """FLOP/s of a [rows, inner] × [inner, cols] product (best of several runs), with the
    fastest kernel here: a plain ``torch.mm``, and on CPU also oneDNN's kernel on its packed
    weight and Brook's on its own (the engine runs one of them, layers.linear) — utilization
    is measured against what the machine can do, not against the slower of the kernels."""
    a = torch.randn(rows, inner, dtype=dtype)
    b = torch.randn(inner, cols, dtype=dtype)
    candidates: list[Callable[[], torch.Tensor]] = [lambda: torch.mm(a, b)]
    weight = b.t().contiguous()
    if cpu_packing_supported(dtype) and torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        onednn = torch.ops.mkldnn._reorder_linear_weight(weight)
        candidates.append(lambda: product(a, onednn, None))
    if cpu_packing_supported(dtype) and cpu_matmul.packs(weight):
        brook = cpu_matmul.pack(weight)
        candidates.append(lambda: product(a, brook, None))
    best = float("inf")
    for run in candidates:
        for _ in range(3):
            run()
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(10):
                run()
            best = min(best, (time.perf_counter() - start) / 10)
    return 2.0 * rows * inner * cols / best
