"""Where a single-stream decode step's time goes: the engine decodes one sequence (32 prompt
tokens, 256 new, three times) while timers around its parts add up their wall time — the
decoder layers (in one kernel call each where ``models/decode_row.py`` runs them, else on
the Python path, split into its weight products, attention with the KV write and fused
steps), the LM head, sampling — and the rest of the step is what is left: embedding, the
final norm, Python and PyTorch's dispatch, the scheduler, detokenization. Then every weight
product of the model once, alone, at one row: what streaming the weights costs, and so the
share of the step that is not weight reading.

    .venv/bin/python tests/bench/step_profile.py MODEL [--dtype bfloat16] [--one-row-weights bf16]
        [--quantization w8a16 [--group-size 32]]

The timers cost ~1 µs a call (~0.2 ms of a step): compare the rows of one run, not the
total with an untimed run.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from brook_engine import LLM, SamplingParams
from brook_engine.core import llm_engine, sampling
from brook_engine.layers import cpu_fused, linear, tensor_parallel
from brook_engine.layers.linear import Linear
from brook_engine.layers.tensor_parallel import VocabParallelHead
from brook_engine.models import llama

# Absent before the decode-layer kernel: the script also profiles earlier commits.
try:
    decode_row: Any = importlib.import_module("brook_engine.models.decode_row")
except ImportError:
    decode_row = None
try:  # absent before W8A16
    quant_linear: Any = importlib.import_module("brook_engine.quant.linear")
except ImportError:
    quant_linear = None

spent: dict[str, float] = {}


def _timed(owner: Any, name: str, part: str) -> None:
    inner: Callable[..., Any] = getattr(owner, name)

    @functools.wraps(inner)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[part] = spent.get(part, 0.0) + time.perf_counter() - start

    setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--one-row-weights", default="model")
    parser.add_argument("--quantization", choices=["none", "w8a16"], default="none")
    parser.add_argument("--group-size", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()
    options: dict[str, Any] = {
        "dtype": args.dtype,
        "kv_cache": {"layer_policies": [{"start": 0.0, "end": 1.0, "dtype": "auto"}]},
        "progress": False,
    }
    if args.one_row_weights != "model":
        options["shapes"] = {"one_row_weights": args.one_row_weights}
    if args.quantization != "none":
        options["quantization"] = {"weights": args.quantization, "group_size": args.group_size}
    llm = LLM(args.model, **options)
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=0)
    prompt = list(range(100, 132))
    llm.generate([prompt], params, use_tqdm=False)  # warm-up, untimed
    # Each name is replaced where its callers look it up at call time.
    if decode_row is not None:
        _timed(decode_row.RowStep, "layer", "layers, one kernel call each")
    _timed(llama.DecoderLayer, "forward", "layers, Python path")
    _timed(linear, "one_row_linear", "  their weight products")
    _timed(llama, "paged_attention", "  their attention and KV write")
    for name in ("add_rms_norm", "silu_mul", "rotary"):
        _timed(cpu_fused, name, "  their fused steps")
    _timed(tensor_parallel, "one_row_linear", "LM head")
    if quant_linear is not None:
        _timed(quant_linear.QuantizedHead, "forward", "LM head")
    _timed(sampling, "sample", "sampling")
    _timed(llm_engine.LLMEngine, "step", "step")
    rounds = 3
    start = time.perf_counter()
    for _ in range(rounds):
        llm.generate([prompt], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    steps = rounds * args.tokens
    step = spent.pop("step")
    print(_cpu())
    print(
        f"{args.model}, {args.dtype}, oneRowWeights {args.one_row_weights}, "
        f"quantization {args.quantization} (group {args.group_size}): "
        f"{steps / elapsed:.1f} tok/s, {step / steps * 1e3:.2f} ms a step (timed)"
    )
    order = [
        "layers, one kernel call each",
        "layers, Python path",
        "  their weight products",
        "  their attention and KV write",
        "  their fused steps",
        "LM head",
        "sampling",
    ]
    for part in order:
        seconds = spent.get(part, 0.0)
        print(f"  {part:<32} {seconds / steps * 1e3:6.2f} ms  {seconds / step:6.1%}")
    top = sum(spent.get(part, 0.0) for part in order if not part.startswith(" "))
    rest = step - top
    print(f"  {'rest of the step':<32} {rest / steps * 1e3:6.2f} ms  {rest / step:6.1%}")
    alone = _products_alone(llm)
    print(
        f"every weight product once, alone, one row: {alone * 1e3:.2f} ms; the step's other "
        f"{(step / steps - alone) * 1e3:.2f} ms ({1 - alone * steps / step:.1%}) is not "
        "weight reading"
    )


def _products_alone(llm: LLM) -> float:
    """Seconds for every linear layer and the LM head once, at one row, in order (the
    weights stream from memory as in a step): best of five passes."""
    kinds: tuple[type, ...] = (Linear, VocabParallelHead)
    if quant_linear is not None:
        kinds += (quant_linear.Int8Linear,)
    modules = [m for m in llm.engine.runner.model.modules() if isinstance(m, kinds)]
    dtype = llm.engine.runner.dtype
    widths = [getattr(m, "in_features", None) or m.weight.shape[1] for m in modules]
    inputs = [torch.randn(1, width, dtype=dtype) for width in widths]
    best = float("inf")
    with torch.inference_mode():
        for attempt in range(6):
            start = time.perf_counter()
            for module, x in zip(modules, inputs, strict=True):
                module(x)
            if attempt:
                best = min(best, time.perf_counter() - start)
    return best


def _cpu() -> str:
    model = platform.processor()
    flags = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name") and not flags:
            model = line.partition(":")[2].strip()
        if line.startswith("flags"):
            wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
            flags = " ".join(f for f in line.split() if f in wanted)
            break
    return f"CPU: {model} ({flags}); BROOK_CPU_ISA={os.environ.get('BROOK_CPU_ISA', 'native')}"


if __name__ == "__main__":
    main()
