"""What every report names: the CPU a figure was measured on, and the rate of the model's
own matrix products there (the stable denominator of model FLOPs utilization)."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from brook_engine.host import cpu_features
from brook_engine.layers import cpu_kernels
from brook_engine.layers.linear import Linear, weight_shape
from brook_engine.layers.tensor_parallel import VocabParallelHead
from brook_engine.quant.linear import Int8Linear

# The flags that decide which kernels run (x86 and Arm names as /proc/cpuinfo spells them).
VECTOR_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_bf16",
    "amx_int8",
    "asimd",
    "asimdhp",
    "sve",
    "bf16",
    "i8mm",
)


def machine_info() -> dict[str, Any]:
    """The CPU model, its vector flags, cores, torch's threads and the kernels' cap."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    features = cpu_features()
    try:
        isa = cpu_kernels.isa_name()
    except ValueError as exc:
        isa = str(exc)
    return {
        "cpu": model,
        "vector_flags": [f for f in VECTOR_FLAGS if f in features],
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "brook_cpu_isa": isa,
    }


def machine_line(info: dict[str, Any] | None = None) -> str:
    """One line for a text report."""
    info = info or machine_info()
    flags = " ".join(info["vector_flags"]) or "no vector flags listed"
    return (
        f"CPU: {info['cpu']} ({info['cores']} cores, {info['threads']} threads; {flags}; "
        f"BROOK_CPU_ISA={info['brook_cpu_isa']})"
    )


def _products(model: nn.Module) -> list[tuple[nn.Module, int, int]]:
    """Every matrix product of a forward pass: (module, in features, out features)."""
    found: list[tuple[nn.Module, int, int]] = []
    for module in model.modules():
        if isinstance(module, Linear | Int8Linear):
            found.append((module, module.in_features, module.out_features))
        elif isinstance(module, VocabParallelHead):
            rows, hidden = weight_shape(module.weight)
            found.append((module, hidden, rows))
    return found


def model_parameters(model: nn.Module) -> int:
    """The model's parameter count, W8A16's int8 weights included where a tiled copy for
    Brook's kernel replaced the plain parameter."""
    count = sum(p.numel() for p in model.parameters())
    for module in model.modules():
        if isinstance(module, Int8Linear) and module.tiled is not None:
            count += module.in_features * module.out_features - module.weight.numel()
    return count


def model_product_rate(model: nn.Module, rows: int, dtype: torch.dtype, repeats: int = 3) -> float:
    """FLOP/s of the model's own products at ``rows`` rows: each linear layer and the LM head
    once, in order, as a step runs them (the weights stream from memory, not one matrix
    kept in cache), with the kernels the engine runs; best of ``repeats`` passes. The
    utilization denominator that moves with the machine as the engine's own products do."""
    products = _products(model)
    if not products:
        raise ValueError("the model has no linear layers to measure")
    device = next(model.parameters()).device
    inputs = {n: torch.randn(rows, n, dtype=dtype, device=device) for _, n, _ in products}
    flops = 2.0 * rows * sum(n * m for _, n, m in products)
    backend = getattr(torch, device.type, None)
    sync = getattr(backend, "synchronize", None) if device.type != "cpu" else None
    best = float("inf")
    with torch.inference_mode():
        for attempt in range(repeats + 1):
            start = time.perf_counter()
            for module, n, _ in products:
                module(inputs[n])
            if sync is not None:
                sync()
            if attempt:  # the first pass warms the caches and the kernels
                best = min(best, time.perf_counter() - start)
    return flops / best
