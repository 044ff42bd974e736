"""The rate at which one row streams a model's worth of weights (BF16, FP16, FP32): every path
of Brook's one-row kernel that this CPU runs, against oneDNN's packed product and ``F.linear``
on the plain weight, in one run (SmolLM2-135M's shapes: 30 layers of qkv [960, 576], o
[576, 576], gate_up [3072, 576], down [576, 1536]; distinct matrices, so the weights stream
from memory as in a decode step). Prints GB/s (best of seven passes) and the CPU.

    .venv/bin/python tests/bench/one_row_rate.py [--threads N]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from brook_engine.bench.machine import machine_line
from brook_engine.layers import cpu_fused, cpu_kernels

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
LAYERS = 30


def _rate(
    run: Callable[[torch.Tensor, torch.Tensor], object],
    weights: list[torch.Tensor],
    rows: dict[int, torch.Tensor],
    nbytes: int,
) -> float:
    best = float("inf")
    for _ in range(7):
        start = time.perf_counter()
        for w in weights:
            run(rows[w.shape[1]], w)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    threads = parser.parse_args().threads
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    plain = [torch.randn(*shape, generator=gen) for _ in range(LAYERS) for shape in SHAPES]
    print(machine_line())
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        weights = [w.to(dtype) for w in plain]
        nbytes = sum(w.numel() * w.element_size() for w in weights)
        x_dtype = torch.float32 if dtype == torch.float32 else torch.bfloat16
        rows = {n: torch.randn(1, n, generator=gen).to(x_dtype) for _, n in SHAPES}
        name = str(dtype).removeprefix("torch.")
        print(
            f"{name} weights, {nbytes / 1e6:.0f} MB, {len(weights)} products, "
            f"{threads} threads (GB/s)"
        )
        for isa in ("avx512bf16", "avx512", "avx2", "c"):
            os.environ["BROOK_CPU_ISA"] = isa
            path = cpu_fused.one_row_path(x_dtype, dtype)
            if path != cpu_kernels.ISA_LEVELS[isa]:
                continue  # this CPU has no such path (or it is not one for this type)
            rate = _rate(lambda x, w: cpu_fused.one_row(x, w, None), weights, rows, nbytes)
            print(f"  Brook one-row, {isa:<11} {rate:6.1f}")
        os.environ.pop("BROOK_CPU_ISA", None)
        packs = dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()
        if dtype != torch.float16 and packs:
            packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
            rate = _rate(
                lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
                packed,
                rows,
                nbytes,
            )
            print(f"  oneDNN packed           {rate:6.1f}")
        if dtype != torch.float16:
            print(f"  F.linear, plain         {_rate(F.linear, weights, rows, nbytes):6.1f}")


if __name__ == "__main__":
    main()
