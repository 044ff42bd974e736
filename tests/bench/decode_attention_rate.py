"""Decode attention's C kernel through the engine's own call (``cpu_decode.decode_attention``
over a ``LayerKVCache``): microseconds per layer call and the KV bytes it reads a second, for
each KV storage type, at SmolLM2's heads (9 query, 3 KV, 64 wide) by default.

The cache is as large as the engine's on a small host (16,131 blocks of 16 tokens), filled
as the engine fills it (INT8 layers with their calibrated channel scales, FP8 E4M3 with its
scale per token), and each sequence's blocks lie at random in it, as a long-running paged
cache leaves them.

    .venv/bin/python tests/bench/decode_attention_rate.py [--shapes 16x200,64x256,64x512]
    PYTHONPATH=<checkout of another commit>/engine .venv/bin/python tests/bench/...  # its build
"""

from __future__ import annotations

import argparse
import time

import torch

from brook_engine.config import KVDType
from brook_engine.kv.cache import Int8Params, LayerKVCache
from brook_engine.layers import cpu_decode, cpu_kernels

KINDS: dict[str, KVDType] = {"int8": "int8", "fp16": "fp16", "fp8": "fp8_e4m3", "float32": "auto"}


def filled_cache(
    kind: KVDType, heads: int, kv_heads: int, dim: int, block_size: int, num_blocks: int
) -> LayerKVCache:
    """A float32 model's cache of ``kind`` with every slot written (random keys with a mean,
    as real keys have; INT8 scales fitted on a sample of them)."""
    gen = torch.Generator().manual_seed(0)
    cache = LayerKVCache.allocate(
        num_blocks, block_size, kv_heads, dim, kind, torch.float32, torch.device("cpu")
    )
    slots = num_blocks * block_size
    k = torch.randn(slots, kv_heads, dim, generator=gen) + 0.5
    v = torch.randn(slots, kv_heads, dim, generator=gen)
    if kind == "int8":
        sample = torch.randn(4096, heads, dim, generator=gen)
        cache.int8 = Int8Params.fit(sample, k[:4096], v[:4096])
    cache.write(torch.arange(slots), k, v)
    return cache


def time_call(
    cache: LayerKVCache, decodes: int, context: int, heads: int, reps: int
) -> tuple[float, float]:
    """Microseconds per call and KV gigabytes read a second."""
    gen = torch.Generator().manual_seed(1)
    kv_heads, slots, dim = cache.k.shape
    num_blocks = slots // cache.block_size
    width = -(-context // cache.block_size)
    tables = torch.randperm(num_blocks, generator=gen)[: decodes * width].view(decodes, width)
    lens = torch.full((decodes,), context, dtype=torch.int64)
    q = cache.query(torch.randn(decodes, heads, dim, generator=gen))

    def call() -> None:
        out = cpu_decode.decode_attention(q, cache, tables, lens, dim**-0.5, None)
        if out is None:
            raise SystemExit("the CPU kernels did not build here (see the log)")

    for _ in range(5):
        call()
    start = time.perf_counter()
    for _ in range(reps):
        call()
    seconds = (time.perf_counter() - start) / reps
    kv_bytes = decodes * kv_heads * context * dim * 2 * cache.k.element_size()
    return seconds * 1e6, kv_bytes / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="16x200,64x256,64x512", help="SEQUENCESxTOKENS,...")
    parser.add_argument("--kinds", default="int8,fp16,fp8,float32", help=", ".join(KINDS))
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=16131)
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    print(f"threads {torch.get_num_threads()}; BROOK_CPU_ISA={cpu_kernels.isa_name()}")
    caches = {
        kind: filled_cache(
            KINDS[kind], args.heads, args.kv_heads, args.head_dim, args.block_size, args.num_blocks
        )
        for kind in args.kinds.split(",")
    }
    for shape in args.shapes.split(","):
        decodes, context = (int(x) for x in shape.split("x"))
        for kind, cache in caches.items():
            micros, rate = time_call(cache, decodes, context, args.heads, args.reps)
            print(f"{decodes:>3} x {context:<4} {kind:<7} {micros:8.0f} us  {rate:5.1f} GB/s of KV")


if __name__ == "__main__":
    main()
