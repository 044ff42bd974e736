"""Decode attention's C kernel alone: microseconds per layer call and the KV bytes it reads a
second, for each KV storage type, at SmolLM2's heads (9 query, 3 KV, 64 wide) by default.

The cache is as large as the engine's on a small host (16,131 blocks of 16 tokens) and each
sequence's blocks lie at random in it, as a long-running paged cache leaves them. Queries
are scaled so that INT8 keys (codes up to 100 with a scale per token) give scores of a real
model's size: with unscaled ones most exponentials underflow and the sums turn subnormal,
which times the CPU's slow path instead of the kernel.

    .venv/bin/python tests/bench/decode_attention_rate.py [--shapes 16x200,64x256,64x512]
    PYTHONPATH=<checkout of another commit>/engine .venv/bin/python tests/bench/...  # its build
"""

from __future__ import annotations

import argparse
import time

import torch

from brook_engine.layers import cpu_kernels

KINDS = {"int8": (torch.int8, 3), "fp16": (torch.float16, 2), "float32": (torch.float32, 0)}


def time_call(
    decodes: int,
    context: int,
    kind: str,
    heads: int,
    kv_heads: int,
    dim: int,
    block_size: int,
    num_blocks: int,
    reps: int,
) -> tuple[float, float]:
    """Microseconds per call and KV gigabytes read a second."""
    library = cpu_kernels.library()
    if library is None:
        raise SystemExit("the CPU kernels did not build here (see the log)")
    dtype, code = KINDS[kind]
    gen = torch.Generator().manual_seed(0)
    slots = num_blocks * block_size
    if dtype == torch.int8:
        k = torch.randint(-100, 100, (kv_heads, slots, dim), dtype=torch.int8, generator=gen)
        v = torch.randint(-100, 100, (kv_heads, slots, dim), dtype=torch.int8, generator=gen)
        k_scale, v_scale = torch.rand(kv_heads, slots) / 50, torch.rand(kv_heads, slots) / 50
        q_scale = 0.05
    else:
        k = torch.randn(kv_heads, slots, dim, generator=gen).to(dtype)
        v = torch.randn(kv_heads, slots, dim, generator=gen).to(dtype)
        k_scale = v_scale = None
        q_scale = 1.0
    width = -(-context // block_size)
    tables = torch.randperm(num_blocks, generator=gen)[: decodes * width].view(decodes, width)
    lens = torch.full((decodes,), context, dtype=torch.int64)
    q = torch.randn(decodes, heads, dim, generator=gen) * q_scale
    out = torch.empty_like(q)
    args = (
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        None if k_scale is None else k_scale.data_ptr(),
        None if v_scale is None else v_scale.data_ptr(),
        tables.contiguous().data_ptr(),
        lens.data_ptr(),
        out.data_ptr(),
        decodes,
        heads,
        kv_heads,
        dim,
        slots,
        block_size,
        width,
        0,
        code,
        None,
        dim**-0.5,
        torch.get_num_threads(),
    )
    for _ in range(5):
        library.brook_paged_decode(*args)
    start = time.perf_counter()
    for _ in range(reps):
        library.brook_paged_decode(*args)
    seconds = (time.perf_counter() - start) / reps
    kv_bytes = decodes * kv_heads * context * dim * 2 * k.element_size()
    return seconds * 1e6, kv_bytes / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="16x200,64x256,64x512", help="SEQUENCESxTOKENS,...")
    parser.add_argument("--kinds", default="int8,fp16,float32")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=16131)
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    print(f"threads {torch.get_num_threads()}; BROOK_CPU_ISA={cpu_kernels.isa_name()}")
    for shape in args.shapes.split(","):
        decodes, context = (int(x) for x in shape.split("x"))
        for kind in args.kinds.split(","):
            micros, rate = time_call(
                decodes,
                context,
                kind,
                args.heads,
                args.kv_heads,
                args.head_dim,
                args.block_size,
                args.num_blocks,
                args.reps,
            )
            print(f"{decodes:>3} x {context:<4} {kind:<7} {micros:8.0f} us  {rate:5.1f} GB/s of KV")


if __name__ == "__main__":
    main()
