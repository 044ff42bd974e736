"""Load a Hugging Face folder's safetensors (single or sharded) into a ``CausalLM``.

q/k/v and gate/up are fused in Brook's layers; the loader copies each checkpoint tensor into
its slice. A missing or unexpected tensor is an error that names it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from brook_engine.config import ConfigError
from brook_engine.models.llama import CausalLM

_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
_FUSED = re.compile(
    r"^(model\.layers\.\d+\.)(self_attn\.(q|k|v)_proj|mlp\.(gate|up)_proj)\.(weight|bias)$"
)


def checkpoint_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{folder} holds no *.safetensors weights")
    return files


def _target(model: CausalLM, name: str) -> tuple[torch.Tensor, int, int] | None:
    """The parameter a checkpoint tensor goes into, and the rows it fills."""
    arch = model.arch
    fused = _FUSED.match(name)
    if fused is None:
        try:
            param = model.get_parameter(name)
        except AttributeError:
            return None
        return param.data, 0, param.shape[0]
    prefix, proj, kind = fused.group(1), fused.group(2), fused.group(5)
    q, kv, inter = (
        arch.num_heads * arch.head_dim,
        arch.num_kv_heads * arch.head_dim,
        (arch.intermediate_size),
    )
    offsets = {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0, q),
        "self_attn.k_proj": ("self_attn.qkv_proj", q, kv),
        "self_attn.v_proj": ("self_attn.qkv_proj", q + kv, kv),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0, inter),
        "mlp.up_proj": ("mlp.gate_up_proj", inter, inter),
    }
    fused_name, start, rows = offsets[proj]
    try:
        param = model.get_parameter(f"{prefix}{fused_name}.{kind}")
    except AttributeError:
        return None
    return param.data, start, rows


def load_weights(model: CausalLM, folder: Path, progress: bool = True) -> None:
    expected = {name for name, _ in model.named_parameters()}
    if model.arch.tie_word_embeddings:
        expected.discard("lm_head.weight")
    filled: dict[str, int] = {}
    files = checkpoint_files(folder)
    with tqdm(total=len(files), desc="Loading weights", unit="file", disable=not progress) as bar:
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    if _IGNORED.match(name) or (
                        name == "lm_head.weight" and model.arch.tie_word_embeddings
                    ):
                        continue
                    target = _target(model, name)
                    if target is None:
                        raise ConfigError(
                            f"{path.name}: unexpected tensor {name!r} for {model.arch.architecture}"
                        )
                    param, start, rows = target
                    tensor = f.get_tensor(name)
                    if tensor.shape[0] != rows or tensor.shape[1:] != param.shape[1:]:
                        raise ConfigError(
                            f"{path.name}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                            f"expected ({rows}, {', '.join(map(str, param.shape[1:]))})"
                        )
                    param[start : start + rows].copy_(tensor)
                    fused = _fused_name(name)
                    filled[fused] = filled.get(fused, 0) + rows
            bar.update(1)
    missing = sorted(n for n in expected if filled.get(n, 0) != model.get_parameter(n).shape[0])
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise ConfigError(f"{folder}: checkpoint lacks {shown}")


def _fused_name(name: str) -> str:
    fused = _FUSED.match(name)
    if fused is None:
        return name
    proj = "self_attn.qkv_proj" if fused.group(2).startswith("self_attn") else "mlp.gate_up_proj"
    return f"{fused.group(1)}{proj}.{fused.group(5)}"
