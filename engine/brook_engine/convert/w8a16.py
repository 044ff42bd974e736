"""``brook-engine convert MODEL_DIR --quantize w8a16 --output DIR``: a float Hugging Face
folder quantized ahead of time into a W8A16 compressed-tensors folder (pack-quantized, one
scale per output channel, or per channel and group with ``--group-size``) that Brook, vLLM
and transformers load.

The decoder's projections (q/k/v/o, gate/up/down, every expert's and a shared expert's) are
quantized exactly as Brook quantizes at load time; the embedding, the norms, MoE routers and
the LM head are copied in float (``ignore: ["lm_head"]``, llm-compressor's default, and the
routers by pattern) — Brook gives the head its int8 copy when it loads
the folder. One tensor at a time is held in memory, so a model larger than memory converts.
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
from brook_engine.quant import checkpoint as quant_checkpoint
from brook_engine.quant.quantize import quantize

_PROJECTION = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj"
    r"|mlp\.(experts\.\d+\.|shared_expert\.)?(gate|up|down)_proj"
    r"|block_sparse_moe\.experts\.\d+\.w[123])\.weight$"
)
#: MoE routers stay in float (as Brook keeps them, and llm-compressor's MoE recipes ignore)
_ROUTERS = ["re:.*mlp\\.gate$", "re:.*block_sparse_moe\\.gate$", "re:.*shared_expert_gate$"]


def quantize_folder(
    source: Path, output: Path, group_size: int | None = None, progress: bool = True
) -> int:
    """Write ``output`` (a scale per output channel, or per channel and ``group_size``
    input channels); returns the number of projections quantized."""
    if group_size is not None and (group_size <= 0 or group_size % 32):
        raise ConfigError(f"--group-size {group_size}: give a positive multiple of 32")
    config_path = source / "config.json"
    if not config_path.is_file():
        raise ConfigError(f"{source} has no config.json; give a Hugging Face model folder")
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if config.get("quantization_config") or config.get("compression_config"):
        raise ConfigError(f"{source} is quantized already (config.json: quantization_config)")
    files = sorted(source.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{source} holds no *.safetensors weights")
    if output.exists() and any(output.iterdir()):
        raise ConfigError(f"{output} is not empty; give a new folder for --output")
    output.mkdir(parents=True, exist_ok=True)
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
                        if group_size is not None and tensor.shape[1] % group_size:
                            raise ConfigError(
                                f"--group-size {group_size} does not divide the input width "
                                f"{tensor.shape[1]} of {name}; use a multiple of 32 that does"
                            )
                        q = quantize(tensor, group_size=group_size)
                        tensors[f"{base}.weight_packed"] = quant_checkpoint.pack_int8(q.q)
                        tensors[f"{base}.weight_scale"] = q.scale.contiguous()
                        tensors[f"{base}.weight_shape"] = torch.tensor(tuple(tensor.shape))
                        quantized += 1
                    else:
                        tensors[name] = tensor
            save_file(tensors, str(output / path.name), metadata={"format": "pt"})
            weight_map.update({name: path.name for name in tensors})
    if quantized == 0:
        raise ConfigError(f"{source}: no decoder projections found to quantize")
    if (source / "model.safetensors.index.json").exists():
        index = {"metadata": {}, "weight_map": weight_map}
        (output / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    ignore = ["lm_head"]
    if any(re.match(r".*(mlp|block_sparse_moe)\.gate\.weight$", n) for n in weight_map):
        ignore += _ROUTERS
    config["quantization_config"] = quant_checkpoint.quantization_config(ignore, group_size)
    (output / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return quantized
