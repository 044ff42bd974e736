"""Time the INT8 layers' per-head map (``brook_head_map``: the query turned to score the
stored integers, the attention output turned back) at decode and prefill token counts, for
SmolLM2's 9 heads of 64, and print µs and GFLOP/s per call. Compare builds by running it
with ``PYTHONPATH=<another checkout>/engine``, or ``BROOK_CPU_ISA=avx2`` for the AVX2 build.

    .venv/bin/python tests/bench/head_map_rate.py
"""

from __future__ import annotations

import argparse
import time

import torch

from brook_engine.layers import cpu_kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="16,64,512,2048", help="token counts, commas")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--dim", type=int, default=64)
    args = parser.parse_args()
    library = cpu_kernels.library()
    if library is None:
        raise SystemExit("the CPU kernels did not build here (see the log)")
    gen = torch.Generator().manual_seed(0)
    heads, dim = args.heads, args.dim
    print(f"{torch.get_num_threads()} threads, {heads} heads of {dim}")
    for tokens in map(int, args.tokens.split(",")):
        x = torch.randn(tokens, heads, dim, generator=gen)
        matrix = torch.randn(heads, dim, dim, generator=gen)
        offset = torch.randn(heads, dim, generator=gen)
        out = torch.empty(tokens, heads, dim)
        call = (
            x.data_ptr(), matrix.data_ptr(), offset.data_ptr(), out.data_ptr(),
            tokens, heads, dim, heads * dim, torch.get_num_threads(),
        )  # fmt: skip
        for _ in range(20):
            library.brook_head_map(*call)
        times = []
        for _ in range(5):
            n = max(5, 20000 // tokens)
            start = time.perf_counter()
            for _ in range(n):
                library.brook_head_map(*call)
            times.append((time.perf_counter() - start) / n)
        us = sorted(times)[len(times) // 2] * 1e6
        rate = 2 * tokens * heads * dim * dim / us / 1e3
        print(f"{tokens:6d} tokens: {us:9.1f} µs  {rate:6.1f} GFLOP/s")


if __name__ == "__main__":
    main()
