"""``brook-engine convert MODEL_DIR --quantize w8a16 --output DIR``: a float Hugging Face
folder quantized ahead of time into a W8A16 compressed-tensors folder (pack-quantized, one
scale per output channel, or per channel and group with ``--group-size``) that Brook, vLLM
and transformers load.

The decoder's projections (q/k/v/o, gate/up/down, every expert's and a shared expert's) are
quantized exactly as Brook quantizes at load time; the embedding, the norms, MoE routers and
the LM head are copied in float (``ignore: ["lm_head"]``, llm-compressor's default, and the
routers by pattern) — Brook gives the head its int8 copy when it loads
the folder. One tensor at a time is held in memory, so a model larger than memory converts.

``--method gptq`` rounds the projections and the LM head with GPTQ against calibration text
(the same scales, other integers; ``convert.gptq_calibration``) and stores the head in int8
too (``lm_head.weight_packed``; ``ignore`` holds only the routers), because a head rounded
to nearest at load would undo much of what GPTQ gains. It needs the model in float32 memory.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from brook_engine.config import ConfigError
from brook_engine.convert.gptq_calibration import DEFAULT_TOKENS, MIN_TOKENS
from brook_engine.models.arch import ModelArch
from brook_engine.quant import checkpoint as quant_checkpoint
from brook_engine.quant.quantize import QuantizedWeight, quantize

_PROJECTION = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj"
    r"|mlp\.(experts\.\d+\.|shared_expert\.)?(gate|up|down)_proj"
    r"|block_sparse_moe\.experts\.\d+\.w[123])\.weight$"
)
#: MoE routers stay in float (as Brook keeps them, and llm-compressor's MoE recipes ignore)
_ROUTERS = ["re:.*mlp\\.gate$", "re:.*block_sparse_moe\\.gate$", "re:.*shared_expert_gate$"]


METHODS = ("minmax", "gptq")
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def quantize_folder(
    source: Path,
    output: Path,
    group_size: int | None = None,
    progress: bool = True,
    method: str = "minmax",
    calibration_text: str | None = None,
    calibration_tokens: int = DEFAULT_TOKENS,
) -> int:
    """Write ``output`` (a scale per output channel, or per channel and ``group_size``
    input channels); returns the number of projections quantized. ``method``: ``minmax``
    rounds each weight to nearest (one tensor in memory at a time); ``gptq`` rounds the
    projections and the LM head against calibration text (``calibration_text``, Brook's
    built-in text by default; ``convert.gptq_calibration``) and stores the head in int8 too."""
    if group_size is not None and (group_size <= 0 or group_size % 32):
        raise ConfigError(f"--group-size {group_size}: give a positive multiple of 32")
    if method not in METHODS:
        raise ConfigError(f"--method {method!r}: use one of {', '.join(METHODS)}")
    if method == "gptq" and calibration_tokens < MIN_TOKENS:
        raise ConfigError(f"--calibration-tokens {calibration_tokens}: give at least {MIN_TOKENS}")
    config_path = source / "config.json"
    if not config_path.is_file():
        raise ConfigError(f"{source} has no config.json; give a Hugging Face model folder")
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if config.get("quantization_config") or config.get("compression_config"):
        raise ConfigError(f"{source} is quantized already (config.json: quantization_config)")
    if method == "gptq" and ModelArch.from_dict(config, str(config_path)).experts is not None:
        raise ConfigError(
            f"--method gptq rounds dense models; {source} is a mixture of experts "
            "(convert it with the default --method minmax)"
        )
    files = sorted(source.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{source} holds no *.safetensors weights")
    if output.exists() and any(output.iterdir()):
        raise ConfigError(f"{output} is not empty; give a new folder for --output")
    layout = _layout(files, group_size)
    output.mkdir(parents=True, exist_ok=True)
    rounded = None
    head_file = None
    if method == "gptq":
        rounded = _gptq(source, layout, group_size, calibration_text, calibration_tokens, progress)
        # where the int8 head goes: beside the float one, or beside the embedding
        head_file = (layout.get("lm_head.weight") or layout["model.embed_tokens.weight"])[0]
    skipped = {config_path.name, "model.safetensors.index.json"}  # written below
    for item in source.iterdir():  # tokenizer, generation config, templates…
        if item.is_file() and item.suffix != ".safetensors" and item.name not in skipped:
            shutil.copy2(item, output / item.name)
    weight_map: dict[str, str] = {}
    quantized = 0
    with tqdm(files, desc="Quantizing to W8A16", unit="file", disable=not progress) as bar:
        for path in bar:
            tensors: dict[str, torch.Tensor] = {}
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    tensor = f.get_tensor(name)
                    if _PROJECTION.match(name) and tensor.dim() == 2:
                        base = name.removesuffix(".weight")
                        if rounded is None:
                            q = quantize(tensor, group_size=group_size)
                        else:
                            q = rounded.pop(name)
                            if q.q.shape != tensor.shape:
                                raise ConfigError(
                                    f"{path.name}: {name} has shape {tuple(tensor.shape)}, "
                                    f"the model GPTQ ran has {tuple(q.q.shape)}; the "
                                    "checkpoint does not match config.json"
                                )
                        tensors.update(_stored(base, q))
                        quantized += 1
                    elif rounded is None or name != "lm_head.weight":
                        tensors[name] = tensor
            if rounded is not None and path == head_file:
                tensors.update(_stored("lm_head", rounded.pop("lm_head.weight")))
            save_file(tensors, str(output / path.name), metadata={"format": "pt"})
            weight_map.update({name: path.name for name in tensors})
    if quantized == 0:
        raise ConfigError(f"{source}: no decoder projections found to quantize")
    if (source / "model.safetensors.index.json").exists():
        index = {"metadata": {}, "weight_map": weight_map}
        (output / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    ignore = ["lm_head"] if rounded is None else []  # GPTQ rounds the head too
    if any(re.match(r".*(mlp|block_sparse_moe)\.gate\.weight$", n) for n in weight_map):
        ignore += _ROUTERS
    if rounded is not None:
        # the head is its own int8 tensor now; a tied config would make transformers tie
        # the quantized head back to the embedding (and fail to load)
        config["tie_word_embeddings"] = False
    config["quantization_config"] = quant_checkpoint.quantization_config(ignore, group_size)
    (output / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return quantized


def _stored(base: str, q: QuantizedWeight) -> dict[str, torch.Tensor]:
    """A quantized layer's tensors in the pack-quantized format."""
    return {
        f"{base}.weight_packed": quant_checkpoint.pack_int8(q.q),
        f"{base}.weight_scale": q.scale.contiguous(),
        f"{base}.weight_shape": torch.tensor(tuple(q.q.shape)),
    }


def _layout(files: list[Path], group_size: int | None) -> dict[str, tuple[Path, str]]:
    """Every checkpoint tensor's file and stored dtype, from the files' headers; every
    projection's input width checked against ``group_size`` before anything is written."""
    layout: dict[str, tuple[Path, str]] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                piece = f.get_slice(name)
                layout[name] = (path, piece.get_dtype())
                shape = piece.get_shape()
                projection = _PROJECTION.match(name) and len(shape) == 2
                if projection and group_size is not None and shape[1] % group_size:
                    raise ConfigError(
                        f"--group-size {group_size} does not divide the input width "
                        f"{shape[1]} of {name}; use a multiple of 32 that does"
                    )
    return layout


def _gptq(
    source: Path,
    layout: dict[str, tuple[Path, str]],
    group_size: int | None,
    text: str | None,
    tokens: int,
    progress: bool,
) -> dict[str, QuantizedWeight]:
    """The GPTQ-rounded projections and head, with scales in the checkpoint's dtype (the
    embedding's)."""
    from brook_engine.convert.gptq_calibration import gptq_weights
    from brook_engine.kv.calibration import builtin_calibration_text

    embedding = layout.get("model.embed_tokens.weight")
    dtype = _DTYPES.get(embedding[1]) if embedding is not None else None
    if dtype is None:
        raise ConfigError(f"{source}: no float model.embed_tokens.weight to take the dtype from")
    text = builtin_calibration_text() if text is None else text
    return gptq_weights(source, dtype, group_size, text, tokens, progress)
