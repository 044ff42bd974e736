"""``brook-engine convert MODEL --quantize w8a16 --method gptq``: the GPTQ-rounded int8
weights of a float folder, from Brook's own engine run on calibration text.

The model is loaded once in float32. Layers are rounded in order: the statistics of layer
``i``'s four products (q/k/v, o, gate/up, down) come from a prefill of the calibration text
in which layers ``0 … i-1`` already multiply by their rounded weights (each forward stops
after layer ``i``), as GPTQ's reference implementation does; the LM head last, from the
final norm's output with every layer rounded. The engine's weights are never modified: a
rounded layer's product is recomputed with its dequantized weight by a forward hook, so the
CPU's packed weight layout does not matter.

Needs the whole model in float32 memory (4 bytes a weight) and about half a forward pass of
the calibration text per layer; for a model that does not fit, the default min-max rounding
converts one tensor at a time.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from brook_engine.config import ConfigError
from brook_engine.layers.linear import dense, weight_shape
from brook_engine.models.loader import placements
from brook_engine.quant.gptq import HessianAccumulator, gptq_quantize
from brook_engine.quant.quantize import QuantizedWeight

#: tokens per calibration prefill
CHUNK = 512
#: fewer tokens than this give statistics too thin to round a layer against
MIN_TOKENS = 256
DEFAULT_TOKENS = 2048
#: the engine's fused products, and the checkpoint projections each holds (by rows)
_FUSED = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


class _Stop(Exception):
    """Raised by a hook to end a calibration forward after the layer being measured."""


def calibration_chunks(token_ids: list[int], tokens: int, chunk: int = CHUNK) -> list[list[int]]:
    """The first ``tokens`` of the text in prefills of ``chunk`` (``tokens`` is at least
    ``MIN_TOKENS``: ``quantize_folder`` refuses fewer before the model loads)."""
    if len(token_ids) < tokens:
        raise ConfigError(
            f"--calibration-tokens {tokens}: the calibration text holds only "
            f"{len(token_ids)} tokens; give a longer --calibration-text or fewer tokens"
        )
    ids = token_ids[:tokens]
    return [ids[i : i + chunk] for i in range(0, len(ids), chunk) if len(ids[i : i + chunk]) > 1]


def gptq_weights(
    source: Path,
    scale_dtype: torch.dtype,
    group_size: int | None,
    text: str,
    tokens: int = DEFAULT_TOKENS,
    progress: bool = True,
) -> dict[str, QuantizedWeight]:
    """Checkpoint name (``model.layers.3.self_attn.q_proj.weight``, ``lm_head.weight``) →
    its GPTQ-rounded int8 weight and min-max scales (in ``scale_dtype``), for a dense model
    (``convert.w8a16.quantize_folder`` refuses a mixture of experts before this loads it)."""
    from brook_engine.core.llm_engine import LLMEngine
    from brook_engine.llm import engine_config_from_options

    options: dict[str, Any] = {
        "device": "cpu",  # the statistics and the rounding are CPU tensors (float32 memory)
        "dtype": "float32",
        "max_model_len": CHUNK,
        "kv_cache": {  # exact, and room for one prefill only (not the default share of RAM)
            "layer_policies": [{"start": 0.0, "end": 1.0, "dtype": "auto"}],
            "dynamic_precision": {"enabled": False},
            "block_size": 16,
            "num_blocks": CHUNK // 16 + 1,
        },
    }
    engine = LLMEngine(engine_config_from_options(str(source), options), progress=False)
    model = engine.runner.model
    arch = model.arch
    chunks = calibration_chunks(engine.tokenizer.encode(text, add_special_tokens=False), tokens)
    layers = model.model.layers
    rounded: dict[str, QuantizedWeight] = {}
    with (
        _RoundedProducts() as products,
        tqdm(total=len(layers) + 1, desc="GPTQ", unit="layer", disable=not progress) as bar,
    ):
        for index, layer in enumerate(layers):
            modules = {name: layer.get_submodule(name) for name in _FUSED}
            stats = _measure(engine, chunks, list(modules.values()), modules["mlp.down_proj"])
            for name, module in modules.items():
                where = f"model.layers.{index}.{name}"
                q = _round(where, _weight(module), stats[module], scale_dtype, group_size)
                products.add(module, q.dequantize(torch.float32))
                rounded.update(_split(model, index, name, q))
            bar.update(1)
        head = model.lm_head
        assert head is not None
        stats = _measure(engine, chunks, [head], None)
        table = _weight(head)[: arch.vocab_size]
        rounded["lm_head.weight"] = _round("lm_head", table, stats[head], scale_dtype, group_size)
        bar.update(1)
    return rounded


def _round(
    where: str,
    weight: torch.Tensor,
    hessian: torch.Tensor,
    scale_dtype: torch.dtype,
    group_size: int | None,
) -> QuantizedWeight:
    """``gptq_quantize``, its failure naming the layer ``where``."""
    try:
        return gptq_quantize(weight, hessian, scale_dtype, group_size)
    except RuntimeError as exc:  # statistics too degenerate even damped
        raise ConfigError(f"GPTQ failed on {where}: {exc}") from None


def _measure(
    engine: Any, chunks: list[list[int]], modules: list[nn.Module], stop_after: nn.Module | None
) -> dict[nn.Module, torch.Tensor]:
    """Each module's ``2 XᵀX / n`` over the calibration prefills; with ``stop_after``, each
    forward ends once that module has seen its input (the layers after it are not needed)."""
    accumulators = {m: HessianAccumulator(_width(m)) for m in modules}

    def hook_for(module: nn.Module) -> Any:
        def hook(_: nn.Module, args: tuple[Any, ...]) -> None:
            accumulators[module].add(args[0])
            if module is stop_after:
                raise _Stop

        return hook

    handles = [m.register_forward_pre_hook(hook_for(m)) for m in modules]
    try:
        for ids in chunks:
            with contextlib.suppress(_Stop):
                engine.prompt_logits(ids)
    finally:
        for handle in handles:
            handle.remove()
    return {m: acc.hessian() for m, acc in accumulators.items()}


def _width(module: nn.Module) -> int:
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    return weight_shape(weight)[1]


def _weight(module: nn.Module) -> torch.Tensor:
    """A product's float32 weight [out, in], in the plain layout whatever the CPU packed."""
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    return dense(weight.detach()).float()


class _RoundedProducts:
    """While open, each added module's output is recomputed with its rounded weight."""

    def __init__(self) -> None:
        self.handles: list[Any] = []

    def __enter__(self) -> _RoundedProducts:
        return self

    def __exit__(self, *_: object) -> None:
        for handle in self.handles:
            handle.remove()

    def add(self, module: nn.Module, weight: torch.Tensor) -> None:
        bias = getattr(module, "bias", None)
        bias32 = bias.detach().float() if isinstance(bias, torch.Tensor) else None

        def hook(_: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
            return F.linear(args[0].float(), weight, bias32).to(output.dtype)

        self.handles.append(module.register_forward_hook(hook))


#: a decoder layer's projections as the checkpoint names them
_PROJECTIONS = tuple(
    f"{part}.weight"
    for part in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    )
)


def _split(model: Any, index: int, fused: str, q: QuantizedWeight) -> dict[str, QuantizedWeight]:
    """The checkpoint projections a fused product holds, at the rows the loader puts them
    (``models.loader.placements``)."""
    prefix = f"model.layers.{index}."
    out = {}
    for projection in _PROJECTIONS:
        for place in placements(model, prefix + projection, q.q.shape[0]) or ():
            if place.param == f"{prefix}{fused}.weight":
                out[prefix + projection] = _rows(q, place.dst_start, place.dst_start + place.length)
    return out


def _rows(q: QuantizedWeight, start: int, end: int) -> QuantizedWeight:
    return QuantizedWeight(q.q[start:end].contiguous(), q.scale[start:end].contiguous())
