"""``brook-engine bench --workload w8a16-quality``: what W8A16 costs and saves against the
same model unquantized — weight bytes (the projections alone and the whole model),
teacher-forced top-1 agreement and perplexity on held-out text, as the long-context KV
workload measures KV precision."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from brook_engine.bench.kv_workloads import KVBenchResult, _engine, _held_out_text


def _projection_bytes(engine: Any) -> int:
    """Bytes the decoder's projections take (int8 weights + scales, or float weights)."""
    from brook_engine.layers.linear import Linear
    from brook_engine.quant.linear import Int8Linear

    total = 0
    for module in engine.runner.model.modules():
        if isinstance(module, Int8Linear):
            total += module.held_bytes()
        elif isinstance(module, Linear):
            total += module.weight.numel() * module.weight.element_size()
    return total


def _group_size(quantized: str | None, quantization: dict[str, Any]) -> int | None:
    if quantized is None:
        return quantization.get("group_size")
    from brook_engine.quant.checkpoint import read_quantization

    stored = read_quantization(Path(quantized))
    return stored.group_size if stored is not None else None


def w8a16_quality(
    model: str,
    options: dict[str, Any],
    num_requests: int,
    seed: int,
    progress: bool,
    quantized: str | None = None,
) -> KVBenchResult:
    """``quantized``: a W8A16 folder to compare with ``model`` (its float original), in
    place of ``model`` quantized as it loads."""
    import torch
    import torch.nn.functional as F

    del num_requests, seed  # the held-out text is fixed
    quantization = {**options.get("quantization", {}), "weights": "w8a16"}
    options = {k: v for k, v in options.items() if k != "quantization"}
    if quantized is not None:
        quantization = {"weights": "w8a16"}  # the folder's own grouping
    exact_kv = {
        "layer_policies": [{"start": 0.0, "end": 1.0, "dtype": "auto"}],
        "dynamic_precision": {"enabled": False},
    }
    full = _engine(model, options, exact_kv, progress)
    w8a16 = _engine(
        quantized or model, {**options, "quantization": quantization}, exact_kv, progress
    )
    text_ids = full.tokenizer.encode(_held_out_text(), add_special_tokens=False)
    chunk_len, num_chunks = 512, 8
    agree = total = 0
    nll = {"full": 0.0, "w8a16": 0.0}
    for i in range(num_chunks):
        chunk = text_ids[i * chunk_len : (i + 1) * chunk_len]
        target = torch.tensor(chunk[1:])
        # float32 heads: a 16-bit head ties the reference's top two at some positions
        reference = full.prompt_logits(chunk, in_float32=True)[:-1]
        rounded = w8a16.prompt_logits(chunk, in_float32=True)[:-1]
        agree += int((reference.argmax(-1) == rounded.argmax(-1)).sum())
        total += len(chunk) - 1
        nll["full"] += float(F.cross_entropy(reference, target, reduction="sum"))
        nll["w8a16"] += float(F.cross_entropy(rounded, target, reduction="sum"))
    ppl = {name: math.exp(value / total) for name, value in nll.items()}
    projections = {name: _projection_bytes(e) for name, e in (("full", full), ("w8a16", w8a16))}
    summary: dict[str, Any] = {
        "dtype": str(full.runner.dtype).removeprefix("torch."),
        "group_size": _group_size(quantized, quantization),
        "quantized_folder": quantized,
        "projection_bytes_full": projections["full"],
        "projection_bytes_w8a16": projections["w8a16"],
        "projection_bytes_ratio": projections["w8a16"] / projections["full"],
        "weight_bytes_full": full.runner.weight_bytes,
        "weight_bytes_w8a16": w8a16.runner.weight_bytes,
        "weight_bytes_ratio": w8a16.runner.weight_bytes / full.runner.weight_bytes,
        "top1_agreement": agree / total,
        "perplexity_full": ppl["full"],
        "perplexity_w8a16": ppl["w8a16"],
        "perplexity_increase": ppl["w8a16"] / ppl["full"] - 1,
        "teacher_forced_tokens": total,
    }
    return KVBenchResult([], summary)
